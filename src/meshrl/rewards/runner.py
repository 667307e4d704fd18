"""``RewardRunner``: run a scorer over a batch with a per-item timeout, clamping and error counting.

Where the scorer runs (``isolation``):

- ``"process"`` (the default on Linux): in a persistent forked child
  (:class:`meshrl.rewards.scorer_process.ScorerProcess`). The limit is a deadline on the child's reply;
  at the deadline the child is SIGKILLed (whatever it is doing, a long C call included) and a fresh one
  is forked for the next item. A scorer that calls ``sys.exit`` or ``os._exit``, or crashes, costs one
  counted error, not the run. The limit holds in any thread. Each reward costs one pipe round trip
  (see ``docs/reliability.md`` for the measured overhead).
- ``"inline"`` (the default elsewhere, and for a problem that cannot be pickled): in this process, with
  a ``signal.setitimer(ITIMER_REAL)`` alarm whose ``SIGALRM`` handler raises inside the scorer (main
  thread only; elsewhere no limit). A signal is only acted on between Python bytecodes, so a single long
  C call finishes first. ``SystemExit`` is caught and counted; ``os._exit`` cannot be.

A timeout, an exception, a non-numeric score or a NaN gives reward 0; a finite score outside [0, 1] is
clamped into it. Each of these counts as an error (timeouts counted separately) and is logged on one
line naming the problem id; ``strict=True`` raises :class:`RewardError` instead.
"""

from __future__ import annotations

import logging
import math
import pickle
import signal
import threading
import time
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

from meshrl.rewards.scorer_process import (
    NonNumber,
    ScorerDied,
    ScorerProcess,
    ScorerRaised,
    ScorerTimeout,
    fork_usable,
)

__all__ = ["ISOLATIONS", "RewardError", "RewardRunner"]

logger = logging.getLogger(__name__)
ISOLATIONS = ("process", "inline")


class RewardError(RuntimeError):
    """A scorer failed, timed out or returned an invalid score while the runner was ``strict``."""


class _ScoreTimeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so a scorer's ``except Exception`` cannot eat it."""


def _raise_timeout(signum: int, frame: object) -> None:
    raise _ScoreTimeout()


def _problem_id(problem: Any) -> str:
    pid = getattr(problem, "id", None)
    if pid is None and isinstance(problem, dict):
        pid = problem.get("id")
    return "?" if pid is None else str(pid)


def _signals_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


#: Seconds a scorer gets beyond its task's own time limit (process start-up, the harness, writing the verdict).
TASK_LIMIT_MARGIN_S = 5.0


def scorer_time_limit(configured: float, task: object) -> float:
    """The per-reward limit to enforce: ``configured``, raised to the task's own limit plus a margin when the task
    runs code under a limit of its own (``task.timeout_s``, e.g. the sandbox of ``humaneval``). Otherwise every
    slow-but-legal program would be cut by the reward limit first and counted as a scorer timeout instead of the
    task's own verdict (a failed test, reward 0)."""
    own = getattr(task, "timeout_s", None)
    if not isinstance(own, Real) or not math.isfinite(own) or own <= 0 or not configured:
        return configured
    needed = float(own) + TASK_LIMIT_MARGIN_S
    if configured < needed:
        logger.info("reward limit raised from %g s to %g s: the task's own limit is %g s", configured, needed, own)
        return needed
    return configured


class RewardRunner:
    """Score ``(completion, problem)`` pairs with ``score_fn`` under a timeout; count failures.

    Args:
        score_fn: ``score_fn(completion, problem) -> float`` in [0, 1] (e.g. ``Task.score``).
        timeout_s: seconds per call; ``None`` or ``0`` disables the limit.
        strict: raise :class:`RewardError` on any failure instead of scoring it 0.
        isolation: ``"process"`` or ``"inline"`` (module docstring); ``None``: ``"process"`` where
            forking is supported, else ``"inline"``.

    ``stats`` accumulates ``{"reward/errors": n, "reward/timeouts": n}`` over calls until
    :meth:`pop_stats` returns and resets it (``errors`` excludes timeouts). :meth:`close` stops the
    scorer process (it also stops when the runner is garbage-collected or the caller exits).
    """

    def __init__(
        self,
        score_fn: Callable[[str, Any], float],
        timeout_s: float | None = 5.0,
        strict: bool = False,
        isolation: str | None = None,
    ) -> None:
        if not callable(score_fn):
            raise ValueError(f"score_fn must be callable, got {type(score_fn).__name__}")
        if timeout_s is not None and (not isinstance(timeout_s, Real) or not math.isfinite(timeout_s) or timeout_s < 0):
            raise ValueError(f"timeout_s must be None or a finite number >= 0, got {timeout_s!r}")
        if isolation is not None and isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS} or None, got {isolation!r}")
        self.score_fn = score_fn
        self.timeout_s = float(timeout_s) if timeout_s else None
        self.strict = bool(strict)
        self.isolation = isolation or ("process" if fork_usable() else "inline")
        self._process = ScorerProcess(score_fn) if self.isolation == "process" else None
        self._lock = threading.Lock()
        self.stats: dict[str, int] = {}
        self.last_failure: str | None = None  # the latest failure's message, for errors that stop a run
        self._reset()

    def _reset(self) -> None:
        self.stats = {"reward/errors": 0, "reward/timeouts": 0}

    def pop_stats(self) -> dict[str, int]:
        """Return the counters accumulated since the last call and reset them to zero."""
        out = dict(self.stats)
        self._reset()
        return out

    def close(self) -> None:
        """Stop the scorer process, if any (the next call starts a new one)."""
        if self._process is not None:
            self._process.close()

    def __call__(self, completions: Sequence[str], problems: Sequence[Any]) -> list[float]:
        """Score ``completions[i]`` against ``problems[i]`` for every i; return rewards in [0, 1]."""
        if isinstance(completions, str) or not isinstance(completions, Sequence):
            raise ValueError(f"completions must be a list of str, got {type(completions).__name__}")
        if isinstance(problems, str) or not isinstance(problems, Sequence):
            raise ValueError(f"problems must be a list, got {type(problems).__name__}")
        if len(completions) != len(problems):
            raise ValueError(f"completions and problems differ in length: {len(completions)} != {len(problems)}")
        return [self.score_one(c, p) for c, p in zip(completions, problems, strict=True)]

    def score_one(self, completion: str, problem: Any) -> float:
        """Score one pair under the runner's rules (timeout, clamping, counting, logging)."""
        try:
            value = self._score(completion, problem)
        except (_ScoreTimeout, ScorerTimeout):
            self.stats["reward/timeouts"] += 1
            return self._fail(problem, f"timed out after {self.timeout_s:g} s", None)
        except SystemExit as exc:  # inline only (the process path reports it as an error below)
            self.stats["reward/errors"] += 1
            return self._fail(problem, f"raised SystemExit({exc.code!r})", exc)
        except ScorerDied as exc:
            self.stats["reward/errors"] += 1
            return self._fail(problem, str(exc), exc)
        except Exception as exc:
            self.stats["reward/errors"] += 1
            name = exc.type_name if isinstance(exc, ScorerRaised) else type(exc).__name__
            return self._fail(problem, f"raised {name}: {exc}", exc)
        return self._check_value(value, problem)

    def _score(self, completion: str, problem: Any) -> Any:
        if self._process is not None:
            with self._lock:
                try:
                    return self._process.score(completion, problem, self.timeout_s)
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    if not _unpicklable(completion, problem):
                        raise
                    logger.debug("problem %s cannot be sent to the scorer process (%s): scoring inline",
                                 _problem_id(problem), exc)
        return self._call_with_timeout(completion, problem)

    def _check_value(self, value: Any, problem: Any) -> float:
        if isinstance(value, NonNumber | bool) or not isinstance(value, Real):
            self.stats["reward/errors"] += 1
            name = value.type_name if isinstance(value, NonNumber) else type(value).__name__
            return self._fail(problem, f"returned a non-number {name}", None)
        try:
            x = float(value)
        except OverflowError:  # an int past float's range (10**400): as far outside [0, 1] as +-inf
            x = math.inf if value > 0 else -math.inf
        if math.isnan(x):
            self.stats["reward/errors"] += 1
            return self._fail(problem, "returned NaN", None)
        if not 0.0 <= x <= 1.0:
            self.stats["reward/errors"] += 1
            clamped = min(max(x, 0.0), 1.0)
            self._fail(problem, f"returned {x!r}, outside [0, 1]; clamped to {clamped:g}", None)
            return clamped
        return x

    def _fail(self, problem: Any, what: str, exc: BaseException | None) -> float:
        msg = f"reward for problem {_problem_id(problem)} {what}"
        self.last_failure = msg
        if self.strict:
            raise RewardError(msg) from exc
        logger.warning(msg)
        return 0.0

    def _call_with_timeout(self, completion: str, problem: Any) -> Any:
        if self.timeout_s is None or not _signals_usable():
            return self.score_fn(completion, problem)
        old_handler = signal.signal(signal.SIGALRM, _raise_timeout)
        start = time.monotonic()
        old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            try:
                return self.score_fn(completion, problem)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay > 0:  # re-arm an outer timer (e.g. a test-suite timeout) with its remaining time
                remaining = max(old_delay - (time.monotonic() - start), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, remaining, old_interval)


def _unpicklable(completion: str, problem: Any) -> bool:
    try:
        pickle.dumps((completion, problem))
    except Exception:
        return True
    return False
