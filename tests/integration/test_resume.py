"""Resume, checkpoints and run records under faults: signals mid-step, kills mid-write, damaged files.

Each test injects a fault a user can meet (a signal from inside the update, an exception standing in
for a kill inside a write, a damaged file) and checks what a user relies on: a checkpoint holds a step
boundary, a resume reproduces the uninterrupted run exactly (CPU), ``latest`` names an intact checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from meshrl.cli import main as cli_main
from meshrl.jsonl import read_jsonl
from meshrl.provenance import code_version
from meshrl.runs import checkpoint as ckpt_mod
from meshrl.runs.checkpoint import checkpoint_problem, save_checkpoint
from meshrl.trainer import load_config, loop, train
from meshrl.trainer.rollout_step import RolloutStep
from meshrl.trainer.signals import RunInterrupted

# One process (no update / decode workers) keeps these fast on a busy machine; the slow trials in
# test_resume_trials.py run the default worker processes and signal the whole process group.
FAST = [
    "model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=2", "rollout.group_size=4",
    "rollout.max_new_tokens=4", "train.micro_batch_size=8", "log.progress=false", "checkpoint.every=1",
    "train.mini_batches=2", "optim.lr=1e-2", "train.update_workers=1", "rollout.decode_workers=1",
]
STEPS = 3
TIME_KEYS = ("time/", "throughput/")


def _cfg(*extra: str, steps: int):
    return load_config(overrides=[*FAST, f"steps={steps}", *extra])


def _strip_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def _weights(run: Path, step: int):
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run every resumed run must reproduce."""
    run = tmp_path_factory.mktemp("full") / "run"
    train(_cfg(steps=STEPS), run)
    return run


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished 2-step run (checkpoints step_000001, step_000002) for tests to copy and damage."""
    run = tmp_path_factory.mktemp("two") / "run"
    train(_cfg(steps=2), run)
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _assert_same_run(run: Path, full: Path, step: int = STEPS) -> None:
    assert _strip_times(read_jsonl(run / "metrics.jsonl")) == _strip_times(read_jsonl(full / "metrics.jsonl"))
    ours, theirs = _weights(run, step), _weights(full, step)
    assert ours.keys() == theirs.keys()
    assert all((ours[k] == theirs[k]).all() for k in ours)


def _signal_in_update(monkeypatch, at_step: int, signals: int) -> None:
    """Deliver ``signals`` SIGTERMs from inside the second mini-batch update of step ``at_step`` (1-based)."""
    real = loop.Trainer.mini_batch_update
    calls = {"n": 0}

    def update(self, *args, **kwargs):
        if self.step_idx + 1 == at_step:
            calls["n"] += 1
            if calls["n"] == 2:  # the first mini-batch has already moved the weights
                for _ in range(signals):
                    os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loop.Trainer, "mini_batch_update", update)


# ---------------------------------------------------------------------- 1: SIGTERM mid-update
def test_sigterm_mid_update_finishes_the_step_and_resumes_exactly(tmp_path, monkeypatch, full_run):
    run = tmp_path / "run"
    _signal_in_update(monkeypatch, at_step=2, signals=1)
    with pytest.raises(RunInterrupted):
        train(_cfg("checkpoint.every=100", steps=STEPS), run)
    assert _latest(run) == "step_000002"  # the step under way was finished, then saved
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    state = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["step"] == 2 and state["cursor"] == 2 * 2
    assert read_jsonl(run / "events.jsonl")[-1]["event"] == "interrupted"
    monkeypatch.undo()
    train(_cfg(steps=STEPS), run, resume=True)
    _assert_same_run(run, full_run)
    # each start records the code and the CPU it ran on, at the step it started from
    starts = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "run_start"]
    assert [(e["step"], e["resumed"]) for e in starts] == [(0, False), (2, True)]
    assert all(e["code"] == code_version() and e["machine"]["capability"] for e in starts)


def test_second_sigterm_stops_at_once_without_saving_a_half_step(tmp_path, monkeypatch, full_run):
    run = tmp_path / "run"
    _signal_in_update(monkeypatch, at_step=2, signals=2)
    with pytest.raises(RunInterrupted, match="at once"):
        train(_cfg(steps=STEPS), run)
    assert _latest(run) == "step_000001"  # step 2 was cut mid-update: not a boundary, not saved
    assert not (run / "checkpoints" / "step_000002").exists()
    monkeypatch.undo()
    assert cli_main(["train", "--resume", str(run), "--steps", str(STEPS)]) == 0
    _assert_same_run(run, full_run)


def test_interrupt_during_the_rollout_saves_the_boundary_before_it(tmp_path, monkeypatch):
    real = RolloutStep.run

    def sample_then_interrupt(self, step, cursor):
        out = real(self, step, cursor)
        if step == 1:
            raise KeyboardInterrupt  # e.g. a second Ctrl-C while sampling: weights and counters untouched
        return out

    monkeypatch.setattr(RolloutStep, "run", sample_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg("checkpoint.every=100", steps=STEPS), tmp_path / "run")
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "state.json").read_text())
    assert state["cursor"] == 2  # the cursor of the boundary, not of the sampled step 2


# ---------------------------------------------------------------------- 2: atomic re-save
class _Killed(BaseException):
    """Stands in for a kill at the injection point."""


def _tiny_state():
    import torch

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "no-exchange"])
def test_resave_of_a_step_never_leaves_latest_on_a_missing_checkpoint(tmp_path, monkeypatch, exchange):
    model, opt = _tiny_state()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {"cursor": step})
    if not exchange:
        monkeypatch.setattr(ckpt_mod, "exchange_dirs", lambda a, b: False)
    seen = []

    def checked(real):
        def wrapped(*args, **kwargs):  # what a resume would find if the process died before or after this call
            seen.append(checkpoint_problem(tmp_path / "checkpoints" / _latest(tmp_path)))
            real(*args, **kwargs)
            seen.append(checkpoint_problem(tmp_path / "checkpoints" / _latest(tmp_path)))
        return wrapped

    monkeypatch.setattr(shutil, "rmtree", checked(shutil.rmtree))
    monkeypatch.setattr(os, "rename", checked(os.rename))
    save_checkpoint(tmp_path, 2, model, opt, {"cursor": 2})  # the re-save an interrupt after a save makes
    monkeypatch.undo()
    assert seen and all(p is None for p in seen), seen
    assert _latest(tmp_path) == "step_000002"
    assert checkpoint_problem(tmp_path / "checkpoints" / "step_000002") is None
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------- 3: records
def test_partial_last_lines_are_dropped_with_a_warning_naming_the_file(tmp_path, caplog, full_run):
    run = tmp_path / "run"
    train(_cfg(steps=2), run)
    for name in ("metrics.jsonl", "samples.jsonl"):  # what a kill in the middle of an append leaves
        with (run / name).open("a") as f:
            f.write('{"step": 3, "reward/me')
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        train(_cfg(steps=STEPS), run, resume=True)
    warned = " ".join(r.getMessage() for r in caplog.records if "partial last line" in r.getMessage())
    assert str(run / "metrics.jsonl") in warned and str(run / "samples.jsonl") in warned
    _assert_same_run(run, full_run)


def test_a_kill_during_the_records_rewrite_keeps_the_history(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()  # records of steps 1-3 and a checkpoint at 2: the resume drops step 3
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss/total": s}) + "\n" for s in (1, 2, 3)))
    before = (run / "metrics.jsonl").read_text()

    def killed_write_text(self, text, *args, **kwargs):
        Path.open(self, "w").write(text[: len(text) // 3])
        raise _Killed

    def killed_fsync(fd):
        raise _Killed

    monkeypatch.setattr(Path, "write_text", killed_write_text)  # wherever the rewrite writes, it dies there
    monkeypatch.setattr(os, "fsync", killed_fsync)
    from meshrl.jsonl import truncate_after_step

    with pytest.raises(_Killed):
        truncate_after_step(run / "metrics.jsonl", 2)
    monkeypatch.undo()
    assert (run / "metrics.jsonl").read_text() == before


# ---------------------------------------------------------------------- 4: temporaries
def test_temporaries_of_interrupted_saves_are_removed_at_start_and_resume(tmp_path):
    fresh = tmp_path / "fresh"
    (fresh / "checkpoints" / ".step_000001.k1ll").mkdir(parents=True)
    (fresh / "checkpoints" / ".step_000001.k1ll" / "model.safetensors").write_bytes(b"\0" * 1000)
    train(_cfg(steps=1), fresh)
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["latest", "step_000001"]
    (fresh / "checkpoints" / ".step_000002.x").mkdir()
    (fresh / "checkpoints" / ".latest.y").write_text("step_000002")
    (fresh / ".metrics.jsonl.z").write_text("{}")
    train(_cfg(steps=2), fresh, resume=True)
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    assert [p.name for p in fresh.glob(".*")] == [".meshrl-run"]  # only the marker: every temporary is gone


# ---------------------------------------------------------------------- 5: re-running a crashed run
def test_rerunning_a_run_that_died_before_its_first_checkpoint_starts_clean(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 3\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (1, 2)))
    (run / "checkpoints").mkdir()  # SIGKILL before the first save: records, no checkpoint
    args = ["train", "--model", "tiny", "--task", "tiny:repeat", "--steps", "2", "--out", str(run), "--no-progress",
            "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=4"]
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        assert cli_main(args) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert all("loss/total" in r for r in read_jsonl(run / "metrics.jsonl"))
    assert any("before its first checkpoint" in r.getMessage() for r in caplog.records)
    assert cli_main(args) == 2  # now it holds checkpoints: --resume, not a second start


# ---------------------------------------------------------------------- 6: pointer outside the run
def test_a_latest_pointer_outside_the_run_directory_is_refused(tmp_path, capsys, two_steps):
    run = _copy(two_steps, tmp_path)
    shutil.copytree(two_steps, tmp_path / "other")
    (run / "checkpoints" / "latest").write_text("../../other/checkpoints/step_000002")
    assert cli_main(["train", "--resume", str(run), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "latest" in err and "outside the run directory" in err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]


# ---------------------------------------------------------------------- 7: damaged checkpoints
def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "delete":
        path.unlink()
    elif how == "no_cursor":
        state = json.loads(path.read_text())
        del state["cursor"]
        path.write_text(json.dumps(state))
    elif how == "not_json":
        path.write_text('{"step": 2, "cur')


@pytest.mark.parametrize("name,how", [
    ("model.safetensors", "truncate"), ("model.safetensors", "flip"), ("optimizer.pt", "truncate"),
    ("rng.pt", "delete"), ("state.json", "no_cursor"), ("state.json", "not_json"),
])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog, two_steps, name, how):
    run = _copy(two_steps, tmp_path)
    _damage(run / "checkpoints" / "step_000002" / name, how)
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        train(_cfg(steps=2), run, resume=True)
    assert any(name in r.getMessage() and "step_000002" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]  # step 2 rerun from step 1
    assert checkpoint_problem(run / "checkpoints" / "step_000002") is None  # and saved again, intact


def test_fallback_resume_reproduces_the_uninterrupted_run(tmp_path, two_steps, full_run):
    run = _copy(two_steps, tmp_path)
    _damage(run / "checkpoints" / "step_000002" / "optimizer.pt", "flip")
    train(_cfg(steps=STEPS), run, resume=True)
    _assert_same_run(run, full_run)


def test_no_intact_checkpoint_names_the_files(tmp_path, capsys, two_steps):
    run = _copy(two_steps, tmp_path)
    _damage(run / "checkpoints" / "step_000002" / "state.json", "not_json")
    _damage(run / "checkpoints" / "step_000001" / "optimizer.pt", "delete")
    assert cli_main(["train", "--resume", str(run), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint" in err
    assert str(run / "checkpoints" / "step_000002" / "state.json") in err
    assert str(run / "checkpoints" / "step_000001" / "optimizer.pt") in err


def test_a_checkpoint_of_another_architecture_is_a_clear_error(tmp_path, capsys, two_steps):
    run = _copy(two_steps, tmp_path)
    assert cli_main(["train", "--resume", str(run), "--steps", "3", "--set", "model=tiny:small"]) == 2
    err = capsys.readouterr().err
    assert "another model architecture" in err and "step_000002" in err and "Traceback" not in err


# ---------------------------------------------------------------------- 9 (part): --out, corrupt files in a resume
def test_out_naming_a_file_is_a_clear_error(tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("not a directory")
    assert cli_main(["train", "--model", "tiny", "--steps", "1", "--out", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a part of its path is a file"):
        train(_cfg(steps=1), f / "run")


def test_corrupt_config_or_state_in_a_resume_names_the_file(tmp_path, capsys, two_steps):
    run = _copy(two_steps, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_000001")
    good = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(good[: len(good) // 2] + "\n  : [unclosed\n")
    assert cli_main(["train", "--resume", str(run), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'config.yaml'}, line" in err and "YAML syntax error" in err  # names the file and the line
    (run / "config.yaml").write_text(good)
    (run / "checkpoints" / "step_000002" / "state.json").write_bytes(b"\x00\xff garbage")
    assert cli_main(["train", "--resume", str(run), "--steps", "3"]) == 2
    assert str(run / "checkpoints" / "step_000002" / "state.json") in capsys.readouterr().err
