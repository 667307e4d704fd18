"""Policy-gradient surrogates (PPO-clip, GSPO, GSPO-token, CISPO): values, gradients, metrics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algos import (
    POLICY_LOSSES,
    aggregate,
    cispo_loss,
    gspo_loss,
    gspo_token_loss,
    policy_loss,
    ppo_clip_loss,
)

FAST = settings(max_examples=50, deadline=None)
OLD = -1.0  # every hand case uses log pi_old = -1 and log pi = -1 + log(rho)


def from_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp requiring grad, old_logp) with pi / pi_old equal to ``ratios``."""
    old = torch.full((len(ratios), len(ratios[0])), OLD, dtype=torch.float64)
    logp = (old + torch.log(torch.tensor(ratios, dtype=torch.float64))).requires_grad_()
    return logp, old


def check(actual: torch.Tensor, expected: list, atol: float = 1e-9) -> None:
    """Element-wise closeness of a tensor to a nested list of hand-computed numbers."""
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-9)


def grad_of(loss_mat: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """d sum_{masked} loss / d logp."""
    m = torch.ones_like(loss_mat) if mask is None else mask.to(loss_mat.dtype)
    (g,) = torch.autograd.grad((loss_mat * m).sum(), logp)
    return g


# --- PPO clip: the hand-built case ----------------------------------------------------------------
# clip_low 0.2, clip_high 0.28: the trust region is [0.8, 1.28].
# Row 0, A = +1, rho = [0.5, 0.9, 1.2, 1.5]:
#   0.5 -> max(-0.5, -0.8) = -0.5   (below the region, but A > 0: the min objective keeps rho; grad -A rho)
#   0.9 -> -0.9;  1.2 -> -1.2        (inside)
#   1.5 -> max(-1.5, -1.28) = -1.28 (clipped high: gradient 0)
# Row 1, A = -2, rho = [0.5, 0.9, 1.5, 4.0]:
#   0.5 -> max(1.0, 1.6) = 1.6      (clipped low: gradient 0)
#   0.9 -> 1.8
#   1.5 -> max(3.0, 2.56) = 3.0     (above the region, but A < 0: unclipped; grad -A rho = 3.0)
#   4.0 -> max(8.0, 2.56) = 8.0; with dual clip c = 3: min(8.0, -A c = 6.0) = 6.0 (gradient 0)
PPO_RATIOS = [[0.5, 0.9, 1.2, 1.5], [0.5, 0.9, 1.5, 4.0]]
PPO_ADV = torch.tensor([1.0, -2.0], dtype=torch.float64)
PPO_MASK = torch.ones(2, 4)


def test_ppo_clip_hand_values_and_gradients() -> None:
    logp, old = from_ratios(PPO_RATIOS)
    loss, metrics = ppo_clip_loss(logp, old, PPO_ADV, PPO_MASK, clip_low=0.2, clip_high=0.28)
    expected = [[-0.5, -0.9, -1.2, -1.28], [1.6, 1.8, 3.0, 8.0]]
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=torch.float64))
    # d loss / d logp = -A rho where the unclipped term is active, 0 where the clip is.
    expected_grad = [[-0.5, -0.9, -1.2, 0.0], [0.0, 1.8, 3.0, 8.0]]
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor(expected_grad, dtype=torch.float64))
    assert metrics["clip/frac_low"] == pytest.approx(1 / 8)
    assert metrics["clip/frac_high"] == pytest.approx(1 / 8)
    assert metrics["clip/frac_dual"] == 0.0


def test_ppo_dual_clip_caps_negative_advantage_losses() -> None:
    logp, old = from_ratios(PPO_RATIOS)
    loss, metrics = ppo_clip_loss(logp, old, PPO_ADV, PPO_MASK, clip_low=0.2, clip_high=0.28, clip_dual=3.0)
    expected = [[-0.5, -0.9, -1.2, -1.28], [1.6, 1.8, 3.0, 6.0]]
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=torch.float64))
    expected_grad = [[-0.5, -0.9, -1.2, 0.0], [0.0, 1.8, 3.0, 0.0]]
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor(expected_grad, dtype=torch.float64))
    assert metrics["clip/frac_dual"] == pytest.approx(1 / 8)


def test_ppo_dual_clip_never_touches_positive_advantages() -> None:
    # A = +1 and rho = 10: clip-high already caps the loss at -1.28; the dual bound must not apply.
    logp, old = from_ratios([[10.0]])
    loss, metrics = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_dual=3.0)
    assert loss.item() == pytest.approx(-1.2)
    assert metrics["clip/frac_dual"] == 0.0


def test_ppo_clip_metrics_count_masked_tokens_only() -> None:
    # Masking out the clipped-high token leaves 7 tokens, one of them clipped low.
    mask = PPO_MASK.clone()
    mask[0, 3] = 0
    logp, old = from_ratios(PPO_RATIOS)
    _, metrics = ppo_clip_loss(logp, old, PPO_ADV, mask, clip_low=0.2, clip_high=0.28)
    assert metrics["clip/frac_high"] == 0.0
    assert metrics["clip/frac_low"] == pytest.approx(1 / 7)
    # ratio metrics over the same 7 tokens; approx_kl = mean(rho - 1 - log rho).
    kept = [0.5, 0.9, 1.2, 0.5, 0.9, 1.5, 4.0]
    assert metrics["ratio/mean"] == pytest.approx(sum(kept) / 7)
    assert metrics["ratio/max"] == pytest.approx(4.0)
    assert metrics["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in kept) / 7)


def test_clip_higher_is_asymmetric() -> None:
    # rho = 1.25 with A > 0 lies inside [0.8, 1.28] (clip-higher) but outside [0.8, 1.2] (symmetric).
    # rho = 0.75 with A < 0 is clipped low under both.
    logp, old = from_ratios([[1.25, 0.75]])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    higher, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    symmetric, _ = ppo_clip_loss(logp, old, adv, mask)  # defaults 0.2 / 0.2
    check(higher.detach(), [[-1.25, 0.8]])
    check(symmetric.detach(), [[-1.2, 0.8]])
    check(grad_of(higher, logp), [[-1.25, 0.0]])
    check(grad_of(symmetric, logp), [[0.0, 0.0]])


def test_ppo_gradient_matches_manual_formula_on_random_tokens(gen: torch.Generator) -> None:
    # grad = -A rho * [not clipped], clipped = (A > 0 and rho > 1 + eh) or (A < 0 and rho < 1 - el).
    lo, hi = 0.2, 0.28
    ratio = torch.exp(torch.randn(6, 9, generator=gen, dtype=torch.float64) * 0.4)
    adv = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    old = torch.full_like(ratio, OLD)
    logp = (old + ratio.log()).requires_grad_()
    loss, _ = ppo_clip_loss(logp, old, adv, torch.ones(6, 9), clip_low=lo, clip_high=hi)
    clipped = ((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - lo))
    manual = torch.where(clipped, torch.zeros_like(ratio), -adv * ratio)
    assert 0 < int(clipped.sum()) < clipped.numel()  # both kinds of token are present
    torch.testing.assert_close(grad_of(loss, logp), manual)


def test_ppo_advantages_1d_and_2d_agree() -> None:
    logp, old = from_ratios(PPO_RATIOS)
    a, _ = ppo_clip_loss(logp, old, PPO_ADV, PPO_MASK)
    b, _ = ppo_clip_loss(logp, old, PPO_ADV[:, None].expand(2, 4).clone(), PPO_MASK)
    torch.testing.assert_close(a, b)


def test_ppo_advantages_carry_no_gradient() -> None:
    logp, old = from_ratios(PPO_RATIOS)
    adv = PPO_ADV.clone().requires_grad_()
    loss, _ = ppo_clip_loss(logp, old, adv, PPO_MASK)
    (g,) = torch.autograd.grad(loss.sum(), adv, allow_unused=True)
    assert g is None or g.abs().max().item() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"clip_low": -0.1}, "clip_low"), ({"clip_high": -0.1}, "clip_high"), ({"clip_dual": 1.0}, "clip_dual")],
)
def test_ppo_rejects_bad_clip_config(kwargs: dict, match: str) -> None:
    logp, old = from_ratios(PPO_RATIOS)
    with pytest.raises(ValueError, match=match):
        ppo_clip_loss(logp, old, PPO_ADV, PPO_MASK, **kwargs)


# --- GSPO -----------------------------------------------------------------------------------------
# Bounds with eps 3e-4 / 4e-4: [0.9997, 1.0004]. Mask row 1 = [1, 1, 0].
#   row 0, A = +1, log rho = [0.1, -0.2, 0.4]        -> mean 0.1, s = e^0.1 = 1.10517 > 1.0004
#          L = max(-1.10517, -1.0004) = -1.0004                      (clipped high, gradient 0)
#   row 1, A = -1, log rho = [0.0, -0.002, (5.0 masked)] -> mean -0.001, s = 0.9990005 < 0.9997
#          L = max(0.9990005, 0.9997) = 0.9997                        (clipped low, gradient 0)
#   row 2, A = +2, log rho = [2e-4, -1e-4, 2e-4]     -> mean 1e-4, s = 1.000100005 (inside)
#          L = -2 s = -2.00020001;  dL/dlogp_t = -A s / |y| = -2 s / 3 per token
GSPO_LR = [[0.1, -0.2, 0.4], [0.0, -0.002, 5.0], [2e-4, -1e-4, 2e-4]]
GSPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
GSPO_ADV = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)


def gspo_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((3, 3), OLD, dtype=torch.float64)
    return (old + torch.tensor(GSPO_LR, dtype=torch.float64)).requires_grad_(), old


def test_gspo_hand_values_and_metrics() -> None:
    logp, old = gspo_inputs()
    loss, metrics = gspo_loss(logp, old, GSPO_ADV, GSPO_MASK)
    s2 = math.exp(1e-4)
    expected = [[-1.0004] * 3, [0.9997, 0.9997, 0.0], [-2 * s2] * 3]  # masked token written as 0
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=torch.float64))
    assert metrics["clip/frac_high"] == pytest.approx(1 / 3)
    assert metrics["clip/frac_low"] == pytest.approx(1 / 3)
    assert metrics["seq_ratio/mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.001) + s2) / 3)


def test_gspo_gradient_under_seq_mean_token_mean() -> None:
    # The aggregate is (1/3) sum_i L_i; only row 2 is unclipped: d/dlogp_{2,t} = (1/3)(-2 s / 3).
    logp, old = gspo_inputs()
    loss, _ = gspo_loss(logp, old, GSPO_ADV, GSPO_MASK)
    total = aggregate(loss, GSPO_MASK, "seq-mean-token-mean")
    assert total.item() == pytest.approx((-1.0004 + 0.9997 - 2 * math.exp(1e-4)) / 3)
    (g,) = torch.autograd.grad(total, logp)
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[2] = -2 * math.exp(1e-4) / 9
    torch.testing.assert_close(g, expected)


def test_gspo_clips_the_sequence_not_the_tokens() -> None:
    # Token ratios e^0.5 and e^-0.5 are far outside any token trust region, but the sequence ratio
    # is exp(mean) = 1: GSPO keeps the gradient; PPO with the same bounds clips both tokens.
    old = torch.full((1, 2), OLD, dtype=torch.float64)
    logp = (old + torch.tensor([[0.5, -0.5]], dtype=torch.float64)).requires_grad_()
    mask, adv = torch.ones(1, 2), torch.tensor([1.0], dtype=torch.float64)
    g_loss, _ = gspo_loss(logp, old, adv, mask)
    check(g_loss.detach(), [[-1.0, -1.0]])
    (g,) = torch.autograd.grad(aggregate(g_loss, mask, "seq-mean-token-mean"), logp)
    check(g, [[-0.5, -0.5]])  # -A s / |y| with s = 1, |y| = 2
    p_loss, _ = ppo_clip_loss(
        logp, old, torch.tensor([[1.0, -1.0]], dtype=torch.float64), mask, clip_low=3e-4, clip_high=4e-4
    )
    assert grad_of(p_loss, logp).tolist() == [[0.0, 0.0]]


def test_gspo_row_constant_2d_advantages_equal_1d() -> None:
    logp, old = gspo_inputs()
    a, _ = gspo_loss(logp, old, GSPO_ADV, GSPO_MASK)
    b, _ = gspo_loss(logp, old, GSPO_ADV[:, None].expand(3, 3).clone(), GSPO_MASK)
    torch.testing.assert_close(a, b)


def test_gspo_2d_advantages_read_the_first_masked_token() -> None:
    # Token-level advantages are often A * mask, so they are 0 outside the response. The sequence
    # advantage must come from a response token: row 0 starts with a masked-out slot, row 1 ends with one.
    old = torch.full((2, 3), OLD, dtype=torch.float64)
    logp = old.clone().requires_grad_()  # rho = 1, s = 1: L_i = -A_i, nothing clips
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    adv = torch.tensor([[0.0, 2.0, 2.0], [-3.0, -3.0, 0.0]], dtype=torch.float64)
    loss, _ = gspo_loss(logp, old, adv, mask)
    check(loss, [[0.0, -2.0, -2.0], [3.0, 3.0, 0.0]])


@FAST
@given(
    st.floats(0.5, 2.0),
    st.floats(-3, 3),
    st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=4),
    st.sampled_from([(3e-4, 4e-4), (0.2, 0.28)]),
)
def test_property_gspo_with_shared_token_ratio(r: float, a: float, mask_rows, clips) -> None:
    # Every token has ratio r, so s_i = exp(mean log r) = r on every row with tokens, and
    # L_i = max(-A r, -A clip(r, 1 - lo, 1 + hi)) is written on each masked token.
    lo, hi = clips
    mask = torch.tensor(mask_rows, dtype=torch.float64)
    mask[0, 0] = 1.0  # at least one token
    logp, old = from_ratios([[r] * 4 for _ in mask_rows])
    adv = torch.full((len(mask_rows),), a, dtype=torch.float64)
    loss, metrics = gspo_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi)
    clipped_r = min(max(r, 1 - lo), 1 + hi)
    expected = max(-a * r, -a * clipped_r)
    torch.testing.assert_close(loss.detach(), expected * mask, atol=1e-9, rtol=1e-9)
    assert metrics["seq_ratio/mean"] == pytest.approx(r, rel=1e-9)


# --- GSPO-token -----------------------------------------------------------------------------------


@pytest.mark.parametrize("clips", [(3e-4, 4e-4), (0.05, 0.08)])
def test_gspo_token_equals_gspo_in_value_and_gradient(clips, gen: torch.Generator) -> None:
    # Per-sequence advantages and seq-mean-token-mean: both give (1/B) sum_i L_i and the same gradient.
    lo, hi = clips
    old = torch.randn(5, 6, generator=gen, dtype=torch.float64) - 2
    logp = (old + torch.randn(5, 6, generator=gen, dtype=torch.float64) * 0.05).requires_grad_()
    adv = torch.randn(5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 6, generator=gen) > 0.3).to(torch.float64)
    mask[:, 0] = 1
    out = []
    for fn in (gspo_loss, gspo_token_loss):
        loss, _ = fn(logp, old, adv, mask, clip_low=lo, clip_high=hi)
        total = aggregate(loss, mask, "seq-mean-token-mean")
        (g,) = torch.autograd.grad(total, logp)
        out.append((total, g))
    (v1, g1), (v2, g2) = out
    torch.testing.assert_close(v2, v1)
    torch.testing.assert_close(g2, g1)
    assert g1.abs().max().item() > 0  # some sequence is unclipped, so the comparison has content


def test_gspo_token_value_is_sequence_ratio_and_gradient_uses_token_advantage() -> None:
    # Row log rho = [0.2, -0.1, 0.2] (mean 0.1, s = e^0.1), token advantages [1, -1, 2], wide clip so
    # nothing clips. L_t = -A_t s; d(seq-mean-token-mean)/dlogp_t = -A_t s / 3 (one row, three tokens).
    old = torch.full((1, 3), OLD, dtype=torch.float64)
    logp = (old + torch.tensor([[0.2, -0.1, 0.2]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    loss, metrics = gspo_token_loss(logp, old, adv, mask, clip_low=0.5, clip_high=0.5)
    s = math.exp(0.1)
    check(loss.detach(), [[-s, s, -2 * s]])
    (g,) = torch.autograd.grad(aggregate(loss, mask, "seq-mean-token-mean"), logp)
    check(g, [[-s / 3, s / 3, -2 * s / 3]])
    assert metrics["seq_ratio/mean"] == pytest.approx(s)


# --- CISPO ----------------------------------------------------------------------------------------
# rho = [0.5, 1.0, 1.5, 3.0], A = [1, -1, 1, -1], eps_high 0.28, eps_low 1 (no lower bound):
# w = clip(rho, 0, 1.28) = [0.5, 1.0, 1.28, 1.28]; L_t = -w A log pi; dL/dlogp = -w A.


def test_cispo_gradient_is_clipped_weight_times_advantage_and_never_zero() -> None:
    logp, old = from_ratios([[0.5, 1.0, 1.5, 3.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, metrics = cispo_loss(logp, old, adv, torch.ones(1, 4))
    w = [0.5, 1.0, 1.28, 1.28]
    logp_vals = logp.detach()[0].tolist()
    assert loss.detach()[0].tolist() == pytest.approx(
        [-wi * ai * lp for wi, ai, lp in zip(w, [1, -1, 1, -1], logp_vals, strict=True)]
    )
    g = grad_of(loss, logp)
    check(g, [[-0.5, 1.0, -1.28, 1.28]])
    assert metrics["clip/frac_high"] == pytest.approx(0.5)
    assert metrics["clip/frac_low"] == 0.0
    # The token with rho = 1.5, A > 0 is clipped: PPO drops its gradient, CISPO keeps it (down-weighted).
    p_loss, _ = ppo_clip_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    assert grad_of(p_loss, logp)[0, 2].item() == 0.0 and g[0, 2].item() != 0.0


def test_cispo_with_a_lower_bound() -> None:
    logp, old = from_ratios([[0.5]])
    loss, metrics = cispo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2)
    assert grad_of(loss, logp).item() == pytest.approx(-0.8)  # w = max(0.5, 0.8)
    assert metrics["clip/frac_low"] == 1.0


def test_cispo_gradient_through_logits_is_weight_times_score(gen: torch.Generator) -> None:
    # With log pi = log_softmax(theta)[y]: grad_theta L = -w A grad_theta log pi(y) = -w A (e_y - p).
    theta = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    y = 2
    logp = torch.log_softmax(theta, -1)[y].reshape(1, 1)
    old = logp.detach() - math.log(2.0)  # rho = 2 -> w = 1.28
    loss, _ = cispo_loss(logp, old, torch.tensor([0.7], dtype=torch.float64), torch.ones(1, 1))
    (g,) = torch.autograd.grad(loss.sum(), theta)
    p = torch.softmax(theta.detach(), -1)
    manual = -1.28 * 0.7 * (torch.nn.functional.one_hot(torch.tensor(y), 4).to(p.dtype) - p)
    torch.testing.assert_close(g, manual)


def test_cispo_weight_is_a_constant_for_autograd() -> None:
    # The weight is stop-gradient: d loss / d logp = -w A is itself a constant (no graph behind it).
    # Had the weight kept its graph, the gradient would carry an extra -A rho log pi term.
    logp, old = from_ratios([[1.1]])
    loss, _ = cispo_loss(logp, old, torch.tensor([2.0]), torch.ones(1, 1))
    (g,) = torch.autograd.grad(loss.sum(), logp, create_graph=True)
    assert not g.requires_grad
    assert g.item() == pytest.approx(-1.1 * 2.0)


# --- registry and bad input -----------------------------------------------------------------------


def test_registry_and_dispatch() -> None:
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "gspo_token", "cispo"}
    logp, old = from_ratios(PPO_RATIOS)
    direct, m1 = ppo_clip_loss(logp, old, PPO_ADV, PPO_MASK, clip_high=0.28, clip_dual=3.0)
    via, m2 = policy_loss("ppo_clip", logp, old, PPO_ADV, PPO_MASK, clip_high=0.28, clip_dual=3.0)
    torch.testing.assert_close(via, direct)
    assert m1 == m2


def test_unknown_policy_loss_lists_known_names() -> None:
    logp, old = from_ratios(PPO_RATIOS)
    with pytest.raises(ValueError, match=r"policy loss.*'reinforce'.*cispo.*gspo.*ppo_clip"):
        policy_loss("reinforce", logp, old, PPO_ADV, PPO_MASK)


ALL_LOSSES = [ppo_clip_loss, gspo_loss, gspo_token_loss, cispo_loss]


def _ok() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.full((2, 3), -1.0), torch.full((2, 3), -1.1), torch.tensor([1.0, -1.0]), torch.ones(2, 3)


@pytest.mark.parametrize("fn", ALL_LOSSES)
@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("logp", torch.zeros(6), "logp"),
        ("logp", torch.tensor([[-1.0, float("nan"), -1.0]] * 2), "logp"),
        ("old_logp", torch.zeros(2, 4), r"shape mismatch.*old_logp"),
        ("old_logp", torch.tensor([[-1.0, float("inf"), -1.0]] * 2), "old_logp"),
        ("adv", torch.tensor([1.0, 2.0, 3.0]), "advantages"),
        ("adv", torch.zeros(2, 1), "advantages"),
        ("adv", torch.tensor([1.0, float("nan")]), "advantages"),
        ("mask", torch.ones(2, 4), "mask"),
        ("mask", torch.full((2, 3), 2.0), "mask"),
    ],
)
def test_losses_reject_bad_input(fn, field: str, bad: torch.Tensor, match: str) -> None:
    args = dict(zip(("logp", "old_logp", "adv", "mask"), _ok(), strict=True))
    args[field] = bad
    with pytest.raises(ValueError, match=match):
        fn(args["logp"], args["old_logp"], args["adv"], args["mask"])


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss, cispo_loss])
def test_losses_reject_negative_clip(fn) -> None:
    with pytest.raises(ValueError, match="clip_low"):
        fn(*_ok(), clip_low=-1.0)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_is_zero_gradient_free_at_zero_advantage(name: str) -> None:
    # A = 0 everywhere: no policy-gradient signal at all, whatever the ratio.
    logp, old = from_ratios([[0.7, 1.0, 1.6]])
    loss, _ = policy_loss(name, logp, old, torch.zeros(1, dtype=torch.float64), torch.ones(1, 3))
    assert loss.detach().abs().max().item() == 0.0
    assert grad_of(loss, logp).abs().max().item() == 0.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_pushes_logp_up_for_positive_advantage_on_policy(name: str) -> None:
    # On-policy (rho = 1), A > 0: the loss gradient is -A per token (or -A / |y| for GSPO's mean),
    # so gradient descent raises log pi. Catches sign errors in any registered loss.
    logp, old = from_ratios([[1.0, 1.0]])
    loss, _ = policy_loss(name, logp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2))
    (g,) = torch.autograd.grad(aggregate(loss, torch.ones(1, 2), "seq-mean-token-mean"), logp)
    check(g, [[-0.5, -0.5]])
