"""Forked worker processes that run shards of a computation on the other CPU cores, one torch thread each.

Used for the rollout decode (:mod:`meshrl.rollout.native`) and the update's forward/backward
(:mod:`meshrl.trainer.parallel_update`). Small models on a CPU are op-overhead bound: BLAS runs their
small matmuls on one core and elementwise ops below torch's parallel grain run on one thread, so two
threads in one process measured 1.47x one thread on a tiny:small update where two processes gave 2.0x.
Python threads do not help (every op hands the GIL over).

Weights are not copied per call: the policy's parameters and buffers are moved to shared memory once
(``Module.share_memory``), so the optimiser's in-place updates are what the workers read at the next
call. A worker is sent only the arguments of its shard, as plain Python values (tensors would cross the
pipe through one shared-memory segment each).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import traceback
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger("meshrl")


_FORK_UNSAFE: list[str] = []  # why forking is no longer safe in this process (see forbid_fork)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere, e.g. musl or macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Give the C heap's free pages back to the kernel (glibc ``malloc_trim(0)``; nothing where it is missing).

    A forked process shares its parent's pages until either writes one. glibc keeps freed memory (a finished
    decode's buffers, float32 weights once moved to shared memory) resident in its arenas; a child forked
    with those pages maps them, and the parent's next reuse of them makes the child's copy its own: memory
    counted twice for nothing. Trimming before a fork leaves nothing free to inherit; a worker that trims
    after each call holds only what it uses while it idles (e.g. while the parent runs the update).
    Memory management only: no value changes."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def forbid_fork(reason: str) -> None:
    """From now on :func:`fork_available` is False in this process: callers run their work in one process.

    vLLM's in-process engine starts threads that hold locks (its CPU build also binds OpenMP threads to cores);
    a process forked while one is held waits on that lock forever (seen: a native decode worker forked after
    ``vllm.LLM`` came up sat in ``futex_wait`` and the rollout never returned)."""
    if reason not in _FORK_UNSAFE:
        _FORK_UNSAFE.append(reason)
        log.info("worker processes off in this process: %s", reason)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def set_heap_mmap_threshold(kib: int) -> bool:
    """Serve every C allocation of at least ``kib`` KiB with its own ``mmap`` (glibc ``mallopt(M_MMAP_THRESHOLD)``),
    for the whole process; ``kib=0`` leaves glibc's setting alone. True when applied.

    glibc's default threshold is dynamic: once a block of up to 32 MiB that had its own mapping is freed, blocks of
    that size come from the heap from then on, and freed ones stay there, fragmented (a training step frees and
    allocates tensors of many sizes). On SmolLM2-135M that kept about 2.5 GB of heap resident between steps and
    raised the peak by about 0.5 GB (benchmarks/JOURNAL.md, "Memory, continued"). A fixed threshold gives large
    tensors' pages back on free. Memory management only: no value changes; the cost is a page fault per fresh page of
    a large tensor, which measured ~1.5x slower steps at 128 KiB (decode allocates its logits every token), so it is
    off by default (``train.heap_mmap_kib``)."""
    if kib <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, kib * 1024))


def freeze_objects_before_fork() -> None:
    """Move every Python object alive now into the collector's permanent generation (``gc.freeze``), after one
    collection so that garbage is freed rather than kept.

    The cyclic collector writes into the header of every container object it scans. After a fork, a page the
    parent writes becomes a private copy in the child (and the reverse): each collection in the parent would
    slowly turn the whole inherited heap (modules, the tokenizer, the model's Python objects) into pages counted
    once per process. Frozen objects are never scanned, on either side (the Python documentation's advice for
    ``gc.freeze`` before ``fork``). Cost: an object alive at the fork that later becomes cyclic garbage is not
    collected while frozen, so :class:`ForkPool` unfreezes (``gc.unfreeze``) when its last pool closes: else every
    trainer of a process (a sweep, a test session) stayed alive after it ended, with its model and its shared
    memory's file descriptors (24 per tiny trainer; past 1024 of them select() failed). Memory management only,
    no value changes."""
    gc.collect()
    gc.freeze()


_open_pools = 0  # ForkPools of this process not yet closed: the collector stays frozen while there are any


def _pool_opened() -> None:
    global _open_pools
    _open_pools += 1


def _pool_closed() -> None:
    global _open_pools
    _open_pools -= 1
    if _open_pools == 0:
        gc.unfreeze()  # what was frozen for the workers can be collected again (see freeze_objects_before_fork)


def fork_available() -> bool:
    """Worker processes are forked, which is safe for torch on Linux only (macOS forbids it for some
    system frameworks; Windows has no fork), and only before something that starts lock-holding threads
    (:func:`forbid_fork`)."""
    return (sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods() and not _FORK_UNSAFE
            and not mp.current_process().daemon)  # multiprocessing forbids a daemonic process children


def shared_memory_room(model: torch.nn.Module) -> tuple[int, int]:
    """``(bytes the parameters and buffers need, bytes free in /dev/shm)``. Shared storage lives in /dev/shm;
    running out there kills the process with SIGBUS at the first write instead of raising, so check first
    (containers often give it 64 MB)."""
    need = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if not t.is_shared())
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        free = 0
    return need, free


def check_shared_memory(model: torch.nn.Module, extra: int = 0) -> None:
    """Raise ``RuntimeError`` unless /dev/shm has twice the room for ``model``'s tensors that are not yet shared
    plus ``extra`` bytes (see :func:`shared_memory_room`)."""
    need, free = shared_memory_room(model)
    need += extra
    if need and need * 2 > free:
        raise RuntimeError(f"worker processes need {need / 2**20:.0f} MB of shared memory, /dev/shm has "
                           f"{free / 2**20:.0f} MB free")


class WorkerError(RuntimeError):
    """A worker's call raised; the message holds the worker's traceback. The pool stays usable."""


class WorkerDied(RuntimeError):
    """A worker process ended (killed, crashed); the pool is closed and a new one starts at the next use."""


# Parent-side pipe ends of every pool of this process: a forked worker closes its copies, or a pool whose
# pipe another process still holds open would never see its workers end (no EOF) when it closes.
_PARENT_ENDS: weakref.WeakSet = weakref.WeakSet()


# A scheduler's SIGTERM (and a terminal's Ctrl-C) reaches the whole process group. Workers ignore both: the parent
# decides (the trainer finishes its step with every worker, so that the step computes what it would have without
# the signal) and releases them by closing their pipes. A worker also ends when its parent is gone: EOF on its
# pipe, or, should another process still hold the parent's end open, a new parent process id (checked every
# PARENT_CHECK_S while idle).
PARENT_CHECK_S = 1.0
_PARENTS_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _next_request(conn, parent: int) -> bool:
    """Wait for a request (or EOF, which the following ``recv`` reports); False once the parent has died."""
    while not conn.poll(PARENT_CHECK_S):
        if os.getppid() != parent:
            return False
    return True


def _worker_main(conn, fn: Callable, parent: int) -> None:
    """Serve ``fn(*args)`` requests until the parent closes the pipe (or dies)."""
    for inherited in list(_PARENT_ENDS):
        with contextlib.suppress(OSError):
            inherited.close()
    for sig in _PARENTS_SIGNALS:  # (blocked since before the fork, so none came in between)
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _PARENTS_SIGNALS)
    torch.set_num_threads(1)
    release_free_heap()  # what the parent had freed need not stay mapped here
    while True:
        try:
            if not _next_request(conn, parent):
                return
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", fn(*args))
        except Exception:  # noqa: BLE001 - every failure goes back to the parent with its traceback
            reply = ("error", traceback.format_exc())
        release_free_heap()  # idle between calls with only what is in use
        try:
            conn.send(reply)
        except OSError:  # the parent closed the pipe (interrupted while this worker ran): nothing to report to
            return


def _close_pool(conns: list, procs: list) -> None:
    try:
        _close(conns, procs)
    finally:
        _pool_closed()


def _close(conns: list, procs: list) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()


class ForkPool:
    """``workers - 1`` forked processes; :meth:`map` runs the first call here and the rest there.

    ``fn(*args)`` must be a function of picklable arguments that returns a picklable result; it is
    called in the workers with the objects they inherited at fork time (the model, whose parameters live
    in shared memory, and whatever ``fn`` is bound to). ``name`` is what errors call the workers.
    """

    def __init__(self, model: torch.nn.Module, fn: Callable, workers: int, name: str = "worker"):
        if workers < 2:
            raise ValueError(f"a worker pool needs >= 2 workers, got {workers}")
        if _FORK_UNSAFE:
            raise RuntimeError(f"forking is off in this process ({'; '.join(_FORK_UNSAFE)})")
        if mp.current_process().daemon:
            raise RuntimeError("this is a daemonic process, which multiprocessing allows no children")
        if not fork_available():
            raise RuntimeError("worker processes need the 'fork' start method on Linux")
        check_shared_memory(model)
        model.share_memory()
        freeze_objects_before_fork()
        _pool_opened()
        release_free_heap()  # e.g. the weights' private pages just freed: not to be inherited
        self.model, self.params, self.name = model, list(model.parameters()), name
        self.conns, self.procs = [], []
        try:
            self._fork(fn, workers)
        except BaseException:
            _close_pool(self.conns, self.procs)
            raise
        self._finalizer = weakref.finalize(self, _close_pool, self.conns, self.procs)

    def _fork(self, fn: Callable, workers: int) -> None:
        ctx = mp.get_context("fork")
        parent_pid = os.getpid()
        for _ in range(workers - 1):
            parent, child = ctx.Pipe()
            _PARENT_ENDS.add(parent)  # this worker closes its own copy too (EOF when the parent dies)
            proc = ctx.Process(target=_worker_main, args=(child, fn, parent_pid), daemon=True)
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _PARENTS_SIGNALS)  # delivered here after the fork
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    @property
    def size(self) -> int:
        return len(self.procs) + 1

    def serves(self, model: torch.nn.Module) -> bool:
        """True while the workers read ``model``'s current weights (same module, storage still shared)."""
        params = list(model.parameters())
        return (model is self.model and len(params) == len(self.params)
                and all(a is b and a.is_shared() for a, b in zip(params, self.params, strict=True)))

    def map(self, local: Callable, args_list: list[tuple]) -> list:
        """``[local(*args_list[0]), fn(*args_list[1]) in worker 1, ...]``; at most ``size`` calls.

        A failure reported by a worker raises :class:`WorkerError` with the pool still usable; any
        other exception on the way (Ctrl-C while waiting, a dead worker, an error in ``local``) closes the
        pool first, since replies might then be left in a pipe for the next call to read as its own.
        """
        if len(args_list) > self.size:
            raise ValueError(f"{len(args_list)} shards for {self.size} processes")
        try:
            return self._map(local, args_list)
        except WorkerError:
            raise
        except BaseException:
            self.close()
            raise

    def _map(self, local: Callable, args_list: list[tuple]) -> list:
        for conn, args in zip(self.conns, args_list[1:], strict=False):
            try:
                conn.send(args)
            except OSError as err:  # BrokenPipeError: the worker is gone
                self._died(err)
        saved = torch.get_num_threads()
        torch.set_num_threads(1)  # the workers hold the other cores
        try:
            first = local(*args_list[0])
        finally:
            torch.set_num_threads(saved)
            replies = self._replies(len(args_list) - 1)
        out = [first]
        for status, value in replies:
            if status != "ok":
                raise WorkerError(f"{self.name} worker failed:\n{value}")
            out.append(value)
        return out

    def _replies(self, count: int) -> list:
        """One reply per busy worker (always collected, even when the local shard failed, so that the pipes
        stay in step); a worker that died makes the pool unusable and raises."""
        replies = []
        for conn in self.conns[:count]:
            try:
                replies.append(conn.recv())
            except (EOFError, OSError) as err:
                self._died(err)
        return replies

    def _died(self, err: Exception) -> None:
        self.close()
        raise WorkerDied(f"a {self.name} worker process died ({err!r}); a new one starts at the next call") from err

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
