"""``plugins.fork``: the policy gradient on the high-entropy "forking" tokens only (Wang et al. 2025, "Beyond the
80/20 Rule", arXiv 2506.01939): the top ``top_frac`` of the micro-batch's valid tokens by entropy keep their loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.algos import token_mask
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, Stage, Stats, TokenTerms, register


@dataclass
class ForkConfig:
    enabled: bool = setting(False, help="train on the highest-entropy tokens only")
    top_frac: float = setting(0.2, gt=0, le=1, help="rho: the highest-entropy share of the micro-batch's tokens")
    norm: str = setting("selected", choices=("selected", "all"),
                        help="the loss mean over the kept tokens (selected, the paper) or every token (all, TRL)")


@register
class Fork(Plugin):
    name = "fork"
    Config = ForkConfig
    stage = Stage.TOKEN_SELECTION
    order = 3.0
    summary = "forking tokens: gradient on the top-entropy tokens (Wang et al. 2025)"

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        weight, agg_mask, stats = token_mask(f"fork_{self.cfg.norm}", terms.entropy, terms.mask,
                                             top_frac=self.cfg.top_frac)
        return pg_mat * weight, agg_mask, stats
