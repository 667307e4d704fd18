"""Rollouts with bounded staleness (``rollout.max_staleness = k``): sampling overlapped with the update.

With ``k = 0`` the trainer samples a batch, updates on it, samples the next (:mod:`meshrl.trainer.step`; this
module is not used). With ``k >= 1`` the batch of step ``s`` is sampled from the weights the policy had after
step ``v(s) = max(0, s - k)`` (version ``v``: ``v`` optimiser steps of the trainer; a step with several
mini-batches counts once), while the trainer updates on the batches before it. The lag is *fixed*, not "at most
k": which weights sample which batch never depends on timing, so a run is a pure function of its seed (the same
records on any machine load, after a resume too) and the two producers below give the same numbers.

- **Weights**: after every step the trainer copies its parameters into one slot of a ring of ``k + 1`` weight
  copies in shared memory (:class:`WeightRing`; version ``v`` in slot ``v % (k + 1)``). The sampler copies the slot
  it needs into its own model before a batch. ``k + 1`` slots are enough: when version ``v`` overwrites version
  ``v - k - 1``, the last batch that needed it (``v - 1``) has been received.
- **Producers**: ``process`` (:class:`ProcessProducer`) forks a sampler process that runs the step's sampler
  (:class:`meshrl.trainer.rollout_step.RolloutStep`: problems, rollouts, rewards, advantages) ahead of the trainer,
  on ``rollout.sampler_threads`` cores, the update keeping the rest; ``inline`` (:class:`InlineProducer`) samples
  the same batches in the trainer's process when they are due (no overlap: the semantics, e.g. on a GPU, or where
  forking is unsafe). Both sample under the same thread count, so they agree bit for bit (tested).
- **Checkpoints**: at a step boundary ``t`` the batches ``t .. t+k-1`` (already sampled from versions the
  checkpoint no longer holds) are completed and saved with it (:meth:`LaggedRollouts.state_dict`); a resume
  restores them and samples from ``t + k`` on: the same records as the run that was not stopped. The sampler
  runs k batches past ``steps``, so that the last checkpoint can be continued (``--resume --steps``) exactly too.
- **Failures**: a sampler process that dies is started again at the first batch not yet received (the ring still
  holds every version it needs), at most ``MAX_RESTARTS`` times; one that sends nothing for
  ``rollout.sampler_timeout_s`` ends the run with one line (:class:`SamplerFailed`). While waiting, a line is
  logged every ``WAIT_LOG_S``.

The rows' policy version and staleness are in each step's metrics (``lag/*``, :func:`staleness_metrics`); the
correction for the lag is ``rollout.staleness_correction`` (:func:`staleness_plugins`).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import logging
import multiprocessing as mp
import os
import pickle
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from meshrl.forkpool import check_shared_memory, fork_available, release_free_heap
from meshrl.trainer.step_data import ROW_COLUMNS, StepData

log = logging.getLogger("meshrl")

MAX_RESTARTS = 2  # sampler processes started again after one died, per run, before the run ends
WAIT_LOG_S = 60.0  # a line this often while the trainer waits for the sampler
POLL_S = 0.5  # how often a wait checks that the other process is alive


class SamplerFailed(RuntimeError):
    """The sampler process failed, died too often, or sent nothing for ``rollout.sampler_timeout_s``."""


# ---------------------------------------------------------------------- settings
def check_staleness(cfg: Any) -> None:
    """Raise ``ValueError`` naming the setting that cannot run with ``rollout.max_staleness >= 1``."""
    from meshrl.trainer.plugins import check_lagged, validate_plugins

    if not cfg.rollout.max_staleness:
        return
    check_lagged(cfg.plugins, cfg.rollout.max_staleness)
    corrected = staleness_plugins(cfg, quiet=True)  # the plug-in the correction turns on, checked as if set by hand
    try:
        validate_plugins(corrected.plugins, corrected.resolved_recipe().policy_loss, corrected)
    except ValueError as err:
        raise ValueError(f"rollout.staleness_correction={cfg.rollout.staleness_correction} turns on its plug-in, "
                         f"which this run refuses: {err}") from None


def staleness_plugins(cfg: Any, *, quiet: bool = False) -> Any:
    """``cfg`` with the plug-in that corrects for the lag turned on (``rollout.staleness_correction``): ``tis``
    enables ``plugins.rollout_corr`` (truncated weights ``min(pi_update / pi_sampler, C)``, the user's settings
    of it kept), ``m2po`` enables ``plugins.m2po`` (the ratio taken against the sampler's log-probs); a copy, the
    given config untouched; ``cfg`` itself when ``k = 0`` or ``none``."""
    from meshrl.trainer.plugins import enable_staleness_correction

    k, how = cfg.rollout.max_staleness, cfg.rollout.staleness_correction
    if k == 0 or how == "none":
        return cfg
    out = copy.deepcopy(cfg)
    key = enable_staleness_correction(out.plugins, how)
    if key is not None and not quiet:
        log.info("rollout.max_staleness=%d: %s on (rollout.staleness_correction=%s)", k, key, how)
    return out


def sampler_threads(cfg: Any, total: int) -> int:
    """Torch threads of the sampler: ``rollout.sampler_threads``, else half of ``total`` (at least 1)."""
    want = cfg.rollout.sampler_threads or max(1, total // 2)
    return max(1, min(want, total - 1)) if total > 1 else 1


def producer_kind(cfg: Any, model: torch.nn.Module, backend: Any) -> str:
    """``process`` or ``inline`` (``rollout.sampler_process``; auto: process for a CPU policy where forking is
    safe). A forked process cannot use the parent's CUDA context, and an in-process vLLM engine holds locks."""
    want = cfg.rollout.sampler_process
    cpu = next(model.parameters()).device.type == "cpu"
    can = cpu and fork_available() and backend.name != "vllm"
    if want == "process" and not can:
        raise ValueError("rollout.sampler_process=process needs a CPU policy, the fork start method (Linux) and an "
                         f"in-process sampler (backend {backend.name!r}); use inline or auto")
    return "process" if want == "process" or (want == "auto" and can) else "inline"


# ---------------------------------------------------------------------- weights
class WeightRing:
    """``slots`` copies of a model's parameters and buffers in shared memory; version ``v`` lives in slot
    ``v % slots``. The trainer writes (:meth:`publish`), the sampler reads (:meth:`load`); no pickling, no copy
    through a pipe."""

    def __init__(self, model: torch.nn.Module, slots: int, *, shared: bool = True) -> None:
        if shared:  # a forked sampler reads it; the inline producer (and a GPU) needs no shared memory
            check_shared_memory(model, extra=_state_bytes(model) * slots)
        self.slots = slots
        self.buffers = [[t.detach().clone() for t in _tensors(model)] for _ in range(slots)]
        if shared:
            for slot in self.buffers:
                for t in slot:
                    t.share_memory_()

    def publish(self, model: torch.nn.Module, version: int) -> None:
        slot = version % self.slots
        with torch.no_grad():
            for dst, src in zip(self.buffers[slot], _tensors(model), strict=True):
                dst.copy_(src)

    def load(self, version: int, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for dst, src in zip(_tensors(model), self.buffers[version % self.slots], strict=True):
                dst.copy_(src)


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(model))


def private_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The sampler's own model: a deep copy (private storage even where ``model``'s is shared), no gradients."""
    out = copy.deepcopy(model)
    for p in out.parameters():
        p.requires_grad_(False)
    return out.eval()


# ---------------------------------------------------------------------- batches on the wire and in checkpoints
def _array(a: Any) -> dict[str, Any] | None:
    if a is None:
        return None
    arr = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return {"dtype": str(arr.dtype), "shape": list(arr.shape),
            "b64": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")}


def _unarray(obj: dict[str, Any] | None) -> np.ndarray | None:
    if obj is None:
        return None
    return np.frombuffer(base64.b64decode(obj["b64"]), dtype=obj["dtype"]).reshape(obj["shape"]).copy()


def batch_to_json(data: StepData) -> dict[str, Any]:
    """A sampled batch as JSON, exactly (floats of the rewards, advantages and features as raw bytes): what the
    sampler process sends and a checkpoint keeps. Every row column (:data:`ROW_COLUMNS`); problems by id."""
    obj: dict[str, Any] = {}
    for column in ROW_COLUMNS.values():
        values = getattr(data, column)
        if column == "problems":
            values = [str(p.id) for p in values]
        elif column == "group_ids":
            values = [list(g) if isinstance(g, tuple) else g for g in values]
        elif column == "rollout_features":
            values = [_array(f) for f in values]
        obj[column] = list(values)
    obj["rewards"], obj["advantages"] = _array(data.rewards), _array(data.advantages)
    obj["stats"] = dict(data.stats)
    obj["seen"] = [[text, score, str(p.id)] for text, score, p in data.seen]
    obj["policy_versions"] = list(data.policy_versions)
    return obj


def batch_from_json(obj: dict[str, Any], problems: dict[str, Any]) -> StepData:
    """The inverse of :func:`batch_to_json`; ``problems`` maps id -> problem."""
    def problem(pid: str) -> Any:
        if pid not in problems:
            raise ValueError(f"lagged batch: problem {pid!r} is not among the task's training problems (was the run "
                             "resumed with another task or task seed?)")
        return problems[pid]

    data = StepData()
    for column in ROW_COLUMNS.values():
        values = obj[column]
        if column == "problems":
            values = [problem(pid) for pid in values]
        elif column == "group_ids":
            values = [tuple(g) if isinstance(g, list) else g for g in values]
        elif column == "rollout_features":
            values = [_unarray(f) for f in values]
        setattr(data, column, list(values))
    for name in ("rewards", "advantages"):
        arr = _unarray(obj[name])
        setattr(data, name, None if arr is None else torch.from_numpy(arr))
    data.stats = dict(obj["stats"])
    data.seen = [(text, score, problem(pid)) for text, score, pid in obj["seen"]]
    data.policy_versions = list(obj["policy_versions"])
    return data


@dataclass
class Sampled:
    """One batch from a producer: the step it is for, the batch (JSON), the cursor after it, the reward runner's
    counters and last failure while sampling it."""

    step: int
    batch: dict[str, Any]
    cursor: int
    reward_stats: dict[str, Any] = field(default_factory=dict)
    reward_failure: str | None = None


def sample_batch(sampler: Any, model: torch.nn.Module, ring: WeightRing, k: int, step: int, cursor: int,
                 threads: int) -> Sampled:
    """Batch ``step`` from the weights of version ``max(0, step - k)`` (loaded from ``ring`` into ``model``, the
    sampler's own), on ``threads`` cores: what both producers run.

    One torch thread, always: OpenMP's thread pool does not survive a fork (a forked sampler's first parallel region
    can wait forever on the pool of the process it was forked from), so a sampler's cores are the native decoder's
    worker processes (``workers = threads``, each on one thread, as :mod:`meshrl.forkpool` runs them); another
    backend samples on one thread. The same counts in both producers: the decoder's row shards round the logits by
    their shapes, so different counts would give different batches."""
    version = max(0, step - k)
    ring.load(version, model)
    backend = sampler.backend
    backend.sync_weights(model)
    saved = torch.get_num_threads()
    saved_workers = getattr(backend, "workers", None)
    if saved_workers is not None and not sampler.cfg.rollout.decode_workers:
        backend.workers = threads
    torch.set_num_threads(1)
    try:
        data, cursor = sampler.run(step, cursor)
    finally:
        torch.set_num_threads(saved)
        if saved_workers is not None:
            backend.workers = saved_workers
    data.policy_versions = [version] * len(data)
    return Sampled(step, batch_to_json(data), cursor, sampler.rewards.pop_stats(),
                   getattr(sampler.rewards, "last_failure", None))


# ---------------------------------------------------------------------- producers
class InlineProducer:
    """Samples batch ``s`` in the trainer's process when it is asked for (no overlap; same numbers)."""

    kind = "inline"

    def __init__(self, sampler: Any, model: torch.nn.Module, ring: WeightRing, k: int, threads: int) -> None:
        self.sampler, self.ring, self.k, self.threads = sampler, ring, k, threads
        self.policy, self.model = model, private_copy(model)
        self.next_step, self.cursor, self.stop = 0, 0, 0

    def start(self, step: int, cursor: int, stop: int, published: int) -> None:
        self.next_step, self.cursor, self.stop = step, cursor, stop

    def published(self, version: int) -> None:
        """Nothing to tell: the ring is read when a batch is due."""

    def receive(self) -> Sampled:
        # A backend may seed torch's global generator; the process producer never touches the trainer's, so
        # neither may this one (the two must agree).
        with torch.random.fork_rng(devices=[]):
            try:
                out = sample_batch(self.sampler, self.model, self.ring, self.k, self.next_step, self.cursor,
                                   self.threads)
            finally:
                self.sampler.backend.sync_weights(self.policy)  # the evaluation samples from the trainer's policy
        self.next_step, self.cursor = self.next_step + 1, out.cursor
        return out

    def close(self) -> None:
        """Nothing runs apart from the trainer."""


class ProcessProducer:
    """A forked sampler process that runs ahead of the trainer (module docstring); restarted when it dies."""

    kind = "process"

    def __init__(self, sampler: Any, model: torch.nn.Module, ring: WeightRing, k: int, threads: int,
                 timeout_s: float) -> None:
        self.sampler, self.model, self.ring, self.k, self.threads = sampler, model, ring, k, threads
        self.timeout_s, self.restarts = timeout_s, 0
        self.proc: Any = None
        self.conn: Any = None
        self.next_step, self.cursor, self.stop, self.published_version = 0, 0, 0, 0

    def start(self, step: int, cursor: int, stop: int, published: int) -> None:
        """Fork the sampler to produce batches ``step .. stop - 1`` from ``cursor`` on; versions up to
        ``published`` are in the ring."""
        self.close()
        self.next_step, self.cursor, self.stop, self.published_version = step, cursor, stop, published
        if step >= stop:
            return
        # The child must not inherit the trainer's decode workers or reward scorer (their pipes are the trainer's):
        # they are started again on demand, in whichever process samples next.
        self.sampler.backend.release_workers()
        self.sampler.rewards.close()
        release_free_heap()
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        args = (child, os.getpid(), self.sampler, self.model, self.ring, self.k, self.threads, step, cursor, stop,
                published)
        # Not a daemon: the sampler may start its own scorer or decode processes. It ends with the trainer (EOF on
        # its pipe, or a new parent id) and ignores the signals the trainer handles (the trainer decides).
        proc = ctx.Process(target=_sampler_main, args=args, name="meshrl-sampler", daemon=False)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self.proc, self.conn = proc, parent

    def published(self, version: int) -> None:
        self.published_version = version
        if self.conn is not None:
            with contextlib.suppress(OSError):  # the sampler is gone: receive() restarts it
                self.conn.send(("version", version))

    def receive(self) -> Sampled:
        """The next batch, in order; a dead sampler is restarted, a silent one ends the run."""
        if self.conn is None:
            self.start(self.next_step, self.cursor, self.stop, self.published_version)
        waited, last_line = 0.0, 0.0
        while True:
            try:
                ready = self.conn.poll(POLL_S)
            except (OSError, EOFError):
                ready = False
            if ready:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    msg = None
                except Exception as err:  # noqa: BLE001 - a message that does not unpickle
                    self.close()
                    raise SamplerFailed(f"the sampler sent what cannot be read ({err!r})") from err
                if msg is not None:
                    return self._accept(msg)
            if not self.proc.is_alive() or (ready and msg is None):
                self._restart(f"the sampler process ended (exit code {self.proc.exitcode})")
                waited = last_line = 0.0
                continue
            waited += POLL_S
            if waited - last_line >= WAIT_LOG_S:
                last_line = waited
                log.info("waiting for the sampler: batch of step %d, %.0f s so far", self.next_step + 1, waited)
            if waited >= self.timeout_s:
                self.close()
                raise SamplerFailed(f"the sampler sent nothing for {waited:.0f} s (batch of step {self.next_step + 1};"
                                    f" rollout.sampler_timeout_s={self.timeout_s:g}): stopped")

    def _accept(self, msg: tuple) -> Sampled:
        if msg[0] == "error":
            _, step, exc, text = msg
            self.close()
            if isinstance(exc, Exception):
                raise exc from SamplerFailed(f"the sampler failed at the batch of step {step + 1}:\n{text}")
            raise SamplerFailed(f"the sampler failed at the batch of step {step + 1}:\n{text}")
        out: Sampled = msg[1]
        if out.step != self.next_step:
            raise SamplerFailed(f"the sampler sent the batch of step {out.step + 1}, expected {self.next_step + 1}")
        self.next_step, self.cursor = out.step + 1, out.cursor
        return out

    def _restart(self, why: str) -> None:
        self.close()
        if self.restarts >= MAX_RESTARTS:
            raise SamplerFailed(f"{why}; already restarted {self.restarts} times: stopped")
        self.restarts += 1
        log.warning("%s; starting it again at the batch of step %d (restart %d of %d)", why, self.next_step + 1,
                    self.restarts, MAX_RESTARTS)
        self.start(self.next_step, self.cursor, self.stop, self.published_version)

    def close(self) -> None:
        if self.conn is not None:
            # Said, not only closed: a process forked from the trainer later (an evaluation's decode workers) may
            # hold a copy of this end, and then the sampler would never see EOF.
            with contextlib.suppress(OSError):
                self.conn.send(("stop", 0))
            with contextlib.suppress(OSError):
                self.conn.close()
            self.conn = None
        if self.proc is not None:
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
            self.proc = None


def _sampler_main(conn: Any, parent: int, sampler: Any, policy: torch.nn.Module, ring: WeightRing, k: int,
                  threads: int, step: int, cursor: int, stop: int, published: int) -> None:
    """The sampler process: batches ``step .. stop - 1`` in order, each as soon as its version is published."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    torch.set_num_threads(1)  # see sample_batch: never an OpenMP pool in a forked process
    model = private_copy(policy)  # the trainer keeps changing ``policy`` (possibly in shared memory)
    release_free_heap()
    while step < stop:
        need = max(0, step - k)
        while published < need:
            while not conn.poll(POLL_S):
                if os.getppid() != parent:
                    return
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                return
            if kind == "stop":
                return
            published = max(published, int(value))  # kind == "version"
        try:
            out = sample_batch(sampler, model, ring, k, step, cursor, threads)
        except Exception as exc:  # noqa: BLE001 - sent to the trainer, which raises it
            text = traceback.format_exc()
            try:  # the round trip the trainer's recv makes: some exceptions pickle but do not unpickle
                sent: Exception | None = pickle.loads(pickle.dumps(exc))
            except Exception:  # noqa: BLE001 - then its text alone
                sent = None
            with contextlib.suppress(Exception):
                conn.send(("error", step, sent, text))
            return
        try:
            conn.send(("batch", out))
        except OSError:
            return
        step, cursor = step + 1, out.cursor
    with contextlib.suppress(EOFError, OSError):  # done: wait for the trainer to say stop (or go)
        while True:
            while not conn.poll(POLL_S):
                if os.getppid() != parent:
                    return
            if conn.recv()[0] == "stop":
                return


# ---------------------------------------------------------------------- the trainer's side
class LaggedRollouts:
    """The trainer's lagged batches: ``next_batch(s)`` returns the batch of step ``s`` (sampled from version
    ``max(0, s - k)``), ``publish(model, v)`` after each step; checkpoints keep the batches sampled ahead."""

    def __init__(self, cfg: Any, sampler: Any, model: torch.nn.Module, problems: list[Any]) -> None:
        self.k = cfg.rollout.max_staleness
        # Batches up to step ``steps + k - 1``: the last checkpoint holds the k batches after it, so that a run
        # continued to a larger total (``--resume --steps``) is the run that was never stopped (k batches' cost).
        self.steps = cfg.steps + self.k
        total = torch.get_num_threads()
        self.threads = sampler_threads(cfg, total)
        self.update_threads = max(1, total - self.threads)
        self.problems = {str(p.id): p for p in problems}
        kind = producer_kind(cfg, model, sampler.backend)
        self.ring = WeightRing(model, self.k + 1, shared=kind == "process")
        self.ring.publish(model, 0)
        if kind == "process":
            self.producer: Any = ProcessProducer(sampler, model, self.ring, self.k, self.threads,
                                                 cfg.rollout.sampler_timeout_s)
        else:
            self.producer = InlineProducer(sampler, model, self.ring, self.k, self.threads)
        self.saved_threads = total
        self.failed: str | None = None  # why the sampler failed: no checkpoint waits for it again
        self.ready: dict[int, Sampled] = {}
        self.started = False
        self.first_cursor, self.published_version = 0, 0
        torch.set_num_threads(self.update_threads)  # the update's share of the cores (the sampler has the rest)
        log.info("rollouts lagged by %d step(s): %s sampler on %d thread(s), update on %d", self.k, kind,
                 self.threads, self.update_threads)

    def _ensure_started(self, step: int, cursor: int) -> None:
        if not self.started:
            first = step + len(self.ready)
            self.producer.start(first, self.first_cursor if self.ready else cursor, self.steps, self.published_version)
            self.started = True

    def next_batch(self, step: int, cursor: int) -> tuple[StepData, int, Sampled]:
        """The batch of step ``step`` and the cursor after it (``cursor``: the trainer's, used when nothing was
        sampled ahead yet), and its record (reward counters)."""
        self._ensure_started(step, cursor)
        while step not in self.ready:
            self._receive()
        out = self.ready.pop(step)
        return batch_from_json(out.batch, self.problems), out.cursor, out

    def _receive(self) -> None:
        try:
            got = self.producer.receive()
        except Exception as err:
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            raise
        self.ready[got.step] = got

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The trainer finished step ``version - 1``: its weights are version ``version``."""
        self.ring.publish(model, version)
        self.published_version = version
        self.producer.published(version)

    def state_dict(self, step: int, cursor: int) -> dict[str, Any]:
        """At the boundary before step ``step``: the batches ``step .. step+k-1`` (sampled ahead, from versions
        the checkpoint does not hold), completed now, and the cursor after them."""
        if self.failed is not None:
            raise SamplerFailed(f"no checkpoint of step {step}: the sampler failed ({self.failed}); the last "
                                "checkpoint stands")
        self._ensure_started(step, cursor)
        last = step + self.k
        while any(s not in self.ready for s in range(step, last)):
            self._receive()
        kept = [self.ready[s] for s in range(step, last)]
        return {"k": self.k, "batches": [{"step": b.step, "cursor": b.cursor, "batch": b.batch,
                                          "reward_stats": b.reward_stats, "reward_failure": b.reward_failure}
                                         for b in kept]}

    def load_state_dict(self, state: dict[str, Any] | None, step: int, cursor: int) -> None:
        """Resume at the boundary before ``step`` (the trainer then publishes its restored weights as version
        ``step``): the saved batches, then sampling from the next on."""
        if not state:
            if step > 0:
                raise ValueError(f"the checkpoint of step {step} holds no lagged batches; it was written with "
                                 "rollout.max_staleness=0: resume with that setting")
            return
        if int(state["k"]) != self.k:
            raise ValueError(f"the checkpoint was written with rollout.max_staleness={state['k']}, this run has "
                             f"{self.k}: resume with the same setting")
        self.ready = {int(b["step"]): Sampled(int(b["step"]), b["batch"], int(b["cursor"]),
                                              dict(b["reward_stats"]), b["reward_failure"])
                      for b in state["batches"]}
        self.first_cursor = max(self.ready.values(), key=lambda b: b.step).cursor if self.ready else cursor

    def close(self) -> None:
        self.producer.close()
        torch.set_num_threads(self.saved_threads)


def staleness_metrics(data: StepData, step: int) -> dict[str, float]:
    """``lag/policy_version`` (mean over rows), ``lag/staleness_mean`` / ``_max`` (trainer steps between the
    sampling weights and the update's: optimiser steps only with one mini-batch and one epoch) and
    ``lag/staleness/<d>``: the share of rows ``d`` steps stale."""
    versions = data.policy_versions
    if not versions:
        return {}
    ages = [step - v for v in versions]
    out = {"lag/policy_version": float(np.mean(versions)), "lag/staleness_mean": float(np.mean(ages)),
           "lag/staleness_max": float(max(ages))}
    for d in sorted(set(ages)):
        out[f"lag/staleness/{d}"] = ages.count(d) / len(ages)
    return out
