"""The update's forward/backward in parts: split over forked CPU processes (data parallelism inside one
machine), and rows whose gradient is exactly zero left out of the backward.

On a CPU, one process with ``k`` torch threads leaves much of ``k - 1`` cores idle for a small model: BLAS
threads small matmuls poorly and elementwise ops below torch's parallel grain run on one thread. ``k``
processes with one thread each, every one running a part of each micro-batch, keep every core busy
(tiny:small GRPO update, 64 rollouts, 2 cores: 243-250 ms with 2 threads, 215-226 ms as 2 processes).

A part is a set of whole prompt groups, so the shared-prompt forward still runs each prompt once. Each part
is weighted as a micro-batch of its own (:func:`meshrl.trainer.batch.micro_weight` with the mini-batch's
totals), so the parts' gradients sum to the micro-batch's gradient, up to float rounding of the summation
order. That order is fixed by the run's number of parts, not by how many processes compute them
(:class:`GradSlots`): part ``k`` of every micro-batch accumulates into a flat buffer of its own (a worker's, in
shared memory), added into ``.grad`` after the mini-batch. When the workers die (a signal, the OOM killer) the
parent computes every part in turn, one thread, the same way, so that a run that loses its workers mid-way
still gives bitwise the update it would have given with them (a resume stays exact). Where they cannot start
at the run's first update (no fork, too little shared memory) the run uses one part, as one process would.

The same parts carry the zero-advantage shortcut (also in one process): when the loss is the policy term
alone, a row with advantage 0 has an exactly zero gradient (``A`` times a function of the ratio), so it runs
a no-grad forward for its metrics only. With binary rewards whole groups often score alike (a model that
never closes its answer tag gets reward 0 everywhere, and then every row's backward is wasted work).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.forkpool import ForkPool, check_shared_memory, fork_available

log = logging.getLogger("meshrl")

MAX_DEFAULT_WORKERS = 8
# Auto uses workers only up to this many trainable parameters: every mini-batch hands each worker's gradients
# over through memory (four passes over them), which outweighs the second process on a full fine-tune of
# SmolLM2-135M (update of 8 rollouts: 2.31 s in one process with 2 threads, 2.72 s with 2 processes) but not
# for tiny:small (1M: 243-250 -> 215-226 ms) or SmolLM2 with LoRA r=8 (2.4M trainable: 2.12 -> 1.54 s).
AUTO_MAX_TRAINABLE = 16_000_000


def update_worker_count(setting: int, model: torch.nn.Module) -> int:
    """Processes for the update: ``setting`` (``train.update_workers``) when >= 1, else (0 = auto) one per
    torch thread, at most :data:`MAX_DEFAULT_WORKERS`, when the model has at most :data:`AUTO_MAX_TRAINABLE`
    trainable parameters. Always 1 off the CPU or without ``fork``, and when CUDA is available (torch refuses
    a backward in a process forked after its CUDA autograd threads started)."""
    if (setting == 1 or next(model.parameters()).device.type != "cpu" or not fork_available()
            or torch.cuda.is_available()):
        return 1
    if setting >= 2:
        return setting
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return min(torch.get_num_threads(), MAX_DEFAULT_WORKERS) if trainable <= AUTO_MAX_TRAINABLE else 1


@dataclass
class Shard:
    """A worker's part of a micro-batch, as plain values (pickled through a pipe, no tensor handles)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    advantages: list[float]
    old_logps: list[list[float]] | None
    ref_logps: list[list[float]] | None
    totals: tuple[int, int, int]  # the mini-batch's (tokens, non-empty rows, rows), for micro_weight
    skip_zero: bool = False  # rows with advantage 0 run forward only (decided by the parent)
    keep: int = -1  # ... except this one (index in the shard), when nothing else in the mini-batch has a gradient
    step: int = 0  # the step's index


def split_rows(rows: list[int], prompt_of: list[tuple[int, ...]], cost: list[int], parts: int) -> list[list[int]]:
    """Split ``rows`` into at most ``parts`` shards of similar total ``cost[row]``.

    Rows with the same ``prompt_of[row]`` stay together when there are at least ``parts`` prompts (the
    prompt then runs once), otherwise single rows are dealt. Greedy longest-processing-time order: each
    item, costliest first, goes to the shard with the least cost so far (Graham 1969, within 4/3 of the
    best largest shard). Rows keep their order inside a shard; empty shards are dropped.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in rows:
        groups.setdefault(prompt_of[r], []).append(r)
    items = list(groups.values()) if len(groups) >= parts else [[r] for r in rows]
    items.sort(key=lambda g: (-sum(cost[r] for r in g), g[0]))
    heap = [(0, k) for k in range(parts)]
    shards: list[list[int]] = [[] for _ in range(parts)]
    for g in items:
        load, k = heapq.heappop(heap)
        shards[k].extend(g)
        heapq.heappush(heap, (load + sum(cost[r] for r in g), k))
    return [sorted(s) for s in shards if s]


class GradSlots:
    """Gradient accumulators of parts ``1 .. parts - 1`` of every micro-batch, one flat buffer per part and dtype.

    The reduction order is fixed by the parts, not by the processes that compute them: part 0's gradients
    accumulate in ``.grad`` over the mini-batch's micro-batches, part ``k``'s in slot ``k - 1``, and
    :meth:`collect` adds the slots to ``.grad`` in order at the end of the mini-batch. A worker process fills
    its slot in shared memory; without workers the parent fills them itself (:meth:`run_here`), with the same
    float operations in the same order, so that the update is bitwise the same either way.
    """

    def __init__(self, params: list[torch.nn.Parameter], slots: int, shared: bool):
        self.params = params
        by_dtype: dict[torch.dtype, int] = {}
        for p in params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        self.grads: list[list[torch.Tensor]] = []  # per slot, one view per parameter
        for _ in range(slots):
            flats = {d: torch.zeros(n, dtype=d) for d, n in by_dtype.items()}
            if shared:
                flats = {d: f.share_memory_() for d, f in flats.items()}
            offsets = dict.fromkeys(by_dtype, 0)
            views = []
            for p in params:
                o = offsets[p.dtype]
                views.append(flats[p.dtype][o : o + p.numel()].view_as(p))
                offsets[p.dtype] = o + p.numel()
            self.grads.append(views)
        self.touched: list[set[int]] = [set() for _ in self.grads]

    @staticmethod
    def nbytes(params: list[torch.nn.Parameter], slots: int) -> int:
        return sum(p.numel() * p.element_size() for p in params) * slots

    def take(self, slot: int) -> list[int]:
        """Add the parameters' ``.grad`` (one part's gradients) into ``slot`` and clear them; the indices added."""
        try:
            touched = []
            for i, (p, buf) in enumerate(zip(self.params, self.grads[slot], strict=True)):
                if p.grad is not None:
                    buf.add_(p.grad)
                    touched.append(i)
            return touched
        finally:  # also after a failure: a gradient left here would join a later part
            for p in self.params:
                p.grad = None

    def run_here(self, slot: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a part's backward) in this process with its gradients going to ``slot``; ``.grad`` (part 0's
        sum so far) is set aside meanwhile."""
        kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            result = fn()
            self.touched[slot].update(self.take(slot))
            return result
        finally:
            for p, g in zip(self.params, kept, strict=True):
                p.grad = g

    def begin(self) -> None:
        """Zero the slots before a mini-batch."""
        for views, touched in zip(self.grads, self.touched, strict=True):
            for i in touched:
                views[i].zero_()
            touched.clear()

    def spoil(self) -> None:
        """After a failed call: a part may have added some of its gradients, so every buffer is zeroed next."""
        for touched in self.touched:
            touched.update(range(len(self.params)))

    def collect(self) -> None:
        """Add the slots' gradients of this mini-batch into the parameters' ``.grad``, slot after slot (only for
        parameters a part gave a gradient: one no row reached keeps ``grad=None``, as in one process)."""
        for views, touched in zip(self.grads, self.touched, strict=True):
            for i in sorted(touched):
                p = self.params[i]
                p.grad = views[i].clone() if p.grad is None else p.grad.add_(views[i])


class UpdateWorkers:
    """``workers - 1`` forked processes that run :class:`Shard` backward passes into :class:`GradSlots` in shared
    memory (worker ``k`` computes part ``k + 1`` of each micro-batch into slot ``k``).

    ``run(shard) -> (finite, result)`` is called in a worker with the trainer it inherited at fork time; it
    must leave its gradients in the parameters' ``.grad``. ``result`` (picklable) goes back to the parent.
    """

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter],
                 run: Callable[[Shard], tuple[bool, Any]], workers: int):
        self.params, self.run = params, run
        check_shared_memory(model, GradSlots.nbytes(params, workers - 1))  # a full /dev/shm is a SIGBUS, not an error
        self.slots = GradSlots(params, workers - 1, shared=True)
        self.pool = ForkPool(model, self._remote, workers, name="update")

    @property
    def size(self) -> int:
        return self.pool.size

    def usable(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> bool:
        """True while the workers train ``model``'s current parameters."""
        return (not self.pool.closed and self.pool.serves(model) and len(params) == len(self.params)
                and all(a is b for a, b in zip(params, self.params, strict=True)))

    def _remote(self, slot: int, shard: Shard) -> tuple[bool, Any, list[int]]:
        """In worker ``slot``: run the shard, add its gradients to the slot, say which it touched."""
        try:
            finite, result = self.run(shard)
        except BaseException:
            for p in self.params:  # a gradient left here would join a later part
                p.grad = None
            raise
        return finite, result, self.slots.take(slot)

    def map(self, local: Callable[[], tuple[bool, Any]], shards: list[Shard]) -> list[tuple[bool, Any]]:
        """``[local(), run(shards[0]) in worker 1, ...]``: the first part runs here, with one thread."""
        try:
            replies = self.pool.map(local, [(), *[(k, s) for k, s in enumerate(shards)]])
        except Exception:
            self.slots.spoil()
            raise
        out = [replies[0]]
        for k, (finite, result, touched) in enumerate(replies[1:]):
            self.slots.touched[k].update(touched)
            out.append((finite, result))
        return out

    def close(self) -> None:
        self.pool.close()


def routed_experts(model: torch.nn.Module) -> bool:
    """True for mixture-of-experts configs (a row reaches only the experts its tokens are routed to)."""
    from meshrl.models import base_model

    config = getattr(base_model(model), "config", None)
    return any(getattr(config, k, 0) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
