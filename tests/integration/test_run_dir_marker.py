"""``meshrl train --out DIR`` never touches what meshrl did not write: a non-empty directory without meshrl's
marker is refused before anything in it changes; meshrl's own run directories (marked, or from a meshrl before
the marker) keep working."""

from __future__ import annotations

import pytest

from meshrl.cli import main as cli_main
from meshrl.runs.run_dir import MARKER
from meshrl.testing import tiny_config
from meshrl.trainer import train

USER_FILES = {"config.yaml": "my: own settings\n", "summary.json": '{"mine": 1}\n', "events.jsonl": '{"a": 1}\n'}


def _user_dir(path):
    path.mkdir()
    for name, text in USER_FILES.items():
        (path / name).write_text(text)
    return path


def test_train_refuses_a_users_directory_and_changes_nothing(tmp_path, capsys):
    out = _user_dir(tmp_path / "mine")
    rc = cli_main(["train", "--model", "tiny", "--task", "tiny:repeat", "--steps", "1", "--out", str(out),
                   "--set", "log.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2 and "is a non-empty directory that is not a meshrl run" in err and "Traceback" not in err
    assert {p.name: p.read_text() for p in out.iterdir()} == USER_FILES


def test_resume_refuses_a_users_directory(tmp_path):
    out = _user_dir(tmp_path / "mine")
    with pytest.raises(ValueError, match=r"--resume .* not a meshrl run"):
        train(tiny_config(steps=1), out, resume=True)
    assert {p.name: p.read_text() for p in out.iterdir()} == USER_FILES


def test_runs_write_the_marker_first_and_a_legacy_run_still_resumes(tmp_path):
    run = tmp_path / "run"
    train(tiny_config(steps=1), run)
    assert (run / MARKER).is_file()
    (run / MARKER).unlink()  # a run directory written before the marker existed
    history = train(tiny_config(steps=2), run, resume=True)
    assert [m["step"] for m in history] == [2] and (run / MARKER).is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    train(tiny_config(steps=1), empty)  # an empty directory is fine
    assert (empty / MARKER).is_file()


def test_a_kill_while_the_marker_was_written_leaves_a_directory_meshrl_reuses(tmp_path):
    """A kill between the marker's temporary file and its rename leaves only that temporary: the directory was
    empty or new, so the rerun takes it (and removes the temporary); a user's file beside one is still refused."""
    from meshrl.jsonl import TEMP_PREFIX

    run = tmp_path / "run"
    run.mkdir()
    leftover = run / f"{TEMP_PREFIX}{MARKER}.2tp4_n67"
    leftover.write_text("")
    train(tiny_config(steps=1), run)
    assert (run / MARKER).is_file() and not leftover.exists()
    mine = _user_dir(tmp_path / "mine")
    (mine / f"{TEMP_PREFIX}{MARKER}.abc").write_text("")
    with pytest.raises(ValueError, match="not a meshrl run"):
        train(tiny_config(steps=1), mine)
    assert (mine / "config.yaml").read_text() == USER_FILES["config.yaml"]
    named = tmp_path / "named"  # only files can be the marker's temporaries: a folder named like one is the user's
    (named / f"{TEMP_PREFIX}{MARKER}.d").mkdir(parents=True)
    with pytest.raises(ValueError, match="not a meshrl run"):
        train(tiny_config(steps=1), named)
