"""meshrl demo at toy size: warm start -> GRPO and forking tokens on several seeds, in worker processes or here ->
the niche's story per run -> rates -> the printed table and caption."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from meshrl.testbed.demo import ARMS, DEMO_SEEDS, DemoSettings, caption, rates_record, run_demo, summary_markdown

# the shipped warm start (no training: it solves about half the problems, so the runs get rewards and updates)
TOY = DemoSettings(warm_steps=700, steps=2, prompts_per_step=2, group_size=3, ppo_epochs=1, mini_batches=1,
                   eval_every=1, eval_problems=12, eval_n=2, workers=1)


def _records(run_dir):
    ev = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    return ev, [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_demo_pipeline_at_toy_size_and_the_same_runs_in_worker_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    summary = run_demo(tmp_path / "one", seeds=(0, 1), settings=TOY, progress=False)
    updated = False
    assert set(summary["runs"]) == {f"{a}/seed_{s}" for a in ARMS for s in (0, 1)}
    for key, d in summary["runs"].items():
        arm, seed = key.split("/seed_")
        evals, metrics = _records(Path(d))
        assert [e["step"] for e in evals] == [0, 1, 2]  # the starting policy, then every step
        assert all("eval/by/decade/mean@1" in e for e in evals)
        assert metrics[-1]["rollouts/count"] == 6  # matched budget: 2 problems x G=3 for every arm
        updated |= any(m["grad/norm"] > 0 for m in metrics)
        assert "mei/query" in metrics[-1]
        story = summary["stories"][arm][int(seed)]
        assert [s for s, _ in story["curve"]] == [0, 1, 2]
    assert summary["rates"]["grpo"]["runs"] == 2 and summary["seeds"] == [0, 1]
    assert updated  # some update had a gradient: the comparison below covers training, not sampling alone
    # two at a time in spawned workers, one thread each: the same records (each run sets its own thread count)
    two = run_demo(tmp_path / "two", seeds=(0, 1), settings=dataclasses.replace(TOY, workers=2), progress=False)
    for key in summary["runs"]:
        a, b = _records(Path(summary["runs"][key])), _records(Path(two["runs"][key]))
        drop = ("time/", "throughput/", "mem/")
        assert a[0] == b[0]
        assert [{k: v for k, v in m.items() if not k.startswith(drop)} for m in a[1]] == \
            [{k: v for k, v in m.items() if not k.startswith(drop)} for m in b[1]]
    text = summary_markdown(summary)
    assert text.count("| grpo |") == 2 and text.count("| fork |") == 2 and "Mesh at the paper's" in text
    # a second call reuses the finished runs: nothing is trained or written again
    stamps = {k: (Path(d) / "metrics.jsonl").stat().st_mtime_ns for k, d in summary["runs"].items()}
    again = run_demo(tmp_path / "one", seeds=(0, 1), settings=TOY, progress=False)
    assert again["stories"] == summary["stories"]
    assert stamps == {k: (Path(d) / "metrics.jsonl").stat().st_mtime_ns for k, d in again["runs"].items()}
    # ... and refuses a directory made with other settings (--quick and the full demo share the default --out)
    with pytest.raises(ValueError, match=r"other settings \(steps differ"):
        run_demo(tmp_path / "one", seeds=(0, 1), settings=dataclasses.replace(TOY, steps=3), progress=False)
    # rates written with --rates-out become the caption of a demo with the same settings, and only of that one
    rec = tmp_path / "rates.json"
    rec.write_text(json.dumps(rates_record(summary)))
    assert "Over RL seeds 0-1" in caption(TOY, rec) and "grpo: fell in" in caption(TOY, rec)
    assert "other settings" in caption(dataclasses.replace(TOY, steps=3), rec)
    assert "Over RL seeds" in caption(dataclasses.replace(TOY, workers=2), rec)  # workers change no figure


def test_demo_arms_run_the_default_engines_and_evaluate_the_niche_from_step_0(tmp_path):
    """The testbed's base pins generate sampling and one update process (the experiments reproduce sample for
    sample); the demo's arms override them with meshrl's defaults, and evaluate by type every eval_every steps."""
    from meshrl.testbed.demo import DEMO_ENGINE, arm_config
    from meshrl.trainer import load_config

    defaults = load_config(overrides=["model=tiny", "task=tiny:repeat"])
    for s in (DemoSettings(), DemoSettings.quick()):
        assert s.extra == DEMO_ENGINE
        cfg = arm_config("fork", tmp_path, s, 0, 30)
        assert cfg.rollout.backend == defaults.rollout.backend == "auto"
        for key in ("share_prompts", "update_workers", "skip_zero_advantage"):
            assert getattr(cfg.train, key) == getattr(defaults.train, key)
        assert (cfg.eval.every, cfg.eval.at_start, cfg.eval.by) == (s.eval_every, True, "type")
        assert cfg.diag.mei.every == 1 and cfg.plugins.fork.enabled
    pinned = arm_config("grpo", tmp_path, DemoSettings(extra=()), 0, 30)
    assert pinned.rollout.backend == "hf" and pinned.train.update_workers == 1
    assert DEMO_SEEDS == (0, 1, 2) and ARMS == ("grpo", "fork")


def test_the_shipped_caption_was_measured_with_the_demos_settings():
    """The rates the demo prints were measured by this demo's configuration over ten seeds: a change of the
    settings without a new measurement would print another configuration's rates (caption() then refuses)."""
    from meshrl.testbed.demo import RATES_FILE

    rec = json.loads(RATES_FILE.read_text())
    assert rec["settings"] == json.loads(json.dumps(DemoSettings().numeric()))
    assert rec["seeds"] == list(range(10)) and set(rec["rates"]) == set(ARMS)
    assert all(r["runs"] == 10 for r in rec["rates"].values())
    assert caption(DemoSettings()).startswith("Over RL seeds 0-9")


def _summary(values: list[float]) -> dict:
    story = {"curve": list(enumerate(values))}
    return {"settings": {"warm_steps": 120}, "stories": {"grpo": {0: story}, "fork": {0: story}}}


def test_plumbing_note_only_when_no_niche_moved_from_step_0():
    from meshrl.testbed.demo import plumbing_note

    note = plumbing_note(_summary([0.0, 0.0, 0.0]))
    assert note and "plumbing only" in note and "120 steps" in note
    assert plumbing_note(_summary([0.0, 0.25, 0.0])) is None


def test_a_run_stopped_in_a_worker_reaches_the_demo_as_itself():
    """RunInterrupted crosses the process pool (pickled) with its signal, so Ctrl-C in a worker is not a
    BrokenProcessPool."""
    import pickle
    import signal

    from meshrl.trainer.signals import RunInterrupted

    err = pickle.loads(pickle.dumps(RunInterrupted(signal.SIGTERM)))
    assert isinstance(err, RunInterrupted) and err.signum == signal.SIGTERM and str(err) == "stopped by SIGTERM"
