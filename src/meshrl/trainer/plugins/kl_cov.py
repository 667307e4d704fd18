"""``plugins.kl_cov``: KL-Cov, a KL penalty on the tokens of highest log-prob/advantage covariance (Cui et al.
2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617).

With the ``ppo_clip`` loss the policy term becomes the paper's unclipped form (:func:`meshrl.algos.kl_cov_loss`,
the ``kl_cov`` covariance loss of ``meshrl.algos``); with the other token-level losses the penalty
``coef * |log pi - log pi_old|`` on the selected tokens is added to the recipe's loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.algos import covariance_loss, kl_cov_penalty, kl_cov_selection, policy_loss
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, Stage, Stats, TokenTerms, register


@dataclass
class KlCovConfig:
    enabled: bool = setting(False, help="penalise the highest-covariance tokens' drift from pi_old")
    ratio: float = setting(2e-4, gt=0, le=1, help="share of the valid tokens penalised (the paper's 0.2% is 2e-3)")
    coef: float = setting(1.0, ge=0, help="weight of |log pi - log pi_old| on them (verl's yaml default: 0.1)")


@register
class KlCov(Plugin):
    name = "kl_cov"
    Config = KlCovConfig
    stage = Stage.BASE_LOSS
    summary = "KL-Cov: KL penalty on high-covariance tokens (Cui et al. 2025)"

    def base_loss(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats]:
        c, t = self.cfg, terms
        if t.loss_name == "ppo_clip":
            return covariance_loss("kl_cov")(t.logp, t.old, t.adv, t.mask, ratio=c.ratio, coef=c.coef)
        pg_mat, stats = policy_loss(t.loss_name, t.logp, t.old, t.adv, t.mask, **t.loss_cfg)
        chosen = kl_cov_selection(t.logp, t.adv, t.mask, ratio=c.ratio)
        penalty = kl_cov_penalty(t.logp, t.old, chosen, coef=c.coef)
        n = float(t.mask.sum().clamp(min=1))
        stats.update({"klcov/frac_tokens": float(chosen.sum()) / n,
                      "klcov/penalty": float((penalty.detach() * t.mask).sum()) / n})
        return pg_mat + penalty, stats
