"""A full disk ends a run with the one-line ``DiskFullError`` even though the clean-up's last flush fails on the same
disk, and the resume after freeing space is exact; files and checkpoint directories that meshrl rewrites atomically
get the modes the user's umask gives, not ``tempfile``'s private 600 / 700."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from meshrl import jsonl
from meshrl.jsonl import DiskFullError, read_jsonl
from meshrl.testing import tiny_config
from meshrl.trainer import train


class FullDiskFile:
    """A record file on a disk that has just filled up: writes are buffered, every flush (close's too) fails."""

    def __init__(self, f) -> None:
        self.f, self.pending = f, ""

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        if self.pending:
            raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        self.f.close()  # the real file closes; what was buffered is lost, as on a full disk
        self.flush()


@pytest.fixture()
def full_metrics_at_step(monkeypatch):
    """From the ``metrics.jsonl`` write of step ``n`` on, that writer's disk is full."""
    real_write = jsonl.JsonlWriter.write

    def arm(n: int) -> None:
        def write(self, record):
            if self.path.name == "metrics.jsonl" and record.get("step") == n and not isinstance(self._f, FullDiskFile):
                self._f = FullDiskFile(self._f)
            return real_write(self, record)

        monkeypatch.setattr(jsonl.JsonlWriter, "write", write)

    return arm


def _weights(run_dir):
    from safetensors.torch import load_file

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "model.safetensors")


def test_a_full_disk_stops_the_run_with_the_disk_full_error_not_the_cleanups(tmp_path, full_metrics_at_step,
                                                                              monkeypatch):
    cfg = tiny_config("checkpoint.every=1", steps=3)
    whole = tmp_path / "whole"
    train(cfg, whole)
    run = tmp_path / "run"
    full_metrics_at_step(2)
    with pytest.raises(DiskFullError, match=r"metrics\.jsonl: No space left on device \(disk full\)") as caught:
        train(cfg, run)
    assert not isinstance(caught.value, OSError)
    monkeypatch.undo()  # space freed
    train(cfg, run, resume=True)
    key = ("step", "loss/total", "reward/mean", "grad/norm")
    assert [{k: m.get(k) for k in key} for m in read_jsonl(run / "metrics.jsonl")] == \
        [{k: m.get(k) for k in key} for m in read_jsonl(whole / "metrics.jsonl")]
    mine, theirs = _weights(run), _weights(whole)
    assert all(mine[k].equal(theirs[k]) for k in theirs)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_atomic_rewrites_keep_the_users_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        run = tmp_path / "run"
        train(tiny_config("checkpoint.every=1", steps=2), run)
        train(tiny_config("checkpoint.every=1", steps=2), run, resume=True)  # rewinds and rewrites records
        jsonl.truncate_after_step(run / "metrics.jsonl", 1)  # a rewinding resume's rewrite
        step_dir = run / "checkpoints" / "step_000002"
        assert _mode(run / "config.yaml") == 0o666 & ~umask
        assert _mode(run / "checkpoints" / "latest") == 0o666 & ~umask
        assert _mode(run / "metrics.jsonl") == 0o666 & ~umask
        assert _mode(step_dir) == 0o777 & ~umask
        assert _mode(step_dir / "state.json") == 0o666 & ~umask
    finally:
        os.umask(old)
