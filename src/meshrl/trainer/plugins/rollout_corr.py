"""``plugins.rollout_corr``: the policy loss corrected for the training-inference mismatch (Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training"; the mismatch itself is measured every step,
:mod:`meshrl.trainer.mismatch`).

:func:`rollout_correction` is the plug-in's loss term: the per-token policy loss times the detached weights
``w = pi_old_train / pi_rollout`` (truncated, TIS, or masked outside ``[lo, hi]``, IcePop), with the tokens
or sequences a k1/k2/k3 test rejects masked out (:func:`meshrl.algos.rollout_is_weights`,
:func:`meshrl.algos.rollout_rejection_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import importance_weight_stats, rollout_is_weights, rollout_rejection_mask
from meshrl.settings import setting
from meshrl.trainer.mismatch import rows_tensor, sampler_logps, unsampled_rows
from meshrl.trainer.plugins.base import Plugin, Stage, Stats, TokenTerms, register

REJECT_STATS = ("none", "k1", "k2", "k3")


@dataclass
class RolloutCorrConfig:
    enabled: bool = setting(False, help="weight the policy loss by pi_train / pi_rollout (TIS / IcePop)")
    level: str = setting("token", choices=("token", "sequence"),
                         help="one weight per token, or the product over the response")
    mode: str = setting("truncate", choices=("truncate", "mask"),
                        help="truncate: w <- min(w, threshold) (TIS); mask: w <- 0 outside [lo, hi] (IcePop)")
    threshold: float = setting(2.0, gt=0, help="C of truncate")
    lo: float = setting(0.5, gt=0, help="the lower end of mask's kept band")
    hi: float = setting(2.0, gt=0, help="the upper end of mask's kept band (>= lo)")
    reject: str = setting("none", choices=REJECT_STATS,
                          help="none | k1 | k2 | k3: mask tokens (token level) or rows (sequence level, row mean) "
                               "whose estimator exceeds reject_threshold")
    reject_threshold: float = setting(0.0, help="k2/k3: reject above it; k1: keep |log w| <= "
                                                      "log(reject_threshold) (> 1)")


@register
class RolloutCorr(Plugin):
    name = "rollout_corr"
    Config = RolloutCorrConfig
    stage = Stage.CORRECTION
    summary = "rollout importance correction: TIS / IcePop weights, k1/k2/k3 rejection (Yao et al. 2025)"
    lag_safe = True  # after_sampling only checks that the batch has sampler log-probs
    corrects_staleness = "tis"
    zero_advantage_exact = True  # the policy term times a detached weight and mask

    @classmethod
    def check(cls, cfg: RolloutCorrConfig, run_cfg: Any) -> None:
        k1 = cfg.reject == "k1"
        ok = {"hi": cfg.lo <= cfg.hi,
              "reject_threshold": cfg.reject == "none" or cfg.reject_threshold > (1 if k1 else 0)}
        wrong = [k for k, good in ok.items() if not good]
        if wrong:
            values = ", ".join(f"plugins.rollout_corr.{k}={getattr(cfg, k)!r}" for k in wrong)
            raise ValueError(f"invalid plug-in setting(s): {values} (see docs/plugins.md)")

    def after_sampling(self, step: int, data: Any, sampler: Any) -> Any:
        skip = unsampled_rows(data)
        sampled = [r for j, r in enumerate(data.rollout_logps) if j not in skip]
        if sampled and all(r is None for r in sampled):
            raise ValueError(f"plugins.rollout_corr.enabled: the rollout backend {sampler.backend.name!r} returned no "
                             "log-probs of its samples")
        return data

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        rollout, has = rows_tensor(sampler_logps(terms.batch, terms.rows), terms.old)
        return rollout_correction(self.cfg, pg_mat, agg_mask, terms.old, rollout, has, terms.mask)


def rollout_correction(c: RolloutCorrConfig, pg_mat: torch.Tensor, agg_mask: torch.Tensor, old: torch.Tensor,
                       rollout: torch.Tensor, has: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(pg_mat * w * keep, agg_mask * keep, metrics)`` for a micro-batch ``[n, T]``.

    ``w = pi_old / pi_rollout`` from the update's old log-probs ``old`` and the sampler's ``rollout`` (rows with
    ``has`` False, e.g. off-policy traces, keep weight 1 and are never rejected); ``keep`` 0 on the rejected
    tokens (``reject=k*``; a whole row at sequence level, tested on the row mean of the estimator). Metrics:
    ``rollout_corr/weight_mean`` (mean weight over the valid tokens with a rollout log-prob),
    ``rollout_corr/frac_truncated`` (share of those whose weight was truncated or zeroed),
    ``rollout_corr/frac_rejected``, and of the untruncated token ratios ``rollout_corr/weight_max`` and
    ``rollout_corr/ess`` (:func:`meshrl.algos.importance_weight_stats`).
    """
    valid = mask * has[:, None].to(mask.dtype)
    if c.mode == "truncate":
        w, s = rollout_is_weights(old, rollout, valid, level=c.level, mode="truncate", upper=c.threshold)
    else:
        w, s = rollout_is_weights(old, rollout, valid, level=c.level, mode="mask", upper=c.hi, lower=c.lo)
    keep = torch.ones_like(valid)
    rejected = 0.0
    if c.reject != "none":
        stat = f"token_{c.reject}" if c.level == "token" else f"seq_mean_{c.reject}"
        lower = 1.0 / c.reject_threshold if c.reject == "k1" else None
        kept, rs = rollout_rejection_mask(old, rollout, valid, stat=stat, upper=c.reject_threshold, lower=lower)
        keep = torch.where(valid > 0, kept, keep)
        rejected = rs["rollout_rs/masked_frac"]
    weight = torch.where(valid > 0, w, torch.ones_like(w)).to(pg_mat.dtype)
    n = valid.sum()
    spread = importance_weight_stats(old - rollout, valid)  # of the token ratios, before truncation
    stats = {"rollout_corr/weight_mean": float((w * valid).sum() / n) if n > 0 else 1.0,
             "rollout_corr/frac_truncated": s["rollout_is/clipped_frac"] if n > 0 else 0.0,
             "rollout_corr/frac_rejected": rejected,
             "rollout_corr/weight_max": spread["max"], "rollout_corr/ess": spread["ess"]}
    keep = keep.to(pg_mat.dtype)
    return pg_mat * weight * keep, agg_mask * keep, stats
