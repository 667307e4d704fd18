"""What crosses between the sandboxed program and the tests: exceptions that are control flow in Python do not
act as such in the tests, and ints of any size cross and compare."""

from __future__ import annotations

import sys

import pytest

from meshrl.rewards.sandbox import run_code

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox targets Linux")

DOUBLES_OVER_MAP = ("def check(candidate):\n    for x, y in zip([1, 2, 3], map(candidate, [1, 2, 3])):\n"
                    "        assert y == 2 * x\n")
DOUBLES_OVER_MAP_LIST = "def check(candidate):\n    assert list(map(candidate, [1, 2])) == [2, 4]\n"


@pytest.mark.parametrize("raised", ["StopIteration", "StopIteration('done')"])
@pytest.mark.parametrize("tests", [DOUBLES_OVER_MAP, DOUBLES_OVER_MAP_LIST])
def test_a_candidate_raising_stop_iteration_does_not_end_the_tests_loop(raised, tests):
    result = run_code(f"def f(x):\n    raise {raised}\n", tests=tests, entry_point="f")
    assert not result.passed and result.status == "error", result
    assert run_code("def f(x):\n    return 2 * x\n", tests=tests, entry_point="f").passed


def test_a_stop_iteration_inside_the_candidate_caught_there_is_fine():
    code = "def f(x):\n    try:\n        next(iter([]))\n    except StopIteration:\n        pass\n    return 2 * x\n"
    assert run_code(code, tests=DOUBLES_OVER_MAP, entry_point="f").passed


def test_a_builtin_exception_the_tests_expect_still_crosses():
    tests = ("def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError:\n        return\n"
             "    assert False\n")
    assert run_code("def f(x):\n    raise ValueError('negative')\n", tests=tests, entry_point="f").passed


@pytest.mark.parametrize("digits", [4301, 5000, 20000])
def test_a_correct_answer_with_more_than_4300_digits_passes(digits):
    tests = f"def check(candidate):\n    assert candidate({digits}) == 10 ** {digits}\n    assert candidate(1) == 10\n"
    assert run_code("def f(n):\n    return 10 ** n\n", tests=tests, entry_point="f").passed
    wrong = run_code("def f(n):\n    return 10 ** n + 1\n", tests=tests, entry_point="f")
    assert wrong.status == "failed", wrong
    # ... as an argument too, and as a string the tests build.
    tests = (f"def check(candidate):\n    assert candidate(10 ** {digits}) == {digits + 1}\n"
             f"    assert str(candidate(7)) == '1'\n")
    assert run_code("def f(n):\n    return len(str(n))\n", tests=tests, entry_point="f").passed
