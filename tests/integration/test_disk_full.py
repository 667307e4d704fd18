"""A disk that fills up: between checkpoints the record writer stops the run in one line (no OSError traceback),
a --resume on the still-full disk says the same, and a disk too small for the run's first checkpoint is told
so, without promising a checkpoint or a --resume that does not exist."""

from __future__ import annotations

import errno
from collections import namedtuple

from meshrl import jsonl
from meshrl.cli import main as cli_main
from meshrl.runs import checkpoint

ARGS = ["--model", "tiny", "--task", "tiny:repeat", "--no-progress", "--set", "rollout.prompts_per_step=2",
        "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=4", "--set", "checkpoint.every=1"]


def _full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_records_on_a_full_disk_stop_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert cli_main(["train", *ARGS, "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    real_write = jsonl.JsonlWriter.write

    class FullFile:  # the open file of a record on a disk that has just filled up
        def __init__(self, f):
            self.f = f

        def write(self, text):
            _full()

        def flush(self):
            self.f.flush()

        def close(self):
            self.f.close()

    def write(self, record):
        if self.path.name == "metrics.jsonl" and not isinstance(self._f, FullFile):
            self._f = FullFile(self._f)
        return real_write(self, record)

    monkeypatch.setattr(jsonl.JsonlWriter, "write", write)
    assert cli_main(["train", "--resume", str(run), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl: No space left on device (disk full)" in err and "Traceback" not in err
    monkeypatch.setattr(jsonl.tempfile, "mkstemp", _full)  # still full: the resume's own rewrites fail too
    assert cli_main(["train", "--resume", str(run), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "(disk full)" in err and "--resume" in err and "Traceback" not in err


def test_a_disk_too_small_for_the_first_checkpoint_promises_no_resume(tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _p: usage(10**6, 10**6 - 1000, 1000))
    assert cli_main(["train", *ARGS, "--steps", "2", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "first checkpoint, so there is nothing to resume" in err and "is intact" not in err


def test_a_later_checkpoint_on_a_full_disk_names_the_intact_one(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert cli_main(["train", *ARGS, "--steps", "1", "--out", str(run)]) == 0
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _p: usage(10**6, 10**6 - 1000, 1000))
    assert cli_main(["train", "--resume", str(run), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the last checkpoint (step_000001) is intact" in err and "--resume" in err
