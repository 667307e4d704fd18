"""Messages a user reads: the ``python`` tool's report of a program that exits says when, once (run in the sandbox)."""

from __future__ import annotations

import pytest

from meshrl.agents import python_tool


@pytest.mark.parametrize("code", ["import sys\nsys.exit(3)", "raise SystemExit(0)"])
def test_python_tool_exit_message_says_when_once(code):
    out = python_tool(timeout_s=10)(code)
    assert "before its code finished running" in out
    assert out.count("before") == 1, out
