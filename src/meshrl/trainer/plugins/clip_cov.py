"""``plugins.clip_cov``: Clip-Cov, the gradient detached on a random subset of mid-covariance tokens (Cui et al.
2025, arXiv 2505.22617, eq. 12).

The candidates are the tokens whose log-prob/advantage covariance lies in ``(cov_lb, cov_ub)`` and whose gradient
the recipe's own clip has not already removed (:func:`meshrl.algos.clipped_by_loss`); the draw is a pure function
of (seed, step, call within the step), so a resumed run detaches the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshrl.algos import clip_cov_selection, clipped_by_loss
from meshrl.settings import setting
from meshrl.trainer.plugins.base import Plugin, PluginContext, Stage, Stats, TokenTerms, register


@dataclass
class ClipCovConfig:
    enabled: bool = setting(False, help="detach a random subset of the mid-covariance tokens")
    ratio: float = setting(2e-4, gt=0, le=1, help="share of the valid tokens detached (at least one)")
    cov_lb: float = setting(1.0, help="candidates have covariance above this")
    cov_ub: float = setting(5.0, help="... and below this (must exceed cov_lb)")


@register
class ClipCov(Plugin):
    name = "clip_cov"
    Config = ClipCovConfig
    stage = Stage.TOKEN_SELECTION
    order = 1.0
    excludes = ("kl_cov",)  # two covariance rules for the same tokens
    summary = "Clip-Cov: detach random mid-covariance tokens (Cui et al. 2025)"

    def __init__(self, cfg: ClipCovConfig, ctx: PluginContext) -> None:
        super().__init__(cfg, ctx)
        self._step, self._calls = -1, 0

    @classmethod
    def check(cls, cfg: ClipCovConfig, run_cfg: Any) -> None:
        if not cfg.cov_lb < cfg.cov_ub:
            raise ValueError(f"invalid plug-in setting(s): plugins.clip_cov.cov_ub={cfg.cov_ub!r} must exceed "
                             f"plugins.clip_cov.cov_lb={cfg.cov_lb!r} (see docs/plugins.md)")

    def _generator(self, step: int) -> torch.Generator:
        if step != self._step:
            self._step, self._calls = step, 0
        self._calls += 1
        return torch.Generator().manual_seed((self.ctx.seed * 1_000_003 + step) * 10_007 + self._calls)

    def transform(self, terms: TokenTerms, pg_mat: torch.Tensor, agg_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Stats]:
        c, t = self.cfg, terms
        token_adv = t.adv[:, None].expand_as(t.logp) if t.adv.dim() == 1 else t.adv
        clipped = clipped_by_loss(t.loss_name, t.logp, t.old, token_adv, t.mask, t.loss_cfg)
        chosen = clip_cov_selection(t.logp, token_adv, t.mask, clipped & (t.mask > 0), ratio=c.ratio,
                                    cov_lb=c.cov_lb, cov_ub=c.cov_ub, generator=self._generator(t.step))
        n = float(t.mask.sum().clamp(min=1))
        stats = {"clipcov/frac_tokens": float(chosen.sum()) / n, "clipcov/n_tokens": float(chosen.sum())}
        return pg_mat * (~chosen).to(pg_mat.dtype), agg_mask, stats
