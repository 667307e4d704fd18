"""meshrl's plug-in terms equal verl 0.9's on the same random inputs (values and gradients; masks with holes,
empty rows): Clip-Cov (same generator state), KL-Cov, rollout importance weights and rejection masks, and
top-K forward-KL distillation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

# Not "verl": under pytest, tests/ is on sys.path and this folder itself imports as a namespace package "verl".
pytest.importorskip("verl.trainer.ppo.core_algos")

from verl.trainer.distillation.fsdp import losses as distill_losses  # noqa: E402
from verl.trainer.ppo import core_algos, rollout_corr_helper  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from meshrl.algos import (  # noqa: E402
    aggregate,
    clip_cov_loss,
    kl_cov_loss,
    rollout_is_weights,
    rollout_rejection_mask,
    topk_forward_kl,
)


def batch(seed: int, b: int = 6, t: int = 12, spread: float = 0.3):
    """Random (logp requiring grad, old_logp, token advantages, mask with holes and one empty row)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    logp = (old + torch.randn(b, t, generator=g, dtype=torch.float64) * spread).requires_grad_()
    adv = (torch.randn(b, generator=g, dtype=torch.float64) * 2)[:, None].expand(b, t).contiguous()
    mask = (torch.rand(b, t, generator=g) > 0.2).to(torch.float64)
    mask[1] = 0  # an empty row
    return logp, old, adv, mask


def actor_config(**policy_loss) -> ActorConfig:
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                      clip_ratio_low=0.2, clip_ratio_high=0.28, policy_loss=PolicyLossConfig(**policy_loss))
    return cfg


def grads(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio", [2e-4, 0.05, 1.0])
def test_clip_cov_equals_verl_under_the_same_generator(seed: int, ratio: float) -> None:
    logp, old, adv, mask = batch(seed)
    adv = adv * 3  # covariances of order 1-5, so the band (1, 5) holds candidates
    cfg = actor_config(loss_mode="clip_cov", clip_cov_ratio=ratio, clip_cov_lb=1.0, clip_cov_ub=5.0)
    torch.manual_seed(100 + seed)  # verl draws from the global generator
    theirs, tm = core_algos.compute_policy_loss_clip_cov(old, logp, adv, mask, "token-mean", cfg)
    loss_mat, metrics = clip_cov_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, ratio=ratio,
                                      generator=torch.Generator().manual_seed(100 + seed))
    ours = aggregate(loss_mat, mask, "token-mean")
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grads(ours, logp), grads(theirs, logp))
    assert metrics["clipcov/frac_tokens"] == pytest.approx(tm["actor/pg_clipfrac"])
    assert metrics["clipcov/n_tokens"] >= 1


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(("ratio", "coef"), [(2e-4, 1.0), (2e-3, 1.0), (0.3, 0.1)])
def test_kl_cov_equals_verl(seed: int, ratio: float, coef: float) -> None:
    logp, old, adv, mask = batch(seed)
    cfg = actor_config(loss_mode="kl_cov", kl_cov_ratio=ratio, ppo_kl_coef=coef)
    theirs, _ = core_algos.compute_policy_loss_kl_cov(old, logp, adv, mask, "token-mean", cfg)
    loss_mat, metrics = kl_cov_loss(logp, old, adv, mask, ratio=ratio, coef=coef)
    ours = aggregate(loss_mat, mask, "token-mean")
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grads(ours, logp), grads(theirs, logp))
    n = int(mask.sum())
    assert metrics["klcov/frac_tokens"] == pytest.approx(max(1, int(n * ratio)) / n)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(("mode", "threshold", "lower", "upper"),
                         [("truncate", 2.0, None, 2.0), ("mask", "0.5_1.5", 0.5, 1.5)])
def test_rollout_is_weights_equal_verl(level, mode, threshold, lower, upper) -> None:
    logp, rollout, _, mask = batch(5, spread=0.4 if level == "token" else 0.05)
    log_ratio = logp.detach() - rollout
    theirs, tm = rollout_corr_helper.compute_rollout_correction_weights(
        log_ratio, mask, rollout_is=level, rollout_is_threshold=threshold)
    ours, metrics = rollout_is_weights(logp, rollout, mask, level=level, mode=mode, upper=upper, lower=lower)
    torch.testing.assert_close(ours, theirs)
    assert metrics["rollout_is/mean"] == pytest.approx(float(theirs[mask > 0].mean()))


@pytest.mark.parametrize(("stat", "lower", "upper", "spec"), [
    ("token_k1", 0.7, 1.4, "0.7_1.4"), ("token_k2", None, 0.05, 0.05), ("token_k3", None, 0.05, 0.05),
    ("seq_sum_k1", 0.3, 3.0, "0.3_3.0"), ("seq_sum_k3", None, 0.4, 0.4), ("seq_mean_k2", None, 0.04, 0.04),
    ("seq_mean_k3", None, 0.04, 0.04), ("seq_max_k2", None, 0.2, 0.2), ("seq_max_k3", None, 0.2, 0.2)])
def test_rollout_rejection_equals_verl(stat, lower, upper, spec) -> None:
    logp, rollout, _, mask = batch(7, spread=0.3)
    theirs, tm = rollout_corr_helper.compute_rollout_rejection_mask(logp.detach() - rollout, mask, stat, spec)
    ours, metrics = rollout_rejection_mask(logp, rollout, mask, stat=stat, lower=lower, upper=upper)
    torch.testing.assert_close(ours, theirs.to(ours.dtype))
    assert metrics["rollout_rs/masked_frac"] == pytest.approx(tm["rollout_rs_masked_fraction"])
    assert 0 < metrics["rollout_rs/masked_frac"] < 1  # the case exercises both outcomes


def test_topk_forward_kl_equals_verl() -> None:
    g = torch.Generator().manual_seed(0)
    lengths, v, k = [5, 3, 4], 40, 8
    teacher_full = torch.log_softmax(torch.randn(3, 5, v, generator=g) * 4, -1)
    t_logps, t_ids = torch.topk(teacher_full, k, dim=-1)
    student = (torch.randn(3, 5, v, generator=g) * 4).requires_grad_()
    mask = torch.zeros(3, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ours, metrics = topk_forward_kl(student, t_logps, t_ids, mask, log_prob_min=-10.0, loss_max=10.0)
    # verl takes the positions packed end to end ("thd"): one row of the valid positions
    valid = mask > 0
    nested = lambda x: torch.nested.nested_tensor([x[valid]], layout=torch.jagged)  # noqa: E731
    cfg = SimpleNamespace(distillation_loss=SimpleNamespace(use_chunked_topk=False, log_prob_min_clamp=-10.0))
    out = distill_losses.compute_forward_kl_topk(student[valid][None], nested(t_logps), nested(t_ids), cfg, "thd")
    theirs = out["distillation_losses"][0].clamp_min(0.0).clamp(max=10.0)  # verl's later clamps
    torch.testing.assert_close(ours[valid], theirs)
    torch.testing.assert_close(grads(ours[valid].sum(), student), grads(theirs.sum(), student))
    assert metrics["distill/teacher_mass"] == pytest.approx(float(out["teacher_mass"].detach().mean()), rel=1e-5)
    assert metrics["distill/student_mass"] == pytest.approx(float(out["student_mass"].detach().mean()), rel=1e-5)
    assert math.isfinite(metrics["distill/overlap_ratio"])
