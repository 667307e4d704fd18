"""The testbed experiment machinery: ARI, thresholds, crossings, Spearman, and a toy-size end-to-end run."""

from __future__ import annotations

import json
import math

import pytest

from experiments.collapse_testbed.results import spearman
from meshrl.testbed.signals import adjusted_rand_index, calibrated_threshold, first_crossing


def test_adjusted_rand_index_hand_values():
    assert adjusted_rand_index([0, 0, 1, 1], ["a", "a", "b", "b"]) == 1.0  # same partition, other names
    assert adjusted_rand_index([0, 0, 0, 0], [1, 1, 1, 1]) == 1.0  # one cluster each: identical
    # Contingency [[2,1],[0,1]] (a = 0,0,0,1; b = x,x,y,y): sum_ij C = 1, sum_a C = 3, sum_b C = 2,
    # E = 3*2/6 = 1, max = 2.5 -> ARI = (1 - 1) / (2.5 - 1) = 0.
    assert adjusted_rand_index([0, 0, 0, 1], ["x", "x", "y", "y"]) == pytest.approx(0.0)
    # a = 0,0,1,1,2,2 vs b = 0,0,0,1,1,1: sum_ij = 1+0+0+1 = 2 (cells (0,0)=2,(1,0)=1,(1,1)=1,(2,1)=2 -> 1+0+0+1),
    # sum_a = 3, sum_b = 6, E = 18/15 = 1.2, max = 4.5 -> (2 - 1.2) / (4.5 - 1.2) = 0.2424...
    assert adjusted_rand_index([0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1]) == pytest.approx(0.8 / 3.3)
    with pytest.raises(ValueError, match="length"):
        adjusted_rand_index([0], [0, 1])


def test_crossings_and_thresholds():
    steps = [0, 4, 8, 12, 16]
    assert first_crossing(steps, [1, 2, 5, 6, 7], 4.0, "up") == 8
    assert first_crossing(steps, [1, 5, 2, 6, 7], 4.0, "up", patience=2) == 12
    assert first_crossing(steps, [9, 8, 7, 6, 5], 4.0, "down") is None
    assert first_crossing(steps, [9, float("nan"), 3, 6, 5], 4.0, "down") == 8
    with pytest.raises(ValueError, match="direction"):
        first_crossing(steps, [1] * 5, 0.0, "sideways")
    assert calibrated_threshold([1.0, 2.0, 3.0], "up") == pytest.approx(2 + 3 * 1.0)
    assert calibrated_threshold([1.0, 2.0, 3.0], "down", k_sd=2) == pytest.approx(0.0)
    assert calibrated_threshold([5.0, 5.0], "up", min_sd=0.5) == pytest.approx(6.5)
    with pytest.raises(ValueError, match="baseline"):
        calibrated_threshold([1.0], "up")


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
