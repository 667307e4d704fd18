"""``RewardRunner``: run a scorer over a batch with a per-item timeout, clamping and error counting.

Rule: each ``score_fn(completion, problem)`` call gets ``timeout_s`` seconds of wall time. In the main
thread of a POSIX process the limit is a ``signal.setitimer(ITIMER_REAL)`` alarm whose ``SIGALRM``
handler raises inside the scorer (the same mechanism math-verify uses, but with sub-second resolution
and restoring any outer timer). Outside the main thread signals cannot be used, so the scorer runs
WITHOUT a time limit there; exceptions are still caught and counted. A signal is only delivered between
Python bytecodes, so a single long C call (a huge integer power in sympy) finishes before the alarm is
acted on.

A timeout, an exception, a non-numeric score or a NaN gives reward 0; a finite score outside [0, 1] is
clamped into it. Each of these counts as an error (timeouts counted separately) and is logged on one
line naming the problem id; ``strict=True`` raises :class:`RewardError` instead.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

__all__ = ["RewardError", "RewardRunner"]

logger = logging.getLogger(__name__)


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


class RewardRunner:
    """Score ``(completion, problem)`` pairs with ``score_fn`` under a timeout; count failures.

    Args:
        score_fn: ``score_fn(completion, problem) -> float`` in [0, 1] (e.g. ``Task.score``).
        timeout_s: seconds per call; ``None`` or ``0`` disables the limit.
        strict: raise :class:`RewardError` on any failure instead of scoring it 0.

    ``stats`` accumulates ``{"reward/errors": n, "reward/timeouts": n}`` over calls until
    :meth:`pop_stats` returns and resets it (``errors`` excludes timeouts).
    """

    def __init__(
        self,
        score_fn: Callable[[str, Any], float],
        timeout_s: float | None = 5.0,
        strict: bool = False,
    ) -> None:
        if not callable(score_fn):
            raise ValueError(f"score_fn must be callable, got {type(score_fn).__name__}")
        if timeout_s is not None and (not isinstance(timeout_s, Real) or not math.isfinite(timeout_s) or timeout_s < 0):
            raise ValueError(f"timeout_s must be None or a finite number >= 0, got {timeout_s!r}")
        self.score_fn = score_fn
        self.timeout_s = float(timeout_s) if timeout_s else None
        self.strict = bool(strict)
        self.stats: dict[str, int] = {}
        self._reset()

    def _reset(self) -> None:
        self.stats = {"reward/errors": 0, "reward/timeouts": 0}

    def pop_stats(self) -> dict[str, int]:
        """Return the counters accumulated since the last call and reset them to zero."""
        out = dict(self.stats)
        self._reset()
        return out

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
            value = self._call_with_timeout(completion, problem)
        except _ScoreTimeout:
            self.stats["reward/timeouts"] += 1
            return self._fail(problem, f"timed out after {self.timeout_s:g} s", None)
        except Exception as exc:
            self.stats["reward/errors"] += 1
            return self._fail(problem, f"raised {type(exc).__name__}: {exc}", exc)
        return self._check_value(value, problem)

    def _check_value(self, value: Any, problem: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, Real):
            self.stats["reward/errors"] += 1
            return self._fail(problem, f"returned a non-number {type(value).__name__}", None)
        x = float(value)
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
