"""``plugins.future_kl``: FIPO's future-KL token credit (Ma, Yang, Huang, Lu, Meng, Wang, Ding, Vosoughi, Wang, Zhou
2026, "FIPO: Eliciting Deep Reasoning with Future-KL Influenced Policy Optimization", arXiv 2603.19835).

GRPO gives every token of a response the response's advantage ``A_i``. FIPO weights each token by how much the
current update moves the rest of the trajectory, from the token on:

    d_k        = clamp(log pi_theta(y_k) - log pi_old(y_k), -20, 20)     (the signed log-ratio of token k)
    FutureKL_t = sum_{k >= t} gamma^(k - t) * M_k * [r_k <= c] * d_k,   gamma = 2^(-1 / decay_rate)
    f_t        = clip(exp(FutureKL_t), 1, 1 + eps_f)          (clip_high_only; else [1 - eps_f, 1 + eps_f];
                                                               eps_f = 0: no lower bound, at most 10)
    f_t        = clip(f_t, 0.8, 1)  where A < 0 and r_t > safety_threshold      (no over-penalised negatives)
    A'_t       = A_i * sg(f_t)

``M`` is the response mask and ``[r_k <= c]`` leaves tokens whose ratio passed the dual-clip constant ``c``
(``filter_ratio``) out of the sum. The formula, the clamp, the filter, the clip and the safety rule are those of
the authors' verl recipe (``compute_policy_loss_future_kl``, the ``future_kl`` policy loss); the defaults are its
Qwen2.5-32B run's (``decay_rate`` 32, ``future_kl_clip_ratio`` 0.2, ``future_kl_clip_high_only`` true,
``safety_thresh`` 10, ``clip_ratio_c`` 10). ms-swift's port defaults ``safety_threshold`` to 4 and its 7B example
uses ``clip_high_only`` false, ``safety_threshold`` 3. The recipe's own loss (its clip, its aggregation) then runs
on ``A'``; FIPO's run also drops a response with more than one dual-clipped negative token, which is not part of
this plug-in.

On-policy (one optimiser step per batch) the ratio is exactly 1, every ``d_k`` is 0 and ``f_t = 1``: the plug-in
changes nothing. It acts with ``train.ppo_epochs > 1``, ``train.mini_batches > 1`` or ``plugins.replay``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, Stage, Stats, TokenTerms, register

LOG_RATIO_BOUND = 20.0  # the reference code's clamp of the log-ratio
UNCLIPPED_MAX = 10.0  # the reference code's cap on the weight when eps_f = 0
SAFETY_BAND = (0.8, 1.0)  # the reference code's band for high-ratio negative-advantage tokens
CHUNK = 128  # future positions per matmul: memory O(T * CHUNK) instead of O(T^2)


@dataclass
class FutureKlConfig:
    enabled: bool = setting(False, help="weight each token's advantage by its discounted future log-ratio (FIPO)")
    decay_rate: float = setting(32.0, gt=0, help="half-life of the future discount in tokens: "
                                "gamma = 2^(-1/decay_rate) (FIPO's 32B run: 32)")
    clip_range: float = setting(0.2, ge=0, help="eps_f: the weight is clipped to [1, 1+eps_f] (clip_high_only) "
                                "or [1-eps_f, 1+eps_f]; 0: only capped at 10")
    clip_high_only: bool = setting(True, help="true: the weight only amplifies (FIPO's 32B run); false: "
                                   "[1-eps_f, 1+eps_f] (ms-swift's 7B example)")
    safety_threshold: float = setting(10.0, gt=0, help="a token with A < 0 and ratio above this keeps a weight "
                                      "in [0.8, 1] (FIPO's 32B run: 10; ms-swift's default: 4)")
    filter_ratio: float = setting(10.0, gt=1, help="c: tokens with ratio above c add nothing to the future sum "
                                  "(the dual-clip constant of FIPO's 32B run: 10)")


def discounted_future_sum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """``out[:, t] = sum_{k >= t} gamma^(k - t) x[:, k]`` of ``x [n, T]``, by chunks of future positions."""
    n, length = x.shape
    out = torch.zeros_like(x)
    pos = torch.arange(length, device=x.device).unsqueeze(1)  # t, [T, 1]
    g = torch.tensor(gamma, dtype=x.dtype, device=x.device)
    for start in range(0, length, CHUNK):
        k = torch.arange(start, min(length, start + CHUNK), device=x.device).unsqueeze(0)  # [1, K]
        dist = k - pos  # [T, K]
        decay = torch.pow(g, dist.clamp(min=0)) * (dist >= 0).to(x.dtype)
        out = out + x[:, start : start + CHUNK] @ decay.t()
    return out


def fipo_weights(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 cfg: FutureKlConfig) -> tuple[torch.Tensor, Stats]:
    """FIPO's influence weights ``f [n, T]`` (detached) and their metrics; ``adv`` is ``[n]`` or ``[n, T]``."""
    valid = mask.bool()
    d = (logp.detach() - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = d.exp()
    joins = valid & (d <= math.log(cfg.filter_ratio))  # tokens past the dual clip add nothing to the sum
    future = discounted_future_sum(d * joins.to(d.dtype), 2.0 ** (-1.0 / cfg.decay_rate))
    raw = future.exp()
    if cfg.clip_range > 0:
        low, high = (1.0 if cfg.clip_high_only else 1.0 - cfg.clip_range), 1.0 + cfg.clip_range
        weight = raw.clamp(low, high)
    else:
        low, high = 0.0, UNCLIPPED_MAX
        weight = raw.clamp(max=high)
    adv_t = adv.unsqueeze(-1).expand_as(d) if adv.dim() == 1 else adv
    guarded = (adv_t < 0) & (ratio > cfg.safety_threshold)
    weight = torch.where(guarded, weight.clamp(*SAFETY_BAND), weight)
    n = max(int(valid.sum()), 1)

    def mean(x: torch.Tensor) -> float:
        return float((x * valid).sum()) / n

    # the share the clip changed, each side apart (a weight of exactly 1 is not clipped, also when low is 1)
    stats = {"fipo/weight_mean": mean(weight), "fipo/raw_weight_mean": mean(raw), "fipo/future_kl_mean": mean(future),
             "fipo/clip_frac_high": mean((raw > high).to(d.dtype)), "fipo/clip_frac_low": mean((raw < low).to(d.dtype)),
             "fipo/safety_frac": mean(guarded.to(d.dtype))}
    return weight, stats


@register
class FutureKl(Plugin):
    name = "future_kl"
    Config = FutureKlConfig
    stage = Stage.ADVANTAGE
    order = 1.0
    summary = "FIPO: token credit from the discounted future log-ratio (Ma et al. 2026)"

    def shape_advantages(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats]:
        weight, stats = fipo_weights(terms.logp, terms.old, terms.adv, terms.mask, self.cfg)
        adv = terms.adv.unsqueeze(-1) if terms.adv.dim() == 1 else terms.adv
        return adv * weight, stats
