"""Update engines: how the gradient of one mini-batch is computed, behind one interface.

:class:`SerialEngine` is the plain path: micro-batch after micro-batch in this process, each one's loss
(:class:`meshrl.trainer.loss.Objective`) weighted for exact gradient accumulation and backpropagated, with the
Mesh balancing term's gradient kept apart. :class:`PartsEngine` only makes it faster on a CPU, with the same
gradients up to float rounding (``tests/integration/test_trainer_parallel.py``): each micro-batch is split by prompt
into a fixed number of parts computed by forked worker processes (:mod:`meshrl.trainer.parallel_update`; bitwise
the same result when fewer processes compute them), and rows whose advantage is 0 run a no-grad forward only,
when their gradient is exactly zero. The trainer chooses the engine once per run (:func:`make_engine`):

==========================================================  =================================================
the run                                                     engine
==========================================================  =================================================
an enabled plug-in overrides an update hook                 SerialEngine (``plugins.UPDATE_HOOKS``: the workers
                                                            would not see the state it sets here, nor the
                                                            whole batch; the skip would drop its terms); rows
                                                            with advantage 0 forward only (``freeze_zero``)
                                                            where every such plug-in is
                                                            ``zero_advantage_exact`` (TIS, M2PO) and the
                                                            parts engine's skip conditions hold
one update process (``train.update_workers=1``; auto with   SerialEngine
more than 16M trainable parameters; not a CPU, no fork, a
CUDA build) and no zero-advantage skip
(``train.skip_zero_advantage=false``, a KL or JS term,
routed experts)
otherwise                                                   PartsEngine
==========================================================  =================================================

and the PartsEngine, per mini-batch (:meth:`PartsEngine.backward`):

==========================================================  =================================================
the mini-batch                                              path
==========================================================  =================================================
MEI's first epoch fed from the update (rows without the    serial (every row's logits and graph here)
sampler's features: :mod:`meshrl.trainer.mei_monitor`),
strategy balancing,
multi-turn episodes (environment tokens masked:
``StepData.response_masks``)
two or more parts (``update_workers`` >= 2; one when the     parts: over the workers, or all here in turn when
workers cannot start at the run's first update)             they died (one thread, bitwise the same)
one part, zero-advantage skip, a row with advantage 0       parts: one part here, zero rows forward only
otherwise                                                   serial
==========================================================  =================================================
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.forkpool import WorkerDied
from meshrl.trainer.loss import MiniBatchSizes, Objective, TokenValues, UpdateInputs
from meshrl.trainer.parallel_update import (
    GradSlots,
    Shard,
    UpdateWorkers,
    routed_experts,
    split_rows,
    update_worker_count,
)
from meshrl.trainer.step_data import StepData

log = logging.getLogger("meshrl")


@dataclass(frozen=True)
class StepPlan:
    """What one step's update computes besides the loss, decided before it starts (replaces mutable flags)."""

    collect_mei: bool = False  # feed the MEI monitor from the first epoch's forward (no sampler features)
    balance: bool = False  # strategy-balancing weights are set this step (their term needs every row's graph)

    def every_row_here(self, epoch: int) -> bool:
        """Whether this epoch's micro-batches must run whole in this process."""
        return (self.collect_mei and epoch == 0) or self.balance


class SerialEngine:
    """Micro-batches one after another in this process; with ``freeze_zero``, rows whose advantage is 0 are
    forwarded without a graph (:meth:`Objective.micro_loss_frozen`: the loss still sees their values)."""

    skip_zero = False  # the parts engine's shortcut (its rows split over parts)
    started = False  # no worker processes

    def __init__(self, objective: Objective, balance: Any, mei: Any, *, freeze_zero: bool = False) -> None:
        self.objective, self.forward, self.balance, self.mei = objective, objective.forward, balance, mei
        self.freeze_zero = freeze_zero

    def serial(self, plan: StepPlan, epoch: int) -> bool:
        """Whether a mini-batch of this epoch runs the serial path (always, here)."""
        return True

    def backward(self, rows: list[int], inputs: UpdateInputs, params: list[torch.nn.Parameter],
                 stats: dict[str, float], plan: StepPlan, epoch: int) -> bool:
        """Accumulate the gradient of mini-batch ``rows`` into ``.grad``; add its row-weighted metrics to
        ``stats``. False when a loss or log-prob is not finite."""
        sizes = MiniBatchSizes.of(rows, inputs.data)
        on_logits = self.mei.add_logits if plan.collect_mei and epoch == 0 else None
        freeze = (self.freeze_zero and not plan.every_row_here(epoch) and self.balance.paper_weights is None
                  and not getattr(inputs.data, "response_masks", None))
        keep = kept_row(rows, inputs.data) if freeze else None
        balance_grads: list[torch.Tensor] | None = None
        for idx, mb in self.forward.micro_batches(rows, inputs.data):
            if mb.num_tokens == 0:
                continue
            frozen = frozen_rows(idx, inputs.data, keep) if freeze else set()
            result = (self.objective.micro_loss_frozen(idx, mb, inputs, frozen) if frozen
                      else self.objective.micro_loss(idx, mb, inputs, on_logits))
            loss = self.objective.weighted(idx, mb, result, sizes) if result.finite else result.loss
            if not result.finite or not torch.isfinite(loss):
                return False
            if loss.requires_grad:  # not when every row of this micro-batch is frozen
                loss.backward(retain_graph=self.balance.paper_weights is not None)
            if self.balance.paper_weights is not None:
                balance_grads = self.balance.paper_grads(idx, result.seq_logp, params, balance_grads)
            for k, v in result.stats.items():  # metrics: row-weighted mean over micro-batches
                stats[k] += v * len(idx) / len(rows)
        if self.balance.support_weights is not None:
            balance_grads = self.balance.support_grads(rows, inputs.data, params, balance_grads)
        if balance_grads is not None:
            stats.update(self.balance.merge(params, balance_grads))
        return True

    def close(self) -> None:
        pass


class PartsEngine(SerialEngine):
    """The serial engine's gradients, computed in parts: over forked CPU workers, and without the backward of rows
    whose gradient is exactly zero (module docstring)."""

    def __init__(self, objective: Objective, balance: Any, mei: Any, *, workers: int, skip_zero: bool,
                 group_size: int) -> None:
        super().__init__(objective, balance, mei)
        self.workers_wanted, self.skip_zero, self.group_size = workers, skip_zero, group_size
        self.parts = workers  # per micro-batch, fixed for the run: the reduction order does not follow the processes
        self._workers: UpdateWorkers | None = None
        self._here: GradSlots | None = None  # the parts' buffers when this process computes them all
        self._computed = False  # an update has run in parts (from then on their number stays)

    @property
    def started(self) -> bool:
        return self._workers is not None

    def serial(self, plan: StepPlan, epoch: int) -> bool:
        return plan.every_row_here(epoch)

    def backward(self, rows: list[int], inputs: UpdateInputs, params: list[torch.nn.Parameter],
                 stats: dict[str, float], plan: StepPlan, epoch: int) -> bool:
        if self.serial(plan, epoch) or getattr(inputs.data, "response_masks", None):
            # Multi-turn episodes (environment tokens masked) run here: the parts' shards carry no masks.
            return super().backward(rows, inputs, params, stats, plan, epoch)
        workers = self.workers(params)
        if self.parts > 1 or (self.skip_zero and bool((inputs.data.advantages[rows] == 0).any())):
            try:
                return self._parts_backward(workers, rows, inputs, params, stats)
            except WorkerDied as err:  # e.g. the OOM killer took one: redo this mini-batch here, go on in one process
                log.warning("update: a worker process died (%r); this process computes the %d parts from now on "
                            "(the same result, slower)", err.__cause__, self.parts)
                self.workers_wanted = 1
                self.close()
                for p in params:
                    p.grad = None
                stats.clear()
                return self._parts_backward(None, rows, inputs, params, stats)
        return super().backward(rows, inputs, params, stats, plan, epoch)

    def workers(self, params: list[torch.nn.Parameter]) -> UpdateWorkers | None:
        """The worker processes (started on first use), or None when one process is configured or they could
        not start."""
        if self.workers_wanted < 2:
            return None
        model = self.forward.model
        if self._workers is not None and not self._workers.usable(model, params):
            self._workers.close()
            self._workers = None
        if self._workers is None:
            try:
                self._workers = UpdateWorkers(model, params, functools.partial(_remote_part, self), self.workers_wanted)
            except (OSError, RuntimeError) as err:  # no fork, no shared memory (e.g. a tiny /dev/shm)
                self.workers_wanted = 1
                if not self._computed:  # none computed yet: this machine cannot run workers, one part (all threads)
                    self.parts = 1
                log.warning("update: no worker processes (%s); %s", err, "one process" if self.parts == 1 else
                            f"this process computes the {self.parts} parts (the same result, slower)")
                return None
        return self._workers

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def _parts_backward(self, workers: UpdateWorkers | None, rows: list[int], inputs: UpdateInputs,
                        params: list[torch.nn.Parameter], stats: dict[str, float]) -> bool:
        """Each micro-batch split by prompt into :attr:`parts`, computed over this process and ``workers`` (None:
        all here, in turn), every part weighted as a micro-batch of its own and its gradients summed in a fixed
        order (:class:`GradSlots`); the metrics are computed here from the per-token values the parts send back,
        as the serial path computes them."""
        data, skip = inputs.data, self.skip_zero
        sizes = MiniBatchSizes.of(rows, data)
        keep = kept_row(rows, data) if skip else None
        prompt_of = [tuple(p) for p in data.prompt_ids]
        cost = [(len(p) // max(1, self.group_size) + len(r)) / (3 if skip and a == 0 else 1)
                for p, r, a in zip(data.prompt_ids, data.response_ids, data.advantages.tolist(), strict=True)]
        slots = workers.slots if workers is not None else self._slots_here(params)
        self._computed = True
        if slots is not None:
            slots.begin()
        for i in range(0, len(rows), self.forward.micro_batch_size):
            idx = rows[i : i + self.forward.micro_batch_size]
            parts = split_rows(idx, prompt_of, cost, self.parts) if self.parts > 1 else [idx]
            shards = [self._shard(part, inputs, sizes, keep) for part in parts[1:]]

            def local(here: list[int] = parts[0]) -> tuple[bool, list[TokenValues]]:
                return self.part_backward(here, [data.prompt_ids[j] for j in here],
                                          [data.response_ids[j] for j in here], inputs, sizes,
                                          here.index(keep) if keep in here else -1)

            results = workers.map(local, shards) if workers is not None else self._run_here(slots, local, shards)
            if not all(finite for finite, _ in results):
                return False
            values = {j: v for part, (_, part_values) in zip(parts, results, strict=True)
                      for j, v in zip(part, part_values, strict=True)}
            if not any(len(data.response_ids[j]) for j in idx):
                continue
            for k, v in self._micro_stats(idx, inputs, values).items():
                stats[k] += v * len(idx) / len(rows)
        if slots is not None:
            slots.collect()
        return True

    def _slots_here(self, params: list[torch.nn.Parameter]) -> GradSlots | None:
        """The parts' buffers in this process (None with one part: its gradients go straight to ``.grad``)."""
        if self.parts < 2:
            return None
        if self._here is None or len(self._here.params) != len(params) or any(
                a is not b for a, b in zip(self._here.params, params, strict=True)):
            self._here = GradSlots(params, self.parts - 1, shared=False)
        return self._here

    def _run_here(self, slots: GradSlots | None, local: Callable[[], tuple[bool, Any]],
                  shards: list[Shard]) -> list[tuple[bool, Any]]:
        """Every part of a micro-batch in this process, in turn: part 0 into ``.grad`` and the others into their
        slots, each computed as a worker computes it (its :class:`Shard`, one torch thread), so that the result
        is bitwise the workers'. With one part: ``local()`` as configured (all threads)."""
        if slots is None:
            return [local()]
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            results = [local()]
            for k, shard in enumerate(shards):
                finite, values = slots.run_here(k, functools.partial(_remote_part, self, shard))
                results.append((finite, values))
        except BaseException:
            slots.spoil()
            raise
        finally:
            torch.set_num_threads(saved)
        return results

    def _shard(self, part: list[int], inputs: UpdateInputs, sizes: MiniBatchSizes, keep: int | None) -> Shard:
        data, old, ref = inputs.data, inputs.old_logps, inputs.ref_logps
        return Shard([data.prompt_ids[j] for j in part], [data.response_ids[j] for j in part],
                     data.advantages[part].tolist(), None if old is None else [old[j].tolist() for j in part],
                     None if ref is None else [ref[j].tolist() for j in part],
                     (sizes.tokens, sizes.nonempty_rows, sizes.rows), self.skip_zero,
                     part.index(keep) if keep in part else -1, inputs.step)

    def part_backward(self, idx: list[int], prompts: list[list[int]], responses: list[list[int]],
                      inputs: UpdateInputs, sizes: MiniBatchSizes, keep: int = -1) -> tuple[bool, list[TokenValues]]:
        """Backward of one part; ``(finite, per-row (logp, entropy, js or None))`` for the metrics.

        With the zero-advantage skip, non-empty rows with advantage 0 (except position ``keep``) run a no-grad
        forward only: when the loss is the policy term alone their gradient is exactly zero (every registered
        policy loss is ``A`` times a function of the clamped ratio). Their log-probs are checked as the policy
        loss's input would be (a non-finite one makes the part non-finite: the step is skipped)."""
        lengths = [len(r) for r in responses]
        out: list[TokenValues] = [(torch.empty(0), torch.empty(0), None)] * len(idx)
        zero = ({k for k, j in enumerate(idx)
                 if lengths[k] > 0 and k != keep and float(inputs.data.advantages[j]) == 0.0}
                if self.skip_zero else set())
        finite = True
        for grad in (True, False):
            ks = [k for k in range(len(idx)) if lengths[k] > 0 and (k in zero) != grad]
            if not ks:
                continue
            mb = self.forward.collate([prompts[k] for k in ks], [responses[k] for k in ks])
            sub = [idx[k] for k in ks]
            if grad:
                result = self.objective.micro_loss(sub, mb, inputs)
                loss = self.objective.weighted(sub, mb, result, sizes) if result.finite else result.loss
                ok = result.finite and bool(torch.isfinite(loss))
                if ok:
                    loss.backward()
                finite = finite and ok
                logp, entropy, js = result.values
            else:
                logp, entropy = self.forward.response_terms(mb)
                finite = finite and bool(torch.isfinite(logp).all())  # a NaN log-prob skips the step
                js = None
            for pos, k in enumerate(ks):
                n = lengths[k]
                out[k] = (logp[pos, :n], entropy[pos, :n], None if js is None else js[pos, :n])
        return finite, out

    def _micro_stats(self, idx: list[int], inputs: UpdateInputs, values: dict[int, TokenValues]) -> dict[str, float]:
        """Metrics of micro-batch ``idx`` from its rows' per-token values (tensors, or lists from a worker)."""
        lengths = [len(inputs.data.response_ids[j]) for j in idx]
        width = max(1, *lengths)
        mask = torch.zeros(len(idx), width)
        cols = [torch.zeros(len(idx), width) for _ in range(3)]
        has_js = any(values[j][2] is not None for j in idx)
        for k, (j, n) in enumerate(zip(idx, lengths, strict=True)):
            mask[k, :n] = 1.0
            for c, v in zip(cols, values[j], strict=False):
                if v is not None and n:
                    c[k, :n] = torch.as_tensor(v)
        with torch.no_grad():
            _, mstats = self.objective.token_loss(idx, mask, inputs, cols[0], cols[1], cols[2] if has_js else None)
        return mstats


def _remote_part(engine: PartsEngine, shard: Shard) -> tuple[bool, list[tuple]]:
    """An update worker's part (runs in the worker, on the engine it inherited at fork time)."""
    local = StepData(advantages=torch.tensor(shard.advantages, dtype=torch.float32))
    old = None if shard.old_logps is None else [torch.tensor(x) for x in shard.old_logps]
    ref = None if shard.ref_logps is None else [torch.tensor(x) for x in shard.ref_logps]
    finite, rows = engine.part_backward(list(range(len(shard.prompts))), shard.prompts, shard.responses,
                                        UpdateInputs(local, old, ref, shard.step), MiniBatchSizes(*shard.totals),
                                        shard.keep)
    return finite, [tuple(None if x is None else x.tolist() for x in row) for row in rows]  # plain values for the pipe


def kept_row(rows: list[int], data: Any) -> int | None:
    """The row that keeps its backward when every non-empty row of the mini-batch has advantage 0 (the
    shortest): its zero gradient reaches the parameters, so that AdamW steps them as it would without
    skipping (a parameter with ``grad=None`` is not stepped at all). None when some row has a gradient."""
    live = [j for j in rows if data.response_ids[j]]
    if not live or any(float(data.advantages[j]) != 0.0 for j in live):
        return None
    return min(live, key=lambda j: (len(data.response_ids[j]), j))


def frozen_rows(idx: list[int], data: Any, keep: int | None) -> set[int]:
    """Positions in micro-batch ``idx`` of the non-empty rows with advantage 0 (but row ``keep``: see
    :func:`kept_row`), whose gradient is exactly zero when the loss is the policy term times factors."""
    return {k for k, j in enumerate(idx)
            if len(data.response_ids[j]) > 0 and j != keep and float(data.advantages[j]) == 0.0}


def overridden_update_hooks(plugin: Any) -> list[str]:
    """The update hooks (:data:`meshrl.trainer.plugins.UPDATE_HOOKS`) ``plugin``'s class overrides."""
    from meshrl.trainer.plugins import UPDATE_HOOKS, Plugin

    return [hook for hook in UPDATE_HOOKS if getattr(type(plugin), hook) is not getattr(Plugin, hook)]


def exact_at_zero_advantage(plugin: Any) -> bool:
    """Whether every update hook ``plugin`` overrides is declared ``zero_advantage_exact`` by the class that defines
    it: a subclass that overrides ``transform`` with a term of its own does not inherit its parent's declaration."""
    owners = (next(c for c in type(plugin).__mro__ if hook in vars(c)) for hook in overridden_update_hooks(plugin))
    return all(vars(owner).get("zero_advantage_exact") is True for owner in owners)


def update_hooks(plugins: Any) -> list[str]:
    """``<plug-in name>.<hook>`` for every update hook (:data:`meshrl.trainer.plugins.UPDATE_HOOKS`) an enabled
    plug-in overrides. The parts engine honours none of them: its workers were forked once and do not see state a
    plug-in sets in this process afterwards (begin_update, after_sampling), their loss hooks get a batch of
    advantages only (TokenTerms.batch), the metrics are recomputed here from per-token values without extra_loss,
    and the zero-advantage skip assumes a gradient of A times a function of the ratio (and a plug-in's term may use
    statistics of the whole micro-batch: an entropy quantile, a covariance mean)."""
    return [f"{p.name}.{hook}" for p in plugins.active for hook in overridden_update_hooks(p)]


def make_engine(cfg: Any, recipe: Any, objective: Objective, balance: Any, mei: Any) -> SerialEngine:
    """The run's engine (the module docstring's table): :class:`PartsEngine` when it can make the update faster
    (more than one CPU process, or rows whose zero gradient can be skipped: only when the loss is the policy term
    alone and every row reaches every parameter, not so with routed experts) and no plug-in acts on the update,
    else :class:`SerialEngine`."""
    hooks = update_hooks(objective.plugins)
    model = objective.forward.model
    skip_zero = (cfg.train.skip_zero_advantage and recipe.kl_coef == 0 and recipe.js_coef == 0
                 and not routed_experts(model))
    if hooks:
        freeze = (skip_zero and not objective.reads_logits
                  and all(map(exact_at_zero_advantage, objective.plugins.active)))
        log.info("update: one process, %s (plug-in hooks on the update: %s)",
                 "rows with advantage 0 forward only" if freeze else "every row's backward", ", ".join(hooks))
        return SerialEngine(objective, balance, mei, freeze_zero=freeze)
    workers = update_worker_count(cfg.train.update_workers, model)
    if workers < 2 and not skip_zero:
        return SerialEngine(objective, balance, mei)
    return PartsEngine(objective, balance, mei, workers=workers, skip_zero=skip_zero,
                       group_size=cfg.rollout.group_size)
