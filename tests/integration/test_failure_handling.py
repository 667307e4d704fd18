"""Failed runs end with one clear line, their records and a checkpoint: disk full, NaN log-probs, non-finite
aborts, a dead policy (``optim.lr=1e6``), a failing scorer under ``--strict-rewards``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from meshrl.cli import main as cli_main
from meshrl.jsonl import read_jsonl
from meshrl.runs import checkpoint as ckpt_mod
from meshrl.runs.checkpoint import CheckpointSpaceError, checkpoint_problem
from meshrl.trainer import NonFiniteAbort, load_config, loss, train
from meshrl.trainer.failure import RewardsFailed, RunHealth, StalledRun

FAST = ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "train.micro_batch_size=8", "log.progress=false", "checkpoint.every=1"]
CLI = ["train", "--model", "tiny", "--task", "tiny:repeat", "--no-progress",
       *[a for kv in FAST for a in ("--set", kv)]]


def _cfg(*extra: str, steps: int):
    return load_config(overrides=["model=tiny", "task=tiny:repeat", *FAST, f"steps={steps}", *extra])


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("meshrl train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------- 8: disk full during a save
def test_disk_full_during_a_save_is_a_clear_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    real = ckpt_mod.save_model
    calls = {"n": 0}

    def fills_the_disk(model, filename, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] < 2:
            return real(model, filename, *args, **kwargs)
        Path(filename).write_bytes(b"\0" * 4096)  # part of the file made it to disk
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    monkeypatch.setattr(ckpt_mod, "save_model", fills_the_disk)
    run = tmp_path / "run"
    with pytest.raises(CheckpointSpaceError) as info:
        train(_cfg(steps=3), run)
    msg = str(info.value)
    assert str(run / "checkpoints") in msg and "MiB" in msg and "needs about" in msg
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # partial files removed
    assert (root / "latest").read_text() == "step_000001" and checkpoint_problem(root / "step_000001") is None
    monkeypatch.undo()
    train(_cfg(steps=3), run, resume=True)  # the run continues from the intact checkpoint
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    real = shutil.disk_usage

    def nearly_full(path):
        u = real(path)
        return type(u)(u.total, u.total - 1000, 1000)

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    out = tmp_path / "run"
    assert cli_main([*CLI, "--steps", "1", "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "not enough disk space" in line and str(out / "checkpoints") in line
    assert not [p for p in (out / "checkpoints").iterdir()]


# ---------------------------------------------------------------------- 10: non-finite values
@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "update-workers"])
def test_nan_log_probs_take_the_nonfinite_skip_path(tmp_path, monkeypatch, workers):
    real = loss.token_logprobs

    def nan_logprobs(*args, **kwargs):
        return real(*args, **kwargs) * float("nan")

    monkeypatch.setattr(loss, "token_logprobs", nan_logprobs)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteAbort, match="failure.max_nonfinite=2"):
        # train.head_chunk=0: the whole-logits path, the one poisoned here (test_head_chunks.py poisons the other)
        train(_cfg("failure.max_nonfinite=2", f"train.update_workers={workers}", "train.head_chunk=0", steps=4), run)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["skipped/nonfinite"] == 1.0 for m in metrics)
    events = [e["event"] for e in read_jsonl(run / "events.jsonl")]
    assert events == ["run_start", "nonfinite_skip", "nonfinite_skip", "nonfinite_abort"]
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"


def test_nonfinite_abort_is_one_line_with_the_steps_metrics_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loss, "aggregate", lambda *a, **k: torch.tensor(float("nan"), requires_grad=True))
    out = tmp_path / "run"
    rc = cli_main([*CLI, "--steps", "5", "--out", str(out), "--set", "failure.max_nonfinite=3"])
    assert rc == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "3 consecutive steps" in line and "step_000003" in line
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_dead_policy_is_detected_and_stopped(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli_main([*CLI, "--steps", "12", "--out", str(out), "--set", "optim.lr=1e6"])
    assert rc == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "stopped learning" in line and "uniform" in line and "optim.lr" in line
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) < 12 and metrics[-1]["grad/norm"] == 0.0
    assert read_jsonl(out / "events.jsonl")[-1]["event"] == "stalled"


def test_stall_tally_ignores_flat_steps_and_resets_on_a_gradient():
    health = RunHealth(max_nonfinite=3, max_stalled=2, vocab_size=100)
    dead = {"grad/norm": 0.0, "adv/abs_mean": 0.2, "entropy/mean": 4.60517, "lr": 1e6}
    flat = {"grad/norm": 0.0, "adv/abs_mean": 0.0}  # every group scored alike: zero gradient by construction
    assert health.verdict({"step": 1, **dead}, 0, Path(".")) is None
    assert health.verdict({"step": 2, **flat}, 0, Path(".")) is None
    assert health.verdict({"step": 3, "grad/norm": 0.5, "adv/abs_mean": 0.2}, 0, Path(".")) is None
    assert health.verdict({"step": 4, **dead}, 0, Path(".")) is None
    assert isinstance(health.verdict({"step": 5, **dead}, 0, Path(".")), StalledRun)
    off = RunHealth(max_nonfinite=3, max_stalled=0, vocab_size=100)
    assert all(off.verdict({"step": s, **dead}, 0, Path(".")) is None for s in range(10))


def test_a_scorer_that_always_fails_stops_the_run(tmp_path, monkeypatch, capsys):
    from meshrl.tasks.tiny import RepeatTask

    def broken(self, completion, problem):
        raise RuntimeError("scorer bug")

    monkeypatch.setattr(RepeatTask, "score", broken)
    out = tmp_path / "run"
    rc = cli_main([*CLI, "--steps", "10", "--out", str(out), "--set", "failure.max_reward_failed=3"])
    assert rc == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "every reward call failed in 3 steps in a row" in line and "8 errors" in line
    assert "RuntimeError: scorer bug" in line and "failure.max_reward_failed=3" in line
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["reward/errors"] == 8 for m in metrics)
    event = read_jsonl(out / "events.jsonl")[-1]
    assert event["event"] == "rewards_failed" and event["checkpoint"].endswith("step_000003")


def test_failed_rewards_tally_counts_only_steps_where_every_call_failed():
    health = RunHealth(max_nonfinite=3, max_stalled=3, vocab_size=100, max_reward_failed=2)
    failed = {"rollouts/count": 8.0, "reward/errors": 6, "reward/timeouts": 2}
    partly = {"rollouts/count": 8.0, "reward/errors": 7, "reward/timeouts": 0}  # one rollout scored
    empty = {"rollouts/count": 0.0, "reward/errors": 0, "reward/timeouts": 0}
    assert health.verdict({"step": 1, **failed}, 0, Path(".")) is None
    assert health.verdict({"step": 2, **partly}, 0, Path(".")) is None  # resets the tally
    assert health.verdict({"step": 3, **failed}, 0, Path(".")) is None
    assert health.verdict({"step": 4, **empty}, 0, Path(".")) is None  # nothing scored: neither counts nor resets
    err = health.verdict({"step": 5, **failed}, 0, Path("."), "reward for problem p raised KeyError: 'x'")
    assert isinstance(err, RewardsFailed)
    assert "2 steps in a row (to step 5" in str(err) and "6 errors, 2 timeouts" in str(err)
    assert "raised KeyError: 'x'" in str(err)
    off = RunHealth(max_nonfinite=3, max_stalled=3, vocab_size=100, max_reward_failed=0)
    assert all(off.verdict({"step": s, **failed}, 0, Path(".")) is None for s in range(1, 10))


def test_held_out_scoring_failures_are_the_evaluations_not_the_training_steps(tmp_path, monkeypatch):
    """Held-out problems whose scorer fails count in eval/reward_errors, never in the next step's reward/errors
    (where the failed-rewards check would read them)."""
    from meshrl.tasks.tiny import RepeatTask

    real = RepeatTask.score

    def fails_on_held_out(self, completion, problem):
        if problem.id.startswith("repeat-eval-"):
            raise RuntimeError("held-out scorer bug")
        return real(self, completion, problem)

    monkeypatch.setattr(RepeatTask, "score", fails_on_held_out)
    hist = train(_cfg("eval.every=1", "eval.n=2", "failure.max_reward_failed=1", steps=3), tmp_path / "run")
    assert [m["step"] for m in hist] == [1, 2, 3]
    assert all(m["reward/errors"] == 0 and m["reward/timeouts"] == 0 for m in hist)
    evals = read_jsonl(tmp_path / "run" / "evals.jsonl")
    assert len(evals) == 3 and all(e["eval/reward_errors"] == 16 * 2 for e in evals)


# ---------------------------------------------------------------------- 11: --strict-rewards
def test_strict_reward_error_is_one_line_and_leaves_a_checkpoint(tmp_path, monkeypatch, capsys):
    from meshrl.tasks.tiny import RepeatTask

    real = RepeatTask.score
    calls = {"n": 0}

    def breaks_in_step_2(self, completion, problem):
        calls["n"] += 1
        if calls["n"] > 8:  # the 8 rollouts of step 1 score; step 2's first one raises
            raise RuntimeError("scorer bug")
        return real(self, completion, problem)

    monkeypatch.setattr(RepeatTask, "score", breaks_in_step_2)
    out = tmp_path / "run"
    rc = cli_main([*CLI, "--steps", "3", "--out", str(out), "--strict-rewards", "--set", "checkpoint.every=10"])
    assert rc == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "scorer bug" in line and "step_000001" in line
    state = json.loads((out / "checkpoints" / "step_000001" / "state.json").read_text())
    assert state["cursor"] == 2  # the boundary after step 1, not the problems step 2 was sampling
    assert read_jsonl(out / "events.jsonl")[-1]["event"] == "error"
    monkeypatch.undo()
    assert cli_main(["train", "--resume", str(out), "--steps", "3"]) == 0
