"""meshrl.rewards.RewardRunner: timeouts, exceptions, NaN/out-of-range scores, strict mode, stats."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from dataclasses import dataclass

import pytest

from meshrl.rewards import RewardError, RewardRunner, grade


@dataclass(frozen=True)
class P:
    id: str
    answer: str = "1"


def sleepy(completion: str, problem: P) -> float:
    time.sleep(5.0)
    return 1.0


def spinning(completion: str, problem: P) -> float:
    while True:  # pure-Python busy loop
        pass


def swallowing(completion: str, problem: P) -> float:
    """A scorer that catches every Exception: the timeout must still get through."""
    try:
        time.sleep(5.0)
    except Exception:
        return 1.0
    return 1.0


def raising(completion: str, problem: P) -> float:
    raise KeyError("boom")


def by_completion(completion: str, problem: P) -> float:
    return {"nan": math.nan, "big": 1.5, "neg": -0.25, "half": 0.5, "str": "1"}[completion]  # type: ignore[return-value]


@pytest.mark.parametrize("fn", [sleepy, spinning, swallowing])
def test_timeout_gives_zero_and_counts(fn, caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner(fn, timeout_s=0.2)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="meshrl.rewards.runner"):
        assert runner(["x"], [P("p-7")]) == [0.0]
    assert time.perf_counter() - t0 < 2.0
    assert runner.pop_stats() == {"reward/errors": 0, "reward/timeouts": 1}
    assert "p-7" in caplog.text and "timed out" in caplog.text


def test_exception_gives_zero_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner(raising)
    with caplog.at_level(logging.WARNING, logger="meshrl.rewards.runner"):
        assert runner(["a", "b"], [P("q1"), P("q2")]) == [0.0, 0.0]
    assert runner.pop_stats() == {"reward/errors": 2, "reward/timeouts": 0}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "q1" in lines[0] and "KeyError" in lines[0] and "q2" in lines[1]


def test_nan_out_of_range_and_non_numbers() -> None:
    runner = RewardRunner(by_completion)
    out = runner(["nan", "big", "neg", "half", "str"], [P(str(i)) for i in range(5)])
    assert out == [0.0, 1.0, 0.0, 0.5, 0.0]
    assert runner.pop_stats() == {"reward/errors": 4, "reward/timeouts": 0}


def test_stats_accumulate_until_popped() -> None:
    runner = RewardRunner(raising)
    runner(["a"], [P("1")])
    runner(["a"], [P("2")])
    assert runner.stats["reward/errors"] == 2
    assert runner.pop_stats()["reward/errors"] == 2
    assert runner.pop_stats() == {"reward/errors": 0, "reward/timeouts": 0}


@pytest.mark.parametrize(
    ("fn", "completion", "match"),
    [
        (raising, "a", r"problem s1 raised KeyError"),
        (by_completion, "nan", r"problem s1 returned NaN"),
        (by_completion, "big", r"outside \[0, 1\]"),
        (sleepy, "a", r"problem s1 timed out after 0.2 s"),
    ],
)
def test_strict_raises(fn, completion: str, match: str) -> None:
    runner = RewardRunner(fn, timeout_s=0.2, strict=True)
    with pytest.raises(RewardError, match=match):
        runner([completion], [P("s1")])


def test_strict_chains_the_cause() -> None:
    with pytest.raises(RewardError) as info:
        RewardRunner(raising, strict=True)(["a"], [P("s")])
    assert isinstance(info.value.__cause__, KeyError)


def test_problem_id_from_dict_or_missing(caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner(raising)
    with caplog.at_level(logging.WARNING, logger="meshrl.rewards.runner"):
        runner(["a", "b"], [{"id": "dict-id"}, object()])
    assert "dict-id" in caplog.records[0].getMessage()
    assert "problem ?" in caplog.records[1].getMessage()


def test_with_grade_and_good_scores_no_errors() -> None:
    runner = RewardRunner(lambda c, p: grade(c, p.answer, "number"))
    assert runner(["#### 1", "#### 2", "no answer"], [P("a"), P("b"), P("c")]) == [1.0, 0.0, 0.0]
    assert runner.pop_stats() == {"reward/errors": 0, "reward/timeouts": 0}


def test_restores_signal_handler_and_outer_timer() -> None:
    fired: list[int] = []

    def outer(signum, frame):
        fired.append(signum)

    old = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        RewardRunner(lambda c, p: 1.0, timeout_s=0.5)(["a"], [P("x")])
        assert signal.getsignal(signal.SIGALRM) is outer
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0
        # A short outer timer still fires on time after the runner re-arms it.
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        RewardRunner(lambda c, p: 1.0, timeout_s=5.0)(["a"], [P("x")])
        time.sleep(0.6)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_no_timer_left_armed_after_success() -> None:
    RewardRunner(lambda c, p: 1.0, timeout_s=0.2)(["a"], [P("x")])
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


def test_worker_thread_runs_without_timeout_but_catches_errors() -> None:
    def slow(c: str, p: P) -> float:
        time.sleep(0.3)
        return 1.0

    results: dict[str, object] = {}

    def work() -> None:
        results["slow"] = RewardRunner(slow, timeout_s=0.05)(["a"], [P("t")])
        r = RewardRunner(raising, timeout_s=0.05)
        results["raise"] = r(["a"], [P("t")])
        results["stats"] = r.pop_stats()

    th = threading.Thread(target=work)
    th.start()
    th.join(10)
    assert results["slow"] == [1.0]  # no signal-based timeout off the main thread
    assert results["raise"] == [0.0]
    assert results["stats"] == {"reward/errors": 1, "reward/timeouts": 0}


def test_timeout_disabled() -> None:
    def slow(c: str, p: P) -> float:
        time.sleep(0.2)
        return 1.0

    assert RewardRunner(slow, timeout_s=None)(["a"], [P("x")]) == [1.0]
    assert RewardRunner(slow, timeout_s=0)(["a"], [P("x")]) == [1.0]


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="score_fn"):
        RewardRunner("not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(raising, timeout_s=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(raising, timeout_s=math.inf)
    runner = RewardRunner(raising)
    with pytest.raises(ValueError, match="differ in length"):
        runner(["a", "b"], [P("x")])
    with pytest.raises(ValueError, match="completions"):
        runner("ab", [P("x"), P("y")])  # type: ignore[arg-type]
    assert runner([], []) == []
