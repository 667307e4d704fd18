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


@pytest.mark.parametrize("isolation", ["process", "inline"])
@pytest.mark.parametrize("fn", [sleepy, spinning, swallowing])
def test_timeout_gives_zero_and_counts(fn, isolation: str, caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner(fn, timeout_s=0.2, isolation=isolation)
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


def test_restores_signal_handler_and_outer_timer() -> None:  # the inline path
    fired: list[int] = []

    def outer(signum, frame):
        fired.append(signum)

    old = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        RewardRunner(lambda c, p: 1.0, timeout_s=0.5, isolation="inline")(["a"], [P("x")])
        assert signal.getsignal(signal.SIGALRM) is outer
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0
        # A short outer timer still fires on time after the runner re-arms it.
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        RewardRunner(lambda c, p: 1.0, timeout_s=5.0, isolation="inline")(["a"], [P("x")])
        time.sleep(0.6)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_no_timer_left_armed_after_success() -> None:
    RewardRunner(lambda c, p: 1.0, timeout_s=0.2, isolation="inline")(["a"], [P("x")])
    RewardRunner(lambda c, p: 1.0, timeout_s=0.2, isolation="process")(["a"], [P("x")])
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_worker_thread(isolation: str) -> None:
    def slow(c: str, p: P) -> float:
        time.sleep(0.3)
        return 1.0

    results: dict[str, object] = {}

    def work() -> None:
        r = RewardRunner(slow, timeout_s=0.05, isolation=isolation)
        results["slow"] = r(["a"], [P("t")])
        results["slow_stats"] = r.pop_stats()
        r = RewardRunner(raising, timeout_s=0.05, isolation=isolation)
        results["raise"] = r(["a"], [P("t")])
        results["stats"] = r.pop_stats()

    th = threading.Thread(target=work)
    th.start()
    th.join(10)
    if isolation == "process":  # the deadline holds in any thread
        assert results["slow"] == [0.0] and results["slow_stats"] == {"reward/errors": 0, "reward/timeouts": 1}
    else:  # no signal-based timeout off the main thread
        assert results["slow"] == [1.0]
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
    with pytest.raises(ValueError, match="isolation"):
        RewardRunner(raising, isolation="thread")
    runner = RewardRunner(raising)
    with pytest.raises(ValueError, match="differ in length"):
        runner(["a", "b"], [P("x")])
    with pytest.raises(ValueError, match="completions"):
        runner("ab", [P("x"), P("y")])  # type: ignore[arg-type]
    assert runner([], []) == []


def matrix_power(completion: str, problem: P) -> float:
    """One long C call: a signal cannot interrupt it."""
    import numpy as np

    m = np.random.default_rng(0).random((3000, 3000))
    np.linalg.matrix_power(m, 64)
    return 1.0


def exiting(completion: str, problem: P) -> float:
    import os
    import sys

    if completion == "sys.exit":
        sys.exit(0)
    if completion == "sys.exit bare except":
        try:
            sys.exit(3)
        except SystemExit:
            raise
    if completion == "os._exit":
        os._exit(0)
    return 0.5


def test_long_c_call_is_stopped_at_the_timeout() -> None:
    runner = RewardRunner(matrix_power, timeout_s=0.5)
    t0 = time.perf_counter()
    assert runner(["x"], [P("mp")]) == [0.0]
    assert time.perf_counter() - t0 < 1.5  # the inline alarm waited 12.8 s for this call
    assert runner.pop_stats() == {"reward/errors": 0, "reward/timeouts": 1}


def test_exiting_scorer_is_a_counted_error_and_the_runner_recovers(caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner(exiting, timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="meshrl.rewards.runner"):
        out = runner(["sys.exit", "fine", "os._exit", "sys.exit bare except", "fine"], [P(str(i)) for i in range(5)])
    assert out == [0.0, 0.5, 0.0, 0.0, 0.5]
    assert runner.pop_stats() == {"reward/errors": 3, "reward/timeouts": 0}
    text = caplog.text
    assert "problem 0 raised SystemExit" in text and "problem 2" in text and "process ended" in text


def test_inline_scorer_calling_sys_exit_is_counted() -> None:
    runner = RewardRunner(exiting, isolation="inline")
    assert runner(["sys.exit", "fine"], [P("a"), P("b")]) == [0.0, 0.5]
    assert runner.pop_stats() == {"reward/errors": 1, "reward/timeouts": 0}


def test_process_scores_match_inline_and_are_deterministic() -> None:
    completions = [f"#### {i % 3}" for i in range(30)] + ["no answer", "\\boxed{1}"]
    problems = [P(str(i), answer="1") for i in range(len(completions))]

    def score(c: str, p: P) -> float:
        return grade(c, p.answer, "number")

    inline = RewardRunner(score, isolation="inline")(completions, problems)
    first = RewardRunner(score, isolation="process")(completions, problems)
    second = RewardRunner(score, isolation="process")(completions, problems)
    assert first == second == inline and sum(first) == 11.0


def test_unpicklable_problem_is_scored_inline() -> None:
    lock_problem = {"id": "lock", "lock": threading.Lock()}
    runner = RewardRunner(lambda c, p: 1.0, isolation="process")
    assert runner(["a"], [lock_problem]) == [1.0]
    assert runner.pop_stats() == {"reward/errors": 0, "reward/timeouts": 0}


def test_scorer_process_is_stopped_by_close() -> None:
    import os

    runner = RewardRunner(lambda c, p: 1.0)
    runner(["a"], [P("x")])
    pid = runner._process.pid  # type: ignore[union-attr]
    assert pid is not None
    runner.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_scorer_process_does_not_keep_a_worker_pool_alive() -> None:
    """A pool's workers must see end-of-file when the pool closes while a scorer process lives (else the
    pool's close waits 5 s for each and then kills it)."""
    import torch

    from meshrl.forkpool import ForkPool, fork_available

    if not fork_available():
        pytest.skip("no fork here")
    pool = ForkPool(torch.nn.Linear(2, 2), lambda x: x + 1, 2)
    assert pool.map(lambda x: x, [(1,), (2,)]) == [1, 3]
    runner = RewardRunner(lambda c, p: 1.0)
    assert runner(["a"], [P("x")]) == [1.0]  # the scorer process is forked while the pool is open
    t0 = time.perf_counter()
    pool.close()
    assert time.perf_counter() - t0 < 3.0
    runner.close()


def test_runner_first_used_in_a_finished_thread_still_scores_without_errors() -> None:
    runner = RewardRunner(lambda c, p: 1.0)
    th = threading.Thread(target=lambda: runner(["a"], [P("x")]))
    th.start()
    th.join(10)
    time.sleep(0.2)  # the child got its parent-death signal when that thread ended
    assert runner(["b", "c"], [P("y"), P("z")]) == [1.0, 1.0]
    assert runner.pop_stats() == {"reward/errors": 0, "reward/timeouts": 0}
    runner.close()


def torch_scorer(completion: str, problem: P) -> float:
    """A parallel elementwise op and a matrix product: both enter torch's OpenMP/MKL pool when it has threads."""
    import torch

    x = torch.linspace(0.0, 1.0, 400_000)
    m = torch.ones(256, 256)
    return float(torch.sin(x).sum() * 0 + (m @ m)[0, 0] / 256)


def test_torch_scorer_in_the_process_after_the_parent_used_threads() -> None:
    """The parent's OpenMP pool is not copied by fork: a torch scorer deadlocked in the child and every reward
    timed out (0, counted as a timeout) until the child was set to one thread."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.linspace(0.0, 1.0, 400_000)
        for _ in range(5):  # start the parent's thread pool
            torch.sin(x).sum()
            (torch.ones(256, 256) @ torch.ones(256, 256)).sum()
        runner = RewardRunner(torch_scorer, timeout_s=3.0, isolation="process")
        assert runner(["a", "b"], [P("t1"), P("t2")]) == [1.0, 1.0]
        assert runner.pop_stats() == {"reward/errors": 0, "reward/timeouts": 0}
        runner.close()
        assert torch.get_num_threads() == 2  # only the child went single-threaded
    finally:
        torch.set_num_threads(saved)


def test_a_reaped_scorer_process_is_never_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the runner reaped its dead child, that pid (and group id) may belong to another process: the
    runner used to SIGKILL it (process group included) anyway when it replaced the child."""
    from meshrl.rewards import scorer_process

    signalled: list[int] = []
    monkeypatch.setattr(scorer_process, "_kill", signalled.append)  # records only: nothing is signalled here
    runner = RewardRunner(exiting, timeout_s=5.0, isolation="process")
    assert runner(["os._exit", "fine"], [P("a"), P("b")]) == [0.0, 0.5]
    assert signalled == [] and runner._process.starts == 2  # type: ignore[union-attr]
    monkeypatch.undo()
    runner.close()


def test_scorer_time_limit_covers_the_task_s_own_limit() -> None:
    from types import SimpleNamespace

    from meshrl.rewards import scorer_time_limit
    from meshrl.rewards.runner import TASK_LIMIT_MARGIN_S

    code_task = SimpleNamespace(timeout_s=10.0)  # e.g. humaneval's sandbox limit
    assert scorer_time_limit(5.0, code_task) == 10.0 + TASK_LIMIT_MARGIN_S
    assert scorer_time_limit(60.0, code_task) == 60.0  # a larger configured limit is kept
    assert scorer_time_limit(5.0, SimpleNamespace()) == 5.0  # tasks without a limit of their own
    assert scorer_time_limit(5.0, SimpleNamespace(timeout_s=float("nan"))) == 5.0
    assert scorer_time_limit(0.0, code_task) == 0.0  # 0 = no limit stays no limit


def test_humaneval_scoring_gets_more_than_its_sandbox_limit() -> None:
    from meshrl.tasks import load_task

    task = load_task("humaneval")
    from meshrl.rewards import scorer_time_limit

    assert scorer_time_limit(5.0, task) > task.timeout_s


def test_scores_with_descriptors_past_fd_setsize(caplog: pytest.LogCaptureFixture) -> None:
    """A long-lived process can hold over 1024 descriptors (seen: a test process after many trainers), so the
    scorer's pipes get numbers select() refuses; every reward then failed with "filedescriptor out of range in
    select()". Waiting uses poll(), which takes any number; the timeout still works there."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard if hard != resource.RLIM_INFINITY else 4096) < 1200:
        pytest.skip("the descriptor limit is below 1200")
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        completions, problems = ["#### 1", "#### 2"], [P("a"), P("b")]
        with caplog.at_level(logging.WARNING, logger="meshrl"):
            scores = RewardRunner(lambda c, p: grade(c, p.answer, "number"), isolation="process")(completions, problems)
        assert scores == [1.0, 0.0] and "out of range" not in caplog.text
        runner = RewardRunner(sleepy, timeout_s=0.3, isolation="process")
        assert runner(["x"], [P("c")]) == [0.0] and runner.pop_stats()["reward/timeouts"] == 1
    finally:
        for fd in held:
            os.close(fd)
        if soft < 1200:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_an_int_past_floats_range_is_clamped_not_a_crash(isolation: str) -> None:
    """``float(10**400)`` raises OverflowError: such a score is as far outside [0, 1] as inf, clamped and counted."""
    runner = RewardRunner(lambda c, p: 10**400 if c == "up" else -(10**400), isolation=isolation)
    assert runner(["up", "down"], [P("a"), P("b")]) == [1.0, 0.0]
    assert runner.pop_stats()["reward/errors"] == 2
