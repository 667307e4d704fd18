"""experiments.lagged_accuracy: the runs' keys as the trainer reads them, the pre-registered endpoints and every
branch of the decision on hand-made evaluations, and the whole pipeline (runs, resume, skip, pack, table) on the
tiny model."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from experiments.lagged_accuracy import analysis, experiment
from experiments.lagged_accuracy.__main__ import main


@pytest.fixture
def data(tmp_path):
    return experiment.write_data(tmp_path / "add_20.jsonl", 20, 50)


def test_the_k2_arm_sets_the_lag_its_correction_and_the_inline_sampler(data):
    from meshrl.trainer import load_config

    cfg = load_config(overrides=experiment.run_overrides(experiment.Settings(), "k2", 1, data))
    r = cfg.rollout
    assert (r.max_staleness, r.staleness_correction, r.sampler_process) == (2, "tis", "inline")
    assert (r.prompts_per_step, r.group_size, r.max_new_tokens, r.temperature) == (4, 8, 32, 1.0)
    assert (cfg.model, cfg.steps, cfg.seed, cfg.task) == ("smollm2-135m", 100, 1, experiment.task_spec(data))
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.schedule) == (1e-5, 5, "constant")
    assert (cfg.train.ppo_epochs, cfg.train.mini_batches, cfg.train.dtype) == (1, 1, "float32")
    assert (cfg.eval.every, cfg.eval.at_start, cfg.eval.limit, cfg.eval.n, cfg.eval.temperature) == \
        (25, True, 100, 4, 1.0)
    assert cfg.checkpoint.every == 25


def test_the_k0_arm_leaves_the_lag_at_zero(data):
    from meshrl.trainer import load_config

    keys = experiment.run_overrides(experiment.Settings(), "k0", 0, data)
    assert load_config(overrides=keys).rollout.max_staleness == 0
    assert not any("staleness_correction" in k or "sampler_process" in k for k in keys)
    with pytest.raises(ValueError, match="unknown arm"):
        experiment.run_overrides(experiment.Settings(), "k1", 0, data)


def _evals(*points):
    return [{"step": s, "eval/mean@1": v} for s, v in points]


def test_endpoints_gain_and_differences():
    r = analysis.run_endpoints(_evals((0, 0.125), (25, 0.2), (100, 0.3), (50, 0.25)), horizon=100)
    assert (r["acc0"], r["final"]) == (0.125, 0.3) and r["gain"] == pytest.approx(0.175)
    assert [s for s, _ in r["curve"]] == [0, 25, 50, 100]
    assert math.isnan(analysis.run_endpoints(_evals((0, 0.1), (25, 0.2)), horizon=100)["gain"])  # not evaluated
    runs = {"k0/seed_0": {"arm": "k0", "seed": 0, "final": 0.30}, "k2/seed_0": {"arm": "k2", "seed": 0, "final": 0.25},
            "k0/seed_1": {"arm": "k0", "seed": 1, "final": 0.30}}  # seed 1 has no k2 run: no pair
    assert analysis.differences(runs) == {0: pytest.approx(-0.05)}


def test_improvement_rules():
    assert analysis.improvement([0.05, 0.02, 0.02]) == "improves"  # mean exactly 0.03
    assert analysis.improvement([0.01, 0.01, 0.01]) == "inconclusive"  # all positive, mean below 0.03
    assert analysis.improvement([0.2, 0.0, -0.01]) == "does not improve"
    assert analysis.improvement([0.2, 0.1]) == "incomplete (2 of 3 seeds)"  # fewer than 3 seeds cannot "improve"
    assert analysis.improvement([0.2, 0.1]) == "incomplete (2 of 3 seeds)"
    assert analysis.improvement([0.0, -0.1]) == "does not improve"  # decided before the third seed
    assert analysis.improvement([]) == "incomplete (0 of 3 seeds)"
    assert analysis.improvement([0.2, 0.1, math.nan]) == "inconclusive (1 run(s) without acc100)"


@pytest.mark.parametrize(("k0", "k2", "diffs", "verdict"), [
    ([0.1, 0.1, 0.1], [0.1, 0.1, 0.1], {0: 0.02, 1: -0.0025, 2: 0.04}, "within 2 points"),  # mean 0.0192
    ([0.1, 0.1, 0.1], [0.1, 0.1, 0.1], {0: 0.02, 1: 0.02, 2: 0.02}, "within 2 points"),  # exactly 2 points
    ([0.1, 0.1, 0.1], [0.0, 0.0, 0.05], {0: -0.05, 1: -0.04, 2: 0.0}, "k2 below k0 by 0.030"),
    ([0.1, 0.1, 0.1], [0.2, 0.2, 0.2], {0: 0.1, 1: 0.1, 2: 0.1}, "k2 above k0 by 0.100"),
    ([0.0, -0.01, 0.1], [0.0, 0.0, 0.0], {0: 0.0, 1: 0.0, 2: 0.0}, "uninformative (both flat)"),
    ([0.0, -0.01, 0.1], [0.1, 0.1, 0.1], {0: 0.1, 1: 0.1, 2: 0.0}, "uninformative (k0 flat, k2 improves)"),
    ([0.01, 0.01, 0.01], [0.01, 0.01, 0.01], {0: 0.0, 1: 0.0, 2: 0.0},
     "within 2 points; k0's improvement inconclusive"),
    ([0.1, 0.1], [0.1], {0: 0.0},
     "partial (1 of 3 pairs), so far: within 2 points; k0's improvement incomplete (2 of 3 seeds)"),
    ([0.0, -0.1], [0.1], {0: 0.0}, "partial (1 of 3 pairs), so far: uninformative (k0 flat, k2 incomplete "
                                   "(1 of 3 seeds))"),
])
def test_decision_branches(k0, k2, diffs, verdict):
    d = analysis.decision(k0, k2, diffs, planned=3)
    assert d["verdict"] == verdict
    assert d["pairs"] == len(diffs) and (d["min_d"], d["max_d"]) == (min(diffs.values()), max(diffs.values()))


def _pack(finals: dict[str, float], steps: int = 100) -> dict:
    runs = {}
    for key, final in finals.items():
        lagged = key.startswith("k2")
        metrics = [{"step": s, "time/step_s": 10.0 * (1 + lagged) + s,
                    **({"lag/staleness_mean": min(s - 1, 2), "rollout_corr/ess": 0.9,
                        "rollout_corr/frac_truncated": 0.01} if lagged else {})} for s in (1, 2, 3)]
        runs[key] = {"evals": _evals((0, 0.1), (50, 0.2), (steps, final)), "metrics": metrics}
    return {"settings": {"steps": steps, "seeds": [0, 1, 2]}, "runs": runs}


def test_analyse_and_table_on_a_hand_made_pack():
    finals = {"k0/seed_0": 0.2, "k0/seed_1": 0.3, "k0/seed_2": 0.25, "k2/seed_0": 0.21, "k2/seed_1": 0.28,
              "k2/seed_2": 0.25}
    result = analysis.analyse(_pack(finals))
    d = result["decision"]
    assert d["k0"] == "improves" and d["verdict"] == "within 2 points"
    assert d["mean_d"] == pytest.approx(-0.01 / 3) and result["differences"][1] == pytest.approx(-0.02)
    k0, k2 = result["arms"]["k0"], result["arms"]["k2"]
    assert math.isnan(k0["rollout_corr/ess"]) and k0["median_step_s"] == 12.0
    assert k2["lag/staleness_mean"] == pytest.approx(1.0) and k2["rollout_corr/ess"] == 0.9
    assert k2["median_step_s"] == 22.0 and k2["mean_gain"] == pytest.approx(0.74 / 3 - 0.1)
    text = analysis.table(result)
    assert "**Verdict: within 2 points.**" in text and "| k2 | 1 | 0.100 | 0.200 | 0.280 | +0.180 | - | - |" in text
    assert "| 1 | 0.300 | 0.280 | -0.020 | - |" in text and "| k0 | 3 of 3 | improves |" in text
    assert "Runs in the pack: 6 of the 6 pre-registered." in text and "not the pre-registered" not in text


def test_settings_of_another_experiment_are_refused(tmp_path):
    experiment.write_settings(tmp_path, experiment.Settings())
    experiment.write_settings(tmp_path, experiment.Settings(steps=150))  # more steps continue the runs
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        experiment.write_settings(tmp_path, experiment.Settings(lr=2e-5))


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["run", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert main(["run", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert main(["table", "--pack-file", str(tmp_path / "none.json.gz")]) == 2
    assert "no such pack" in capsys.readouterr().err
    assert main(["table", "--out", str(tmp_path / "none")]) == 2
    assert main(["pack", "--out", str(tmp_path)]) == 2  # not a run directory
    assert "no settings.json" in capsys.readouterr().err


TINY = experiment.Settings(model="tiny", problems=40, steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4,
                           warmup_steps=0, eval_every=1, eval_limit=4, eval_n=2, checkpoint_every=1, seeds=(0,),
                           extra=("task=tiny:add",))


@pytest.mark.slow  # two tiny runs of 1 step, resumed to 2 in one spawned worker (~15 s)
def test_the_pipeline_on_the_tiny_model(tmp_path):
    out = tmp_path / "runs"
    out.mkdir()
    data = experiment.write_data(experiment.data_path(TINY, out), TINY.high, TINY.problems)
    for arm in ("k0", "k2"):  # a first call, stopped after step 1 (in-process: no worker to start)
        experiment.run_one(TINY, arm, 0, data, experiment.run_dir(out, arm, 0))
    s = replace(TINY, steps=2)
    assert [(r["arm"], r["from_step"]) for r in experiment.run_all(s, out, workers=1)] == [("k0", 1), ("k2", 1)]
    assert experiment.run_all(s, out, workers=1) == []  # finished runs are skipped
    pack = experiment.pack(out, tmp_path / "pack.json.gz")
    stored = experiment.read_pack(pack)
    assert "max_staleness: 2" in stored["runs"]["k2/seed_0"]["config"]
    assert [r["step"] for r in stored["runs"]["k2/seed_0"]["evals"]] == [0, 1, 2]  # step 0 kept, none twice
    result = analysis.analyse(stored)
    assert set(result["runs"]) == {"k0/seed_0", "k2/seed_0"} and list(result["differences"]) == [0]
    assert result["arms"]["k2"]["lag/staleness_mean"] == pytest.approx(0.5)  # steps 1, 2: stale by 0, 1
    assert math.isnan(result["arms"]["k0"]["lag/staleness_mean"])
    assert result["runs"]["k0/seed_0"]["acc0"] == result["runs"]["k2/seed_0"]["acc0"]  # one base model, one split
    table = tmp_path / "t.md"
    assert main(["table", "--pack-file", str(pack), "--table-file", str(table)]) == 0
    assert table.read_text() == analysis.table(result) == analysis.table(analysis.analyse(analysis.load(out)))
    assert "partial (1 of 3 pairs)" in table.read_text() and "| k2 | 0 |" in table.read_text()
    assert "not the pre-registered 100: these runs were made shorter" in table.read_text()
    assert stored["runs"]["k2/seed_0"]["done"]["machine"]["capability"]  # the CPU that made it
    assert json.loads((out / "settings.json").read_text())["steps"] == 2


def test_a_partial_grid_leads_with_partial_and_lists_the_arm_not_run():
    result = analysis.analyse(_pack({"k0/seed_0": 0.3}))
    text = analysis.table(result)
    assert "**Verdict: partial (0 of 3 pairs), so far: no complete pair.**" in text
    assert "| k2 | 0 of 3 | not run |" in text and "Runs in the pack: 1 of the 6 pre-registered." in text


def test_the_endpoint_stays_at_step_100_when_runs_are_continued():
    pack = _pack({"k0/seed_0": 0.3, "k2/seed_0": 0.3}, steps=100)
    for run in pack["runs"].values():
        run["evals"].append({"step": 150, "eval/mean@1": 0.9})
    pack["settings"]["steps"] = 150
    result = analysis.analyse(pack)
    assert result["horizon"] == 100 and result["runs"]["k0/seed_0"]["final"] == 0.3


def test_aborted_runs_missing_evaluations_mixed_cpus_and_a_weak_correction_are_said():
    pack = _pack({"k0/seed_0": 0.3, "k2/seed_0": 0.25, "k2/seed_1": 0.2})
    pack["settings"]["eval_every"] = 25
    pack["runs"]["k0/seed_0"]["done"] = {"machine": {"capability": "AVX2"}}
    pack["runs"]["k2/seed_0"]["done"] = {"machine": {"capability": "AVX512"}}
    pack["runs"]["k2/seed_1"]["done"] = {"aborted": "NonFiniteAbort at step 3: loss is nan"}
    pack["runs"]["k2/seed_1"]["metrics"][1].update({"rollout_corr/ess": "nan", "time/step_s": "nan"})
    pack["runs"]["k2/seed_0"]["metrics"][2]["rollout_corr/ess"] = 0.4
    pack["runs"]["k2/seed_0"]["metrics"][1]["rollout_corr/frac_truncated"] = 0.3
    text = analysis.table(analysis.analyse(pack))
    assert "aborted (NonFiniteAbort at step 3: loss is nan); evaluations missing at 25, 75" in text
    assert "| 0 | 0.300 | 0.250 | -0.050 | made on two CPUs |" in text
    assert "| 22.0 | 2 | 1 |" in text  # 2 steps past the doctor's limits, 1 run aborted


def test_packs_from_two_machines_merge_and_another_experiment_is_refused(tmp_path):
    def out(root, seed, arm, lr=1e-5):
        s = experiment.Settings(seeds=(seed,), arms=(arm,), lr=lr)
        d = experiment.run_dir(root, arm, seed)
        d.mkdir(parents=True)
        experiment.write_settings(root, s)
        (d / "config.yaml").write_text("x: 1\n")
        (d / "evals.jsonl").write_text(json.dumps({"step": 100, "eval/mean@1": 0.3}) + "\n")
        (d / "done.json").write_text(json.dumps({"steps": 100, "machine": {"capability": "AVX2"}}))
        return root

    dest = tmp_path / "p.json.gz"
    experiment.pack(out(tmp_path / "a", 0, "k0"), dest)
    experiment.pack(out(tmp_path / "b", 0, "k2"), dest)
    data = experiment.read_pack(dest)
    assert set(data["runs"]) == {"k0/seed_0", "k2/seed_0"} and data["settings"]["arms"] == ["k0", "k2"]
    before = dest.read_bytes()
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        experiment.pack(out(tmp_path / "c", 1, "k0", lr=2e-5), dest)
    assert dest.read_bytes() == before


def test_a_run_the_trainer_ends_is_recorded_not_resumed(tmp_path, monkeypatch, data):
    import meshrl.trainer
    from meshrl.trainer import StalledRun

    def stalling(cfg, d, resume=False):
        d.mkdir(parents=True, exist_ok=True)
        (d / "metrics.jsonl").write_text(json.dumps({"step": 4}) + "\n")
        raise StalledRun("5 steps with a zero gradient")

    monkeypatch.setattr(meshrl.trainer, "train", stalling)
    d = tmp_path / "run"
    record = experiment.run_one(TINY, "k2", 0, data, d)
    assert record["aborted"] == "StalledRun at step 4: 5 steps with a zero gradient"
    # a result: the next call skips it, also one asking for more steps (a resume would reset the failure counters)
    assert experiment.finished_steps(d) > 10 ** 6


def test_the_task_is_the_real_model_pilots_choice():
    from experiments.real_model.experiment import COMMITTED_PILOT

    assert experiment.Settings().high == json.loads(COMMITTED_PILOT.read_text())["chosen"]


def test_a_run_stopped_by_a_signal_ends_with_one_line_and_the_signals_status(monkeypatch, capsys, tmp_path):
    import signal

    from meshrl.trainer import RunInterrupted

    def stop(*_args, **_kwargs):
        raise RunInterrupted(signal.SIGTERM)

    monkeypatch.setattr(experiment, "run_all", stop)
    assert main(["run", "--out", str(tmp_path)]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped (stopped by SIGTERM)" in err and "resumes them" in err and "Traceback" not in err


def test_the_committed_table_is_the_committed_pack():
    from experiments.lagged_accuracy.__main__ import PACK, TABLE

    if not PACK.is_file():
        pytest.skip("no runs packed yet")
    assert analysis.table(analysis.analyse(analysis.load(PACK))) == TABLE.read_text()
