"""Every load of a run's checkpoint checks its files against the sizes and SHA-256 recorded in its state.json:
a damaged checkpoint the user named is refused in one line naming the file; without a named step the newest
intact one is used, with a warning naming what was passed over. Never a loader's traceback, never rc 0 over
tampered weights."""

from __future__ import annotations

import logging

import pytest

from meshrl.cli import main as cli_main
from meshrl.runs.checkpoint import CheckpointError
from meshrl.testing import tiny_config
from meshrl.trainer import load_policy, train


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


# ---------------------------------------------------------------------- nothing outside the run is followed
@pytest.fixture()
def other(tmp_path):
    path = tmp_path / "other"
    train(tiny_config("checkpoint.every=1", "seed=1", steps=2), path)
    return path


def _tree(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_step_linked_to_another_runs_checkpoint_is_never_used_or_deleted_through(tmp_path, other, caplog):
    run = tmp_path / "mine"
    train(tiny_config("checkpoint.every=1", steps=1), run)
    theirs = _tree(other)
    (run / "checkpoints" / "step_000002").symlink_to(other / "checkpoints" / "step_000002")
    (run / "checkpoints" / "latest").write_text("step_000002")
    with pytest.raises(CheckpointError, match=r"step_000002 is a symbolic link"):
        load_policy(str(run / "checkpoints" / "step_000002"))
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        assert load_policy(str(run))[2].endswith("@ step 1")  # the run's own checkpoint, not the linked one
        history = train(tiny_config("checkpoint.every=1", steps=3), run, resume=True)
    assert [m["step"] for m in history] == [2, 3]
    assert "symbolic link" in caplog.text
    assert not (run / "checkpoints" / "step_000002").is_symlink()  # replaced by this run's own step 2
    assert _tree(other) == theirs  # nothing of the other run was read into this one, moved or deleted


def test_a_stale_step_link_does_not_crash_a_fresh_run(tmp_path, other):
    run = tmp_path / "fresh"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_000001").symlink_to(tmp_path / "gone")  # dangling
    (run / "checkpoints" / "step_000002").symlink_to(other / "checkpoints" / "step_000001")
    theirs = _tree(other)
    train(tiny_config(steps=1), run)
    assert (run / "checkpoints" / "step_000001" / "state.json").is_file()
    assert not (run / "checkpoints" / "step_000002").exists()
    assert _tree(other) == theirs


def test_a_checkpoint_file_linked_elsewhere_is_damaged(run, other):
    weights = run / "checkpoints" / "step_000002" / "model.safetensors"
    weights.unlink()
    weights.symlink_to(other / "checkpoints" / "step_000002" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a symbolic link"):
        load_policy(str(run / "checkpoints" / "step_000002"))


# ---------------------------------------------------------------------- state.json is validated, not trusted
def _edit_state(step_dir, **fields):
    import json

    path = step_dir / "state.json"
    state = json.loads(path.read_text())
    state.update(fields)
    path.write_text(json.dumps(state))


@pytest.mark.parametrize(("fields", "named"), [
    ({"step": 1}, "field 'step' is 1 but the directory is step_000002"),
    ({"step": True}, "field 'step' must be a non-negative integer, got True"),
    ({"step": 10**30}, "field 'step' is"),
    ({"files": ["model.safetensors"]}, "field 'files' must map file names"),
    ({"files": "model.safetensors"}, "field 'files' must map file names"),
    ({"files": {"model.safetensors": {"bytes": "12", "sha256": "x"}}}, "field 'files.model.safetensors'"),
    ({"cursor": -3}, "field 'cursor' must be a non-negative integer, got -3"),
])
def test_a_bad_state_falls_back_to_the_previous_intact_checkpoint(run, fields, named, caplog):
    _edit_state(run / "checkpoints" / "step_000002", **fields)
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        history = train(tiny_config("checkpoint.every=1", steps=3), run, resume=True)
    assert [m["step"] for m in history] == [2, 3]  # resumed from step 1, the newest intact checkpoint
    assert "step_000002/state.json" in caplog.text and named in caplog.text


def test_a_named_step_with_a_bad_state_is_refused_naming_file_and_field(run):
    _edit_state(run / "checkpoints" / "step_000002", step=5)
    with pytest.raises(CheckpointError, match=r"step_000002/state.json: field 'step' is 5 but the directory"):
        load_policy(str(run / "checkpoints" / "step_000002"))
