"""The suite keeps no passing test's files: a full run writes ~5 GB of runs and checkpoints (two SmolLM2 checkpoints at
1.6 GB each), which a CI box with a few GB of free disk cannot hold at once; pyproject's tmp_path_retention_policy
deletes each passing test's tmp_path as the test ends and keeps a failing one's for inspection."""

from __future__ import annotations

from pathlib import Path

import pytest

_written: list[Path] = []


def test_writes_into_its_tmp_path(tmp_path):
    (tmp_path / "checkpoint.bin").write_bytes(b"\0" * 1024)
    _written.append(tmp_path)


def test_the_previous_tests_tmp_path_is_gone_once_it_passed():
    # pytest runs a module's tests in file order, so the test above has finished (and passed) by now
    if not _written:
        pytest.skip("run on its own: the test that writes did not run first")
    assert not _written[0].exists(), f"{_written[0]} outlived its passing test"
