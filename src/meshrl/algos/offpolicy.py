"""Off-policy terms: LUFFY's shaped off-policy loss, M2PO's second-moment mask, rollout importance
correction for the training-inference mismatch (TIS / IcePop weights, k1/k2/k3 rejection) and mismatch
statistics. Pure tensor functions; ``B`` rows, ``T`` response positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from meshrl.algos._checks import check_choice, check_mask, check_same_shape, check_tensor
from meshrl.algos.divergences import LOG_RATIO_CLAMP

OFF_POLICY_SHAPES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    # f of LUFFY's ``off_policy_reshape``, as functions of log p: "p_div_p" is p / (p + gamma) ("p_div_p_0.1" in
    # its scripts).
    "p_div_p": lambda logp, gamma: logp.exp() / (logp.exp() + gamma),
    # No shaping: -A * p, the importance ratio against a behaviour policy taken as deterministic.
    "none": lambda logp, gamma: logp.exp(),
    # -A * log p: the tokens trained as if the policy had sampled them (advantage-weighted behaviour cloning;
    # biased, but its gradient does not vanish as p -> 0, unlike the two above). meshrl's option, not LUFFY's.
    "log": lambda logp, gamma: logp,
}
REJECTION_STATS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                   "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")


def _masked(name: str, x: torch.Tensor, mask: torch.Tensor, like_name: str) -> torch.Tensor:
    check_tensor(like_name, x, ndim=2)
    return check_mask(name, mask, x, like_name)


def luffy_off_policy_loss(
    logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, gamma: float = 0.1, shape: str = "p_div_p"
) -> tuple[torch.Tensor, dict[str, float]]:
    """LUFFY's policy-shaped loss on off-policy (demonstration) tokens, unclipped.

    Formula (Yan et al. 2025, "Learning to Reason under Off-Policy Guidance", arXiv 2504.14945, eq. 6;
    gamma = 0.1)::

        L_t = -A_t f(pi_theta(y_t)),    f(p) = p / (p + gamma)

    ``shape`` picks f (``OFF_POLICY_SHAPES``): ``p_div_p`` (the formula above), ``none`` (f(p) = p, the ratio
    against a deterministic behaviour policy) or ``log`` (f(p) = log p: the tokens trained as if sampled).

    Its gradient ``-A gamma / (p + gamma)^2 * grad p`` up-weights the low-probability tokens of the trace.
    The advantage is the mixed group's (off- and on-policy rollouts together).

    Args:
        logp: ``[B, T]`` current log-probs of the off-policy tokens (requires grad).
        advantages: ``[B]`` or ``[B, T]``.
        mask: ``[B, T]``.
    Returns:
        ``loss_mat [B, T]`` and ``offpolicy/prob_mean`` (mean p over valid tokens).
    """
    m = _masked("mask", logp, mask, "logp")
    check_choice("off-policy shape", shape, OFF_POLICY_SHAPES)
    if not gamma > 0:
        raise ValueError(f"luffy gamma must be > 0, got {gamma}")
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        if adv.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages has {adv.shape[0]} rows but logp has {logp.shape[0]}")
        adv = adv[:, None].expand_as(logp)
    check_same_shape(advantages=adv, logp=logp)
    logp = logp.clamp(max=0.0)
    p = logp.exp()
    loss = -adv * OFF_POLICY_SHAPES[shape](logp, gamma)
    n = float(m.sum().clamp(min=1))
    return loss, {"offpolicy/prob_mean": float((p.detach() * m).sum()) / n}


def m2po_mask(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float = 0.04,
) -> tuple[torch.Tensor, dict[str, float]]:
    """M2PO: mask the trust-region-breaking tokens of largest ``(log r)^2`` until their second moment fits.

    Rule (Zheng, Zhao, Chen 2025, "Prosperity before Collapse", arXiv 2510.01161, Algorithm 1;
    ``tau = 0.04`` in all its experiments), with ``r = pi_theta / pi_behaviour``::

        S = {valid t : (A_t > 0 and r_t > 1) or (A_t < 0 and r_t < 1)}
        while S and mean_{t in S} (log r_t)^2 > tau:  S <- S minus argmax_{t in S} (log r_t)^2 (masked)

    Solved in one sort: with ``S``'s values in decreasing order, the masked set is the shortest prefix
    whose removal leaves a suffix mean ``<= tau``. Tokens outside ``S`` are never masked. The objective
    then is ``(1/N) sum_t keep_t r_t A_t`` over all valid tokens, without an eps-clip.

    Args:
        logp, behaviour_logp: ``[B, T]`` (the mask is computed without gradient).
        advantages: ``[B]`` or ``[B, T]``.
        mask: ``[B, T]``.
    Returns:
        ``keep [B, T]`` (0/1 in ``logp.dtype``, masked positions 0) and metrics ``m2po/masked_frac``
        (share of valid tokens masked), ``m2po/m2`` (mean ``(log r)^2`` over valid tokens before masking),
        ``m2po/m2_kept`` (after).
    """
    m = _masked("mask", logp, mask, "logp")
    check_same_shape(logp=logp, behaviour_logp=behaviour_logp)
    if not threshold > 0:
        raise ValueError(f"m2po threshold must be > 0, got {threshold}")
    adv = advantages.detach().to(logp.dtype)
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    check_same_shape(advantages=adv, logp=logp)
    log_r = (logp.detach() - behaviour_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sq = log_r**2
    valid = m > 0
    breaking = valid & (((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0)))
    flat_idx = torch.nonzero(breaking.reshape(-1), as_tuple=True)[0]
    values, order = torch.sort(sq.reshape(-1)[flat_idx], descending=True)
    n_mask = _prefix_to_mask(values, threshold)
    keep = m.clone()
    keep.view(-1)[flat_idx[order[:n_mask]]] = 0
    n = float(m.sum().clamp(min=1))
    return keep, {
        "m2po/masked_frac": n_mask / n,
        "m2po/m2": float((sq * m).sum()) / n,
        "m2po/m2_kept": float((sq * keep).sum() / keep.sum().clamp(min=1)),
    }


def _prefix_to_mask(desc: torch.Tensor, threshold: float) -> int:
    """Smallest ``j`` such that the mean of ``desc[j:]`` is ``<= threshold`` (or ``j = len``)."""
    n = desc.numel()
    if n == 0:
        return 0
    suffix_sum = torch.flip(torch.cumsum(torch.flip(desc.double(), [0]), 0), [0])
    suffix_mean = suffix_sum / torch.arange(n, 0, -1, dtype=torch.float64)
    ok = torch.nonzero(suffix_mean <= threshold)
    return int(ok[0]) if len(ok) else n


def rollout_is_weights(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    upper: float = 2.0,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights ``w = pi_train / pi_rollout`` that correct the training-inference mismatch.

    Formulas (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
    TIS truncation, IcePop masking; conventions of verl's ``compute_rollout_correction_weights``)::

        token:     log w_t = clamp(log pi_t - log pi_rollout_t, -20, 20)
        sequence:  log w_i = clamp(sum_t m_t (log pi_t - log pi_rollout_t), -20, 20)   (on every token)
        truncate:  w <- min(w, upper)                       (TIS, upper = C = 2)
        mask:      w <- w * 1[lower <= w <= upper]          (IcePop / MIS)

    The weights are detached and 0 at masked positions; multiply the per-token policy loss by them.

    Returns:
        ``w [B, T]`` and metrics ``rollout_is/mean``, ``rollout_is/max``, ``rollout_is/clipped_frac`` (share
        of valid tokens whose weight was truncated or zeroed).
    """
    m = _masked("mask", logp, mask, "logp")
    check_same_shape(logp=logp, rollout_logp=rollout_logp)
    check_choice("rollout_is level", level, IS_LEVELS)
    check_choice("rollout_is mode", mode, IS_MODES)
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is bounds need 0 < lower <= upper, got lower={lower} upper={upper}")
    if mode == "mask" and lower is None:
        raise ValueError("rollout_is mode 'mask' needs a lower bound")
    log_ratio = logp.detach() - rollout_logp.detach()
    if level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True).expand_as(logp)
    raw = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp() * m
    if mode == "truncate":
        w = raw.clamp(max=upper)
        hit = raw > upper
    else:
        inside = (raw >= lower) & (raw <= upper)
        w = torch.where(inside, raw, torch.zeros_like(raw))
        hit = ~inside
    n = float(m.sum().clamp(min=1))
    valid = w[m > 0]
    return w, {
        "rollout_is/mean": float(valid.mean()) if valid.numel() else 1.0,
        "rollout_is/max": float(valid.max()) if valid.numel() else 1.0,
        "rollout_is/clipped_frac": float((hit.to(m.dtype) * m).sum()) / n,
    }


def importance_weight_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the weights ``w = exp(log_ratio)`` (untruncated, e.g. ``log pi_update - log pi_sampler`` per token)
    are from uniform, over the valid tokens of ``mask``: ``max`` = max w, and Kish's normalised effective sample
    size (Kong 1992; Kish 1965)::

        ess = (sum_t w_t)^2 / (n * sum_t w_t^2)      in (0, 1]: 1 when every weight is equal

    (``log_ratio`` clamped to +-20 first, as the weights are). No valid token: ``{"max": 1, "ess": 1}``."""
    m = _masked("mask", log_ratio, mask, "log_ratio")
    w = log_ratio.detach().double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()[m > 0]
    if w.numel() == 0:
        return {"max": 1.0, "ess": 1.0}
    return {"max": float(w.max()), "ess": float(w.sum() ** 2 / (w.numel() * (w * w).sum()))}


def rollout_rejection_mask(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    stat: str = "token_k3",
    upper: float,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reject tokens or sequences whose divergence estimate to the rollout policy is out of bounds.

    Estimators of ``KL(pi_rollout || pi_train)`` from ``log w = clamp(log pi - log pi_rollout, -20, 20)``
    (Schulman 2020, "Approximating KL divergence"; verl's ``compute_rollout_rejection_mask``)::

        k1 = -log w         k2 = (log w)^2 / 2         k3 = w - 1 - log w

    ``token_kX`` tests each token; ``seq_sum_kX`` / ``seq_mean_kX`` / ``seq_max_kX`` test the sum / mean /
    max over the row's valid tokens and reject the whole row. ``k2``/``k3`` keep ``stat <= upper``; ``k1``
    (signed) keeps ``log(lower) <= stat <= log(upper)``, bounds given as ratios ``pi_rollout / pi_train``
    as in verl.

    Returns:
        ``keep [B, T]`` (0/1 in ``logp.dtype``; ``mask * keep``) and ``rollout_rs/masked_frac``,
        ``rollout_rs/seq_masked_frac``.
    """
    m = _masked("mask", logp, mask, "logp")
    check_same_shape(logp=logp, rollout_logp=rollout_logp)
    check_choice("rollout rejection statistic", stat, REJECTION_STATS)
    k1 = stat.endswith("k1")
    if not upper > 0 or (k1 and (lower is None or not 0 < lower <= upper)):
        raise ValueError(f"rejection {stat} needs upper > 0{' and 0 < lower <= upper' if k1 else ''}, "
                         f"got lower={lower} upper={upper}")
    log_w = (logp.detach() - rollout_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    per_token = {"k1": -log_w, "k2": 0.5 * log_w**2, "k3": log_w.exp() - 1 - log_w}[stat[-2:]]
    if stat.startswith("token"):
        value = per_token
    else:
        value = _row_reduce(per_token, m, stat.split("_")[1])[:, None].expand_as(logp)
    ok = (value >= math.log(lower)) & (value <= math.log(upper)) if k1 else value <= upper
    keep = m * ok.to(m.dtype)
    n = float(m.sum().clamp(min=1))
    rows = m.sum(-1) > 0
    rejected_rows = ((m - keep).sum(-1) > 0) & rows
    return keep, {
        "rollout_rs/masked_frac": float((m - keep).sum()) / n,
        "rollout_rs/seq_masked_frac": float(rejected_rows.sum()) / max(int(rows.sum()), 1),
    }


def _row_reduce(x: torch.Tensor, m: torch.Tensor, how: str) -> torch.Tensor:
    """Per-row sum / mean / max of ``x`` over valid tokens (a row without one: 0)."""
    if how == "sum":
        return (x * m).sum(-1)
    if how == "mean":
        return (x * m).sum(-1) / m.sum(-1).clamp(min=1e-8)
    top = x.masked_fill(m == 0, float("-inf")).max(-1).values
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


MISMATCH_QUANTILES = (0.5, 0.9, 0.99)


def logprob_mismatch_stats(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the training forward's.

    With ``d_t = log pi_train(y_t) - log pi_rollout(y_t)`` over valid tokens (the training-inference
    mismatch of Yao et al. 2025): ``mismatch/logp_absdiff_{mean,max,p50,p90,p99}`` of ``|d|``,
    ``mismatch/logp_diff_mean`` (signed) and ``mismatch/kl_k3`` (mean ``e^d - 1 - d``: the k3 estimate of
    ``KL(pi_rollout || pi_train)`` from tokens sampled by the rollout policy). Quantiles are
    ``torch.quantile`` (linear). No valid token: an empty dict.
    """
    m = _masked("mask", logp, mask, "logp")
    check_same_shape(logp=logp, rollout_logp=rollout_logp)
    valid = m > 0
    d = (logp.detach() - rollout_logp.detach()).double()[valid]
    if d.numel() == 0:
        return {}
    a = d.abs()
    out = {"mismatch/logp_absdiff_mean": float(a.mean()), "mismatch/logp_absdiff_max": float(a.max()),
           "mismatch/logp_diff_mean": float(d.mean()),
           "mismatch/kl_k3": float((torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - 1 - d).mean())}
    for q, v in zip(MISMATCH_QUANTILES, torch.quantile(a, torch.tensor(MISMATCH_QUANTILES, dtype=a.dtype)),
                    strict=True):
        out[f"mismatch/logp_absdiff_p{round(q * 100)}"] = float(v)
    return out
