"""Entropy-collapse counter-measures as pure tensor functions: Clip-Cov, KL-Cov, entropy-based advantage
shaping and forking-token (high-entropy) masks.

Clip-Cov and KL-Cov are policy losses in :data:`COVARIANCE_LOSSES` (same signature as
:data:`meshrl.algos.POLICY_LOSSES`, kept apart from the recipes' registry); their token selection is
exposed on its own (:func:`clip_cov_selection`, :func:`kl_cov_selection`) so a trainer can apply it on top
of another token-level loss. Advantage shapers live in :data:`ADVANTAGE_SHAPERS`, token masks with their
loss normalisation in :data:`TOKEN_MASKS`. Shapes: ``B`` rows, ``T`` response positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshrl.algos._checks import check_choice, check_mask, check_tensor
from meshrl.algos.policy_losses import PolicyLossFn, _prepare, _ratio_metrics, ppo_clip_loss

COVARIANCE_LOSSES: dict[str, PolicyLossFn] = {}
ADVANTAGE_SHAPERS: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}
TOKEN_MASKS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, float]]]] = {}


def register_covariance_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: add ``fn(logp, old_logp, advantages, mask, **cfg) -> (loss_mat, metrics)``."""

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        COVARIANCE_LOSSES[name] = fn
        return fn

    return deco


def register_advantage_shaper(name: str) -> Callable:
    """Decorator: add ``fn(advantages [B,T], mask [B,T], **kw) -> (shaped [B,T], metrics)``."""

    def deco(fn: Callable) -> Callable:
        ADVANTAGE_SHAPERS[name] = fn
        return fn

    return deco


def register_token_mask(name: str) -> Callable:
    """Decorator: add ``fn(scores [B,T], mask [B,T], **kw) -> (loss_weight, agg_mask, metrics)``."""

    def deco(fn: Callable) -> Callable:
        TOKEN_MASKS[name] = fn
        return fn

    return deco


def _check_fraction(name: str, value: float, *, allow_one: bool = True) -> None:
    ok = 0 < value <= 1 if allow_one else 0 < value < 1
    if not ok:
        raise ValueError(f"{name} must be in (0, {'1]' if allow_one else '1)'}, got {value}")


def token_covariance(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token centred covariance term of log-prob and advantage over the valid tokens.

    Formula (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv 2505.22617, eq. 11)::

        cov_t = (A_t - mean_{valid} A) * (log pi_t - mean_{valid} log pi)

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens (detached here).
        advantages: ``[B]`` (one per sequence, broadcast over its tokens) or ``[B, T]``.
        mask: ``[B, T]`` 0/1, the valid tokens the means run over.
    Returns:
        ``[B, T]`` covariance terms; 0 at masked positions (callers select among valid tokens only).
    """
    m = check_mask("mask", mask, logp, "logp")
    n = m.sum().clamp(min=1)
    lp = logp.detach()
    adv = _token_advantages(advantages, lp)
    cov = (adv - (adv * m).sum() / n) * (lp - (lp * m).sum() / n)
    return cov * m


def clip_cov_selection(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    already_clipped: torch.Tensor,
    *,
    ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Tokens whose gradient Clip-Cov removes: a uniform random subset of the mid-covariance tokens.

    Rule (Cui et al. 2025, §4.2, "Clip-Cov"): the candidates are the valid tokens not clipped already
    with ``cov_lb < cov_t < cov_ub``; ``k = max(1, floor(ratio * N))`` of them (``N`` valid tokens), or all
    when fewer, are drawn uniformly without replacement. Drawing: candidates in row-major order, permuted
    by ``torch.randperm(n_candidates, generator=generator)``, the first ``k`` kept; this is the law and
    the draw of verl's ``compute_policy_loss_clip_cov`` under the same CPU generator state.

    Args:
        logp, mask: ``[B, T]``; advantages: ``[B]`` or ``[B, T]``.
        already_clipped: ``[B, T]`` bool, tokens the base loss already clipped (left out of the draw).
        generator: CPU generator of the draw (None: torch's global one, as verl).
    Returns:
        ``[B, T]`` bool, True for the tokens that lose their gradient.
    """
    _check_fraction("clip_cov ratio", ratio)
    if not cov_lb < cov_ub:
        raise ValueError(f"clip_cov bounds need cov_lb < cov_ub, got {cov_lb} >= {cov_ub}")
    m = check_mask("mask", mask, logp, "logp")
    cov = token_covariance(logp, advantages, m)
    valid = m > 0
    candidates = valid & ~already_clipped.bool() & (cov > cov_lb) & (cov < cov_ub)
    idx = torch.nonzero(candidates.cpu())
    chosen = torch.zeros_like(valid)
    if len(idx):
        k = max(int(ratio * float(m.sum())), 1)
        perm = torch.randperm(len(idx), generator=generator)
        pick = idx[perm[: min(k, len(idx))]].to(chosen.device)
        chosen[pick[:, 0], pick[:, 1]] = True
    return chosen


def kl_cov_selection(
    logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, ratio: float = 2e-4
) -> torch.Tensor:
    """Tokens KL-Cov penalises: the top ``k = max(1, floor(ratio * N))`` valid tokens by covariance.

    Rule (Cui et al. 2025, §4.2, "KL-Cov"); ties are broken by ``torch.topk`` over the valid tokens in
    row-major order, as verl's ``compute_policy_loss_kl_cov``. ``ratio`` is a fraction (verl's
    ``kl_cov_ratio``; the paper's scripts give it in percent: 0.2 % = 2e-3 for 7B, 0.02 % = 2e-4 for 32B).

    ``advantages`` is ``[B]`` (one per sequence) or ``[B, T]``.

    Returns:
        ``[B, T]`` bool (all False when no token is valid).
    """
    _check_fraction("kl_cov ratio", ratio)
    m = check_mask("mask", mask, logp, "logp")
    valid = m > 0
    chosen = torch.zeros_like(valid)
    n = int(valid.sum())
    if n == 0:
        return chosen
    # The covariance over the valid tokens only, flattened in row-major order.
    adv = _token_advantages(advantages, logp)[valid]
    lp = logp.detach()[valid]
    cov = (adv - adv.mean()) * (lp - lp.mean())
    top = torch.topk(cov, max(1, int(n * ratio)), largest=True).indices
    flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0][top]
    chosen.view(-1)[flat] = True
    return chosen


def clipped_tokens(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Tokens where PPO's clip removed the gradient: ``-A clip(r) > -A r``, i.e. A>0, r>1+eh or A<0, r<1-el."""
    return ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))


@register_covariance_loss("clip_cov")
def clip_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: PPO-clip whose gradient is detached on a random subset of high-covariance tokens.

    Formula (Cui et al. 2025, eq. 12; defaults ``ratio = 2e-4, cov_lb = 1, cov_ub = 5``)::

        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) * (1 - c_t)

    with ``c_t`` from :func:`clip_cov_selection` (the paper's DAPO scripts use ``eps = 1`` and token-mean).
    Returns ``loss_mat [B, T]`` and metrics ``clipcov/frac_tokens`` (share of valid tokens detached),
    ``clipcov/n_tokens`` and those of :func:`~meshrl.algos.policy_losses.ppo_clip_loss` (its base loss).
    """
    base, metrics = ppo_clip_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
    clipped = clipped_tokens(log_ratio.detach().exp(), adv, clip_low, clip_high) & (m > 0)
    chosen = clip_cov_selection(logp, adv, m, clipped, ratio=ratio, cov_lb=cov_lb, cov_ub=cov_ub,
                                generator=generator)
    n = float(m.sum().clamp(min=1))
    metrics.update({"clipcov/frac_tokens": float(chosen.sum()) / n, "clipcov/n_tokens": float(chosen.sum())})
    return base * (~chosen).to(base.dtype), metrics


def kl_cov_penalty(
    logp: torch.Tensor, old_logp: torch.Tensor, chosen: torch.Tensor, *, coef: float = 1.0
) -> torch.Tensor:
    """KL-Cov's per-token penalty ``coef * |log pi_t - log pi_old_t|`` on the chosen tokens, 0 elsewhere
    (Cui et al. 2025, eq. 13). ``[B, T]``, differentiable in ``logp``."""
    if coef < 0:
        raise ValueError(f"kl_cov coef must be >= 0, got {coef}")
    return coef * (logp - old_logp.detach()).abs() * chosen.to(logp.dtype)


@register_covariance_loss("kl_cov")
def kl_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float = 2e-4,
    coef: float = 1.0,
    clip_low: float | None = None,
    clip_high: float | None = None,
    clip_dual: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: unclipped policy gradient plus an |log-ratio| penalty on the top-covariance tokens.

    Formula (Cui et al. 2025, eq. 13; reference ``k = 0.2 %`` (7B) / ``0.02 %`` (32B), ``coef = 1``;
    verl's yaml default ``ppo_kl_coef`` is 0.1)::

        L_t = -A_t r_t + coef * |log r_t| * 1[t in top-k by cov_t]

    No clipping (``ppo_clip``'s ``clip_low``, ``clip_high``, ``clip_dual`` are accepted and ignored so it
    drops in for ``ppo_clip``; any other keyword, e.g. a misspelt ``coeff``, is a ``TypeError``). On-policy
    (one optimiser step per batch, ``r = 1``) the penalty and its gradient are exactly 0.
    Metrics: ``klcov/frac_tokens``, ``klcov/penalty`` (mean penalty over the valid tokens), ``approx_kl``...
    """
    del clip_low, clip_high, clip_dual  # KL-Cov's surrogate is unclipped
    log_ratio, adv, m = _prepare(logp, old_logp, advantages, mask)
    chosen = kl_cov_selection(logp, adv, m, ratio=ratio)
    penalty = kl_cov_penalty(logp, old_logp, chosen, coef=coef)
    loss = -adv * log_ratio.exp() + penalty
    n = float(m.sum().clamp(min=1))
    metrics = {
        "klcov/frac_tokens": float(chosen.sum()) / n,
        "klcov/penalty": float((penalty.detach() * m).sum()) / n,
        **_ratio_metrics(log_ratio, m),
    }
    return loss, metrics


@register_advantage_shaper("entropy")
def entropy_advantage(
    advantages: torch.Tensor, mask: torch.Tensor, *, entropy: torch.Tensor, alpha: float = 0.4, kappa: float = 2.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """Entropy-based advantage shaping.

    Formula (Cheng et al. 2025, "Reasoning with Exploration: An Entropy Perspective", arXiv 2506.14758,
    eqs. 3-4; alpha = 0.4 for GRPO, 0.1 for PPO, kappa = 2)::

        psi_t = min(alpha * sg(H_t), |A_t| / kappa)        A'_t = A_t + psi_t

    ``kappa > 1`` keeps a negative ``A_t`` negative; ``A_t = 0`` stays 0 (so zero-advantage rows keep an
    exactly zero gradient). The entropy is detached: this re-weights the policy gradient, it is not an
    entropy bonus in the loss.

    Args:
        advantages: ``[B]`` or ``[B, T]``.
        mask: ``[B, T]`` valid tokens (metrics only; masked positions are shaped too and masked later).
        entropy: ``[B, T]`` per-token entropy of the current policy, ``>= 0``.
    Returns:
        ``[B, T]`` shaped advantages and metrics ``entadv/bonus_mean``, ``entadv/capped_frac`` (share of
        valid tokens where ``|A|/kappa`` was the smaller term).
    """
    check_tensor("entropy", entropy, ndim=2)
    m = check_mask("mask", mask, entropy, "entropy")
    if alpha <= 0 or kappa <= 1:
        raise ValueError(f"entropy advantage needs alpha > 0 and kappa > 1, got alpha={alpha} kappa={kappa}")
    adv = _token_advantages(advantages, entropy)
    h = entropy.detach().to(adv.dtype)
    if (h * m < -1e-6).any():
        raise ValueError("entropy must be >= 0 at valid tokens")
    cap = adv.abs() / kappa
    bonus = torch.minimum(alpha * h, cap)
    n = float(m.sum().clamp(min=1))
    metrics = {
        "entadv/bonus_mean": float((bonus * m).sum()) / n,
        "entadv/capped_frac": float(((cap < alpha * h).to(m.dtype) * m).sum()) / n,
    }
    return adv + bonus, metrics


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    check_tensor("advantages", advantages)
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.detach()[:, None].expand_as(like).to(like.dtype)
    if tuple(advantages.shape) == tuple(like.shape):
        return advantages.detach().to(like.dtype)
    raise ValueError(f"advantages shape {tuple(advantages.shape)} is neither [B] nor {tuple(like.shape)}")


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, *, top_frac: float = 0.2) -> torch.Tensor:
    """Forking tokens: valid tokens whose entropy reaches the ``1 - top_frac`` quantile of the valid ones.

    Rule (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939, eq. 6; rho = 20 %)::

        keep_t = 1[H_t >= tau],  tau = quantile_{valid}(H, 1 - rho)

    ``tau`` is ``torch.quantile`` (linear interpolation), as TRL's ``get_high_entropy_mask``; ties at
    ``tau`` are all kept, so the kept share can exceed ``top_frac``. No valid token: all False.

    Returns:
        ``[B, T]`` bool.
    """
    check_tensor("entropy", entropy, ndim=2)
    m = check_mask("mask", mask, entropy, "entropy")
    _check_fraction("top_frac", top_frac)
    valid = m > 0
    values = entropy.detach()[valid].float()
    if values.numel() == 0:
        return torch.zeros_like(valid)
    tau = torch.quantile(values, 1 - top_frac)
    return (entropy.detach().float() >= tau) & valid


def _forking(entropy: torch.Tensor, mask: torch.Tensor, top_frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    keep = high_entropy_mask(entropy, mask, top_frac=top_frac)
    m = mask.to(entropy.dtype)
    n = float(m.sum().clamp(min=1))
    return keep, torch.tensor(float(keep.sum()) / n)


@register_token_mask("fork_selected")
def forking_mask_selected(
    entropy: torch.Tensor, mask: torch.Tensor, *, top_frac: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The paper's normalisation: the loss is aggregated over the selected tokens only.

    ``J = sum_t keep_t l_t / sum_t keep_t`` (token-mean; Wang et al. 2025 eq. 6). Returns
    ``(loss_weight, agg_mask, metrics)`` with ``loss_weight = agg_mask = keep`` (as ``entropy.dtype``),
    metric ``fork/frac_tokens``. Rows without a selected token drop out of the sequence means.
    """
    keep, frac = _forking(entropy, mask, top_frac)
    k = keep.to(entropy.dtype)
    return k, k, {"fork/frac_tokens": float(frac)}


@register_token_mask("fork_all")
def forking_mask_all(
    entropy: torch.Tensor, mask: torch.Tensor, *, top_frac: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """TRL's normalisation (``GRPOConfig.top_entropy_quantile``): unselected tokens get loss weight 0 but
    the normaliser still counts every valid token (``sum_t keep_t l_t / sum_t m_t`` for token-mean).

    Returns ``(loss_weight = keep, agg_mask = mask, metrics)``.
    """
    keep, frac = _forking(entropy, mask, top_frac)
    return keep.to(entropy.dtype), mask.to(entropy.dtype), {"fork/frac_tokens": float(frac)}


def token_mask(
    name: str, scores: torch.Tensor, mask: torch.Tensor, **config: float
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Dispatch to a registered token mask (``fork_selected``, ``fork_all``)."""
    check_choice("token mask", name, TOKEN_MASKS)
    return TOKEN_MASKS[name](scores, mask, **config)


def covariance_loss(name: str) -> PolicyLossFn:
    """Look up a registered covariance-based policy loss (``clip_cov``, ``kl_cov``)."""
    check_choice("covariance loss", name, COVARIANCE_LOSSES)
    return COVARIANCE_LOSSES[name]


def shape_advantages(
    name: str, advantages: torch.Tensor, mask: torch.Tensor, **config: object
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch to a registered advantage shaper (``entropy``)."""
    check_choice("advantage shaper", name, ADVANTAGE_SHAPERS)
    return ADVANTAGE_SHAPERS[name](advantages, mask, **config)


def clipped_by_loss(loss_name: str, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    loss_cfg: dict) -> torch.Tensor:
    """``[n, T]`` bool: the tokens whose gradient the recipe's own clip already removed (Clip-Cov leaves them out
    of its candidates). ``ppo_clip``: ``A>0, r>1+eh`` or ``A<0, r<1-el`` on the token ratio, and with a dual clip
    ``A<0, r>c``; ``gspo_token``: the same bounds on the sequence ratio ``s_i`` (its value for every token of the
    row); ``cispo`` clips the weight, never the gradient: none."""
    ratio = (logp.detach() - old).exp()
    low, high = loss_cfg.get("clip_low", 0.2), loss_cfg.get("clip_high", 0.2)
    if loss_name == "cispo":
        return torch.zeros_like(ratio, dtype=torch.bool)
    if loss_name == "gspo_token":
        m = mask.to(ratio.dtype)
        seq = (((logp.detach() - old) * m).sum(-1) / m.sum(-1).clamp(min=1)).exp()
        return clipped_tokens(seq[:, None].expand_as(ratio), adv, low, high)
    clipped = clipped_tokens(ratio, adv, low, high)
    if loss_cfg.get("clip_dual") is not None:  # -A c: a constant, no gradient
        clipped = clipped | ((adv < 0) & (ratio > loss_cfg["clip_dual"]))
    return clipped
