"""Messages a user reads: exporting a run whose checkpoint is a symlink says that it is a link meshrl does not follow
(the ``python`` tool's exit report: tests/integration/test_messages_export_and_sandbox_tool.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from meshrl.export.model import select_checkpoint


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
