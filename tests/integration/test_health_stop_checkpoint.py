"""A ``stop`` of the live health checks names the last checkpoint from before the finding's onset, and ``--resume``
continues from it, never from a checkpoint that already holds the unhealthy policy (step ``s``'s records measure
the policy checkpoint ``s - 1`` holds)."""

from __future__ import annotations

import pytest

from meshrl.jsonl import read_jsonl
from meshrl.trainer import HealthStop, load_config, train

# lr 0.5 wrecks the tiny policy in its first updates; the update_blowup alarm can fire at step 5 (min_steps)
BLOWUP = ["model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=2", "rollout.group_size=4",
          "rollout.max_new_tokens=6", "train.micro_batch_size=8", "log.progress=false", "checkpoint.every=100",
          "optim.lr=0.5", "health.every=1", "health.on.alarm=stop"]


def _stop(run, *extra: str) -> tuple[HealthStop, dict, int]:
    with pytest.raises(HealthStop, match="update_blowup") as caught:
        train(load_config(overrides=[*BLOWUP, "steps=12", *extra]), run)
    err = caught.value
    finding = next(e for e in read_jsonl(run / "events.jsonl")
                   if e.get("event") == "health_finding" and e.get("action") == "stop")
    stop = next(e for e in read_jsonl(run / "events.jsonl") if e.get("event") == "health_stop")
    return err, stop, min(finding["steps"])


def test_a_health_stop_names_and_resumes_from_the_checkpoint_before_the_onset(tmp_path):
    run = tmp_path / "run"
    err, stop, onset = _stop(run, "checkpoint.keep_last=20")
    assert err.onset == onset and onset >= 3  # this run's finding dates the blow-up after a kept checkpoint
    healthy = f"step_{onset - 2:06d}"
    assert str(err.checkpoint) == stop["checkpoint"] == str(run / "checkpoints" / healthy)
    assert (run / "checkpoints" / "latest").read_text().strip() == healthy
    assert "already hold the unhealthy policy" in str(err)
    resumed = train(load_config(overrides=[*BLOWUP, "optim.lr=1e-4", f"steps={onset}"]), run, resume=True)
    assert [int(m["step"]) for m in resumed] == list(range(onset - 1, onset + 1))


def test_a_health_stop_with_no_healthy_checkpoint_kept_says_so(tmp_path):
    run = tmp_path / "run"
    err, stop, onset = _stop(run)  # keep_last=2: the checkpoints from before the onset are pruned
    assert getattr(err, "checkpoint", None) is None and stop["checkpoint"] is None
    assert "no checkpoint from before the finding is kept" in str(err) and "checkpoint.keep_last" in str(err)
    assert f"step {onset}'s records" in stop["error"]
