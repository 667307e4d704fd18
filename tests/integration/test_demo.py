"""meshrl demo plumbing at toy size: warm start -> three arms -> held-out eval by type -> comparisons."""

from __future__ import annotations

import json

import pytest

from meshrl.testbed.demo import ARMS, DemoSettings, run_demo


@pytest.mark.slow
def test_demo_pipeline_at_toy_size(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    s = DemoSettings(warm_steps=2, steps=1, prompts_per_step=2, group_size=3, ppo_epochs=1, mini_batches=1,
                     eval_problems=6, eval_n=2, ks=(1, 2), threads=1)
    summary = run_demo(tmp_path / "demo", settings=s, progress=False)
    assert set(summary["runs"]) == set(ARMS)
    assert set(summary["evals"]) == {*ARMS, "warm_start"}
    for arm in ARMS:
        metrics = [json.loads(x) for x in (tmp_path / "demo" / "runs" / arm / "metrics.jsonl").read_text().splitlines()]
        assert metrics[-1]["rollouts/count"] == 6  # matched budget: 2 problems x G=3 for every arm
        assert "strategy/max_mass" in metrics[-1] and "mei/query" in metrics[-1]
        ev = json.loads((tmp_path / "demo" / "evals" / arm / "eval.json").read_text())
        assert ev["overall"]["problems"] == 6 and ev["by"]["field"] == "type"
    assert {"fork_vs_grpo", "cp_only_vs_grpo", "mesh_vs_grpo"} <= set(summary["comparisons"])
    assert ARMS == ("grpo", "fork", "cp_only", "mesh")
    assert (tmp_path / "demo" / "demo_summary.json").is_file()


def test_demo_arms_run_the_default_engines(tmp_path):
    """The testbed's base pins generate sampling and one update process (the experiments reproduce sample for
    sample); the demo's arms override them with meshrl's defaults (the native decoder, forked update workers)."""
    from meshrl.testbed.demo import DEMO_ENGINE, arm_config
    from meshrl.trainer import load_config

    defaults = load_config(overrides=["model=tiny", "task=tiny:repeat"])
    for s in (DemoSettings(), DemoSettings.quick()):
        assert s.extra == DEMO_ENGINE
        cfg = arm_config("mesh", tmp_path, s, 0, 30)
        assert cfg.rollout.backend == defaults.rollout.backend == "auto"
        for key in ("share_prompts", "update_workers", "skip_zero_advantage"):
            assert getattr(cfg.train, key) == getattr(defaults.train, key)
    pinned = arm_config("grpo", tmp_path, DemoSettings(extra=()), 0, 30)
    assert pinned.rollout.backend == "hf" and pinned.train.update_workers == 1


def _summary(grpo_acc: float) -> dict:
    row = {"eval": {"pass@1": 0.0}, "eval_by_type": {"low": {"pass@1": 0.0}}}
    arms = {arm: row for arm in ARMS}
    arms["grpo"] = {"eval": {"pass@1": grpo_acc}, "eval_by_type": {"low": {"pass@1": grpo_acc}}}
    return {"settings": {"warm_steps": 120}, "final": {**arms, "warm_start": row}}


def test_plumbing_note_only_when_no_policy_moved_from_the_warm_start():
    from meshrl.testbed.demo import plumbing_note

    note = plumbing_note(_summary(0.0))
    assert note and "plumbing only" in note and "120 steps" in note
    assert plumbing_note(_summary(0.25)) is None
