"""meshrl.agents.execute: time limit and output cap per call, errors as counted results, the calculator (the
sandboxed Python tool: tests/integration/test_agents_execute_sandbox.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from meshrl.agents import CalculatorError, Toolbox, ToolCall, calculator, execute_call

_release = threading.Event()


def hang(seconds: int) -> str:
    """Hang.

    Args:
        seconds: How long.
    """
    _release.wait(seconds)
    return "late"


def fail(x: int) -> int:
    """Fail.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")


def leave(x: int) -> int:
    """Exit the interpreter.

    Args:
        x: Anything.
    """
    raise SystemExit(x)


def chatty(n: int) -> str:
    """Talk.

    Args:
        n: How much.
    """
    return "a" * n


def listing(n: int) -> list[int]:
    """List.

    Args:
        n: How many.
    """
    return list(range(n))


BOX = Toolbox(None, [hang, fail, leave, chatty, listing])


def test_a_hanging_tool_times_out_as_an_error():
    start = time.monotonic()
    result = execute_call(BOX, ToolCall("hang", {"seconds": 30}), timeout_s=0.2, max_output_chars=100)
    _release.set()  # let the abandoned thread finish
    assert time.monotonic() - start < 5
    assert result.timed_out and result.error == "tool 'hang' timed out after 0.2 s"
    assert json.loads(result.content) == {"error": result.error}


def test_raising_tools_are_errors_not_crashes():
    result = execute_call(BOX, ToolCall("fail", {"x": 3}), timeout_s=5, max_output_chars=100)
    assert result.error == "RuntimeError: broken on 3" and not result.timed_out
    assert json.loads(result.content) == {"error": "RuntimeError: broken on 3"}
    result = execute_call(BOX, ToolCall("leave", {"x": 1}), timeout_s=5, max_output_chars=100)
    assert result.error == "SystemExit: 1"


def test_output_is_capped_and_values_are_json():
    result = execute_call(BOX, ToolCall("chatty", {"n": 50}), timeout_s=5, max_output_chars=10)
    assert result.content == "aaaaaaaaaa\n[output cut: 40 more characters]" and result.cut_chars == 40
    assert result.error is None
    assert execute_call(BOX, ToolCall("listing", {"n": 3}), timeout_s=5, max_output_chars=100).content == "[0, 1, 2]"
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        execute_call(BOX, ToolCall("listing", {"n": 3}), timeout_s=0, max_output_chars=100)


@pytest.mark.parametrize(("expression", "value"), [
    ("1 + 2 * 3", "7"),
    ("2**200", str(2**200)),
    ("(2**64 + 1) // 3", str((2**64 + 1) // 3)),
    ("-7 % 3", "2"),
    ("1/3 + 1/6", "1/2 = 0.5"),
    ("10 / 4", "5/2 = 2.5"),
    ("0.1 + 0.2", "3/10 = 0.3"),
    ("1/3", "1/3 = 0.33333333333333333"),
    ("2**1000 / 3", f"{2**1000}/3 = 3.5716953572875577E+300"),
    ("2**-2", "1/4 = 0.25"),
    ("abs(-5) + max(1, 9, 4) - min(3, 2)", "12"),
    ("gcd(12, 18) * lcm(4, 6)", "72"),
    ("123456789123456789 * 987654321987654321", str(123456789123456789 * 987654321987654321)),
])
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("__import__('os').system('true')", "unsupported syntax"),
    ("(1).__class__", "unsupported syntax"),
    ("x + 1", "unsupported syntax"),
    ("'a' * 3", "unsupported syntax"),
    ("[1, 2]", "unsupported syntax"),
    ("abs(x=1)", "unsupported syntax"),
    ("2**100000", "more than 13000 bits"),
    ("2**12999 * 4", "more than 13000 bits"),
    ("9**9**9", "more than 13000 bits"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0**-1", "negative power"),
    ("2**0.5", "whole-number exponents"),
    ("gcd(1.5, 3)", "whole numbers"),
    ("1e999", "not a finite number"),
    ("1 +", "not an expression"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculator(expression)


def test_calculator_is_a_tool_whose_errors_reach_the_model():
    box = Toolbox(None, [calculator])
    assert box.tools["calculator"].parameters["required"] == ["expression"]
    result = execute_call(box, ToolCall("calculator", {"expression": "1/0"}), timeout_s=5, max_output_chars=200)
    assert result.error == "CalculatorError: division by zero"
