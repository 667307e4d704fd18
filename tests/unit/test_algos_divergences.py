"""KL estimators k1/k2/k3/k3+ and the Jensen-Shannon divergence (exact and sampled)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.algos import KL_ESTIMATORS, js_divergence, js_sampled, kl_penalty

FAST = settings(max_examples=50, deadline=None)
LOG2 = math.log(2.0)


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# --- KL estimators: values ------------------------------------------------------------------------

# Three tokens: log pi = [-1, -2, -0.5], log pi_ref = [-1.5, -1, -0.5], so x = ref - logp = [-0.5, 1, 0].
LOGP = [-1.0, -2.0, -0.5]
REF = [-1.5, -1.0, -0.5]


def test_k1_is_the_log_ratio() -> None:
    assert kl_penalty(t64(LOGP), t64(REF), "k1").tolist() == pytest.approx([0.5, -1.0, 0.0])


def test_k2_is_half_the_squared_log_ratio() -> None:
    # 0.5 * 0.5^2 = 0.125, 0.5 * 1^2 = 0.5, 0.
    assert kl_penalty(t64(LOGP), t64(REF), "k2").tolist() == pytest.approx([0.125, 0.5, 0.0])


def test_k3_is_exp_x_minus_x_minus_one() -> None:
    # x = -0.5: e^-0.5 + 0.5 - 1 = 0.1065307;  x = 1: e - 1 - 1 = 0.7182818;  x = 0: 0.
    expected = [math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0]
    assert kl_penalty(t64(LOGP), t64(REF), "k3").tolist() == pytest.approx(expected, rel=1e-12)
    assert kl_penalty(t64(LOGP), t64(REF)).tolist() == pytest.approx(expected, rel=1e-12)  # default k3


def test_registry_names() -> None:
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "k3+"}


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_for_kl_over_a_categorical(kind: str) -> None:
    # E_{y~p}[k(y)] summed exactly over a 6-token vocabulary must equal KL(p || q) = sum p log(p / q).
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    q = np.array([0.1, 0.2, 0.3, 0.2, 0.1, 0.1])
    kl = float(np.sum(p * np.log(p / q)))  # 0.3327...
    k = kl_penalty(t64(np.log(p)), t64(np.log(q)), kind).numpy()
    assert float(np.sum(p * k)) == pytest.approx(kl, rel=1e-10)


def test_k2_is_biased_on_the_same_categorical() -> None:
    # Guards the test above against a vacuous pass: a biased estimator does not match.
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    q = np.array([0.1, 0.2, 0.3, 0.2, 0.1, 0.1])
    kl = float(np.sum(p * np.log(p / q)))
    k2 = kl_penalty(t64(np.log(p)), t64(np.log(q)), "k2").numpy()
    assert abs(float(np.sum(p * k2)) - kl) > 1e-2


# --- KL estimators: clamps and gradients ----------------------------------------------------------


def test_k3_clamps_the_value_at_ten() -> None:
    # x = 5: e^5 - 6 = 142.4 -> 10;  x = -15: e^-15 + 14 = 14.0000003 -> 10;
    # x = 50 / -1000: the exponent is clamped to +-20 first, so no inf or NaN appears.
    logp = t64([0.0, 0.0, 0.0, 0.0, 0.0])
    ref = t64([5.0, -15.0, 50.0, -1000.0, 2.0])
    k3 = kl_penalty(logp, ref, "k3")
    assert k3.tolist()[:4] == [10.0, 10.0, 10.0, 10.0]
    assert k3[4].item() == pytest.approx(math.exp(2) - 3)  # 4.389, below the clamp


def test_k3_gradient_is_one_minus_exp_x_inside_and_zero_when_clamped() -> None:
    # d/dlogp (e^(ref - logp) - (ref - logp) - 1) = 1 - e^x. Clamped tokens pass no gradient.
    logp = t64([-1.0, -2.0, -0.5, 0.0, 0.0]).requires_grad_()
    ref = t64([-1.5, -1.0, -0.5, 5.0, -15.0])
    kl_penalty(logp, ref, "k3").sum().backward()
    expected = [1 - math.exp(-0.5), 1 - math.e, 0.0, 0.0, 0.0]
    assert logp.grad.tolist() == pytest.approx(expected, rel=1e-12)


def test_k3_plus_has_k3_value_and_k2_gradient() -> None:
    # Value: k3 (including its clamp). Gradient: that of k2 = (logp - ref)^2 / 2, i.e. logp - ref
    # for logp and ref - logp for ref, even on the clamped token where k3's own gradient is 0.
    logp = t64(LOGP + [0.0]).requires_grad_()
    ref = t64(REF + [5.0]).requires_grad_()
    out = kl_penalty(logp, ref, "k3+")
    k3 = kl_penalty(logp.detach(), ref.detach(), "k3")
    torch.testing.assert_close(out.detach(), k3, atol=1e-12, rtol=1e-12)
    out.sum().backward()
    diff = [a - b for a, b in zip(LOGP + [0.0], REF + [5.0], strict=True)]  # [0.5, -1, 0, -5]
    assert logp.grad.tolist() == pytest.approx(diff)
    assert ref.grad.tolist() == pytest.approx([-d for d in diff])


def test_k1_and_k2_gradients() -> None:
    logp = t64(LOGP).requires_grad_()
    (g1,) = torch.autograd.grad(kl_penalty(logp, t64(REF), "k1").sum(), logp)
    (g2,) = torch.autograd.grad(kl_penalty(logp, t64(REF), "k2").sum(), logp)
    assert g1.tolist() == [1.0, 1.0, 1.0]
    assert g2.tolist() == pytest.approx([0.5, -1.0, 0.0])


@FAST
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=20))
def test_property_k3_is_nonnegative_and_bounded(pairs) -> None:
    logp, ref = t64([a for a, _ in pairs]), t64([b for _, b in pairs])
    k3 = kl_penalty(logp, ref, "k3")
    # >= 0 up to float rounding: exp(x) - x - 1 for |x| ~ 1e-11 rounds to -1.1e-16 (as in verl, which computes it alike)
    assert bool((k3 >= -1e-12).all()) and bool((k3 <= 10).all())
    # k3+ = k2 + (k3 - k2): the same value up to one rounding of the straight-through sum.
    torch.testing.assert_close(kl_penalty(logp, ref, "k3+"), k3, atol=1e-12, rtol=1e-12)


def test_kl_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"kl kind.*'k4'.*k1.*k2.*k3"):
        kl_penalty(t64(LOGP), t64(REF), "k4")
    with pytest.raises(ValueError, match=r"shape mismatch.*logp.*ref_logp"):
        kl_penalty(t64(LOGP), t64(REF[:2]))
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalty(t64(LOGP), t64([-1.0, float("nan"), 0.0]))
    with pytest.raises(ValueError, match="logp"):
        kl_penalty(t64([-1.0, float("-inf"), 0.0]), t64(REF))


# --- exact JS -------------------------------------------------------------------------------------


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_js(logits: np.ndarray, ref_logits: np.ndarray) -> np.ndarray:
    """Float64 reference: 1/2 sum p log(p/m) + 1/2 sum q log(q/m), m = (p + q) / 2."""
    p, q = np_softmax(logits.astype(np.float64)), np_softmax(ref_logits.astype(np.float64))
    m = (p + q) / 2
    return 0.5 * np.sum(p * np.log(p / m), -1) + 0.5 * np.sum(q * np.log(q / m), -1)


def torch_js64(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """The same formula in float64 torch, written from probabilities (not log space) for autograd."""
    p, q = torch.softmax(logits, -1), torch.softmax(ref_logits, -1)
    m = (p + q) / 2
    return 0.5 * (p * torch.log(p / m)).sum(-1) + 0.5 * (q * torch.log(q / m)).sum(-1)


def test_js_two_token_hand_case() -> None:
    # p = softmax([0, 0]) = (1/2, 1/2); q = softmax([log 3, 0]) = (3/4, 1/4); m = (5/8, 3/8).
    logits = torch.tensor([[[0.0, 0.0]]])
    ref = torch.tensor([[[math.log(3), 0.0]]])
    kl_pm = 0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)
    kl_qm = 0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)
    assert js_divergence(logits, ref).item() == pytest.approx(0.5 * (kl_pm + kl_qm), rel=1e-5)


def test_js_matches_float64_numpy_formula(gen: torch.Generator) -> None:
    logits = torch.randn(2, 3, 7, generator=gen) * 3
    ref = torch.randn(2, 3, 7, generator=gen) * 3
    out = js_divergence(logits, ref)
    assert out.shape == (2, 3) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), np_js(logits.numpy(), ref.numpy()), atol=2e-6, rtol=1e-5)


def test_js_of_disjoint_distributions_is_log_two() -> None:
    # Nearly disjoint supports: JS -> log 2 from below.
    logits = torch.tensor([[[60.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    ref = torch.tensor([[[0.0, 60.0, 0.0], [0.0, 0.0, 0.0]]])
    out = js_divergence(logits, ref)
    assert out[0, 0].item() == pytest.approx(LOG2, abs=1e-5)
    assert out[0, 1].item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 4096])
def test_js_chunk_size_does_not_change_value_or_gradient(chunk_size: int, gen: torch.Generator) -> None:
    logits = (torch.randn(3, 4, 6, generator=gen) * 2).requires_grad_()
    ref = torch.randn(3, 4, 6, generator=gen) * 2
    whole = js_divergence(logits, ref, chunk_size=10_000)
    (g_whole,) = torch.autograd.grad(whole.sum(), logits)
    part = js_divergence(logits, ref, chunk_size=chunk_size)
    (g_part,) = torch.autograd.grad(part.sum(), logits)
    torch.testing.assert_close(part, whole, atol=1e-7, rtol=0)
    torch.testing.assert_close(g_part, g_whole, atol=1e-7, rtol=0)


def test_js_gradient_matches_autograd_of_float64_reference(gen: torch.Generator) -> None:
    logits = (torch.randn(2, 2, 5, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ref = (torch.randn(2, 2, 5, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    w = torch.rand(2, 2, generator=gen, dtype=torch.float64)  # weights so positions are not symmetric
    g_impl = torch.autograd.grad((js_divergence(logits, ref) * w).sum(), (logits, ref))
    g_ref = torch.autograd.grad((torch_js64(logits, ref) * w).sum(), (logits, ref))
    for a, b in zip(g_impl, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_js_empty_input() -> None:
    out = js_divergence(torch.zeros(0, 3, 4), torch.zeros(0, 3, 4))
    assert out.shape == (0, 3)


def test_js_rejects_bad_input() -> None:
    x = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="logits must have 3 dims"):
        js_divergence(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="ref_logits"):
        js_divergence(x, torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"shape mismatch.*logits.*ref_logits"):
        js_divergence(x, torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="chunk_size"):
        js_divergence(x, x, chunk_size=0)
    with pytest.raises(ValueError, match="ref_logits"):
        js_divergence(x, torch.full((1, 2, 3), float("nan")))
    bad = x.clone()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="logits"):
        js_divergence(bad, x)


logit_rows = st.integers(2, 6).flatmap(
    lambda v: st.lists(
        st.tuples(
            st.lists(st.floats(-15, 15), min_size=v, max_size=v),
            st.lists(st.floats(-15, 15), min_size=v, max_size=v),
        ),
        min_size=1,
        max_size=3,
    )
)


@FAST
@given(logit_rows)
def test_property_js_symmetric_nonnegative_bounded(rows) -> None:
    a = torch.tensor([[r[0] for r in rows]])
    b = torch.tensor([[r[1] for r in rows]])
    ab, ba = js_divergence(a, b), js_divergence(b, a)
    torch.testing.assert_close(ab, ba, atol=1e-6, rtol=0)
    assert bool((ab >= 0).all()) and bool((ab <= LOG2 + 1e-6).all())
    np.testing.assert_allclose(ab.numpy(), np_js(a.numpy(), b.numpy()), atol=1e-5)


@FAST
@given(logit_rows, st.floats(-50, 50))
def test_property_js_of_equal_distributions_is_zero(rows, shift: float) -> None:
    # Equal inputs, and inputs equal up to a constant logit shift (same softmax), both give 0.
    a = torch.tensor([[r[0] for r in rows]])
    assert js_divergence(a, a).abs().max().item() < 1e-6
    assert js_divergence(a, a + shift).abs().max().item() < 1e-5


# --- sampled JS -----------------------------------------------------------------------------------


def f_hand(p: float, q: float) -> float:
    """Per-sample value 1/2 log(p/m) + q/(2p) log(q/m), written out independently of the module."""
    m = (p + q) / 2
    return 0.5 * math.log(p / m) + q / (2 * p) * math.log(q / m)


def test_js_sampled_value_hand_case() -> None:
    # p = 1/2, q = 1/4, m = 3/8: f = 1/2 log(4/3) + 1/4 log(2/3) = 0.14384 - 0.10137 = 0.04247.
    out = js_sampled(t64([math.log(0.5)]), t64([math.log(0.25)]))
    assert out.item() == pytest.approx(0.5 * math.log(4 / 3) + 0.25 * math.log(2 / 3), rel=1e-12)


def test_js_sampled_is_zero_with_zero_gradient_when_policies_agree() -> None:
    logp = t64([-0.1, -2.0, -7.0]).requires_grad_()
    out = js_sampled(logp, logp.detach().clone())
    (g,) = torch.autograd.grad(out.sum(), logp)
    assert out.abs().max().item() < 1e-15 and g.abs().max().item() < 1e-15


def test_js_sampled_gradient_weight_is_half_log_p_over_m() -> None:
    # d surrogate / d logp = g(y) = 1/2 log(p / m), the dJS/dp_y of the derivation.
    p, q = [0.5, 0.1, 0.02], [0.25, 0.3, 0.02]
    logp = t64([math.log(x) for x in p]).requires_grad_()
    out = js_sampled(logp, t64([math.log(x) for x in q]))
    (g,) = torch.autograd.grad(out.sum(), logp)
    expected = [0.5 * math.log(a / ((a + b) / 2)) for a, b in zip(p, q, strict=True)]
    assert g.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert out.tolist() == pytest.approx([f_hand(a, b) for a, b in zip(p, q, strict=True)], rel=1e-12)


def five_token_case() -> tuple[torch.Tensor, torch.Tensor]:
    logits = t64([1.2, -0.3, 0.5, -1.7, 0.0])
    ref_logits = t64([-0.4, 0.9, 0.1, 0.6, -2.0])
    return logits, ref_logits


def test_js_sampled_exact_expectation_equals_js() -> None:
    # sum_y p_y f(y) over the whole vocabulary is the exact JS (no sampling noise).
    logits, ref_logits = five_token_case()
    logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    expectation = (logp.exp() * js_sampled(logp, logq)).sum().item()
    exact = float(np_js(logits.numpy(), ref_logits.numpy()))
    assert expectation == pytest.approx(exact, rel=1e-12)


def test_js_sampled_monte_carlo_mean_matches_exact_js(gen: torch.Generator) -> None:
    # Tokens drawn from p; the sample mean must be within 4 standard errors of the exact JS.
    logits, ref_logits = five_token_case()
    logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    n = 200_000
    ys = torch.multinomial(logp.exp(), n, replacement=True, generator=gen)
    values = js_sampled(logp[ys], logq[ys])
    mean, se = values.mean().item(), values.std().item() / math.sqrt(n)
    exact = float(np_js(logits.numpy(), ref_logits.numpy()))
    assert se > 0
    assert abs(mean - exact) < 4 * se, (mean, exact, se)


def test_js_sampled_expected_gradient_equals_exact_js_gradient() -> None:
    # E_{y~p}[grad_theta surrogate(y)] = sum_y p_y grad_theta surrogate(y), with p = softmax(theta)
    # held fixed as the sampling distribution, must equal grad_theta JS(softmax(theta), q).
    logits, ref_logits = five_token_case()
    theta = logits.clone().requires_grad_()
    logq = torch.log_softmax(ref_logits, -1)
    p = torch.softmax(logits, -1)
    expected_grad = torch.zeros_like(theta)
    for y in range(theta.shape[0]):
        logp_y = torch.log_softmax(theta, -1)[y].reshape(1, 1)
        (g_y,) = torch.autograd.grad(js_sampled(logp_y, logq[y].reshape(1, 1)).sum(), theta)
        expected_grad += p[y] * g_y
    (exact_grad,) = torch.autograd.grad(torch_js64(theta, ref_logits).sum(), theta)
    torch.testing.assert_close(expected_grad, exact_grad, atol=1e-12, rtol=1e-10)
    assert exact_grad.abs().max().item() > 1e-2  # a non-trivial gradient, so the match means something


def test_js_sampled_monte_carlo_gradient_matches_exact(gen: torch.Generator) -> None:
    # The same through actual sampling: one backward over a batch of sampled tokens, compared within
    # 5 standard errors per coordinate (the per-sample gradient of token y is the same for every draw
    # of y, so its spread over the draws gives the standard error).
    logits, ref_logits = five_token_case()
    theta = logits.clone().requires_grad_()
    logq = torch.log_softmax(ref_logits, -1)
    per_token = torch.stack(
        [
            torch.autograd.grad(
                js_sampled(torch.log_softmax(theta, -1)[y].reshape(1), logq[y].reshape(1)).sum(), theta
            )[0]
            for y in range(5)
        ]
    )
    n = 100_000
    ys = torch.multinomial(torch.softmax(logits, -1), n, replacement=True, generator=gen)
    logp_all = torch.log_softmax(theta, -1)
    (g_mc,) = torch.autograd.grad(js_sampled(logp_all[ys], logq[ys]).mean(), theta)
    se = per_token[ys].std(0) / math.sqrt(n)
    (exact_grad,) = torch.autograd.grad(torch_js64(theta, ref_logits).sum(), theta)
    assert bool((se > 0).all())
    assert bool(((g_mc - exact_grad).abs() < 5 * se).all()), (g_mc, exact_grad, se)


@FAST
@given(st.lists(st.tuples(st.floats(-15, 0), st.floats(-15, 0)), min_size=1, max_size=20))
def test_property_js_sampled_value_is_nonnegative(pairs) -> None:
    # f(y) = (p log(p/m) + q log(q/m)) / (2p) = (p + q)(log 2 - H(p / (p + q))) / (2p) >= 0 for every
    # single sample, unlike the paper release's per-token "JS" (<= 0, docs/method.md §1.4).
    logp, ref = t64([a for a, _ in pairs]), t64([b for _, b in pairs])
    out = js_sampled(logp, ref)
    assert bool((out >= -1e-12).all())
    expected = [f_hand(math.exp(a), math.exp(b)) for a, b in pairs]
    assert out.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_js_sampled_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"shape mismatch.*logp.*ref_logp"):
        js_sampled(t64([[-1.0, -2.0]]), t64([-1.0, -2.0]))
    with pytest.raises(ValueError, match="ref_logp"):
        js_sampled(t64([-1.0]), t64([float("nan")]))
    with pytest.raises(ValueError, match="logp"):
        js_sampled(t64([float("inf")]), t64([-1.0]))
