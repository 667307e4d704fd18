"""``plugins.entropy_adv``: advantages shaped by the token entropy (Cheng et al. 2025, arXiv 2506.14758).

The formula is :func:`meshrl.algos.entropy_advantage` (the ``entropy`` advantage shaper of ``meshrl.algos``):
``A_t + min(alpha * H_t.detach(), |A| / kappa)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.algos import shape_advantages
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, Stage, Stats, TokenTerms, register


@dataclass
class EntropyAdvConfig:
    enabled: bool = setting(False, help="add the entropy bonus to every token's advantage")
    alpha: float = setting(0.4, gt=0, help="bonus per nat of entropy (the paper: 0.4 for GRPO, 0.1 for PPO)")
    kappa: float = setting(2.0, gt=1, help="the bonus is capped at |A| / kappa, so it never flips A's sign")


@register
class EntropyAdvantage(Plugin):
    name = "entropy_adv"
    Config = EntropyAdvConfig
    stage = Stage.ADVANTAGE
    summary = "entropy-based advantage shaping (Cheng et al. 2025)"

    def shape_advantages(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats]:
        return shape_advantages("entropy", terms.adv, terms.mask, entropy=terms.entropy, alpha=self.cfg.alpha,
                                kappa=self.cfg.kappa)
