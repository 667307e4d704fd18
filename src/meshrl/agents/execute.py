"""Running tool calls: a time limit and an output cap per call, and two built-in tools.

:func:`execute_call` never raises for what a tool does: an exception, a hang past the time limit, or a result
that cannot be shown becomes an error :class:`ToolResult` whose message is what the model reads next, counted
by the episode. Tools run in a daemon thread so that an environment method keeps its instance's state; a thread
cannot be killed, so a tool that hangs keeps running in the background after its call has timed out (its result
is discarded, and a warning says so once per tool). A call that holds the interpreter (one long C call, a large
allocation) cannot even be waited for: it returns late, past the limit, and its result is refused as timed out.
Code that may hang or misbehave belongs in :func:`python_tool`, which runs it in meshrl's sandbox (a separate,
killed process); the built-in :func:`calculator` bounds its own work before each operation.

Built-in tools (standalone functions in TRL's convention, pass them as ``tools=``):

* :func:`calculator`: arithmetic on exact integers and fractions (``+ - * / // % **``, parentheses, ``abs``,
  ``min``, ``max``, ``gcd``, ``lcm``), evaluated on the parsed syntax tree, never with ``eval``.
* :func:`python_tool`: a ``python(code)`` tool that runs the code in :func:`meshrl.rewards.sandbox.run_code`.
"""

from __future__ import annotations

import ast
import decimal
import logging
import math
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from meshrl.agents.environment import Toolbox
from meshrl.agents.tool_calls import ToolCall, as_text, tool_result_text

log = logging.getLogger("meshrl")


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: ``content`` (the text the model reads, capped), ``error`` (``None`` on success, else the
    message, also in ``content``), ``timed_out``, ``duration_s``, ``cut_chars`` (characters removed by the cap)."""

    name: str
    content: str
    error: str | None
    timed_out: bool
    duration_s: float
    cut_chars: int = 0


def cap_text(text: str, max_chars: int) -> tuple[str, int]:
    """``(text cut to max_chars with a note saying how much was cut, number of characters cut)``."""
    if len(text) <= max_chars:
        return text, 0
    cut = len(text) - max_chars
    return f"{text[:max_chars]}\n[output cut: {cut} more characters]", cut


def execute_call(toolbox: Toolbox, call: ToolCall, *, timeout_s: float, max_output_chars: int) -> ToolResult:
    """Run ``call`` with ``toolbox`` in a daemon thread, waiting at most ``timeout_s`` seconds (module docstring).

    An error's content is ``{"error": MESSAGE}`` as JSON, the form TRL gives a failed tool."""
    if timeout_s <= 0 or max_output_chars < 1:
        raise ValueError(f"timeout_s must be > 0 and max_output_chars >= 1, got {timeout_s}, {max_output_chars}")
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = toolbox.call(call.name, call.arguments)
        except BaseException as exc:  # SystemExit / KeyboardInterrupt raised by a tool must not end the run
            box["error"] = f"{type(exc).__name__}: {exc}"
        box["took"] = time.monotonic() - start  # the tool's own time, not the wait's

    start = time.monotonic()
    thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    duration = time.monotonic() - start
    if thread.is_alive():
        _warn_once(("running", call.name), "tool %r timed out after %g s and keeps running in a thread of this "
                   "process (a thread cannot be stopped): it may slow the rest of the run and still change its "
                   "environment; run work that may not end in a subprocess (python_tool)", call.name, timeout_s)
        return _error(call.name, f"tool {call.name!r} timed out after {timeout_s:g} s", duration, True)
    if box.get("took", 0.0) > timeout_s:  # it held the interpreter (one long C call): the wait could not return
        _warn_once(("late", call.name), "tool %r returned after %.1f s, past its %g s limit: a call that holds the "
                   "interpreter (a long C call, a large allocation) cannot be stopped by the time limit; its result "
                   "is refused as timed out", call.name, duration, timeout_s)
        return _error(call.name, f"tool {call.name!r} took {duration:.1f} s, more than its limit of {timeout_s:g} s",
                      duration, True)
    if "error" in box:
        return _error(call.name, box["error"], duration, False)
    try:
        text = tool_result_text(box["value"])
    except Exception as exc:  # a __str__ that raises
        return _error(call.name, f"the result cannot be shown ({type(exc).__name__}: {exc})", duration, False)
    content, cut = cap_text(as_text(text), max_output_chars)  # what the model reads: no surrogates
    return ToolResult(call.name, content, None, False, duration, cut)


_warned: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], message: str, *args: Any) -> None:
    """Log ``message`` once per process for ``key`` (what happened, tool name): a run of many episodes would
    otherwise repeat it per call; each call is still counted in ``tools/error_frac``."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _error(name: str, message: str, duration: float, timed_out: bool) -> ToolResult:
    message = as_text(message)  # an exception may quote the model's argument, lone surrogates included
    return ToolResult(name, tool_result_text({"error": message}), message, timed_out, duration)


# ---- calculator ----

MAX_RESULT_BITS = 13_000  # ~3900 decimal digits: below Python's 4300-digit int-to-str limit, so results print
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "min": min, "max": max, "gcd": math.gcd, "lcm": math.lcm}


class CalculatorError(ValueError):
    """The expression is not arithmetic this calculator evaluates, or its value is out of range."""


def _bits(value: Fraction) -> int:
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are supported")
    e = exponent.numerator
    if base == 0 and e < 0:
        raise CalculatorError("zero cannot be raised to a negative power")
    if base not in (0, 1, -1) and abs(e) * (_bits(base) - 1) > MAX_RESULT_BITS:  # a lower bound of its bits
        raise CalculatorError(f"the result would have more than {MAX_RESULT_BITS} bits")
    return base**e


def _fold(function: Callable[[int, int], int], values: list[int]) -> int:
    """``function`` (gcd or lcm) over ``values`` two at a time, each partial result checked against
    :data:`MAX_RESULT_BITS`: one C call over all of them would build a result of millions of bits (lcm of 180
    large terms: 73 s, holding the interpreter) before any check could refuse it; two operands within the limit
    cost microseconds."""
    value = values[0]
    for other in values[1:]:
        value = function(value, other)
        if value.bit_length() > MAX_RESULT_BITS:
            raise CalculatorError(f"the result has more than {MAX_RESULT_BITS} bits")
    return abs(value)  # as math.gcd and math.lcm: never negative, also for one argument


def _apply(op: type, left: Fraction, right: Fraction) -> Fraction:
    if op is ast.Pow:
        return _power(left, right)
    if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
        raise CalculatorError("division by zero")
    return Fraction(_BINARY[op](left, right))


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):
            raise CalculatorError(f"{node.value} is not a finite number")
        # repr: the decimal literal the model wrote (0.1 is 1/10, not the binary float's exact value)
        return Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _apply(type(node.op), _evaluate(node.left), _evaluate(node.right))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
          and node.args and not node.keywords):
        args = [_evaluate(a) for a in node.args]
        if node.func.id in ("gcd", "lcm") and any(a.denominator != 1 for a in args):
            raise CalculatorError(f"{node.func.id} takes whole numbers")
        if node.func.id in ("gcd", "lcm"):
            value = Fraction(_fold(_FUNCTIONS[node.func.id], [a.numerator for a in args]))
        else:
            value = Fraction(_FUNCTIONS[node.func.id](*args))
    else:
        raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:80]}")
    if _bits(value) > MAX_RESULT_BITS:
        raise CalculatorError(f"the result has more than {MAX_RESULT_BITS} bits")
    return value


def format_number(value: Fraction) -> str:
    """An integer exactly; a fraction as ``p/q`` followed by its decimal value, exact when it terminates within 17
    significant digits, else rounded to 17 (``decimal``, so that no size overflows a float)."""
    if value.denominator == 1:
        return str(value.numerator)
    with decimal.localcontext() as context:
        context.prec = 17
        approx = decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)
    return f"{value.numerator}/{value.denominator} = {approx}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (big integers and fractions).

    Supports + - * / // % ** and parentheses, and the functions abs, min, max, gcd and lcm.

    Args:
        expression: The arithmetic expression, e.g. "(2**64 + 1) // 3".
    """
    if len(expression) > 2000:
        raise CalculatorError("the expression is longer than 2000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an expression: {exc.msg}") from exc
    return format_number(_evaluate(tree))


# ---- sandboxed Python ----

def python_tool(*, timeout_s: float = 10.0, memory_mb: int = 512, max_output_bytes: int = 16384,
                allow_weak: bool | None = None) -> Callable[[str], str]:
    """A ``python(code)`` tool that runs ``code`` in :func:`meshrl.rewards.sandbox.run_code` (no network, a
    throw-away working directory, the time and memory limits given here) and returns what it printed.

    Its result is the program's stdout; when the run did not pass (an exception, a timeout, a memory error) the
    status and stderr follow, so the model sees the traceback. ``allow_weak`` as in ``run_code``: without
    bubblewrap the sandbox refuses to run unless the weak fallback was accepted (``reward.sandbox_allow_weak``).
    """
    from meshrl.rewards.sandbox import run_code

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Args:
            code: The complete Python program; print the values you want to see.
        """
        result = run_code(code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                          allow_weak=allow_weak)
        if result.status == "passed":
            return result.stdout
        return f"{result.stdout}\n[status: {result.status}, exit code {result.returncode}]\n{result.stderr}".strip()

    return python
