"""The enabled plug-ins of one run, called at their hooks by the step (:mod:`meshrl.trainer.step`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from meshrl.algos import policy_loss
from meshrl.trainer.plugins.base import REGISTRY, Plugin, PluginContext, Stats, TokenTerms
from meshrl.trainer.plugins.config import load_custom

log = logging.getLogger("meshrl")


class TrainPlugins:
    """Instances of the enabled plug-ins, in stage order; each hook runs them one after another."""

    def __init__(self, plugins_cfg: Any, ctx: PluginContext) -> None:
        found = [(name, cls, getattr(plugins_cfg, name)) for name, cls in REGISTRY.items()]
        # A custom plug-in is known by its import path, so that its checkpoint state follows it when the list is
        # reordered (a position would load one plug-in's state into another); validation refuses duplicates.
        found += [(f"custom:{e['path']}", *load_custom(e, f"plugins.custom[{i}]"))
                  for i, e in enumerate(plugins_cfg.custom)]
        on = [(name, cls(cfg, ctx)) for name, cls, cfg in found if cls.is_enabled(cfg)]
        on.sort(key=lambda item: (item[1].stage, item[1].order))  # stable: ties keep registry order
        self.by_name: dict[str, Plugin] = dict(on)
        self.active: list[Plugin] = [p for _, p in on]

    def get(self, name: str) -> Plugin | None:
        return self.by_name.get(name)

    def opener(self) -> Plugin | None:
        """The enabled plug-in that forces response openings (overrides :meth:`Plugin.opening`), or None."""
        openers = [p for p in self.active if type(p).opening is not Plugin.opening]
        if len(openers) > 1:
            raise ValueError("plug-ins " + " and ".join(p.name for p in openers) + " both force response openings; "
                             "enable one")
        return openers[0] if openers else None



    # ---- sampling
    def sample(self, sampler: Any, step: int, cursor: int) -> tuple[Any, int]:
        """The step's batch and the next cursor: a stored batch a plug-in reuses, or fresh rollouts after every
        plug-in's :meth:`~Plugin.after_sampling`."""
        for p in self.active:
            reused = p.reuse_batch(step, cursor)
            if reused is not None:
                return reused
        for p in self.active:
            p.before_sampling(sampler)
        data, cursor = sampler.run(step, cursor)
        for p in self.active:
            data = p.after_sampling(step, data, sampler)
        for p in self.active:
            p.batch_ready(step, data)
        return data, cursor

    def received(self, step: int, data: Any, sampler: Any) -> Any:
        """A batch sampled ahead in the sampler process (``rollout.max_staleness``): every plug-in's
        :meth:`~Plugin.after_sampling` and :meth:`~Plugin.batch_ready` on it (only plug-ins whose sampling hooks
        just check the batch may be on: meshrl.trainer.lagged_rollouts.check_staleness)."""
        for p in self.active:
            data = p.after_sampling(step, data, sampler)
        for p in self.active:
            p.batch_ready(step, data)
        return data

    def behaviour_logps(self, data: Any, old_logps: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        for p in self.active:
            old_logps = p.behaviour_logps(data, old_logps)
        return old_logps

    # ---- the update
    def begin_update(self, data: Any, start_logps: list[torch.Tensor] | None,
                     ref_logps: list[torch.Tensor] | None) -> Stats:
        stats: Stats = {}
        for p in self.active:
            stats.update(p.begin_update(data, start_logps, ref_logps))
        return stats

    def policy_term(self, terms: TokenTerms) -> tuple[torch.Tensor, Stats, torch.Tensor]:
        """``(loss [n, T], metrics, aggregation mask [n, T])`` of the recipe's policy loss with every enabled
        plug-in, in stage order: advantages shaped -> loss settings and base loss -> off-policy shaping, token
        selection and weights -> correction. Aggregate the loss over the returned mask with the recipe's mode."""
        stats: Stats = {}
        for p in self.active:
            terms.adv, s = p.shape_advantages(terms)
            stats.update(s)
        for p in self.active:
            terms.loss_cfg = p.loss_settings(terms.loss_name, terms.loss_cfg)
        base = next((b for b in (p.base_loss(terms) for p in self.active) if b is not None), None)
        if base is None:
            base = policy_loss(terms.loss_name, terms.logp, terms.old, terms.adv, terms.mask, **terms.loss_cfg)
        pg_mat, s = base
        stats.update(s)
        agg_mask = terms.mask.to(pg_mat.dtype)
        for p in self.active:
            pg_mat, agg_mask, s = p.transform(terms, pg_mat, agg_mask)
            stats.update(s)
        return pg_mat, stats, agg_mask

    def extra_loss(self, mb: Any, logits: torch.Tensor, total: torch.Tensor, stats: Stats) -> torch.Tensor:
        for p in self.active:
            total = p.extra_loss(mb, logits, total, stats)
        return total

    def surrogate(self, rows: list[int], seq_logp: torch.Tensor) -> torch.Tensor | float:
        out: torch.Tensor | float = 0.0
        for p in self.active:
            term = p.surrogate(rows, seq_logp)
            out = term if isinstance(out, float) and out == 0.0 else out + term
        return out

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        """What must survive a resume (JSON), by plug-in name; None when no plug-in keeps state."""
        out = {name: s for name, p in self.by_name.items() if (s := p.state_dict()) is not None}
        return out or None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output; a checkpoint without a stateful plug-in's state (written before it
        was kept) starts that plug-in afresh, with a warning."""
        state = state or {}
        stateful = [name for name, p in self.by_name.items() if type(p).state_dict is not Plugin.state_dict]
        missing = [name for name in stateful if name not in state]
        if missing:
            log.warning("the checkpoint has no state of plugins.%s: the resumed run starts it afresh",
                        ", plugins.".join(missing))
        for name in stateful:
            self.by_name[name].load_state_dict(state.get(name))
