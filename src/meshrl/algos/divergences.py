"""Per-token divergences to a reference policy: KL estimators k1/k2/k3 and Jensen-Shannon."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshrl.algos._checks import check_choice, check_same_shape, check_tensor

KL_CLAMP = 10.0
LOG_RATIO_CLAMP = 20.0


def _kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-KL_CLAMP, KL_CLAMP)


def _kl_k3_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    k2 = _kl_k2(logp, ref_logp)
    return k2 + (_kl_k3(logp, ref_logp) - k2).detach()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
    "k3+": _kl_k3_plus,
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimator of KL(pi_theta || pi_ref) from the sampled token's log-probs.

    Estimators (Schulman 2020, "Approximating KL Divergence"; names as in verl ``kl_penalty``),
    with ``x = log pi_ref(y) - log pi_theta(y)``, ``y ~ pi_theta``::

        k1  = -x                      unbiased, high variance, can be negative
        k2  = x^2 / 2                 biased, low variance; its gradient is the gradient of KL
        k3  = exp(x) - x - 1          unbiased, >= 0 ("low_var_kl")
        k3+ = k3 value, k2 gradient   straight-through (verl "low_var_kl+")

    k3 clamps ``x`` to [-20, 20] before ``exp`` and the result to [-10, 10], exactly as verl's
    ``low_var_kl`` does, so one wild token cannot dominate the loss; the clamp is visible in the value.

    Args:
        logp, ref_logp: ``[B, T]`` log-probs of the sampled tokens under the policy and the reference.
        kind: ``"k1" | "k2" | "k3" | "k3+"``.
    Returns:
        ``[B, T]`` per-token penalty (mask and aggregate it with :func:`meshrl.algos.aggregate`).
    """
    check_choice("kl kind", kind, KL_ESTIMATORS)
    check_tensor("logp", logp)
    check_tensor("ref_logp", ref_logp)
    check_same_shape(logp=logp, ref_logp=ref_logp)
    return KL_ESTIMATORS[kind](logp, ref_logp)


def _js_chunk(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(logits.float(), dim=-1)
    logq = F.log_softmax(ref_logits.float(), dim=-1)
    logm = torch.logaddexp(logp, logq) - math.log(2.0)
    kl_pm = (logp.exp() * (logp - logm)).sum(-1)
    kl_qm = (logq.exp() * (logq - logm)).sum(-1)
    return (0.5 * (kl_pm + kl_qm)).clamp(min=0.0)


def js_divergence(logits: torch.Tensor, ref_logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Exact Jensen-Shannon divergence per position over the full vocabulary.

    Formula (Lin 1991)::

        JS(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m),   m = (p + q) / 2

    with ``p = softmax(logits)``, ``q = softmax(ref_logits)``. Properties: symmetric, ``0 <= JS <= log 2``,
    zero iff ``p = q``. Computed in log space (``log m = logaddexp(log p, log q) - log 2``) and in chunks
    of ``chunk_size`` positions so peak memory is ``chunk_size x V`` floats, not ``B x T x V``.
    This replaces the paper release's "JS" term, which is <= 0 per token and so is not a divergence
    (docs/method.md §1.4).

    Args:
        logits, ref_logits: ``[B, T, V]``.
    Returns:
        ``[B, T]`` float32; differentiable with respect to both inputs.
    """
    check_tensor("logits", logits, ndim=3)
    check_tensor("ref_logits", ref_logits, ndim=3)
    check_same_shape(logits=logits, ref_logits=ref_logits)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, v = logits.shape
    flat_p, flat_q = logits.reshape(b * t, v), ref_logits.reshape(b * t, v)
    parts = [
        _js_chunk(flat_p[i : i + chunk_size], flat_q[i : i + chunk_size])
        for i in range(0, b * t, chunk_size)
    ]
    out = torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)
    return out.reshape(b, t)


def js_sampled(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Unbiased single-sample estimator of JS(pi_theta, pi_ref) with the exact JS gradient in expectation.

    Derivation (ours; JS as in :func:`js_divergence`). With ``p = pi_theta(y)``, ``q = pi_ref(y)``,
    ``m = (p + q) / 2`` and ``y ~ pi_theta``::

        JS = sum_y p/2 log(p/m) + q/2 log(q/m) = E_{y~p}[ f(y) ],
        f(y) = 1/2 log(p/m) + (q / 2p) log(q/m)

        dJS/dp_y = 1/2 log(p_y / m_y)   =>   grad JS = E_{y~p}[ g(y) grad log p(y) ],  g = 1/2 log(p/m)

    so the returned surrogate is ``f(y) + (log p - sg(log p)) * sg(g(y))``: its value is ``f`` (unbiased for
    JS) and its gradient is the score-function estimator ``g * grad log p`` (unbiased for grad JS).
    The ratio ``q/p`` is clamped at ``exp(20)`` to keep the value finite for tokens the policy almost never
    samples; with tokens drawn from the policy this never binds in practice.

    Args:
        logp, ref_logp: ``[B, T]`` log-probs of the sampled tokens.
    Returns:
        ``[B, T]`` per-token surrogate.
    """
    check_tensor("logp", logp)
    check_tensor("ref_logp", ref_logp)
    check_same_shape(logp=logp, ref_logp=ref_logp)
    lp, lq = logp.detach(), ref_logp.detach()
    logm = torch.logaddexp(lp, lq) - math.log(2.0)
    ratio_qp = (lq - lp).clamp(max=LOG_RATIO_CLAMP).exp()
    value = 0.5 * (lp - logm) + 0.5 * ratio_qp * (lq - logm)
    score_weight = 0.5 * (lp - logm)
    return value + (logp - lp) * score_weight
