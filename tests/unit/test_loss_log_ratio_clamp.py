"""Log-ratio edge cases of the policy losses: ReMix's mix-policy PPG clamps its log-ratios as the recipe's PPO clip
does (finite, gradient 0 beyond the clamp, unchanged inside it), and GSPO's sequence log-ratio stays inside the
token clamp's bound."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import ppo_clip_loss
from meshrl.algos.divergences import LOG_RATIO_CLAMP
from meshrl.algos.policy_losses import gspo_loss, gspo_token_loss
from meshrl.trainer.plugins.remix import mix_ppg_loss


def _far_off(log_r: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row of three tokens: the first ``log_r`` away from its behaviour policy, the others on it."""
    behaviour = torch.tensor([[-95.0, -1.0, -2.0]], dtype=dtype)
    logp = (behaviour + torch.tensor([[log_r, 0.0, 0.0]], dtype=dtype)).requires_grad_(True)
    adv = torch.tensor([-1.0], dtype=dtype)
    mask = torch.ones_like(behaviour)
    return logp, behaviour, adv, mask


@pytest.mark.parametrize("log_r", [25.0, 90.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_remix_loss_matches_the_ppo_clip_beyond_the_clamp(log_r, dtype):
    logp, behaviour, adv, mask = _far_off(log_r, dtype)
    mat, stats = mix_ppg_loss(logp, behaviour, behaviour, adv, mask, clip_low=0.2, clip_high=0.28)
    mat.sum().backward()
    assert torch.isfinite(mat).all() and all(math.isfinite(v) for v in stats.values())
    ref_logp = logp.detach().clone().requires_grad_(True)
    ppo, _ = ppo_clip_loss(ref_logp, behaviour, adv, mask, clip_low=0.2, clip_high=0.28)
    ppo.sum().backward()
    torch.testing.assert_close(mat, ppo)
    assert float(mat.detach()[0, 0]) == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-5)
    assert float(logp.grad[0, 0]) == 0.0  # clamped: no gradient, as the recipe's clip
    torch.testing.assert_close(logp.grad, ref_logp.grad)


def test_remix_centre_far_off_its_behaviour_is_finite():
    logp, behaviour, adv, mask = _far_off(0.0, torch.float32)
    start = behaviour + 90.0
    mat, stats = mix_ppg_loss(logp, behaviour, start, adv, mask, clip_low=0.2, clip_high=0.28)
    assert torch.isfinite(mat).all() and math.isfinite(stats["remix/centre_mean"])


def test_remix_loss_inside_the_clamp_is_unchanged_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(4, 6, generator=gen) * 3
    logp = (behaviour + torch.randn(4, 6, generator=gen) * 2).requires_grad_(True)
    start = behaviour + torch.randn(4, 6, generator=gen) * 0.3
    adv = torch.randn(4, generator=gen)
    mask = torch.ones(4, 6)
    mat, _ = mix_ppg_loss(logp, behaviour, start, adv, mask, clip_low=0.2, clip_high=0.28)
    mat.sum().backward()
    # the unclamped formula, written out
    plain_logp = logp.detach().clone().requires_grad_(True)
    ratio = torch.exp(plain_logp - behaviour)
    centre = torch.exp(start - behaviour)
    clipped = torch.maximum(torch.minimum(ratio, centre + 0.28), centre - 0.2)
    want = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * clipped)
    want.sum().backward()
    assert torch.equal(mat, want) and torch.equal(logp.grad, plain_logp.grad)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
@pytest.mark.parametrize("log_r", [-90.0, 90.0])
def test_gspo_sequence_log_ratio_stays_within_the_token_clamp(fn, log_r):
    behaviour = torch.full((1, 3), -95.0)
    logp = (behaviour + log_r).requires_grad_(True)
    mat, stats = fn(logp, behaviour, torch.tensor([-1.0]), torch.ones(1, 3))
    mat.sum().backward()
    assert torch.isfinite(mat).all() and torch.isfinite(logp.grad).all()
    bound = math.exp(math.copysign(LOG_RATIO_CLAMP, log_r))
    assert stats["seq_ratio/mean"] == pytest.approx(bound, rel=1e-5)
