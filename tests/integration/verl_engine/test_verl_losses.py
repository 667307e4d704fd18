"""meshrl's policy losses registered in verl equal meshrl's algos (values and gradients, masks with holes)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from meshrl.algos import POLICY_LOSSES, policy_loss  # noqa: E402

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
B, T = 6, 9


def actor_config(loss_mode: str, clip_low: float = 0.2, clip_high: float = 0.28) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=2, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                       clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode))


def batch(seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    new = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True  # every row keeps a token; holes in the middle, ragged ends
    mask[1, 5:] = False
    mask[2, 2:4] = False
    return old, new, adv, mask


def reference_agg(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *, dp_size: int = 1,
                  batch_num_tokens: float | None = None, global_batch_size: float | None = None) -> torch.Tensor:
    """verl's documented aggregation, written out (fully masked rows do not count as sequences)."""
    m = mask.to(loss_mat.dtype)
    tokens = m.sum() if batch_num_tokens is None else batch_num_tokens
    seqs = (m.sum(-1) > 0).sum() if global_batch_size is None else global_batch_size
    if mode == "token-mean":
        return (loss_mat * m).sum() / tokens * dp_size
    if mode == "token-sum":
        return (loss_mat * m).sum() * dp_size
    per_seq_sum = (loss_mat * m).sum(-1)
    if mode == "seq-mean-token-mean":
        return (per_seq_sum / m.sum(-1).clamp(min=1)).sum() / seqs * dp_size
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / seqs * dp_size
    return per_seq_sum.sum() / seqs * dp_size / loss_mat.shape[1]


def test_every_meshrl_loss_is_registered():
    for name in POLICY_LOSSES:
        assert get_policy_loss_fn(f"meshrl_{name}").__name__ == f"meshrl_{name}"


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_registered_loss_equals_meshrl_value_and_gradient(name, mode):
    old, new, adv, mask = batch(seed=sorted(POLICY_LOSSES).index(name) * 10 + AGG_MODES.index(mode))
    cfg = actor_config(f"meshrl_{name}", 0.2, 0.28) if name in ("ppo_clip", "cispo") else actor_config(
        f"meshrl_{name}", 3e-2, 4e-2)
    fn = get_policy_loss_fn(f"meshrl_{name}")
    got, metrics = fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode=mode,
                      config=cfg, rollout_is_weights=None)
    (g_got,) = torch.autograd.grad(got, new)
    mat, stats = policy_loss(name, new, old, adv, mask, clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high)
    want = reference_agg(mat, mask, mode)
    (g_want,) = torch.autograd.grad(want, new)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
    assert g_got[~mask].abs().max() == 0  # holes get no gradient
    assert metrics == {f"meshrl/{k}": pytest.approx(v) for k, v in stats.items()}


def test_rollout_weights_and_global_batch_info():
    old, new, adv, mask = batch(seed=7)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cfg = actor_config("meshrl_ppo_clip")
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=50, global_batch_size=None, loss_scale_factor=None)
    got, _ = get_policy_loss_fn("meshrl_ppo_clip")(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
        config=cfg, rollout_is_weights=weights)
    mat, _ = policy_loss("ppo_clip", new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    want = reference_agg(mat * weights, mask, "token-mean", dp_size=2, batch_num_tokens=50)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, new)[0], torch.autograd.grad(want, new)[0])


def test_verl_gspo_is_gspo_token_so_it_is_not_a_new_form():
    """verl's ``gspo`` is the GSPO-token objective: equal to meshrl's gspo_token and gspo (seq-mean-token-mean)."""
    old, new, adv, mask = batch(seed=11, spread=0.01)
    cfg = actor_config("gspo", 3e-2, 4e-2)
    kwargs = dict(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                  loss_agg_mode="seq-mean-token-mean", config=cfg, rollout_is_weights=None)
    verl_value, _ = get_policy_loss_fn("gspo")(**kwargs)
    g_verl = torch.autograd.grad(verl_value, new)[0]
    for name in ("meshrl_gspo_token", "meshrl_gspo"):
        value, _ = get_policy_loss_fn(name)(**kwargs)
        torch.testing.assert_close(value, verl_value)
        torch.testing.assert_close(torch.autograd.grad(value, new)[0], g_verl)


def test_meshrl_ppo_clip_has_no_dual_clip_unlike_vanilla():
    """Negative advantage, ratio e^2 > clip_ratio_c = 3: verl's vanilla bounds the loss at 3|A|, meshrl does not."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.full((1, 2), 2.0, dtype=torch.float64, requires_grad=True)
    adv = -torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    kwargs = dict(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
                  config=actor_config("vanilla"), rollout_is_weights=None)
    vanilla, _ = get_policy_loss_fn("vanilla")(**kwargs)
    mesh, _ = get_policy_loss_fn("meshrl_ppo_clip")(**kwargs)
    assert float(vanilla) == pytest.approx(3.0)
    assert float(mesh) == pytest.approx(torch.e ** 2)
    assert float(torch.autograd.grad(mesh, new)[0].sum()) == pytest.approx(torch.e ** 2)


def test_missing_config_is_an_error():
    old, new, adv, mask = batch(seed=1)
    with pytest.raises(ValueError, match="needs verl's actor config"):
        get_policy_loss_fn("meshrl_cispo")(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask)
