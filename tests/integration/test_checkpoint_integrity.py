"""Every load of a run's checkpoint checks its files against the sizes and SHA-256 recorded in its state.json:
a damaged checkpoint the user named is refused in one line naming the file; without a named step the newest
intact one is used, with a warning naming what was passed over. Never a loader's traceback, never rc 0 over
tampered weights."""

from __future__ import annotations

import logging

import pytest

from meshrl.cli import main as cli_main
from meshrl.runs import load_policy
from meshrl.runs.checkpoint import CheckpointError
from meshrl.testing import tiny_config
from meshrl.trainer import train


@pytest.fixture()
def run(tmp_path):
    path = tmp_path / "run"
    train(tiny_config("checkpoint.every=1", steps=2), path)
    return path


def _tamper(path, how: str) -> None:
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if how == "flip":  # same size, other bytes: only the hash can tell
        data[-5] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_named_damaged_step_is_refused_naming_the_file(run, how):
    step2 = run / "checkpoints" / "step_000002"
    _tamper(step2, how)
    with pytest.raises(CheckpointError, match=r"step_000002.*model\.safetensors"):
        load_policy(str(step2))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_without_a_named_step_the_newest_intact_one_is_used(run, how, caplog):
    _tamper(run / "checkpoints" / "step_000002", how)
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        _, _, desc = load_policy(str(run))
    assert desc.endswith("@ step 1")
    assert "step_000002" in caplog.text and "model.safetensors" in caplog.text


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_export_of_a_damaged_final_checkpoint_is_one_line(run, how, tmp_path, capsys):
    _tamper(run / "checkpoints" / "step_000002", how)
    out = tmp_path / "export"
    assert cli_main(["export", "model", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_with_every_checkpoint_damaged_the_error_lists_them(run):
    for step in ("step_000001", "step_000002"):
        _tamper(run / "checkpoints" / step, "flip")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint.*step_000002.*step_000001"):
        load_policy(str(run))
