"""meshrl.agents.execute: the sandboxed Python tool, run in its sandbox process."""

from __future__ import annotations

from meshrl.agents import Toolbox, python_tool


def test_python_tool_runs_in_the_sandbox():
    python = python_tool(timeout_s=5)
    box = Toolbox(None, [python])
    assert box.names == ["python"] and box.tools["python"].parameters["required"] == ["code"]
    assert python("print(6 * 7)") == "42\n"
    failed = python("import sys\nprint('before')\nraise ValueError('bad input')")
    assert failed.startswith("before\n\n[status: error") and "ValueError: bad input" in failed
    slow = python_tool(timeout_s=0.5)("while True: pass")
    assert "[status: timeout" in slow
