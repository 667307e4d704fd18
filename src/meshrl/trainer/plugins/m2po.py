"""``plugins.m2po``: M2PO's second-moment mask against the behaviour policy (Zheng et al. 2025, "Prosperity before
Collapse", arXiv 2510.01161): the tokens of largest ``(log r)^2`` are masked until the batch's mean second moment is
below ``threshold``; with ``ppo_clip`` the recipe's eps-clip is dropped, as in M2PO (``keep_clip`` keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import m2po_mask
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, Stage, Stats, TokenTerms, register


@dataclass
class M2poConfig:
    enabled: bool = setting(False, help="mask the tokens of largest squared log-ratio (M2PO)")
    threshold: float = setting(0.04, gt=0, help="tau_M2: the largest mean (log r)^2 left unmasked")
    keep_clip: bool = setting(False, help="false: the ppo_clip recipes' eps-clip is dropped, as in M2PO")


@register
class M2po(Plugin):
    name = "m2po"
    Config = M2poConfig
    stage = Stage.TOKEN_SELECTION
    order = 2.0
    summary = "M2PO: second-moment token mask for stale rollouts (Zheng et al. 2025)"
    corrects_staleness = "m2po"
    zero_advantage_exact = True  # the policy term times a detached mask (the clip setting keeps it A times f(r))

    def loss_settings(self, loss_name: str, loss_cfg: dict[str, Any]) -> dict[str, Any]:
        if loss_name == "ppo_clip" and not self.cfg.keep_clip:  # clamp(r, 1 - inf, 1 + inf) = r: the surrogate -A r
            return {**loss_cfg, "clip_low": float("inf"), "clip_high": float("inf"), "clip_dual": None}
        return loss_cfg

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        keep, stats = m2po_mask(terms.logp, terms.old, terms.adv, terms.mask, threshold=self.cfg.threshold)
        return pg_mat * keep, agg_mask, stats  # the mean still runs over every valid token (M2PO's objective)
