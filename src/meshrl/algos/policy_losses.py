"""Policy-gradient surrogate losses (PPO-clip, GSPO, GSPO-token, CISPO) behind one registry.

Every loss takes the same tensors and returns ``(loss_mat [B, T], metrics)``; aggregation over tokens
and sequences is a separate choice (:func:`meshrl.algos.aggregate`), as in verl's ``core_algos``.
Metric names follow CleanRL's style without the prefix the trainer adds (``clip/frac_low`` ...).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshrl.algos._checks import check_choice, check_mask, check_same_shape, check_tensor
from meshrl.algos.divergences import LOG_RATIO_CLAMP

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: add ``fn(logp, old_logp, advantages, mask, **cfg) -> (loss_mat, metrics)``."""

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = mask.sum()
    return float((x * mask).sum() / n) if n > 0 else 0.0


def _prepare(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate inputs; return (log_ratio [B,T], advantages broadcast to [B,T], float mask)."""
    check_tensor("logp", logp, ndim=2)
    check_tensor("old_logp", old_logp, ndim=2)
    check_same_shape(logp=logp, old_logp=old_logp)
    m = check_mask("mask", mask, logp, "logp")
    check_tensor("advantages", advantages)
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages has {advantages.shape[0]} rows but logp has {logp.shape[0]}")
        adv = advantages[:, None].expand_as(logp)
    elif tuple(advantages.shape) == tuple(logp.shape):
        adv = advantages
    else:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} is neither [B] nor logp's {tuple(logp.shape)}"
        )
    log_ratio = (logp - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, adv.to(logp.dtype).detach(), m


def _ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    lr = log_ratio.detach()
    ratio = lr.exp()
    valid = ratio[mask > 0]
    return {
        # k3 estimate of KL(old || new) as in CleanRL's ``approx_kl``.
        "approx_kl": _masked_mean(ratio - 1 - lr, mask),
        "ratio/mean": float(valid.mean()) if valid.numel() else 1.0,
        "ratio/max": float(valid.max()) if valid.numel() else 1.0,
    }


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_dual: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO clipped surrogate with clip-higher and optional dual clip.

    Formula (Schulman et al. 2017, PPO eq. 7; clip-higher from DAPO, Yu et al. 2025 eq. 10; dual clip
    from Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5)::

        rho_t  = exp(log pi(y_t) - log pi_old(y_t))
        L_t    = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
        L_t    = min(L_t, -A_t c)            if A_t < 0 and c (clip_dual > 1) is set

    Args:
        logp: ``[B, T]`` current log-probs of the sampled tokens (requires grad).
        old_logp: ``[B, T]`` behaviour-policy log-probs (no grad).
        advantages: ``[B]`` (one per sequence) or ``[B, T]``.
        mask: ``[B, T]`` 1 for response tokens that enter the loss.
    Returns:
        ``loss_mat [B, T]`` and metrics ``clip/frac_low``, ``clip/frac_high`` (share of masked tokens
        where the lower / upper clip removed the gradient), ``clip/frac_dual``, ``approx_kl``,
        ``ratio/mean``, ``ratio/max``.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}/{clip_high}")
    if clip_dual is not None and clip_dual <= 1.0:
        raise ValueError(f"clip_dual must be > 1, got {clip_dual}")
    log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_hit = torch.zeros_like(m, dtype=torch.bool)
    if clip_dual is not None:
        dual_bound = -adv * clip_dual
        dual_hit = (adv < 0) & (loss > dual_bound)
        loss = torch.where(adv < 0, torch.minimum(loss, dual_bound), loss)
    r = ratio.detach()
    metrics = {
        "clip/frac_low": _masked_mean(((r < 1 - clip_low) & (adv < 0)).to(m.dtype), m),
        "clip/frac_high": _masked_mean(((r > 1 + clip_high) & (adv > 0)).to(m.dtype), m),
        "clip/frac_dual": _masked_mean(dual_hit.to(m.dtype), m),
        **_ratio_metrics(log_ratio, m),
    }
    return loss, metrics


def _sequence_log_ratio(log_ratio: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B]`` length-normalised sequence log-ratio ``mean_t log rho_t`` over masked tokens."""
    return (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)


@register_policy_loss("gspo")
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: sequence-level importance ratio and sequence-level clipping.

    Formula (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7)::

        s_i = exp( (1/|y_i|) sum_t log rho_{i,t} )
        L_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))

    ``L_i`` is written on every response token of sequence ``i``, so ``seq-mean-token-mean`` aggregation
    gives the paper's ``(1/G) sum_i L_i``. Sequence advantages are required (``[B]``, or ``[B, T]`` constant
    along each row, of which the first masked value is used). Paper defaults eps 3e-4 / 4e-4.

    Clamp: every token log-ratio is clamped to ``[-20, 20]`` before the mean, as the PPO clip's is (verl's
    ``compute_policy_loss_vanilla`` clamps ``negative_approx_kl`` so), so the sequence log-ratio, a mean of them,
    lies in ``[-20, 20]`` and ``s_i <= e^20``; a clamped token carries no gradient. This departs from verl's
    ``compute_policy_loss_gspo`` (``verl/trainer/ppo/core_algos.py``), which leaves the tokens unclamped and clamps
    the sequence log-ratio above at 10 only: the two agree wherever every token log-ratio lies in ``[-20, 20]`` and
    their mean is at most 10; meshrl's bound is the one its other losses share.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}/{clip_high}")
    log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
    seq_adv = adv[:, 0] if advantages.dim() == 1 else _first_masked(adv, m)
    s = _sequence_log_ratio(log_ratio, m).exp()
    loss_seq = torch.maximum(-seq_adv * s, -seq_adv * s.clamp(1 - clip_low, 1 + clip_high))
    loss = loss_seq[:, None].expand_as(logp) * m
    sd = s.detach()
    has_tok = (m.sum(-1) > 0).to(m.dtype)
    n_seq = has_tok.sum().clamp(min=1)
    metrics = {
        "clip/frac_low": float((((sd < 1 - clip_low) & (seq_adv < 0)).to(m.dtype) * has_tok).sum() / n_seq),
        "clip/frac_high": float((((sd > 1 + clip_high) & (seq_adv > 0)).to(m.dtype) * has_tok).sum() / n_seq),
        **_ratio_metrics(log_ratio, m),
        "seq_ratio/mean": float((sd * has_tok).sum() / n_seq),
    }
    return loss, metrics


def _first_masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    first = (m > 0).to(torch.long).argmax(-1)
    return x.gather(1, first[:, None]).squeeze(1)


@register_policy_loss("gspo_token")
def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token: sequence-level ratio value with token-level advantages.

    Formula (Zheng et al. 2025, eqs. 13-14)::

        s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t))
        L_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

    Numerically ``s_{i,t} = s_i``; its gradient is ``s_i grad log pi(y_t)``. With ``A_{i,t} = A_i`` and
    ``seq-mean-token-mean`` aggregation it equals GSPO in value and gradient. The sequence log-ratio is bounded as
    in :func:`gspo_loss` (token log-ratios clamped to ``[-20, 20]``), and ``log s_{i,t}`` is clamped above at 20.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}/{clip_high}")
    log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
    seq_log_ratio = _sequence_log_ratio(log_ratio, m)
    tok_log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()
    s_tok = tok_log_ratio.clamp(max=LOG_RATIO_CLAMP).exp()
    loss = torch.maximum(-adv * s_tok, -adv * s_tok.clamp(1 - clip_low, 1 + clip_high))
    sd = s_tok.detach()
    metrics = {
        "clip/frac_low": _masked_mean(((sd < 1 - clip_low) & (adv < 0)).to(m.dtype), m),
        "clip/frac_high": _masked_mean(((sd > 1 + clip_high) & (adv > 0)).to(m.dtype), m),
        **_ratio_metrics(log_ratio, m),
        "seq_ratio/mean": _masked_mean(sd, m),
    }
    return loss, metrics


@register_policy_loss("cispo")
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: clip the importance weight, never the token's gradient.

    Formula (MiniMax 2025, "MiniMax-M1", eqs. 4-5)::

        L_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi(y_t)

    The paper sets no lower bound (``eps_low`` large; default 1.0 here, i.e. weights >= 0) and tunes only
    ``eps_high`` (default 0.28, as Trinity-RFT's CISPO). Its gradient is ``-w_t A_t grad log pi``, which
    matches PPO's inside the trust region and keeps (down-weighted) gradients for clipped tokens.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}/{clip_high}")
    log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(max(0.0, 1 - clip_low), 1 + clip_high)
    loss = -weight * adv * logp
    metrics = {
        "clip/frac_low": _masked_mean((ratio < 1 - clip_low).to(m.dtype), m),
        "clip/frac_high": _masked_mean((ratio > 1 + clip_high).to(m.dtype), m),
        **_ratio_metrics(log_ratio, m),
    }
    return loss, metrics


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **config: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch to a registered policy loss by ``name`` (``ppo_clip``, ``gspo``, ``gspo_token``, ``cispo``).

    ``config`` holds the loss's keyword options (``clip_low``, ``clip_high``, ``clip_dual``...). Unknown
    names raise ``ValueError`` listing the registry.
    """
    check_choice("policy loss", name, POLICY_LOSSES)
    return POLICY_LOSSES[name](logp, old_logp, advantages, mask, **config)
