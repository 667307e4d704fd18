"""The single-process training loop: rollouts -> rewards -> advantages -> PPO epochs -> AdamW.

Read top to bottom: :func:`train` builds everything, :meth:`Trainer.step` does one step, and
:meth:`Trainer.update` is the policy-gradient update over mini- and micro-batches.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from meshrl.algos import (
    aggregate,
    js_divergence,
    js_sampled,
    kl_penalty,
    masked_mean,
    policy_loss,
)
from meshrl.doctor.grouping import grouping_metrics
from meshrl.forkpool import WorkerDied
from meshrl.progress import progress_bar
from meshrl.trainer.batch import collate, micro_weight, response_logits, token_entropy, token_logprobs
from meshrl.trainer.checkpoint import restore_checkpoint, rng_state, save_checkpoint
from meshrl.trainer.config import RunConfig, config_record
from meshrl.trainer.failure import NonFiniteAbort, RunHealth, StalledRun, record_stop
from meshrl.trainer.mei_monitor import MeiMonitor
from meshrl.trainer.mesh_support import balance_row_weights, prepare_prefixes, support_backward, support_row_weights
from meshrl.trainer.parallel_update import (
    UpdateWorkers,
    parallel_backward,
    remote_part,
    routed_experts,
    update_worker_count,
)
from meshrl.trainer.periodic_eval import PeriodicEval, write_summary
from meshrl.trainer.plugins import TrainPlugins
from meshrl.trainer.rollout_step import CORRECT_AT, RolloutStep, StepData, strategy_figures
from meshrl.trainer.run_dir import prepare_fresh, prepare_resume, rewind_records, write_config
from meshrl.trainer.runlog import JsonlWriter, Trackers
from meshrl.trainer.schedule import lr_at
from meshrl.trainer.signals import RunInterrupted, StopRequests

__all__ = ["NonFiniteAbort", "StalledRun", "Trainer", "train"]

log = logging.getLogger("meshrl")


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        from meshrl.models import encode_prompt, load_model
        from meshrl.rewards import RewardRunner, scorer_time_limit
        from meshrl.rollout import make_backend
        from meshrl.tasks import load_task

        self.cfg, self.run_dir = cfg, run_dir
        self.recipe = cfg.resolved_recipe()
        torch.manual_seed(cfg.seed)
        self.task = load_task(cfg.task, seed=cfg.seed, **cfg.task_options)
        self.problems = self.task.problems("train")
        self.model, self.tokenizer = load_model(cfg.model, dtype=cfg.train.dtype, seed=cfg.seed)
        self.ref_model = None
        self.balance_on = cfg.mesh_enabled and cfg.balance_mu > 0
        self.paper_balance = self.balance_on and cfg.mesh.balance == "paper"
        self.support_balance = self.balance_on and cfg.mesh.balance == "support"
        needs_ref = (self.recipe.needs_reference or (self.paper_balance and cfg.mesh.subtract_ref)
                     or cfg.plugins.dpo.enabled)
        if cfg.train.lora_r > 0:  # the reference is the adapter-disabled base model
            from meshrl.models import apply_lora

            self.model = apply_lora(self.model, r=cfg.train.lora_r, alpha=cfg.train.lora_alpha)
        elif needs_ref:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.model.eval()  # dropout off: RL log-probs must match the sampling distribution
        self.pad_id = self._pad_id()
        params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        # fused=True: on CPU the default per-tensor loop was 8x slower per step on 135M parameters (benchmarks/).
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=True)
        name = cfg.rollout.backend
        extra = {"workers": cfg.rollout.decode_workers or None} if name in ("auto", "native") else {}
        if name != "vllm":  # the in-process samplers' precision (vllm: its own dtype)
            extra["autocast"] = "bfloat16" if cfg.rollout.autocast_bf16 else None
        self.backend = make_backend(name, self.model, self.tokenizer, batch_size=cfg.rollout.batch_size, **extra)
        log.info("rollout backend: %s (rollout.backend=%s)", self.backend.name, cfg.rollout.backend)
        runner = RewardRunner(self.task.score, timeout_s=scorer_time_limit(cfg.reward.timeout_s, self.task),
                              strict=cfg.reward.strict)
        prefixes = prepare_prefixes(cfg, self.task, self.problems, run_dir) if cfg.mesh_enabled else None
        self.sampler = RolloutStep(task=self.task, problems=self.problems, backend=self.backend,
                                   tokenizer=self.tokenizer, reward_runner=runner, recipe=self.recipe,
                                   cfg=cfg, encode_prompt=encode_prompt, prefixes=prefixes)
        self.evaluator = (PeriodicEval(cfg, self.task, self.tokenizer, self.backend, runner, encode_prompt)
                          if cfg.eval.every > 0 else None)
        per_prefix = cfg.mesh_enabled and cfg.mesh.budget == "per_prefix"
        group = cfg.rollout.group_size * (cfg.mesh.m + cfg.mesh.bare_groups * cfg.mesh.bare_group if per_prefix else 1)
        self.mei = MeiMonitor(cfg, group) if cfg.diag.mei.every > 0 else None
        self.pending_events: list[dict[str, Any]] = []
        self._mei_collect = False
        self.step_idx, self.cursor, self.bad_in_row = 0, 0, 0
        # A checkpoint holds a step boundary: ``dirty`` is True from the moment a step starts changing the
        # trainer until its records are written; ``boundary_rng`` is the RNG state at the start of the step.
        self.dirty, self.boundary_rng, self.saved_step = False, None, None
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        self.health = RunHealth(cfg.failure.max_nonfinite, cfg.failure.max_stalled, vocab)
        self.last_data = StepData()
        self.balance_w: torch.Tensor | None = None  # per-row balancing weights of the current step
        self.support_w: torch.Tensor | None = None
        self.update_workers = update_worker_count(cfg.train.update_workers, self.model)
        self._routed = routed_experts(self.model)
        self._workers: UpdateWorkers | None = None
        self.plugins = TrainPlugins(cfg.plugins, cfg.seed)

    def _pad_id(self) -> int:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            raise ValueError(f"model {self.cfg.model!r}: tokenizer has neither a pad nor an eos token")
        return int(pad)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint the last step boundary (once per step: the state has not changed since)."""
        if self.dirty:
            raise RuntimeError(f"step {self.step_idx}: a checkpoint must hold a step boundary, not a step under way")
        path = self.run_dir / "checkpoints" / f"step_{self.step_idx:06d}"
        if self.saved_step == self.step_idx and path.is_dir():
            return path
        state = {"cursor": self.cursor, "bad_in_row": self.bad_in_row, "stalled_in_row": self.health.stalled_in_row,
                 "mei": self.mei.state_dict() if self.mei else None, "plugins": self.plugins.state_dict(self)}
        path = save_checkpoint(self.run_dir, self.step_idx, self.model, self.optimizer, state,
                               keep_last=self.cfg.checkpoint.keep_last, rng=self.boundary_rng)
        self.saved_step = self.step_idx
        return path

    def end_step(self) -> None:
        """The step's records are written: the trainer is at a step boundary again."""
        self.dirty, self.boundary_rng = False, None

    def restore(self) -> None:
        _, state = restore_checkpoint(self.run_dir, self.model, self.optimizer)
        self.step_idx, self.cursor = int(state["step"]), int(state["cursor"])
        self.bad_in_row = int(state.get("bad_in_row", 0))
        self.health.stalled_in_row = int(state.get("stalled_in_row", 0))
        self.saved_step = self.step_idx
        if self.mei and state.get("mei"):
            self.mei.load_state_dict(state["mei"])
        self.plugins.load_state_dict(self, state.get("plugins"))
        self.backend.sync_weights(self.model)

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.boundary_rng = rng_state()
        # the sampler's rollouts (with plugins.luffy / plugins.replay); no change to the trainer's state yet
        data, cursor = self.plugins.sample(self)
        self.last_data = data
        t1 = time.perf_counter()
        self.dirty = True
        self._set_lr()
        mei_now = bool(self.mei and self.mei.active(self.step_idx) and len(data))
        self._mei_collect = mei_now
        if mei_now:
            self.mei.begin(len(data))
        metrics = self.update(data) if len(data) else {"skipped/empty_batch": 1.0}
        metrics.update(self.plugins.mismatch_metrics(self))  # sampler vs update log-probs (mismatch/*)
        if mei_now:
            mei_metrics, events = self.mei.finish(data, self.step_idx + 1)
            metrics.update(mei_metrics)
            self.pending_events.extend(events)
            self._mei_collect = False
        self.backend.sync_weights(self.model)
        t2 = time.perf_counter()
        self.step_idx, self.cursor = self.step_idx + 1, cursor
        n_tokens = sum(len(p) + len(r) for p, r in zip(data.prompt_ids, data.response_ids, strict=True))
        metrics.update(self._rollout_metrics(data))
        metrics.update(self._strategy_metrics(data))
        metrics.update(data.stats)
        metrics.update({
            "step": self.step_idx,
            "lr": self.optimizer.param_groups[0]["lr"],
            "time/train_s": t2 - t1,
            "time/step_s": t2 - t0,
            "throughput/tokens_per_s": n_tokens / max(t2 - t0, 1e-9),
            **self.sampler.rewards.pop_stats(),
        })
        return metrics

    def _set_lr(self) -> None:
        lr = lr_at(self.cfg.optim, self.step_idx, self.cfg.steps)  # a pure function of the step: resumes exactly
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    @staticmethod
    def _rollout_metrics(data: StepData) -> dict[str, float]:
        if not len(data):  # every group filtered (DAPO): still report the reward and accuracy of what was sampled
            if not data.seen:
                return {}
            return {"reward/mean": data.stats["reward/sampled_mean"],
                    "acc/mean": sum(float(sc >= CORRECT_AT) for _, sc, _ in data.seen) / len(data.seen)}
        scores = torch.tensor(data.scores)
        lengths = torch.tensor([len(r) for r in data.response_ids], dtype=torch.float32)
        return {
            "reward/mean": float(data.rewards.mean()),
            "reward/std": float(data.rewards.std()) if len(data) > 1 else 0.0,
            "score/mean": float(scores.mean()),
            "acc/mean": float((scores >= CORRECT_AT).float().mean()),
            "adv/abs_mean": float(data.advantages.abs().mean()),
            "len/response_mean": float(lengths.mean()),
            "len/response_max": float(lengths.max()),
            "len/truncated_frac": float(torch.tensor(data.truncated, dtype=torch.float32).mean()),
            **grouping_metrics(data.group_ids, data.query_ids, data.strategy_ids, [p.id for p in data.problems],
                               data.rewards.tolist(), data.advantages.tolist()),
        }

    def _strategy_metrics(self, data: StepData) -> dict[str, float]:
        """Strategy masses and accuracy per type over every rollout sampled this step (before a
        dynamic-sampling filter: they describe the policy), and the sampled accuracy."""
        seen = data.seen or list(zip(data.texts, data.scores, data.problems, strict=True))
        if not seen:
            return {}
        return {"acc/sampled_mean": sum(float(sc >= CORRECT_AT) for _, sc, _ in seen) / len(seen),
                **strategy_figures(self.task, seen)}

    # ------------------------------------------------------------------ the update
    def _micro_batches(self, rows: list[int], data: StepData, *, bare: bool = False):
        """``(row indices, MicroBatch)`` of ``rows``; ``bare`` puts each response after its query *without*
        the coach prefix it was sampled under (support balancing scores the unconditioned policy)."""
        size = self.cfg.train.micro_batch_size
        for i in range(0, len(rows), size):
            idx = rows[i : i + size]
            prompts = ([self.sampler.prompt_ids(data.problems[j], -1) for j in idx] if bare
                       else [data.prompt_ids[j] for j in idx])
            yield idx, collate(prompts, [data.response_ids[j] for j in idx], self.pad_id)

    @torch.no_grad()
    def _logps(self, model: torch.nn.Module, data: StepData) -> list[torch.Tensor]:
        """Per-row log-probs ``[T_i]`` of each response under ``model`` (old policy or reference)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(data)
        temp = self.cfg.rollout.temperature
        for idx, mb in self._micro_batches(list(range(len(data))), data):
            lp = token_logprobs(self.logits_of(model, mb), mb.response_ids, temp)
            for k, j in enumerate(idx):
                out[j] = lp[k, : len(data.response_ids[j])].cpu()
        return out

    def logits_of(self, model: torch.nn.Module, mb) -> torch.Tensor:
        """Response logits ``[n, T, V]`` of ``model`` with the configured autocast and prompt sharing."""
        tc = self.cfg.train
        return response_logits(model, mb, tc.autocast_bf16, share_prompts=tc.share_prompts,
                               pack=tc.pack_responses, length_buckets=tc.length_buckets)

    def _reference_forward(self, mb) -> torch.Tensor:
        if self.ref_model is not None:
            return self.logits_of(self.ref_model, mb)
        from meshrl.models import reference_mode

        with reference_mode(self.model):
            return self.logits_of(self.model, mb)

    def update(self, data: StepData) -> dict[str, Any]:
        tc, rec = self.cfg.train, self.recipe
        single_pass = tc.ppo_epochs == 1 and tc.mini_batches == 1
        # With one optimiser step per batch the old policy IS the current one: reuse logp.detach().
        old_logps = None if single_pass and not self.paper_balance else self._logps(self.model, data)
        start_logps = old_logps  # the policy's own at the step's start, or None (plugins.dpo reuses them)
        old_logps = self.plugins.behaviour_logps(data, old_logps)  # plugins.replay: a reused batch's sampler
        need_ref_logp = (rec.kl_coef > 0 or (rec.js_coef > 0 and rec.js_mode == "sampled")
                         or (self.paper_balance and self.cfg.mesh.subtract_ref))
        ref_logps = self._ref_logps(data) if need_ref_logp else None
        self.balance_w, self.support_w, balance_stats = None, None, {}
        if self.support_balance:
            self.support_w, balance_stats = support_row_weights(self, data)
        if self.paper_balance:
            seq = torch.stack([lp.sum() for lp in old_logps])
            ref_seq = torch.stack([lp.sum() for lp in ref_logps]) if self.cfg.mesh.subtract_ref else None
            self.balance_w, balance_stats = balance_row_weights(self.cfg, data, seq, ref_seq)
        balance_stats.update(self.plugins.dpo.begin(self, data, start_logps, ref_logps))  # plugins.dpo: row weights
        sums: dict[str, float] = defaultdict(float)
        n_updates = 0
        gen = torch.Generator().manual_seed(self.cfg.seed * 7 + self.step_idx)
        for _epoch in range(tc.ppo_epochs):
            order = torch.randperm(len(data), generator=gen).tolist() if not single_pass else list(range(len(data)))
            for m in range(tc.mini_batches):
                rows = order[m :: tc.mini_batches]
                if not rows:
                    continue
                ok, mstats = self._mini_batch_update(rows, data, old_logps, ref_logps)
                n_updates += 1
                for k, v in mstats.items():
                    sums[k] += v
                if not ok:
                    return self._skip_step(sums, n_updates)
            self._mei_collect = False  # every rollout has passed through once
        self.bad_in_row = 0
        out = {**{k: v / max(n_updates, 1) for k, v in sums.items()}, **balance_stats}
        if "mesh/balance_loss" in balance_stats and "loss/total" in out:
            out["loss/total"] += balance_stats["mesh/balance_loss"]
        if "dpo/term" in balance_stats and "loss/total" in out:
            out["loss/total"] += balance_stats["dpo/term"]
        return out

    def _ref_logps(self, data: StepData) -> list[torch.Tensor]:
        if self.ref_model is not None:
            return self._logps(self.ref_model, data)
        from meshrl.models import reference_mode

        with reference_mode(self.model):
            return self._logps(self.model, data)

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

    def _mini_batch_update(self, rows, data, old_logps, ref_logps) -> tuple[bool, dict[str, float]]:
        """Accumulate gradients over micro-batches of ``rows``, then clip and step. False if non-finite."""
        lengths = [len(data.response_ids[j]) for j in rows]
        totals = (sum(lengths), sum(1 for x in lengths if x > 0), len(rows))  # micro_weight's mini-batch sizes
        stats: dict[str, float] = defaultdict(float)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer.zero_grad(set_to_none=True)
        workers = self._update_workers(params)
        finite = None
        if workers is not None or (self.skips_zero_advantage() and bool((data.advantages[rows] == 0).any())):
            try:  # in parts (workers None: one part, here)
                finite = parallel_backward(self, workers, rows, data, old_logps, ref_logps, totals, stats)
            except WorkerDied as err:  # e.g. the OOM killer took one: redo this mini-batch here, go on in one process
                log.warning("update: %s; continuing in one process", err)
                self.update_workers = 1
                self.optimizer.zero_grad(set_to_none=True)
                stats.clear()
        if finite is None:
            finite = self._serial_backward(rows, data, old_logps, ref_logps, totals, stats, params)
        if not finite:
            return False, dict(stats)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.max_grad_norm)
        stats["grad/norm"] = float(grad_norm)
        if not torch.isfinite(grad_norm):
            return False, dict(stats)
        self.optimizer.step()
        return True, dict(stats)

    def _serial_backward(self, rows, data, old_logps, ref_logps, totals, stats, params) -> bool:
        """Micro-batches one after another in this process (with the balancing terms when they are on)."""
        balance_grads: list[torch.Tensor] | None = None
        for idx, mb in self._micro_batches(rows, data):
            if mb.num_tokens == 0:
                continue
            finite, mstats, seq_logp, _ = self._backward_micro(idx, mb, data, old_logps, ref_logps, totals)
            if not finite:
                return False
            if self.balance_w is not None:
                balance_grads = self._balance_backward(idx, seq_logp, params, balance_grads)
            for k, v in mstats.items():  # metrics: row-weighted mean over micro-batches
                stats[k] += v * len(idx) / len(rows)
        if self.support_w is not None:
            balance_grads = support_backward(self, rows, data, params, balance_grads)
        if balance_grads is not None:
            stats.update(self._merge_balance_grads(params, balance_grads))
        return True

    def skips_zero_advantage(self) -> bool:
        """Whether rows with advantage 0 may skip their backward (``train.skip_zero_advantage``): only when the
        loss is the policy term alone, no per-step collector needs every row's logits, and every row reaches
        every parameter (not so with routed experts: one kept row would not give them their zero gradient)."""
        rec = self.recipe
        return (self.cfg.train.skip_zero_advantage and rec.kl_coef == 0 and rec.js_coef == 0
                and not self._needs_every_row_here() and not self._routed)

    def _needs_every_row_here(self) -> bool:
        """MEI collection and strategy balancing need every row's logits or graph in this process; the
        ``plugins.*`` terms select tokens by statistics of the whole micro-batch."""
        return (self._mei_collect or self.balance_w is not None or self.support_w is not None
                or self.plugins.changes_loss)

    @torch.no_grad()
    def response_terms(self, mb) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies ``[n, T]`` of a micro-batch, without a graph."""
        temp = self.cfg.rollout.temperature
        logits = self.logits_of(self.model, mb)
        return token_logprobs(logits, mb.response_ids, temp), token_entropy(logits, temp)

    def _backward_micro(self, idx, mb, data, old_logps, ref_logps, totals):
        """Loss of one micro-batch, backward with its :func:`micro_weight`; ``(finite, stats, seq_logp,
        detached per-token (logp, entropy, js or None))``."""
        w = micro_weight(self.recipe.loss_agg, mb.response_mask, *totals)
        loss, mstats, seq_logp, terms = self._micro_loss(idx, mb, data, old_logps, ref_logps)
        # plugins.dpo: sum_i w_i seq_logp_i, unweighted (its weights already give the step's gradient)
        loss = loss * w + self.plugins.dpo.surrogate(idx, seq_logp)
        if not torch.isfinite(loss):
            return False, mstats, seq_logp, terms
        loss.backward(retain_graph=self.balance_w is not None)
        return True, mstats, seq_logp, terms

    def _update_workers(self, params) -> UpdateWorkers | None:
        """The update's worker processes, or None when this mini-batch runs in one process: one worker
        configured, a GPU, or a term that needs every row here (MEI collection, strategy balancing)."""
        if self.update_workers < 2 or self._needs_every_row_here():
            return None
        if self._workers is not None and not self._workers.usable(self.model, params):
            self._workers.close()
            self._workers = None
        if self._workers is None:
            try:
                self._workers = UpdateWorkers(self.model, params, functools.partial(remote_part, self),
                                              self.update_workers)
            except (OSError, RuntimeError) as err:  # no fork, no shared memory (e.g. a tiny /dev/shm)
                log.warning("update: no worker processes (%s); one process", err)
                self.update_workers = 1
                return None
        return self._workers

    def close(self) -> None:
        """Stop the update and decode worker processes (also done at garbage collection and exit)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def _balance_backward(self, idx, seq_logp, params, acc: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Gradient of the balancing surrogate ``sum_j w_j seq_logp_j`` kept apart from the policy term's,
        so that the ratio of their norms can be logged (``mesh/grad_ratio``)."""
        w = self.balance_w[idx].to(seq_logp.dtype).to(seq_logp.device)
        grads = torch.autograd.grad((w * seq_logp).sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        return grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]

    @staticmethod
    def _merge_balance_grads(params, balance_grads: list[torch.Tensor]) -> dict[str, float]:
        policy_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None))
        balance_norm = torch.sqrt(sum((g.float() ** 2).sum() for g in balance_grads))
        for p, g in zip(params, balance_grads, strict=True):
            p.grad = g.clone() if p.grad is None else p.grad + g
        return {"mesh/grad_ratio": float(balance_norm / policy_norm.clamp(min=1e-30)),
                "mesh/balance_grad_norm": float(balance_norm)}

    def _micro_loss(self, idx, mb, data, old_logps, ref_logps):
        """``(total loss, metrics, per-row sum of response log-probs, detached per-token terms)`` of one
        micro-batch; the terms ``(logp, entropy, js or None)`` ``[n, T]`` let a parent process recompute the
        metrics of a micro-batch whose parts ran elsewhere."""
        rec, temp = self.recipe, self.cfg.rollout.temperature
        logits = self.logits_of(self.model, mb)
        logp = token_logprobs(logits, mb.response_ids, temp)
        mask = mb.response_mask
        if not bool(torch.isfinite(logp.detach()[mask > 0]).all()):  # skipped as a non-finite loss is
            nan = torch.tensor(float("nan"))
            return nan, {}, (logp * mask).sum(-1), (logp.detach(), token_entropy(logits.detach(), temp), None)
        if self._mei_collect:
            self.mei.add(idx, logits.detach(), mb.response_ids, mask, temp)
        entropy = token_entropy(logits.detach(), temp)
        js_mat = None
        if rec.js_coef > 0 and rec.js_mode == "exact":
            with torch.no_grad():
                ref_logits = self._reference_forward(mb)
            t = temp if temp > 0 else 1.0
            js_mat = js_divergence(logits / t, ref_logits / t)
        total, stats = self._loss_and_stats(idx, mask, data, logp, entropy, js_mat, old_logps, ref_logps)
        total = self.plugins.extra_loss(self, mb, logits, total, stats)  # plugins.distill
        terms = (logp.detach(), entropy, None if js_mat is None else js_mat.detach())
        return total, stats, (logp * mask).sum(-1), terms

    def _loss_and_stats(self, idx, mask, data, logp, entropy, js_mat, old_logps, ref_logps):
        """The recipe's loss and its metrics from per-token ``logp``, ``entropy`` and (exact JS) ``js_mat``."""
        rec = self.recipe
        old = logp.detach() if old_logps is None else _pad_rows([old_logps[j] for j in idx], logp)
        self.plugins.observe_old(idx, old, mask)  # pi_old of each row's first pass: the mismatch diagnostic
        adv = data.advantages[idx].to(logp.device)
        cfg = {"clip_low": rec.clip_low, "clip_high": rec.clip_high}
        if rec.policy_loss == "ppo_clip":
            cfg["clip_dual"] = rec.clip_dual
        if self.plugins.changes_loss:
            pg_mat, pg_stats, pg_mask = self.plugins.policy_term(self.step_idx, idx, rec.policy_loss, logp, old,
                                                                 adv, mask, entropy, cfg)
        else:
            (pg_mat, pg_stats), pg_mask = policy_loss(rec.policy_loss, logp, old, adv, mask, **cfg), mask
        norm = self.cfg.rollout.max_new_tokens
        pg = aggregate(pg_mat, pg_mask, rec.loss_agg, norm_len=norm)
        total = pg
        stats = {"loss/policy": float(pg.detach()), **{k: float(v) for k, v in pg_stats.items()}}
        stats["entropy/mean"] = float(masked_mean(entropy, mask))
        if rec.kl_coef > 0:
            ref = _pad_rows([ref_logps[j] for j in idx], logp)
            kl = aggregate(kl_penalty(logp, ref, rec.kl_kind), mask, rec.loss_agg, norm_len=norm)
            total = total + rec.kl_coef * kl
            stats["kl/mean"] = float(kl.detach())
        if rec.js_coef > 0:
            if js_mat is None:
                js_mat = js_sampled(logp, _pad_rows([ref_logps[j] for j in idx], logp))
            js = aggregate(js_mat, mask, rec.loss_agg, norm_len=norm)
            total = total + rec.js_coef * js
            stats["js/mean"] = float(js.detach())
        stats["loss/total"] = float(total.detach())
        return total, stats


def _pad_rows(rows: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r.to(like.device)
    return out


# ---------------------------------------------------------------------- entry point
def train(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> list[dict[str, Any]]:
    """Run (or resume) training into ``run_dir``; return the metrics of the steps run now.

    SIGTERM / Ctrl-C finish the step, save it and raise :class:`RunInterrupted`; see ``docs/reliability.md``.
    """
    (prepare_resume if resume else prepare_fresh)(run_dir)
    trainer = Trainer(cfg, run_dir)
    if resume:
        trainer.restore()
        rewind_records(run_dir, trainer.step_idx)
    write_config(config_record(cfg, trainer.task), run_dir)
    writers = {n: JsonlWriter(run_dir / f"{n}.jsonl") for n in ("metrics", "samples", "events", "evals")}
    trackers = Trackers(cfg.log.report_to, run_dir, cfg.to_dict())
    history: list[dict[str, Any]] = []
    with StopRequests() as stops:
        try:
            with progress_bar("train", cfg.steps, cfg.log.progress, start=trainer.step_idx) as advance:
                while trainer.step_idx < cfg.steps and not stops.requested:
                    metrics = _step_and_record(trainer, writers, trackers)
                    history.append(metrics)
                    failure = trainer.health.verdict(metrics, trainer.bad_in_row, run_dir)
                    if failure is not None:
                        raise failure
                    if trainer.step_idx % cfg.checkpoint.every == 0 or trainer.step_idx == cfg.steps:
                        with stops.critical():
                            trainer.save()
                    advance(description=f"reward {metrics.get('reward/mean', float('nan')):.3f} "
                                        f"acc {metrics.get('acc/mean', float('nan')):.3f}")
            if stops.requested:
                raise RunInterrupted(stops.signum)
        except BaseException as err:
            record_stop(trainer, writers["events"], err, stops)
            raise
        finally:
            trainer.close()
            for w in writers.values():
                w.close()
            trackers.close()
            write_summary(run_dir)
    return history


def _step_and_record(trainer: Trainer, writers: dict[str, JsonlWriter], trackers: Trackers) -> dict[str, Any]:
    """One step, its held-out evaluation when due, and its records; the trainer is at a boundary after it."""
    cfg = trainer.cfg
    metrics = trainer.step()
    if trainer.evaluator and (trainer.step_idx % cfg.eval.every == 0 or trainer.step_idx == cfg.steps):
        ev = trainer.evaluator(trainer.step_idx)
        metrics.update(ev)
        writers["evals"].write({"step": trainer.step_idx, **ev})
    _write_samples(writers["samples"], trainer, metrics["step"])
    writers["metrics"].write(metrics)
    trackers.log(metrics, metrics["step"])
    for event in trainer.pending_events:
        writers["events"].write(event)
    trainer.pending_events.clear()
    if "skipped/nonfinite" in metrics:
        writers["events"].write({"step": metrics["step"], "event": "nonfinite_skip"})
    trainer.end_step()
    return metrics


def _write_samples(writer: JsonlWriter, trainer: Trainer, step: int) -> None:
    """Log ``log.samples_per_step`` random rollouts of the step (-1: all of them, e.g. for ``meshrl census``)."""
    data = trainer.last_data
    want = trainer.cfg.log.samples_per_step
    k = len(data) if want < 0 else min(want, len(data))
    if k == 0:
        return
    picks = torch.randperm(len(data), generator=torch.Generator().manual_seed(step))[:k].tolist()
    for i in sorted(picks):
        p, strategy = data.problems[i], data.strategy_ids[i]
        row = {"step": step, "problem_id": p.id, "prompt": trainer.task.format_prompt(p),
               "completion": data.texts[i], "reward": float(data.rewards[i]), "score": data.scores[i],
               "advantage": float(data.advantages[i]), "truncated": data.truncated[i], "strategy": strategy,
               "group_id": data.group_ids[i]}
        if strategy >= 0:  # the coach text the rollout was conditioned on, so it can be re-scored as sampled
            row.update(trainer.sampler.conditioning(p, strategy))
        writer.write(row)
