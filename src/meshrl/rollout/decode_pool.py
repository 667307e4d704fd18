"""Worker processes that decode shards of a rollout batch on the other CPU cores.

A decode step of a small model is a chain of small matmuls that BLAS runs on one core, plus per-op
overhead; Python threads do not help (every op hands the GIL over). Forked worker processes do: each
decodes its own rows with one torch thread while the parent decodes the first shard.

Weights are not copied per call: the policy's parameters and buffers are moved to shared memory once
(``Module.share_memory``), so the optimiser's in-place updates are what the workers read at the next
call. A worker is told nothing but the prompts, the sampling parameters, the seed and where its rows
start; sampling noise depends on ``(seed, row, step)`` only, so the samples are the same whatever the
number of workers.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import shutil
import signal
import sys
import traceback
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger("meshrl")


def fork_available() -> bool:
    """Worker processes are forked, which is safe for torch on Linux only (macOS forbids it for some
    system frameworks; Windows has no fork)."""
    return sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods()


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


class DecodeWorkerError(RuntimeError):
    """A worker's decode raised; the message holds the worker's traceback."""


def _worker_main(conn, decode: Callable) -> None:
    """Serve ``decode(*args)`` requests until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's SIGTERM-as-Ctrl-C handler
    torch.set_num_threads(1)
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", decode(*args)))
        except Exception:  # noqa: BLE001 - every failure goes back to the parent with its traceback
            conn.send(("error", traceback.format_exc()))


def _close(conns: list, procs: list) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()


class DecodePool:
    """``workers - 1`` forked processes; :meth:`map` runs the first call here and the rest there.

    ``decode(*args)`` must be a function of picklable arguments that returns a picklable result; it is
    called in the workers with the objects they inherited at fork time (the model, whose parameters live
    in shared memory).
    """

    def __init__(self, model: torch.nn.Module, decode: Callable, workers: int):
        if workers < 2:
            raise ValueError(f"a decode pool needs >= 2 workers, got {workers}")
        if not fork_available():
            raise RuntimeError("worker processes need the 'fork' start method on Linux")
        need, free = shared_memory_room(model)
        if need and need * 2 > free:
            raise RuntimeError(f"the policy needs {need / 2**20:.0f} MB of shared memory, /dev/shm has "
                               f"{free / 2**20:.0f} MB free")
        model.share_memory()
        self.model, self.params = model, list(model.parameters())
        ctx = mp.get_context("fork")
        self.conns, self.procs = [], []
        for _ in range(workers - 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, decode), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _close, self.conns, self.procs)

    @property
    def size(self) -> int:
        return len(self.procs) + 1

    def serves(self, model: torch.nn.Module) -> bool:
        """True while the workers read ``model``'s current weights (same module, storage still shared)."""
        params = list(model.parameters())
        return (model is self.model and len(params) == len(self.params)
                and all(a is b and a.is_shared() for a, b in zip(params, self.params, strict=True)))

    def map(self, local: Callable, args_list: list[tuple]) -> list:
        """``[local(*args_list[0]), decode(*args_list[1]) in worker 1, ...]``; at most ``size`` calls.

        A failure reported by a worker raises :class:`DecodeWorkerError` with the pool still usable; any
        other exception on the way (Ctrl-C while waiting, a dead worker, an error in ``local``) closes the
        pool first, since replies might then be left in a pipe for the next call to read as its own.
        """
        if len(args_list) > self.size:
            raise ValueError(f"{len(args_list)} shards for {self.size} decoders")
        try:
            return self._map(local, args_list)
        except DecodeWorkerError:
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
                raise DecodeWorkerError(f"decode worker failed:\n{value}")
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
        raise RuntimeError(f"a decode worker process died ({err!r}); it is restarted at the next call") from err

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
