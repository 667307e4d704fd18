"""A hostile tool call that holds the interpreter in one C call for about half a second: past its limit, it is a
timeout."""

from __future__ import annotations

from meshrl.agents import Toolbox


def hog(size: int) -> str:
    """Hold the interpreter in one C call.

    Args:
        size: Characters to backtrack over (24: about half a second).
    """
    import re as _re

    _re.match(r"(a+)+b", "a" * size)  # catastrophic backtracking: one C call that keeps the GIL
    return "done"


def test_a_call_past_its_limit_that_could_not_be_stopped_is_a_timeout(caplog):
    from meshrl.agents import ToolCall, execute_call

    result = execute_call(Toolbox(None, [hog]), ToolCall("hog", {"size": 24}), timeout_s=0.05, max_output_chars=100)
    assert result.duration_s > 0.1  # the wait itself could not return in time
    assert result.timed_out and result.error is not None and "more than its limit" in result.error
    assert "past its 0.05 s limit" in caplog.text
