"""Messages a user reads: the ``python`` tool's report of a program that exits says when, once; exporting a run whose
checkpoint is a symlink says that it is a link meshrl does not follow."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from meshrl.agents import python_tool
from meshrl.export.model import select_checkpoint


@pytest.mark.parametrize("code", ["import sys\nsys.exit(3)", "raise SystemExit(0)"])
def test_python_tool_exit_message_says_when_once(code):
    out = python_tool(timeout_s=10)(code)
    assert "before its code finished running" in out
    assert out.count("before") == 1, out


def _run_with_linked_last_step(tmp_path: Path, *, pointer: bool) -> Path:
    """A run whose own checkpoint is step 1 and whose step 2 is a link to another run's complete checkpoint."""
    other = tmp_path / "other" / "step_000002"
    other.mkdir(parents=True)
    (other / "state.json").write_text("{}")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "state.json").write_text("{}")
    (run / "checkpoints" / "step_000002").symlink_to(other)
    if pointer:
        (run / "checkpoints" / "latest").write_text("step_000002")
    return run


@pytest.mark.parametrize("pointer", [True, False])
def test_export_final_says_the_last_step_is_a_link_not_followed(tmp_path, caplog, pointer):
    run = _run_with_linked_last_step(tmp_path, pointer=pointer)
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        chosen = select_checkpoint(run, "final")
    assert chosen.step == 1 and chosen.path == run / "checkpoints" / "step_000001"  # the run's own, never the link
    assert "symbolic link" in caplog.text and "not followed" in caplog.text
    assert "missing or incomplete" not in caplog.text


def test_export_of_a_linked_step_names_the_link(tmp_path):
    run = _run_with_linked_last_step(tmp_path, pointer=True)
    with pytest.raises(ValueError, match=r"step_000002 is a symbolic link \(to .*other.*\), not followed"):
        select_checkpoint(run, 2)
    (run / "checkpoints" / "step_000001" / "state.json").unlink()
    with pytest.raises(ValueError, match=r"no checkpoint yet .*step_000002: symbolic link"):
        select_checkpoint(run, "final")
