"""Round two of the testbed experiment (issue 16): the exact test, the variants, the second family, the tables."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
from meshrl.stats import fisher_exact
from meshrl.tasks import load_task
from meshrl.testbed.audit import AUDIT_BUDGET, audit_feasible, audit_pool, audit_type
from meshrl.testbed.task import A_RANGE, B_RANGE, COACH_VARIANTS, applicable_prefixes, prefix_strategy
from meshrl.testbed.traces import STRATEGIES, label_strategy, reference_trace

TABLES = [[[5, 0], [1, 4]], [[4, 1], [2, 3]], [[0, 5], [0, 5]], [[3, 2], [3, 2]], [[8, 2], [1, 5]],
          [[0, 3], [6, 1]], [[10, 0], [0, 10]], [[2, 7], [9, 1]], [[1, 0], [0, 0]], [[12, 5], [3, 9]]]


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("alternative", ["two-sided", "less", "greater"])
def test_fisher_exact_matches_scipy(table, alternative):
    scipy_stats = pytest.importorskip("scipy.stats")
    ours = fisher_exact(table, alternative)
    ref = scipy_stats.fisher_exact(table, alternative=alternative)
    assert ours.p_value == pytest.approx(float(ref.pvalue), rel=1e-9, abs=1e-12)
    a, b, c, d = table[0] + table[1]
    if b * c:
        assert ours.odds_ratio == pytest.approx(float(ref.statistic))


def test_fisher_exact_hand_case_and_bad_input():
    # [[5, 0], [0, 5]]: the observed table and its mirror are the only ones as extreme: 2 / C(10, 5) = 2 / 252.
    assert fisher_exact([[5, 0], [0, 5]]).p_value == pytest.approx(2 / 252)
    assert fisher_exact([[5, 0], [0, 5]], "greater").p_value == pytest.approx(1 / 252)
    with pytest.raises(ValueError, match="2x2"):
        fisher_exact([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="non-negative integer"):
        fisher_exact([[1, -1], [2, 3]])
    with pytest.raises(ValueError, match="alternative"):
        fisher_exact([[1, 1], [2, 3]], "both")


def test_applicable_coach_proposes_only_procedures_that_fit():
    from meshrl.mesh.coach.validate import PrefixRules, validate_strategies

    task = load_task("testbed:add", coach="applicable", size=300, eval_size=0)
    seen = set()
    for p in task.problems("train"):
        prefixes = task.coach_strategies(p)
        named = [prefix_strategy(x) for x in prefixes]
        assert set(named) <= task.feasible(p) and len(prefixes) == 3
        assert validate_strategies([{"prefix": x} for x in prefixes], p.answer, PrefixRules(m=3)) == []
        seen.add((p.meta["type"], tuple(named)))
    assert ("carry", ("r", "r", "r")) in seen and ("decade", ("t", "t", "t")) in seen
    # the default coach still names all three procedures, in STRATEGIES order
    default = load_task("testbed:add", size=5, eval_size=0)
    p = default.problems("train")[0]
    assert [prefix_strategy(x) for x in default.coach_strategies(p)] == list(STRATEGIES)
    assert applicable_prefixes({"c", "r"}) == [COACH_VARIANTS["c"][0], COACH_VARIANTS["r"][0], COACH_VARIANTS["c"][1]]
    with pytest.raises(ValueError, match="no procedure"):
        applicable_prefixes(set())
    with pytest.raises(ValueError, match="coach must be"):
        load_task("testbed:add", coach="oracle")


def test_coach_following_reward():
    task = load_task("testbed:add", follow=True, size=50, eval_size=0)
    p = next(q for q in task.problems("train") if q.meta["type"] == "low" and q.meta["b"] % 10)
    a, b = p.meta["a"], p.meta["b"]
    col, rnd = reference_trace(a, b, "c"), reference_trace(a, b, "r")
    assert task.score(col, p) == 1.0 and task.score(rnd, p) == 1.0  # both fit a low problem
    assert task.conditioned_score(1.0, col, p, COACH_VARIANTS["c"][0]) == 1.0
    assert task.conditioned_score(1.0, rnd, p, COACH_VARIANTS["c"][0]) == 0.0  # abandoned its prefix
    assert task.conditioned_score(1.0, rnd, p, COACH_VARIANTS["r"][2]) == 1.0  # a rephrased prefix counts
    assert task.conditioned_score(0.0, col, p, COACH_VARIANTS["c"][0]) == 0.0
    plain = load_task("testbed:add", size=50, eval_size=0)
    assert plain.conditioned_score(1.0, rnd, p, COACH_VARIANTS["c"][0]) == 1.0  # off by default
    with pytest.raises(ValueError, match="follow must be"):
        load_task("testbed:add", follow="false")


def test_audit_family_niche_holds_for_every_pair():
    task = load_task("testbed:audit", size=10, eval_size=10)
    counts = {"plain": 0, "carry": 0}
    for a in A_RANGE:
        for b in B_RANGE:
            kind = audit_type(a, b)
            counts[kind] += 1
            problem = SimpleNamespace(answer=str(a + b), meta={"a": a, "b": b, "type": kind})
            scoring = {s for s in STRATEGIES if task.score(reference_trace(a, b, s), problem) == 1.0}
            assert scoring == audit_feasible(a, b)
            assert all(len(reference_trace(a, b, s)) <= AUDIT_BUDGET for s in STRATEGIES)
    assert counts["carry"] > 0 and counts["plain"] > 0
    # c is the longest procedure on every carry problem
    assert all(len(reference_trace(a, b, "c")) >= len(reference_trace(a, b, "r"))
               for a, b in audit_pool(False)["carry"][:2000])
    train, held = set(audit_pool(False)["carry"]), set(audit_pool(True)["carry"])
    assert not train & held
    p = next(q for q in task.problems("eval") if q.meta["type"] == "carry")
    a, b = p.meta["a"], p.meta["b"]
    assert task.score(reference_trace(a, b, "r"), p) == 0.0 and task.score(reference_trace(a, b, "c"), p) == 1.0
    assert all(label_strategy(reference_trace(a, b, s)) == s for s in STRATEGIES)  # the parser labels it
    assert [prefix_strategy(x) for x in load_task("testbed:audit", coach="applicable", size=5).coach_strategies(p)] \
        == ["c", "c", "c"]
    assert task.max_new_tokens == AUDIT_BUDGET + 1 and task.headline_niche == "carry"
    with pytest.raises(ValueError, match="unknown option"):
        load_task("testbed:audit", reward="answer")


def test_warm_settings_per_family_keep_the_default_cache_name():
    from meshrl.testbed.warm import _Examples, settings_hash, warm_settings

    kw = {"seed": 0, "steps": 700, "preset": "tiny:small", "batch_size": 64, "lr": 3e-3, "coach_fraction": 0.06}
    assert settings_hash(warm_settings(**kw)) == "134e5de0d2f0"  # the default warm start's cache name (round one)
    audit = warm_settings(**kw, task="testbed:audit")
    assert audit["prior"]["c"] == 0.1 and audit["budget"] == AUDIT_BUDGET and settings_hash(audit) != "134e5de0d2f0"
    assert "coach_variants" in warm_settings(**kw, coach_variants=True)
    with pytest.raises(ValueError, match="unknown task family"):
        warm_settings(**kw, task="testbed:mul")
    from meshrl.models import build_tiny

    _, tok = build_tiny("tiny:small", seed=0)
    data = _Examples(tok, {**audit, "batch_size": 400})
    tags = [tok.decode(r[1][:1]) for r in data._rows(400, None)]
    assert 0.04 < tags.count("c") / len(tags) < 0.18  # c is the rare procedure of the audit warm start
    variants = _Examples(tok, {**warm_settings(**kw, coach_variants=True), "batch_size": 8})
    assert len(variants.systems["r", "plain"]) == 3


def _step(cfg, task, prefixes, texts_for):
    """A RolloutStep over a fake backend that answers each prompt with ``texts_for(problem, strategy)``."""
    from meshrl.trainer.rollout_step import ProblemSampler, PromptBudget, RolloutStep

    step = RolloutStep.__new__(RolloutStep)
    step.task, step.problems, step.cfg, step.prefixes = task, task.problems("train"), cfg, prefixes
    step.budget = PromptBudget(None, cfg.rollout.max_new_tokens)  # the fake model has no position limit
    step.sampler = ProblemSampler(len(step.problems), cfg.seed)
    step.prompt_ids = lambda problem, k=-1: [k + 2]
    step.rewards = lambda texts, problems: [task.score(t, p) for t, p in zip(texts, problems, strict=True)]

    class Backend:
        def generate(self, prompts, params, seed):
            rows = [(i, k) for i, k in enumerate(prompts) for _ in range(params.n)]
            arms = step._arms_cache
            texts = [texts_for(step._chosen[arms[i][0]], arms[i][1]) for i, _ in rows]
            return SimpleNamespace(prompt_index=[i for i, _ in rows], prompt_ids=[[0]] * len(rows),
                                   response_ids=[[1]] * len(rows), texts=texts, truncated=[False] * len(rows),
                                   engine_logprobs=None)

    original = step._arms

    def arms(chosen):
        out = original(chosen)
        step._arms_cache, step._chosen = out[0], chosen
        return out

    step._arms, step.backend = arms, Backend()
    return step


def test_trainer_hooks_bare_groups_and_conditioned_score():
    from meshrl.trainer import load_config

    task = load_task("testbed:add", follow=True, size=20, eval_size=0)
    prefixes = {p.id: task.coach_strategies(p) for p in task.problems("train")}
    cfg = load_config(overrides=["recipe=mesh", "task=testbed:add", "rollout.group_size=12", "mesh.m=3",
                                 "mesh.bare_group=true", "mesh.bare_groups=3", "rollout.prompts_per_step=2"])
    # every rollout writes the round-and-adjust trace: correct on low/carry problems whatever its prefix
    step = _step(cfg, task, prefixes, lambda p, k: reference_trace(p.meta["a"], p.meta["b"], "r"))
    data, _ = step._sample(0, 2, seed=0)
    assert len(data) == 24 and data.strategy_ids.count(-1) == 12  # half the budget prefix-free
    assert {data.strategy_ids.count(k) for k in range(3)} == {4}
    for score, k, p in zip(data.scores, data.strategy_ids, data.problems, strict=True):
        fits = "r" in task.feasible(p)
        assert score == (1.0 if fits and k in (-1, 2) else 0.0)  # only prefix 2 (r) and bare rollouts keep it
    with pytest.raises(ValueError, match="bare_groups"):
        load_config(overrides=["recipe=mesh", "mesh.bare_group=true", "mesh.bare_groups=0"])
    with pytest.raises(ValueError, match=r"\+ 2 \(mesh.bare_group\)"):
        load_config(overrides=["recipe=mesh", "mesh.m=3", "mesh.bare_group=true", "mesh.bare_groups=2",
                               "rollout.group_size=12"])


def test_niche_outcomes_and_bar():
    from meshrl.testbed.round2 import niche_outcomes

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
    from meshrl.testbed.round2 import checkpoint_table

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
    from meshrl.report.testbed import checkpoints_markdown

    md = checkpoints_markdown({"checkpoints": json.loads(json.dumps({"grpo": row})),
                               "outcomes": {"headline_niche": "decade"}})
    assert "| grpo | 0.60 (0.40) | 0.60 (0.20) | 0.60 (0.00) |" in md and "worst accuracy (step)" in md


def test_signal_separation_hand_case():
    from meshrl.testbed.round2 import signal_separation

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
    from meshrl.testbed.experiment import (
        ARMS,
        ROUND1_ARMS,
        ROUND2_ARMS,
        ExperimentSettings,
        check_resumable,
        checkpoint_overrides,
        preset_settings,
    )

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
def test_round_two_end_to_end_at_toy_size(tmp_path, monkeypatch):
    from meshrl.cli import main as cli_main
    from meshrl.testbed.experiment import ExperimentSettings, run_experiment

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
    assert cli_main(["experiment", "--out", str(out), "--summarize-only"]) == 0
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
    from meshrl.testbed.experiment import ExperimentSettings, run_experiment
    from meshrl.testbed.results import summarize_experiment
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
    from meshrl.testbed.round2 import arm_task_options, prefix_procedures

    assert arm_task_options("mesh_applicable_follow") == {"coach": "applicable", "follow": True}
    assert arm_task_options("grpo") == {} and prefix_procedures(tmp_path, "mesh_mu1e-5", 0) == {}
    (tmp_path / "settings.json").write_text(json.dumps({"task": "testbed:add"}))
    named = prefix_procedures(tmp_path, "mesh_applicable", 0)
    task = load_task("testbed:add", seed=0)
    by_type = {p.meta["type"]: named[p.id] for p in task.problems("train")}
    assert by_type["carry"] == ["r", "r", "r"] and by_type["decade"] == ["t", "t", "t"]
    assert by_type["low"][0] == "c"


def test_experiment_settings_keep_earlier_arms_and_the_directory_is_locked(tmp_path):
    from meshrl.testbed.experiment import ExperimentSettings, experiment_lock, write_settings

    write_settings(tmp_path, ExperimentSettings(arms=("grpo", "cp_pp"), seeds=(0, 1), probe_arms=("grpo",)),
                   Path("/warm"))
    write_settings(tmp_path, ExperimentSettings(arms=("grpo_fork",), seeds=(3,), probe_arms=()), Path("/warm"))
    saved = json.loads((tmp_path / "settings.json").read_text())
    assert saved["arms"] == ["grpo", "cp_pp", "grpo_fork"] and saved["seeds"] == [0, 1, 3]
    assert saved["probe_arms"] == ["grpo"] and saved["warm_start"] == "/warm"
    with experiment_lock(tmp_path):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
        with pytest.raises(RuntimeError, match=f"pid {os.getpid()}.*another --out"), experiment_lock(tmp_path):
            pass
    with experiment_lock(tmp_path):  # released on exit: the next experiment may run
        pass


def test_a_finished_run_is_never_retrained(tmp_path):
    """A run with done.json (finished, or unpacked from a pack without checkpoints) is skipped whole: the
    checkpoint test alone would see no checkpoint and train it again over its own files."""
    from meshrl.testbed.experiment import ExperimentSettings, _job

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
    from meshrl.testbed.experiment import ARMS, ExperimentSettings, base_overrides
    from meshrl.trainer.config import load_config

    s = ExperimentSettings()
    for arm, overrides in ARMS.items():
        cfg = load_config(overrides=[*base_overrides(s, tmp_path, 24), *overrides])
        assert cfg.steps == s.steps, arm
    guided = load_config(overrides=[*base_overrides(s, tmp_path, 24), *ARMS["guide_all_log"]])
    assert guided.plugins.coach_guide.shape == "log" and not guided.mesh.bare_group
