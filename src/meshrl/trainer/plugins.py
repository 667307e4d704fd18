"""Plug-ins around the recipes' policy term, selected by the ``plugins.*`` config keys (docs/plugins.md).

Each one changes how the per-token policy loss of a micro-batch is built, on top of any recipe (the Mesh
recipes included, whose balancing term is separate):

- ``plugins.entropy_adv``: advantages shaped by the token entropy (Cheng et al. 2025);
- ``plugins.clip_cov`` / ``plugins.kl_cov``: covariance-based token selection (Cui et al. 2025);
- ``plugins.fork``: policy gradient on the high-entropy "forking" tokens only (Wang et al. 2025);
- ``plugins.m2po``: second-moment mask against the behaviour policy (Zheng et al. 2025).

The selections use statistics of the whole micro-batch (covariance means, an entropy quantile, a moment
over tokens), so a micro-batch must not be split into parts: with any plug-in on, the trainer runs the
update in one process and without the zero-advantage shortcut (``TrainPlugins.changes_loss``). The
formulas live in :mod:`meshrl.algos.entropy_control` and :mod:`meshrl.algos.offpolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.algos import (
    clip_cov_selection,
    entropy_advantage,
    kl_cov_loss,
    kl_cov_penalty,
    kl_cov_selection,
    m2po_mask,
    policy_loss,
    token_mask,
)
from meshrl.algos.entropy_control import _clipped_tokens

SEQUENCE_LEVEL_LOSSES = ("gspo",)  # one ratio and one advantage per sequence: no per-token selection


@dataclass
class ClipCovConfig:
    enabled: bool = False
    ratio: float = 2e-4  # share of valid tokens detached (at least one)
    cov_lb: float = 1.0  # candidates: cov_lb < cov < cov_ub
    cov_ub: float = 5.0


@dataclass
class KlCovConfig:
    enabled: bool = False
    ratio: float = 2e-4  # share of valid tokens penalised, a fraction (the paper's 0.2 % = 2e-3)
    coef: float = 1.0  # penalty weight on |log pi - log pi_old| (verl's yaml default: 0.1)


@dataclass
class EntropyAdvConfig:
    enabled: bool = False
    alpha: float = 0.4  # 0.4 for GRPO, 0.1 for PPO in the paper
    kappa: float = 2.0  # bonus <= |A| / kappa, kappa > 1


@dataclass
class ForkConfig:
    enabled: bool = False
    top_frac: float = 0.2  # rho: the highest-entropy share of the micro-batch's tokens
    norm: str = "selected"  # "selected": normalise over the kept tokens (paper); "all": over every token (TRL)


@dataclass
class M2poConfig:
    enabled: bool = False
    threshold: float = 0.04  # tau_M2
    keep_clip: bool = False  # False: the ppo_clip recipes' eps-clip is dropped, as in M2PO


@dataclass
class PluginsConfig:
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    kl_cov: KlCovConfig = field(default_factory=KlCovConfig)
    entropy_adv: EntropyAdvConfig = field(default_factory=EntropyAdvConfig)
    fork: ForkConfig = field(default_factory=ForkConfig)
    m2po: M2poConfig = field(default_factory=M2poConfig)

    def enabled(self) -> list[str]:
        return [name for name in ("clip_cov", "kl_cov", "entropy_adv", "fork", "m2po")
                if getattr(self, name).enabled]


def validate_plugins(plugins: PluginsConfig, policy_loss_name: str) -> None:
    """Raise ``ValueError`` naming the ``plugins.*`` key of an invalid or incompatible setting."""
    p = plugins
    checks = {
        "plugins.clip_cov.ratio": 0 < p.clip_cov.ratio <= 1,
        "plugins.clip_cov.cov_ub": p.clip_cov.cov_lb < p.clip_cov.cov_ub,
        "plugins.kl_cov.ratio": 0 < p.kl_cov.ratio <= 1,
        "plugins.kl_cov.coef": p.kl_cov.coef >= 0,
        "plugins.entropy_adv.alpha": p.entropy_adv.alpha > 0,
        "plugins.entropy_adv.kappa": p.entropy_adv.kappa > 1,
        "plugins.fork.top_frac": 0 < p.fork.top_frac <= 1,
        "plugins.fork.norm": p.fork.norm in ("selected", "all"),
        "plugins.m2po.threshold": p.m2po.threshold > 0,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        values = ", ".join(f"{k}={_get(p, k)!r}" for k in bad)
        raise ValueError(f"invalid plug-in setting(s): {values} (see docs/plugins.md)")
    on = p.enabled()
    if "clip_cov" in on and "kl_cov" in on:
        raise ValueError("plugins.clip_cov.enabled and plugins.kl_cov.enabled exclude each other "
                         "(two covariance rules for the same tokens)")
    if on and policy_loss_name in SEQUENCE_LEVEL_LOSSES:
        raise ValueError(f"plugins.{on[0]}.enabled needs a token-level policy loss; the recipe's policy_loss is "
                         f"{policy_loss_name!r} (one ratio per sequence): use gspo_token, ppo_clip or cispo")


def _get(plugins: PluginsConfig, dotted: str) -> Any:
    _, section, key = dotted.split(".")
    return getattr(getattr(plugins, section), key)


class TrainPlugins:
    """The enabled plug-ins of one run: builds a micro-batch's policy loss matrix and its metrics."""

    def __init__(self, plugins: PluginsConfig, seed: int) -> None:
        self.cfg = plugins
        self.seed = seed
        self._step, self._calls = -1, 0

    @property
    def changes_loss(self) -> bool:
        """True when a plug-in is on: micro-batches then run whole, in one process, every row backward."""
        return bool(self.cfg.enabled())

    def _generator(self, step: int) -> torch.Generator:
        """Clip-Cov's draw: a pure function of (seed, step, call within the step), so a resumed run draws the
        same tokens."""
        if step != self._step:
            self._step, self._calls = step, 0
        self._calls += 1
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 10_007 + self._calls)

    def policy_term(
        self, step: int, loss_name: str, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
        mask: torch.Tensor, entropy: torch.Tensor, loss_cfg: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """``(loss_mat [n, T], metrics, aggregation mask [n, T])`` of the recipe's policy loss with the
        enabled plug-ins; aggregate ``loss_mat`` over the returned mask with the recipe's mode.

        Order: advantages shaped (entropy_adv) -> base loss (kl_cov's unclipped form replaces ``ppo_clip``;
        M2PO drops the clip) -> Clip-Cov detach -> M2PO and forking masks (loss weights)."""
        c = self.cfg
        stats: dict[str, float] = {}
        if c.entropy_adv.enabled:
            adv, s = entropy_advantage(adv, mask, entropy=entropy, alpha=c.entropy_adv.alpha,
                                       kappa=c.entropy_adv.kappa)
            stats.update(s)
        loss_cfg = dict(loss_cfg)
        unclipped = loss_name == "ppo_clip" and c.m2po.enabled and not c.m2po.keep_clip
        if unclipped:  # clamp(r, 1 - inf, 1 + inf) = r: the surrogate -A r
            loss_cfg.update(clip_low=float("inf"), clip_high=float("inf"), clip_dual=None)
        if c.kl_cov.enabled and loss_name == "ppo_clip":
            pg_mat, s = kl_cov_loss(logp, old, adv, mask, ratio=c.kl_cov.ratio, coef=c.kl_cov.coef)
        else:
            pg_mat, s = policy_loss(loss_name, logp, old, adv, mask, **loss_cfg)
            if c.kl_cov.enabled:  # other token-level losses: the penalty is added on top
                chosen = kl_cov_selection(logp, adv, mask, ratio=c.kl_cov.ratio)
                penalty = kl_cov_penalty(logp, old, chosen, coef=c.kl_cov.coef)
                pg_mat = pg_mat + penalty
                n = float(mask.sum().clamp(min=1))
                s.update({"klcov/frac_tokens": float(chosen.sum()) / n,
                          "klcov/penalty": float((penalty.detach() * mask).sum()) / n})
        stats.update(s)
        if c.clip_cov.enabled:
            pg_mat, s = self._clip_cov(step, logp, old, adv, mask, pg_mat, loss_cfg)
            stats.update(s)
        agg_mask = mask.to(pg_mat.dtype)
        if c.m2po.enabled:
            keep, s = m2po_mask(logp, old, adv, mask, threshold=c.m2po.threshold)
            pg_mat = pg_mat * keep  # the mean still runs over every valid token (M2PO's objective)
            stats.update(s)
        if c.fork.enabled:
            weight, agg_mask, s = token_mask(f"fork_{c.fork.norm}", entropy, mask, top_frac=c.fork.top_frac)
            pg_mat = pg_mat * weight
            stats.update(s)
        return pg_mat, stats, agg_mask

    def _clip_cov(self, step, logp, old, adv, mask, pg_mat, loss_cfg) -> tuple[torch.Tensor, dict[str, float]]:
        """Detach a random subset of the mid-covariance tokens the base loss's clip has not already clipped."""
        c = self.cfg.clip_cov
        token_adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
        ratio = (logp.detach() - old).exp()
        clipped = _clipped_tokens(ratio, token_adv, loss_cfg.get("clip_low", 0.2), loss_cfg.get("clip_high", 0.2))
        chosen = clip_cov_selection(logp, token_adv, mask, clipped & (mask > 0), ratio=c.ratio, cov_lb=c.cov_lb,
                                    cov_ub=c.cov_ub, generator=self._generator(step))
        n = float(mask.sum().clamp(min=1))
        stats = {"clipcov/frac_tokens": float(chosen.sum()) / n, "clipcov/n_tokens": float(chosen.sum())}
        return pg_mat * (~chosen).to(pg_mat.dtype), stats
