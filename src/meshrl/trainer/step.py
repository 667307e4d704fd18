"""One training step, top to bottom: rollouts -> rewards -> advantages -> loss -> optimiser step.

:class:`Trainer` is built once per run (:meth:`Trainer.__init__`); :meth:`Trainer.step` is the reference step,
read in order:

1. **rollouts and rewards**: the sampler draws the step's problems, samples ``G`` responses each and grades them
   (:meth:`RolloutStep.run`); sampling plug-ins may reuse or change the batch (:class:`TrainPlugins`);
2. **advantages**: group-relative, from the recipe's estimator (done by the sampler, per advantage group);
3. **the update** (:meth:`Trainer.update`): old-policy and reference log-probs when the recipe needs them, the
   per-step terms (Mesh balancing, DPO) at the start parameters, then PPO epochs x mini-batches; each
   mini-batch's gradient comes from the update engine (:mod:`meshrl.trainer.update`: the loss of
   :mod:`meshrl.trainer.loss` per micro-batch), is clipped, and AdamW steps;
4. **diagnostics**: the training-inference mismatch, MEI, and the step's metrics.

The run loop around it (checkpoints, records, signals) is :func:`meshrl.trainer.loop.train`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from meshrl.trainer.balance import StrategyBalance
from meshrl.trainer.build import build_policy, build_sampler, build_task, emulated_bf16_event
from meshrl.trainer.config import RunConfig
from meshrl.trainer.failure import RunHealth
from meshrl.trainer.forward import PolicyForward
from meshrl.trainer.lagged_rollouts import LaggedRollouts, staleness_metrics, staleness_plugins
from meshrl.trainer.loss import Objective, UpdateInputs
from meshrl.trainer.mei_monitor import MeiMonitor
from meshrl.trainer.metrics import rollout_metrics, strategy_metrics
from meshrl.trainer.mismatch import MismatchMonitor, unsampled_rows, whole_vocab_rows
from meshrl.trainer.plugins import PluginContext, TrainPlugins
from meshrl.trainer.schedule import lr_at
from meshrl.trainer.speed import make_speed_path
from meshrl.trainer.step_data import StepData
from meshrl.trainer.update import StepPlan, make_engine

log = logging.getLogger("meshrl")


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        cfg = staleness_plugins(cfg)  # rollout.max_staleness >= 1: the correction's plug-in on
        self.cfg, self.run_dir = cfg, run_dir
        self.speed = make_speed_path(cfg.train)
        self.speed.at_start()  # before the model's tensors exist
        self.recipe = cfg.resolved_recipe()
        torch.manual_seed(cfg.seed)
        self.task, self.problems = build_task(cfg)
        p = build_policy(cfg, self.recipe)
        self.model, self.tokenizer, self.ref_model, self.optimizer = p.model, p.tokenizer, p.ref_model, p.optimizer
        self.backend, self.sampler, self.evaluator = build_sampler(cfg, self.recipe, self.task, self.problems, p,
                                                                   run_dir)
        self.forward = PolicyForward(cfg, self.model, self.ref_model, p.pad_id,
                                     lambda problem: self.sampler.prompt_ids(problem, -1), self.speed)
        self.plugins = TrainPlugins(cfg.plugins, PluginContext(
            cfg=cfg, recipe=self.recipe, forward=self.forward, tokenizer=self.tokenizer, task=self.task,
            problems=self.problems, seed=cfg.seed, rollouts=self.sampler))
        self.sampler.opener = self.plugins.opener()  # a plug-in may force the coach arms' openings
        self.mismatch = MismatchMonitor()  # every run: the sampler's log-probs against the update's
        # rollout.max_staleness >= 1: batches sampled ahead from older weights (before the update engine, which
        # sizes its workers by the cores the sampler leaves it)
        self.lag = (LaggedRollouts(cfg, self.sampler, self.model, self.problems) if cfg.rollout.max_staleness
                    else None)
        self.lag_reward: tuple[dict[str, Any], str | None] = ({}, None)  # the lagged batch's reward counters
        self.balance = StrategyBalance(cfg, self.forward)
        per_prefix = cfg.mesh_enabled and cfg.mesh.budget == "per_prefix"
        group = cfg.rollout.group_size * (cfg.mesh.m + cfg.mesh.bare_groups * cfg.mesh.bare_group if per_prefix else 1)
        self.mei = MeiMonitor(cfg, group) if cfg.diag.mei.every > 0 else None
        self.objective = Objective(self.recipe, cfg, self.plugins, self.forward, self.mismatch)
        self.engine = make_engine(cfg, self.recipe, self.objective, self.balance, self.mei)
        self.params = [q for q in self.model.parameters() if q.requires_grad]
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        self.health = RunHealth(cfg.failure.max_nonfinite, cfg.failure.max_stalled, vocab,
                                cfg.failure.max_reward_failed)
        self.step_idx, self.cursor, self.bad_in_row = 0, 0, 0
        self.last_data = StepData()
        self.pending_events: list[dict[str, Any]] = []
        slow = emulated_bf16_event(cfg, self.model, self.step_idx + 1)  # the first step this process runs
        if slow is not None:
            self.pending_events.append(slow)
        # A checkpoint holds a step boundary: ``dirty`` is True from the moment a step starts changing the
        # trainer until its records are written; ``boundary_rng`` is the RNG state at the start of the step.
        self.dirty, self.boundary_rng, self.saved_step = False, None, None

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, Any]:
        from meshrl.runs.checkpoint import rng_state

        t0 = time.perf_counter()
        self.boundary_rng = rng_state()
        # 1-2. rollouts, rewards, advantages (a sampling plug-in may reuse or change the batch)
        if self.lag is None:
            data, cursor = self.plugins.sample(self.sampler, self.step_idx, self.cursor)
        else:  # sampled ahead, from the weights of step max(0, s - k) (meshrl.trainer.lagged_rollouts)
            data, cursor, got = self.lag.next_batch(self.step_idx, self.cursor)
            data = self.plugins.received(self.step_idx, data, self.sampler)
            self.lag_reward = (got.reward_stats, got.reward_failure)
        # The mismatch is measured on rows the current weights sampled: a lagged row's gap is mostly the lag, which
        # the correction's weights (rollout_corr/*) report.
        self.mismatch.begin(data, unsampled_rows(data) | stale_rows(data, self.step_idx))
        self.last_data = data
        if not self.cfg.rollout.keep_decoders:  # their private pages would sit through the update
            self.backend.release_workers()
        t1 = time.perf_counter()
        self.dirty = True  # from here on the trainer's state changes
        for g in self.optimizer.param_groups:  # a pure function of the step: a resume continues it exactly
            g["lr"] = lr_at(self.cfg.optim, self.step_idx, self.cfg.steps)
        # The sampler's MEI features (taken every step: they belong to the policy the update is about to change).
        rollout_phi, missing = data.take_rollout_features()
        collect_mei = bool(self.mei and self.mei.active(self.step_idx) and len(data))
        mei_from_update = False
        if collect_mei:
            reason = None if rollout_phi is not None else self.mei_fallback_reason(data, missing)
            mei_from_update = self.mei.begin(len(data), rollout_phi, reason)
        # 3. the update
        metrics = self.update(data, mei_from_update) if len(data) else {"skipped/empty_batch": 1.0}
        # AdamW has read the gradients: drop them now rather than at the next update's zero_grad, so that the
        # next rollout (and the checkpoint between) does not hold a weights-sized buffer nobody reads.
        self.optimizer.zero_grad(set_to_none=True)
        self.speed.after_update()  # the update's memory back before the next rollout (meshrl.trainer.speed)
        # 4. diagnostics
        metrics.update(self.mismatch_metrics())
        if collect_mei:
            mei_metrics, events = self.mei.finish(data, self.step_idx + 1)
            metrics.update(mei_metrics)
            self.pending_events.extend(events)
        self.backend.sync_weights(self.model)
        if self.lag is not None:
            metrics.update(staleness_metrics(data, self.step_idx))
            self.lag.publish(self.model, self.step_idx + 1)
        t2 = time.perf_counter()
        self.step_idx, self.cursor = self.step_idx + 1, cursor
        n_tokens = sum(len(p) + len(r) for p, r in zip(data.prompt_ids, data.response_ids, strict=True))
        metrics.update(rollout_metrics(data))
        metrics.update(strategy_metrics(self.task, data))
        metrics.update(data.stats)
        metrics.update({
            "step": self.step_idx,
            "lr": self.optimizer.param_groups[0]["lr"],
            "time/train_s": t2 - t1,
            "time/step_s": t2 - t0,
            "throughput/tokens_per_s": n_tokens / max(t2 - t0, 1e-9),
            **self.reward_counters(),
        })
        return metrics

    def reward_counters(self) -> dict[str, Any]:
        """The reward runner's counters of this step's batch (a lagged batch's came from the sampler process)."""
        out = dict(self.lag_reward[0]) if self.lag is not None else {}
        for key, value in self.sampler.rewards.pop_stats().items():
            out[key] = out.get(key, 0) + value
        return out

    def last_reward_failure(self) -> str | None:
        """The scorer's latest failure message (None: none yet), for the error that stops a run whose rewards fail."""
        if self.lag is not None and self.lag_reward[1] is not None:
            return self.lag_reward[1]
        return getattr(self.sampler.rewards, "last_failure", None)

    def mei_fallback_reason(self, data: StepData, missing: int) -> str:
        """Why this step's MEI features come from the update's forward instead of the sampler."""
        if not self.backend.returns_features:
            return f"rollout backend {self.backend.name!r} returns none"
        if getattr(self.task, "episodic", False):
            return "multi-turn episodes carry no sampler features"
        return f"{missing} of {len(data)} rows have no sampler features (reused, off-policy or coach-guided rows)"

    def mismatch_metrics(self) -> dict[str, float]:
        out = self.mismatch.finish()
        if out:
            event = self.mismatch.setup_event(self.backend, self.model, self.cfg.train.autocast_bf16,
                                              self.step_idx + 1)
            if event is not None:
                self.pending_events.append(event)
        return out

    # ------------------------------------------------------------------ the update
    def update(self, data: StepData, collect_mei: bool = False) -> dict[str, Any]:
        """PPO epochs x mini-batches over the step's rollouts; the step's update metrics."""
        tc, rec = self.cfg.train, self.recipe
        single_pass = tc.ppo_epochs == 1 and tc.mini_batches == 1
        if self.backend.logprobs_truncated and self.cfg.rollout.top_p < 1:  # compare like with like (mismatch.py)
            data.rollout_log_kept = self.forward.log_kept_mass(self.model, data, self.cfg.rollout.top_p)
        # With one optimiser step per batch the old policy IS the current one: reuse logp.detach().
        start_logps = (None if single_pass and not self.balance.needs_start_logps
                       else self.forward.logps(self.model, data))
        if self.lag is not None and self.cfg.rollout.staleness_correction == "m2po":
            if start_logps is None:
                start_logps = self.forward.logps(self.model, data)
            old_logps = sampler_behaviour(data, start_logps)  # M2PO's ratio: against the policy that sampled
        else:
            old_logps = self.plugins.behaviour_logps(data, start_logps)  # a reused batch: its sampler's
        need_ref = (rec.kl_coef > 0 or (rec.js_coef > 0 and rec.js_mode == "sampled") or self.balance.needs_reference)
        ref_logps = self.forward.ref_logps(data) if need_ref else None
        # Per-step terms: Mesh balancing weights (over the log-probs of the policy that sampled the batch, which
        # for a batch plugins.replay reuses is the earlier behaviour policy), then the plug-ins' (DPO's pairs, at
        # the start parameters).
        step_stats = self.balance.begin_update(data, old_logps, ref_logps)
        step_stats.update(self.plugins.begin_update(data, start_logps, ref_logps))
        plan = StepPlan(collect_mei=collect_mei, balance=self.balance.active)
        inputs = UpdateInputs(data, old_logps, ref_logps, self.step_idx)
        sums: dict[str, float] = defaultdict(float)
        n_updates = 0
        gen = torch.Generator().manual_seed(self.cfg.seed * 7 + self.step_idx)
        for epoch in range(tc.ppo_epochs):
            order = torch.randperm(len(data), generator=gen).tolist() if not single_pass else list(range(len(data)))
            for m in range(tc.mini_batches):
                rows = order[m :: tc.mini_batches]
                if not rows:
                    continue
                ok, mstats = self.mini_batch_update(rows, inputs, plan, epoch)
                n_updates += 1
                for k, v in mstats.items():
                    sums[k] += v
                if not ok:
                    return self._skip_step(sums, n_updates)
        self.bad_in_row = 0
        out = {**{k: v / max(n_updates, 1) for k, v in sums.items()}, **step_stats}
        # The per-step terms' share of the objective: Mesh's balancing loss and any plug-in's ``<ns>/term``.
        terms = [k for k in step_stats if k == "mesh/balance_loss" or k.endswith("/term")]
        if "loss/total" in out:
            for term in terms:
                out["loss/total"] += step_stats[term]
        return out

    def mini_batch_update(self, rows: list[int], inputs: UpdateInputs, plan: StepPlan,
                          epoch: int) -> tuple[bool, dict[str, float]]:
        """Accumulate the gradient of ``rows`` (the engine), clip it, step AdamW; False if non-finite."""
        stats: dict[str, float] = defaultdict(float)
        self.optimizer.zero_grad(set_to_none=True)
        if not self.engine.backward(rows, inputs, self.params, stats, plan, epoch):
            return False, dict(stats)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm)
        stats["grad/norm"] = float(grad_norm)
        if not torch.isfinite(grad_norm):
            return False, dict(stats)
        self.optimizer.step()
        return True, dict(stats)

    def _skip_step(self, sums: dict[str, float], n_updates: int) -> dict[str, Any]:
        """The step's update is skipped; :class:`RunHealth` stops the run after ``failure.max_nonfinite`` in a
        row, once the step's records are written."""
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_in_row += 1
        log.warning("step %d: non-finite loss, gradient or log-prob, update skipped (%d in a row)",
                    self.step_idx + 1, self.bad_in_row)
        out = {k: v / max(n_updates, 1) for k, v in sums.items()}
        out["skipped/nonfinite"] = 1.0
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint the last step boundary (once per step: the state has not changed since)."""
        from meshrl.runs.checkpoint import save_checkpoint

        if self.dirty:
            raise RuntimeError(f"step {self.step_idx}: a checkpoint must hold a step boundary, not a step under way")
        path = self.run_dir / "checkpoints" / f"step_{self.step_idx:06d}"
        if self.saved_step == self.step_idx and path.is_dir():
            return path
        state = {"cursor": self.cursor, "bad_in_row": self.bad_in_row, "stalled_in_row": self.health.stalled_in_row,
                 "mei": self.mei.state_dict() if self.mei else None, "plugins": self.plugins.state_dict()}
        if self.lag is not None:  # the batches sampled ahead, from weights this checkpoint does not hold
            state["lagged"] = self.lag.state_dict(self.step_idx, self.cursor)
        path = save_checkpoint(self.run_dir, self.step_idx, self.model, self.optimizer, state,
                               keep_last=self.cfg.checkpoint.keep_last, rng=self.boundary_rng)
        self.saved_step = self.step_idx
        return path

    def saved_path(self) -> Path | None:
        """The checkpoint this run last wrote or resumed from (None if it has none)."""
        if self.saved_step is None:
            return None
        path = self.run_dir / "checkpoints" / f"step_{self.saved_step:06d}"
        return path if path.is_dir() else None

    def restore(self) -> None:
        from meshrl.runs.checkpoint import restore_checkpoint

        _, state = restore_checkpoint(self.run_dir, self.model, self.optimizer)
        self.step_idx, self.cursor = int(state["step"]), int(state["cursor"])
        self.bad_in_row = int(state.get("bad_in_row", 0))
        self.health.stalled_in_row = int(state.get("stalled_in_row", 0))
        self.saved_step = self.step_idx
        for event in self.pending_events:  # said at start-up, before the step to resume from was known
            if event.get("event") == "bf16_emulated":
                event["step"] = self.step_idx + 1
        if self.mei and state.get("mei"):
            self.mei.load_state_dict(state["mei"])
        self.plugins.load_state_dict(state.get("plugins"))
        self.backend.sync_weights(self.model)
        if self.lag is not None:
            self.lag.load_state_dict(state.get("lagged"), self.step_idx, self.cursor)
            self.lag.publish(self.model, self.step_idx)

    def end_step(self) -> None:
        """The step's records are written: the trainer is at a step boundary again."""
        self.dirty, self.boundary_rng = False, None

    def close(self) -> None:
        """Stop the update and decode worker processes (also done at garbage collection and exit)."""
        if self.lag is not None:
            self.lag.close()
        self.engine.close()
        self.backend.close()


def stale_rows(data: StepData, step: int) -> set[int]:
    """Rows sampled by weights older than step ``step``'s (lagged rollouts; none otherwise)."""
    return {i for i, v in enumerate(data.policy_versions) if v != step}


def sampler_behaviour(data: StepData, start_logps: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per row, the sampler's log-probs of its tokens (whole tempered vocabulary: meshrl.trainer.mismatch), where it
    sampled them all; the update's start log-probs for a row it did not (a forced opening, a trace). A sampled row
    without them is an error: M2PO's ratio would silently be 1 there."""
    unsampled = unsampled_rows(data)
    rows = whole_vocab_rows(data, data.rollout_logps, unsampled, list(range(len(data))))
    out = []
    for i, (r, start) in enumerate(zip(rows, start_logps, strict=True)):
        if i in unsampled:
            out.append(start)
        elif r is None or len(r) != len(start):
            raise ValueError(f"rollout.staleness_correction=m2po: row {i} has {'no' if r is None else len(r)} sampler "
                             f"log-probs for its {len(start)} response tokens (the rollout backend must return them)")
        else:
            out.append(torch.tensor(r, dtype=start.dtype))
    return out
