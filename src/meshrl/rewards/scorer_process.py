"""A persistent forked process that runs a scorer, so that a time limit can always be enforced.

Used by :class:`meshrl.rewards.RewardRunner`. A signal-based limit in the scoring process cannot stop a
single long C call (a 3000x3000 matrix power ran 12.8 s under a 0.5 s limit), and a scorer that calls
``os._exit`` (or ``sys.exit`` past a bare ``except``) would end the whole run. Here the scorer runs in a
child forked once from the caller (so ``score_fn`` and its closures need no pickling; only each
``(completion, problem)`` pair crosses, parent to child) and the parent waits for each reply with a
deadline: at the deadline it SIGKILLs the child's process group and forks a fresh one for the next call.
Replies are plain JSON (a number, a type name or an exception's type and message), never pickle.

The child ignores SIGINT and SIGTERM (a Ctrl-C or a preemption signal is for the trainer, which decides
when to stop; a scorer dying mid-step would change that step's rewards) and dies with its parent
(``PR_SET_PDEATHSIG``). The child runs torch on one thread: the trainer's OpenMP (and MKL) pool does not
survive the fork, and the first parallel region in the child would wait forever for its threads (every
reward of a torch-using scorer then timed out). Other libraries with a thread pool that is not fork-safe
have the same hazard; numpy's OpenBLAS re-initialises its pool after a fork.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import json
import math
import os
import pickle
import signal
import sys
import time
import weakref
from collections.abc import Callable
from numbers import Real
from typing import Any

from meshrl.rewards.fdwait import wait_readable

__all__ = ["NonNumber", "ScorerDied", "ScorerProcess", "ScorerRaised", "ScorerTimeout", "fork_usable"]

_PR_SET_PDEATHSIG = 1


class ScorerTimeout(Exception):
    """The scorer did not answer within the time limit (its process was killed)."""


class ScorerDied(Exception):
    """The scorer's process ended during a call (``os._exit``, a crash, a kill)."""


class ScorerRaised(RuntimeError):
    """The scorer raised an exception that is not a built-in ``Exception`` (``SystemExit``, its own class)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


class NonNumber:
    """What the scorer returned when it was not a real number: only its type name crosses."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def fork_usable() -> bool:
    """Forked scorer processes are used on Linux only (see :func:`meshrl.forkpool.fork_available`)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def _write_all(fd: int, data: bytes) -> None:
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _read_all(fd: int) -> bytes | None:
    def exact(n: int) -> bytes | None:
        chunks = []
        while n:
            chunk = os.read(fd, min(n, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    head = exact(8)
    return None if head is None else exact(int.from_bytes(head, "big"))


def _reply_for(score_fn: Callable[[str, Any], Any], request: bytes) -> dict:
    try:
        completion, problem = pickle.loads(request)  # from the parent, which is trusted
        value = score_fn(completion, problem)
    except BaseException as exc:  # SystemExit included: a scorer must not end the run
        return {"raised": [type(exc).__name__, str(exc)[:2000]]}
    if isinstance(value, bool) or not isinstance(value, Real):
        return {"non_number": type(value).__name__}
    try:
        return {"value": float(value)}
    except OverflowError:  # an int past float's range (10**400): the parent clamps it like +-inf
        return {"value": math.inf if value > 0 else -math.inf}
    except (TypeError, ValueError) as exc:
        return {"raised": [type(exc).__name__, str(exc)[:2000]]}


def _close_pool_pipes() -> None:
    """Close this child's copies of the parent ends of any worker pool's pipes (:mod:`meshrl.forkpool`):
    while a copy stays open here, the pool's workers would never see end-of-file when the pool closes."""
    forkpool = sys.modules.get("meshrl.forkpool")  # not imported here: only a loaded pool has pipes to close
    for conn in list(getattr(forkpool, "_PARENT_ENDS", ())):
        with contextlib.suppress(OSError):
            conn.close()


def _single_threaded_torch() -> None:
    """One intra-op thread for torch in this forked child, if the parent loaded torch: with one thread torch
    runs its kernels inline and never enters the parent's OpenMP pool, whose threads the fork did not copy."""
    torch = sys.modules.get("torch")  # not imported here: a scorer that never uses torch pays nothing
    set_threads = getattr(torch, "set_num_threads", None)
    if set_threads is not None:
        set_threads(1)


def _release_free_heap() -> None:
    """The parent's free C heap pages dropped from this child (:func:`meshrl.forkpool.release_free_heap`), so that
    the parent's later reuse of them does not leave a private copy here."""
    forkpool = sys.modules.get("meshrl.forkpool")
    release = getattr(forkpool, "release_free_heap", None)
    if release is not None:
        release()


def _serve(score_fn: Callable[[str, Any], Any], request_fd: int, reply_fd: int) -> None:
    _close_pool_pipes()
    _single_threaded_torch()
    _release_free_heap()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    while (request := _read_all(request_fd)) is not None:
        _write_all(reply_fd, json.dumps(_reply_for(score_fn, request)).encode())


def _rebuild(type_name: str, message: str) -> BaseException:
    """The scorer's exception as a built-in exception of the same type when there is one (and an
    ``Exception``: a ``SystemExit`` raised by the scorer must not end the caller)."""
    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):  # never SystemExit & co. here, in the parent
        with contextlib.suppress(Exception):
            return cls(message)
    return ScorerRaised(type_name, message)


def _kill(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


class ScorerProcess:
    """``score_fn`` in a forked child; :meth:`score` is one call under a deadline. Not thread-safe (the
    runner holds a lock)."""

    def __init__(self, score_fn: Callable[[str, Any], Any]) -> None:
        self.score_fn = score_fn
        self.pid: int | None = None
        self.fds: tuple[int, int] = (-1, -1)
        self.starts = 0
        self._child: _Child | None = None
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: serve until the parent closes the request pipe, never return
            try:
                os.setpgid(0, 0)
                os.close(request_w)
                os.close(reply_r)
                _serve(self.score_fn, request_r, reply_w)
            finally:
                os._exit(0)
        os.close(request_r)
        os.close(reply_w)
        self.pid, self.fds, self.starts = pid, (request_w, reply_r), self.starts + 1
        self._child = _Child(pid, self.fds)
        self._finalizer = weakref.finalize(self, _shutdown, self._child)

    def close(self) -> None:
        """Stop the child (a later :meth:`score` forks a new one)."""
        if self._finalizer is not None:
            self._finalizer()
        self.pid, self._finalizer = None, None

    def score(self, completion: str, problem: Any, timeout_s: float | None) -> float | NonNumber:
        """``score_fn(completion, problem)`` in the child. Raises :class:`ScorerTimeout`,
        :class:`ScorerDied`, the scorer's exception (rebuilt), or ``pickle`` errors for a problem that
        cannot be sent (before anything runs)."""
        request = pickle.dumps((completion, problem))
        if self.pid is not None and self._ended_between_calls():
            self.close()
        if self.pid is None:
            self._start()
        request_fd, reply_fd = self.fds
        try:
            _write_all(request_fd, request)
        except OSError:
            return self._died()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if wait_readable(reply_fd, left):
                break
            if deadline is not None and time.monotonic() >= deadline:
                self.close()
                raise ScorerTimeout()
        reply = _read_all(reply_fd)
        if reply is None:
            return self._died()
        message = json.loads(reply)
        if "raised" in message:
            raise _rebuild(*message["raised"])
        if "non_number" in message:
            return NonNumber(message["non_number"])
        return float(message["value"])

    def _ended_between_calls(self) -> bool:
        """Whether the idle child is gone (``PR_SET_PDEATHSIG`` fires when the THREAD that forked it ends,
        so a runner first used in a finished thread finds its child killed): not the next item's fault."""
        try:
            ended = os.waitpid(self.pid, os.WNOHANG)[0] != 0  # type: ignore[arg-type]
        except ChildProcessError:
            ended = True
        if ended:
            self._child.reaped = True  # type: ignore[union-attr]
        return ended

    def _died(self) -> float:
        pid = self.pid
        status = None
        if pid is not None:
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(pid, 0)
            self._child.reaped = True  # type: ignore[union-attr]
        self.close()
        how = "" if status is None else (f" (signal {os.WTERMSIG(status)})" if os.WIFSIGNALED(status)
                                         else f" (exit status {os.WEXITSTATUS(status)})")
        raise ScorerDied(f"the scorer's process ended during the call{how}")


class _Child:
    """A forked scorer: its pid, the parent's pipe ends, and whether it was reaped. A reaped child's pid (and
    process group id) is free for the system to reuse, so it is never signalled again."""

    def __init__(self, pid: int, fds: tuple[int, int]) -> None:
        self.pid, self.fds, self.reaped = pid, fds, False


def _shutdown(child: _Child) -> None:
    for fd in child.fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    if not child.reaped:
        _kill(child.pid)
        child.reaped = True
