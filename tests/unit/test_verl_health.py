"""The live checks of meshrl's verl trainer (``+meshrl.health_every``), without verl: the verdict at each checked
step equals ``meshrl doctor`` on verl's file-logger JSONL of the same metrics cut there; figures go back into the
step's metrics; ``stop`` names the last healthy step; bad settings are refused naming the key."""

from __future__ import annotations

import json
import math

import pytest

from meshrl.doctor import diagnose_records
from meshrl.doctor.engines import load_verl
from meshrl.doctor.live import truncate_records
from meshrl.integrations.verl.health import VerlHealth
from meshrl.integrations.verl.settings import settings_from_config
from meshrl.jsonl import read_jsonl


def verl_metrics(step: int) -> dict[str, float]:
    """A run whose score climbs to 0.7 by step 8, then falls back to 0.1 while the entropy collapses."""
    score = 0.1 + 0.6 * min(step, 8) / 8 - (0.6 * (step - 8) / 6 if step > 8 else 0.0)
    return {"critic/score/mean": max(score, 0.1), "actor/entropy": 2.0 * math.exp(-0.35 * step),
            "actor/grad_norm": 1.0, "actor/lr": 1e-6, "actor/pg_loss": 0.0, "response_length/mean": 40.0,
            "response_length/clip_ratio": 0.0, "critic/advantages/mean": 0.0}


def test_live_verdicts_equal_the_doctor_on_the_file_log_cut_there(tmp_path):
    health = VerlHealth(2, {}, tmp_path / "health")
    log_file = tmp_path / "verl.jsonl"
    with log_file.open("w") as fh:
        for step in range(1, 17):
            metrics = verl_metrics(step)
            figures, action, reason = health.after_step(step, metrics)
            metrics.update(figures)  # as the trainer does: the figures reach verl's loggers
            fh.write(json.dumps({"step": step, "data": metrics}) + "\n")
            assert (step % 2 == 0) == bool(figures) and action in ("ignore", "warn") and not reason
    checks = [e for e in read_jsonl(tmp_path / "health" / "health_events.jsonl") if e["event"] == "health_check"]
    assert [c["step"] for c in checks] == list(range(2, 17, 2))
    rec = load_verl(log_file)
    for check in checks:
        assert check["findings"] == diagnose_records(truncate_records(rec, check["step"])).ids(), check["step"]
    assert {"reward_collapse", "entropy_collapse"} & set(checks[-1]["findings"])


def test_stop_names_the_last_healthy_step(tmp_path):
    health = VerlHealth(1, {"alarm": "stop", "warning": "stop"}, tmp_path)
    for step in range(1, 30):
        figures, action, reason = health.after_step(step, verl_metrics(step))
        if action == "stop":
            break
    assert action == "stop" and figures["health/new"] >= 1
    assert reason.startswith(f"run health at step {step}:")
    assert f"last step the checks found healthy: step {step - 1}" in reason


def test_health_settings_are_checked_by_name():
    s = settings_from_config({"health_every": 5, "health_on": {"alarm": "stop"}})
    assert s.health_every == 5 and s.health_on == {"alarm": "stop"}
    with pytest.raises(ValueError, match="meshrl.health_on.alarm='halt'"):
        settings_from_config({"health_on": {"alarm": "halt"}})
    with pytest.raises(ValueError, match="meshrl.health_on.bogus: not a severity"):
        settings_from_config({"health_on": {"bogus": "stop"}})
    with pytest.raises(ValueError, match="meshrl.health_every must be an integer >= 0"):
        settings_from_config({"health_every": -1})


def write_dump(folder, step: int, outputs: list[str]) -> None:
    """verl's ``_dump_generations`` file for one step."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{step}.jsonl").write_text("".join(
        json.dumps({"input": "2+2=", "output": o, "gts": "4", "score": 0.0, "step": step}) + "\n" for o in outputs))


def test_the_completion_checks_read_verls_generation_dumps(tmp_path):
    """Garbled completions in verl's rollout dumps: ``meshrl doctor LOG --samples DIR`` finds them, and the live
    check at step t reads the dumps of the steps before t (verl writes a step's dump after its metrics)."""
    dumps, log_file = tmp_path / "rollout_data", tmp_path / "verl.jsonl"
    garbled = ["zzzzzzzzzzzzzzzzzzzzzzzzzzzzzz", "abababababababababababababababab"]
    health = VerlHealth(1, {}, tmp_path / "health", dumps)
    with log_file.open("w") as fh:
        for step in range(1, 9):
            metrics = verl_metrics(step)
            health.after_step(step, metrics)  # the metrics stage: this step's dump is not written yet
            write_dump(dumps, step, garbled)
            fh.write(json.dumps({"step": step, "data": metrics}) + "\n")
    post = load_verl(log_file, dumps)
    assert len(post.samples) == 16 and {s["step"] for s in post.samples} == set(range(1, 9))
    assert "garbled_output" in diagnose_records(post).ids()
    assert "garbled_output" in [u.id for u in diagnose_records(load_verl(log_file)).unchecked]  # without the dumps
    checks = [e for e in read_jsonl(tmp_path / "health" / "health_events.jsonl") if e["event"] == "health_check"]
    for check in checks:
        t = check["step"]
        cut = truncate_records(post, t)
        cut.samples = [s for s in cut.samples if s["step"] < t]  # what existed at step t's metrics stage
        assert check["findings"] == diagnose_records(cut).ids(), t
    assert "garbled_output" in checks[-1]["findings"]


def test_samples_option_is_checked(tmp_path):
    from meshrl.doctor import diagnose

    log_file = tmp_path / "verl.jsonl"
    log_file.write_text(json.dumps({"step": 1, "data": verl_metrics(1)}) + "\n")
    with pytest.raises(ValueError, match="--samples .*: not a directory"):
        diagnose(log_file, samples=tmp_path / "nope")
