"""The testbed experiments' tables (niche outcomes, checkpoints, separation), presets, resume guard and runner."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
from meshrl.stats import fisher_exact
from meshrl.tasks import load_task


def test_niche_outcomes_and_bar():
    from experiments.collapse_testbed.tables import niche_outcomes

    def arm(niches, acc, passk):
        return {"acc": acc, "pass@8": passk, "per_seed": [{"seed": i, "acc/decade": v} for i, v in enumerate(niches)]}

    arms = {"grpo": arm([0.9, 0.0, 0.02, 0.01, 0.6], 0.7, 0.8), "good": arm([0.9, 0.8, 0.7, 0.55, 0.1], 0.75, 0.85),
            "poor": arm([0.9, 0.8, 0.7, 0.55, 0.6], 0.6, 0.9)}
    res = niche_outcomes(arms, "decade", 0.5)
    g = res["arms"]["good"]
    assert (g["kept"], g["lost"]) == (4, 1) and res["arms"]["grpo"]["kept"] == 2
    assert g["fisher_p"] == pytest.approx(fisher_exact([[4, 1], [2, 3]]).p_value)
    assert g["meets_bar"] is True and res["arms"]["poor"]["meets_bar"] is False  # lower accuracy than GRPO
    assert res["arms"]["grpo"]["meets_bar"] is False and "fisher_p" not in res["arms"]["grpo"]
    assert res["arms"]["poor"]["fisher_p_holm"] >= res["arms"]["poor"]["fisher_p"]


def _fake_eval(path, acc, by):
    path.mkdir(parents=True)
    groups = {t: {"pass@1": v, "problems": 10} for t, v in by.items()}
    (path / "eval.json").write_text(json.dumps({"overall": {"pass@1": acc, "pass@2": acc, "problems": 30},
                                                "by": {"groups": groups}}))


def test_checkpoint_table_final_vs_best(tmp_path):
    from experiments.collapse_testbed.tables import checkpoint_table

    run = tmp_path / "runs" / "grpo" / "seed_0"
    _fake_eval(run / "eval", 0.6, {"low": 0.9, "carry": 0.8, "decade": 0.0})
    for step, acc, dec in ((8, 0.7, 0.6), (16, 0.8, 0.3), (24, 0.6, 0.0)):
        _fake_eval(run / "ckpt_eval" / f"step_{step}", acc, {"low": 0.9, "carry": 0.8, "decade": dec})
    row = checkpoint_table(tmp_path, "decade")["grpo"]
    p = row["per_seed"][0]
    assert (p["final_step"], p["best_step"], p["best_niche_step"]) == (24, 16, 8)
    assert (p["final_acc"], p["best_acc"], p["final_niche"], p["best_niche"]) == (0.6, 0.8, 0.0, 0.6)
    assert p["steps"] == [8, 16, 24] and row["best_acc"] == 0.8
    assert (p["worst_step"], p["worst_acc"]) == (24, 0.6)
    seed1 = tmp_path / "runs" / "grpo" / "seed_1"
    _fake_eval(seed1 / "eval", 0.5, {"low": 0.9, "carry": 0.8, "decade": 0.0})
    for step, acc, dec in ((8, 0.5, 0.2), (16, 0.4, 0.1)):  # a shorter run: step 24 has one seed
        _fake_eval(seed1 / "ckpt_eval" / f"step_{step}", acc, {"low": 0.9, "carry": 0.8, "decade": dec})
    row = checkpoint_table(tmp_path, "decade")["grpo"]
    assert row["by_step"][8] == {"acc": pytest.approx(0.6), "niche": pytest.approx(0.4), "seeds": 2}
    assert row["by_step"][24] == {"acc": 0.6, "niche": 0.0, "seeds": 1}
    assert row["worst_acc"] == pytest.approx(0.5) and row["worst_step"] == 20.0  # seed 1's trough: step 16
    from experiments.collapse_testbed.report import checkpoints_markdown

    md = checkpoints_markdown({"checkpoints": json.loads(json.dumps({"grpo": row})),
                               "outcomes": {"headline_niche": "decade"}})
    assert "| grpo | 0.60 (0.40) | 0.60 (0.20) | 0.60 (0.00) |" in md and "worst accuracy (step)" in md


def test_signal_separation_hand_case():
    from experiments.collapse_testbed.tables import signal_separation

    fall = "decade accuracy < 0.1"
    runs = [{"arm": "grpo", "seed": s, "crossings": {"entropy": e, "mei": m, fall: f}}
            for s, e, m, f in ((0, 4, 8, 8), (1, 4, None, 12), (2, 8, 4, None), (3, None, 4, None))]
    warning = {"runs": runs, "summary": {f"entropy | {fall}": {}, f"mei | {fall}": {}}}
    outcomes = {"arms": {"grpo": {"per_seed": [{"seed": 0, "kept": False}, {"seed": 1, "kept": False},
                                               {"seed": 2, "kept": True}, {"seed": 3, "kept": True}]}}}
    sep = signal_separation(warning, outcomes)
    assert sep["fall_event"] == fall
    e, m = sep["signals"]["entropy"], sep["signals"]["mei"]
    assert (e["lost_crossed"], e["kept_crossed"], e["crossed_before_fall"], e["lost_with_fall"]) == (2, 1, 2, 2)
    assert (m["lost_crossed"], m["kept_crossed"], m["crossed_before_fall"]) == (1, 2, 0)  # at the fall: not before
    assert e["fisher_p"] == pytest.approx(fisher_exact([[2, 0], [1, 1]]).p_value)


def test_experiment_presets_and_resume_guard(tmp_path):
    from experiments.collapse_testbed.experiment import (
        ARMS,
        PRESETS,
        ExperimentSettings,
        check_resumable,
        checkpoint_overrides,
        preset_settings,
    )

    ROUND1_ARMS, ROUND2_ARMS = PRESETS["round1"]["arms"], PRESETS["round2"]["arms"]
    assert isinstance(ROUND1_ARMS, tuple) and ExperimentSettings().arms == ROUND2_ARMS  # the default preset
    r2 = preset_settings("round2")
    assert len(r2.seeds) >= 5 and r2.arms == ROUND2_ARMS and set(ROUND2_ARMS) <= set(ARMS)
    assert {"grpo_g36", "mesh_pp_mu1e-5", "mesh_applicable", "mesh_follow", "support_bare_half_mu1e-1"} <= set(r2.arms)
    r1 = preset_settings("round1", steps=10)
    assert r1.seeds == (0, 1, 2) and r1.arms == ROUND1_ARMS and r1.steps == 10 and r1.ckpt_eval_every == 0
    assert checkpoint_overrides("mesh_follow", r2) == ["checkpoint.every=8", "checkpoint.keep_last=6"]
    assert checkpoint_overrides("grpo", r2) == ["checkpoint.every=4", "checkpoint.keep_last=11"]
    plug = preset_settings("plugins")
    assert plug.arms[0] == "grpo" and len(plug.arms) == 5 and len(plug.seeds) >= 3 and not plug.warm_coach_variants
    assert {a for a in plug.arms if a != "grpo"} == {"grpo_clip_cov", "grpo_kl_cov", "grpo_entropy_adv", "grpo_fork"}
    from meshrl.trainer.config import load_config

    for arm in plug.arms:  # every plug-in arm is a valid meshrl train config with the plug-in on
        cfg = load_config(overrides=["model=tiny", "task=testbed:add", *ARMS[arm]])
        on = [name for name in ("clip_cov", "kl_cov", "entropy_adv", "fork") if getattr(cfg.plugins, name).enabled]
        assert on == ([] if arm == "grpo" else [arm.removeprefix("grpo_")])
    with pytest.raises(ValueError, match="unknown preset"):
        preset_settings("round3")
    s = ExperimentSettings(steps=4)
    (tmp_path / "settings.json").write_text(json.dumps({"steps": 2, "task": "testbed:add"}))
    with pytest.raises(ValueError, match="steps=2"):
        check_resumable(tmp_path, s)
    check_resumable(tmp_path, ExperimentSettings(steps=2, seeds=(7,)))  # other seeds/arms may be added


@pytest.mark.slow
def test_second_experiment_end_to_end_at_toy_size(tmp_path, monkeypatch):
    from experiments.collapse_testbed.cli import main as cli_main
    from experiments.collapse_testbed.experiment import ExperimentSettings, run_experiment

    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    s = ExperimentSettings(steps=2, prompts_per_step=2, group_size=6, probe_every=1, probe_problems=3,
                           probe_group=3, eval_problems=6, eval_n=2, ks=(1, 2), seeds=(0, 1), ckpt_eval_every=1,
                           ckpt_eval_problems=4, arms=("grpo", "grpo_g36", "mesh_applicable_follow", "cp_bare_half"),
                           probe_arms=("grpo",), warm_steps=2, workers=2)
    out = run_experiment(tmp_path / "exp", s, progress=False)
    counts = {}
    for arm in s.arms:
        d = out / "runs" / arm / "seed_0"
        hist = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        counts[arm] = hist[0]["rollouts/count"]
        assert sorted(p.name for p in (d / "ckpt_eval").iterdir()) == ["step_1", "step_2"]
        assert [p.name for p in (d / "checkpoints").glob("step_*")] == ["step_000002"]  # pruned after evaluation
        assert (d / "done.json").is_file()
    assert counts == {"grpo": 12.0, "grpo_g36": 72.0, "mesh_applicable_follow": 12.0, "cp_bare_half": 12.0}
    prefixes = [json.loads(x) for x in (out / "runs" / "cp_bare_half" / "seed_0" / "samples.jsonl").read_text()
                .splitlines()]
    assert sum(r["strategy"] == -1 for r in prefixes if r["step"] == 1) == 6  # half the step's rollouts
    assert cli_main(["--out", str(out), "--summarize-only"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["outcomes"]["arms"]) == set(s.arms) and res["outcomes"]["arms"]["grpo"]["seeds"] == 2
    assert set(res["checkpoints"]) == set(s.arms) and res["compute"]["grpo_g36"]["rollouts_mean"] == 144.0
    assert res["separation"]["probes"]["fall_event"] == "decade accuracy < 0.1"
    md = (out / "results.md").read_text()
    assert "### Niche kept or lost, per seed" in md and "### Final vs best checkpoint" in md
    assert (out / "figures" / "testbed_checkpoints.png").is_file()
    with pytest.raises(ValueError, match="other settings"):
        run_experiment(out, ExperimentSettings(**{**s.__dict__, "steps": 3}), progress=False)


@pytest.mark.slow
def test_audit_family_experiment_at_toy_size(tmp_path, monkeypatch):
    from experiments.collapse_testbed.experiment import ExperimentSettings, run_experiment
    from experiments.collapse_testbed.results import summarize_experiment
    from meshrl.testbed.warm import warm_info

    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "cache"))
    s = ExperimentSettings(task="testbed:audit", steps=1, prompts_per_step=2, group_size=3, probe_every=1,
                           probe_problems=3, probe_group=3, eval_problems=6, eval_n=2, ks=(1, 2), seeds=(0,),
                           ckpt_eval_every=1, ckpt_eval_problems=4, arms=("grpo", "mesh_mu1e-5"),
                           probe_arms=("grpo",), warm_steps=2, workers=1)
    out = run_experiment(tmp_path / "exp", s, progress=False)
    settings = json.loads((out / "settings.json").read_text())
    assert warm_info(settings["warm_start"])["settings"]["task"] == "testbed:audit"
    res = summarize_experiment(out)
    assert res["outcomes"]["headline_niche"] == "carry"
    assert "plain" in res["arms"]["grpo"]["shares_by_type"] and set(res["arms"]["grpo"]["shares_by_type"]) <= {
        "plain", "carry"}
    assert math.isfinite(res["arms"]["grpo"]["acc/plain"]) and "acc/low" not in res["arms"]["grpo"]
    # one training step cannot calibrate the per-run thresholds: the run is skipped and recorded
    assert res["warning_training"]["skipped"] == [{"arm": "grpo", "seed": 0, "steps": 1}]


def test_prefix_procedures_follow_the_arms_coach(tmp_path):
    from experiments.collapse_testbed.tables import arm_task_options, prefix_procedures

    assert arm_task_options("mesh_applicable_follow") == {"coach": "applicable", "follow": True}
    assert arm_task_options("grpo") == {} and prefix_procedures(tmp_path, "mesh_mu1e-5", 0) == {}
    (tmp_path / "settings.json").write_text(json.dumps({"task": "testbed:add"}))
    named = prefix_procedures(tmp_path, "mesh_applicable", 0)
    task = load_task("testbed:add", seed=0)
    by_type = {p.meta["type"]: named[p.id] for p in task.problems("train")}
    assert by_type["carry"] == ["r", "r", "r"] and by_type["decade"] == ["t", "t", "t"]
    assert by_type["low"][0] == "c"


def test_experiment_settings_keep_earlier_arms_and_the_directory_is_locked(tmp_path):
    from experiments.collapse_testbed.experiment import ExperimentSettings, experiment_lock, write_settings

    write_settings(tmp_path, ExperimentSettings(arms=("grpo", "cp_pp"), seeds=(0, 1), probe_arms=("grpo",)),
                   Path("/warm"))
    write_settings(tmp_path, ExperimentSettings(arms=("grpo_fork",), seeds=(3,), probe_arms=()), Path("/warm"))
    saved = json.loads((tmp_path / "settings.json").read_text())
    assert saved["arms"] == ["grpo", "cp_pp", "grpo_fork"] and saved["seeds"] == [0, 1, 3]
    assert saved["probe_arms"] == ["grpo"] and saved["warm_start"] == "/warm"
    with experiment_lock(tmp_path):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
        with pytest.raises(ValueError, match=f"pid {os.getpid()}.*another --out"), experiment_lock(tmp_path):
            pass
    with experiment_lock(tmp_path):  # released on exit: the next experiment may run
        pass


def test_a_finished_run_is_never_retrained(tmp_path):
    """A run with done.json (finished, or unpacked from a pack without checkpoints) is skipped whole: the
    checkpoint test alone would see no checkpoint and train it again over its own files."""
    from experiments.collapse_testbed.experiment import ExperimentSettings, _job

    run_dir = tmp_path / "runs" / "grpo" / "seed_0"
    run_dir.mkdir(parents=True)
    (run_dir / "done.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    res = _job("grpo", 0, run_dir, ExperimentSettings(steps=2), tmp_path / "no_such_model")
    assert res["skipped"] == "done" and (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["done.json", "metrics.jsonl"]


def test_every_experiment_arm_is_a_valid_train_config(tmp_path):
    """Each arm, on top of the experiment's shared overrides, passes the trainer's validation (the matched
    budget's divisibility, the coach_guide prerequisites, the plug-ins' settings) before any run starts."""
    from experiments.collapse_testbed.experiment import ARMS, ExperimentSettings, arm_keys, base_overrides
    from meshrl.trainer.config import load_config

    s = ExperimentSettings()
    traces = tmp_path / "traces.jsonl"  # the expert-guided arms' file (experiment.expert_traces in a run)
    traces.write_text('{"id": "add-100-10", "completion": "c:100+10=110|110"}\n')
    for arm in ARMS:
        cfg = load_config(overrides=[*base_overrides(s, tmp_path, 24), *arm_keys(arm, traces)])
        assert cfg.steps == s.steps, arm
    guided = load_config(overrides=[*base_overrides(s, tmp_path, 24), *ARMS["guide_all_log"]])
    assert guided.plugins.coach_guide.shape == "log" and not guided.mesh.bare_group


def test_arm_and_preset_files_are_checked(tmp_path):
    from experiments.collapse_testbed.experiment import ARMS, load_arms, load_presets

    assert list(ARMS)[:2] == ["grpo", "dapo"] and ARMS["mesh_mu1e-5"] == ["recipe=mesh", "mesh.mu=1e-5"]
    bad = tmp_path / "arms.yaml"
    bad.write_text("grpo: [recipe=grpo]\nbroken: [recipe=grpo\n")
    with pytest.raises(ValueError, match=r"arms.yaml, line \d+, column \d+: YAML syntax error"):
        load_arms(bad)
    bad.write_text("grpo: [recipe=grpo]\nmesh: [recipe=mesh]\ngrpo: [recipe=dapo]\n")  # a name twice
    with pytest.raises(ValueError, match=r"arms.yaml, line 3.*key 'grpo' repeats \(first at line 1\)"):
        load_arms(bad)
    bad.write_text("grpo: recipe=grpo\n")
    with pytest.raises(ValueError, match="arm 'grpo' must be a list of key=value"):
        load_arms(bad)
    presets = tmp_path / "presets.yaml"
    presets.write_text("mine:\n  arms: [grpo, nope]\n")
    with pytest.raises(ValueError, match=r"preset 'mine': arms has unknown arm\(s\) \['nope'\]"):
        load_presets(ARMS, presets)
    presets.write_text("mine:\n  stepz: 3\n")
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['stepz'\]"):
        load_presets(ARMS, presets)
    presets.write_text("mine:\n  arms: [grpo]\n  seeds: [3]\n")
    assert load_presets(ARMS, presets) == {"mine": {"arms": ("grpo",), "seeds": (3,)}}


def test_demo_arms_are_the_experiment_arms(tmp_path):
    """``meshrl demo`` keeps its own arm list inside the package; it must train exactly the experiment's arms (on
    meshrl's default engines, ``DEMO_ENGINE``, where the experiments pin ``generate`` and one update process, and
    with its own evaluation keys, ``demo_keys``)."""
    from experiments.collapse_testbed.experiment import ARMS, ExperimentSettings, base_overrides
    from meshrl.testbed.demo import DEMO_ARMS, DEMO_ENGINE, DemoSettings, arm_config, demo_keys
    from meshrl.trainer import load_config

    same = {"grpo": "grpo", "fork": "grpo_fork"}
    assert list(DEMO_ARMS) == list(same)
    for s in (DemoSettings(), DemoSettings.quick()):
        es = ExperimentSettings(steps=s.steps, prompts_per_step=s.prompts_per_step, group_size=s.group_size,
                                lr=s.lr, ppo_epochs=s.ppo_epochs, mini_batches=s.mini_batches)
        for demo_arm, arm in same.items():
            want = load_config(overrides=[*base_overrides(es, tmp_path, 30), *DEMO_ENGINE, *ARMS[arm],
                                          *demo_keys(s, 3)])
            assert arm_config(demo_arm, tmp_path, s, 3, 30) == want


def test_signals_the_probes_did_not_compute_are_left_out(tmp_path):
    """Probes limited to some feature maps (``probe_features``) calibrate only the signals they computed; the
    duplicate-aware MEI is calibrated like the others where present."""
    from experiments.collapse_testbed.results import thresholds

    rows = [{"mei/bias": 1.0 + 0.1 * k, "mei_distinct/bias": 0.2 + 0.01 * k, "eff_dirs/bias": 10.0 - k,
             "entropy": 0.5, "kernel_max_mass/bias@0.2": 0.5, "ref_logp/min": -3.0, "true_max_mass": 0.6,
             "acc/type/carry": 0.3, "acc/type/decade": 0.4} for k in range(5)]
    (tmp_path / "baseline_probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    th = thresholds(tmp_path)
    assert "MEI bias" in th and "MEI bias (distinct rollouts)" in th
    assert "MEI full" not in th and "MEI head" not in th and "kernel max mass full" not in th
    sd = (sum((0.01 * k - 0.02) ** 2 for k in range(5)) / 4) ** 0.5
    assert th["MEI bias (distinct rollouts)"][0] == pytest.approx(0.22 + 3 * sd)
