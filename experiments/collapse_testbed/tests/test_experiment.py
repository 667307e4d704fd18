"""The testbed experiment machinery: Spearman, the lead summary, and a toy-size end-to-end run."""

from __future__ import annotations

import json
import math

import pytest

from experiments.collapse_testbed.results import spearman


def test_spearman_hand_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties: x ranks (1.5, 1.5, 3), y ranks (1, 2, 3) -> Pearson of those = 0.866...
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


@pytest.mark.slow
def test_experiment_end_to_end_at_toy_size(tmp_path, monkeypatch):
    from experiments.collapse_testbed.cli import main as cli_main
    from experiments.collapse_testbed.experiment import ExperimentSettings, run_experiment

    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    s = ExperimentSettings(steps=2, prompts_per_step=2, group_size=3, probe_every=1, probe_problems=3,
                           probe_group=3, eval_problems=6, eval_n=2, ks=(1, 2), seeds=(0,),
                           arms=("grpo", "mesh_mu1e-1", "support_mu1"), warm_steps=2, workers=2)
    out = run_experiment(tmp_path / "exp", s, progress=False)
    for arm in s.arms:
        d = out / "runs" / arm / "seed_0"
        hist = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert [h["rollouts/count"] for h in hist] == [6.0, 6.0]  # matched budget for every arm
        assert (d / "eval" / "eval.json").is_file()
    probes = [json.loads(x) for x in (out / "runs" / "grpo" / "seed_0" / "probes.jsonl").read_text().splitlines()]
    assert [p["step"] for p in probes] == [0, 1, 2]
    assert {"mei/full", "ari/head@0.2", "true_max_mass", "ref_logp/min"} <= set(probes[0])
    assert not (out / "runs" / "mesh_mu1e-1" / "seed_0" / "probes.jsonl").exists()  # only baselines probed
    assert cli_main(["--out", str(out), "--summarize-only"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["arms"]) == set(s.arms)
    assert set(res["paired_vs_grpo"]["mean"]) == {"mesh_mu1e-1", "support_mu1"}
    assert res["warning"]["runs"][0]["arm"] == "grpo" and res["mei_vs_truth"]["queries"] > 0
    assert set(res["coach_following"]) == {"mesh_mu1e-1", "support_mu1"}
    assert {r["arm"] for r in res["warning_training"]["runs"]} == {"grpo"}
    assert "### Warning signals" in (out / "results.md").read_text()
    assert (out / "figures" / "testbed_final_by_type.png").is_file()
    # the compact pack rebuilds every table (the training rollouts replaced by the per-step series read from them)
    pack = tmp_path / "pack.json.gz"
    assert cli_main(["--out", str(out), "--summarize-only", "--pack", str(pack)]) == 0
    again = tmp_path / "again"
    assert cli_main(["--out", str(again), "--summarize-only", "--unpack", str(pack)]) == 0
    res2 = json.loads((again / "results.json").read_text())
    for key in ("arms", "paired_vs_grpo", "warning", "warning_training", "mei_vs_truth", "outcomes", "checkpoints",
                "compute", "separation", "curves", "coach_following", "partition"):
        # as text (NaN != NaN), with the directories' names taken out
        assert json.dumps(res2[key]).replace(str(again), "OUT") == json.dumps(res[key]).replace(str(out), "OUT"), key
    assert not (again / "runs" / "grpo" / "seed_0" / "samples.jsonl").exists()
    assert not (again / "runs" / "grpo" / "seed_0" / "checkpoints").exists()


def test_lead_summary_hand_case():
    from experiments.collapse_testbed.results import lead_summary

    runs = [{"crossings": {"ev": 12, "a": 8, "b": None}}, {"crossings": {"ev": 8, "a": 10, "b": 4}},
            {"crossings": {"ev": None, "a": 4, "b": 4}}]
    s = lead_summary(runs, ("a", "b"), ("ev",))
    assert s["a | ev"] == {"runs": 3, "event_seen": 2, "signal_seen": 3, "both": 2, "lead_mean": 1.0,
                           "lead_min": -2, "lead_max": 4}
    assert s["b | ev"]["both"] == 1 and s["b | ev"]["lead_mean"] == 4.0


def test_expert_traces_are_the_home_procedure_and_score_one(tmp_path):
    import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
    from experiments.collapse_testbed.experiment import ARMS, EXPERT_TRACES, expert_traces
    from meshrl.jsonl import read_jsonl
    from meshrl.tasks import load_task
    from meshrl.testbed.traces import label_strategy

    task = load_task("testbed:add", seed=3)
    path = expert_traces(tmp_path, task, 3)
    rows = {r["id"]: r["completion"] for r in read_jsonl(path)}
    problems = task.problems("train")
    assert list(rows) == [p.id for p in problems]
    for p in problems[:200]:
        assert task.score(rows[p.id], p) == 1.0 and label_strategy(rows[p.id]) == p.meta["home"]
    assert expert_traces(tmp_path, task, 3) == path  # written once
    assert any(EXPERT_TRACES in k for k in ARMS["grpo_calib"])
