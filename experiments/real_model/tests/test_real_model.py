"""experiments.real_model: the pre-registered endpoints on hand-made curves, and the whole pipeline (pilot, runs,
step-0 evaluations, pack, table) on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from experiments.real_model import analysis, experiment
from experiments.real_model.__main__ import main
from meshrl.provenance import code_version


def test_fall_is_harm_only_when_it_lasts_two_evaluations():
    assert analysis.fall([(0, 0.2), (10, 0.3), (20, 0.35), (30, 0.36)])[:2] == ("none", None)
    assert analysis.fall([(0, 0.2), (10, 0.4), (20, 0.25), (30, 0.4)])[:2] == ("dip", 20)  # one evaluation below
    cls, step, depth, dips = analysis.fall([(0, 0.2), (10, 0.4), (20, 0.3), (30, 0.25), (40, 0.4)])
    assert (cls, step, dips) == ("harm", 20, []) and depth == pytest.approx(0.15)
    assert analysis.fall([(0, 0.2), (10, 0.4), (20, 0.35)])[0] == "none"  # 0.05 below: no fall
    assert analysis.fall([(0, 0.3), (10, 0.5), (20, 0.3)])[:2] == ("dip", 20)  # ends one below: a dip


def test_mei_threshold_and_crossing_need_three_steps_after_calibration():
    series = [(s, 1.0 + 0.01 * (s % 2)) for s in range(1, 11)] + [(11, 5.0), (12, 5.0), (13, 1.0), (14, 5.0),
                                                                   (15, 5.0), (16, 5.0)]
    thr = analysis.mei_threshold(series)
    assert 1.0 < thr < 1.05
    assert analysis.crossing(series, thr) == 14
    assert analysis.crossing(series, math.nan) is None and math.isnan(analysis.mei_threshold([(1, 1.0)]))


def test_verdict_rules():
    assert analysis.verdict([0.1, 0.05, 0.02]) == "improves"
    assert analysis.verdict([0.01, 0.01, 0.01]) == "inconclusive"  # all positive, mean below 0.05
    assert analysis.verdict([0.2, -0.01, 0.0]) == "does not improve"
    assert analysis.verdict([0.2, 0.1]) == "incomplete (2 of 3 seeds)"  # fewer than 3 seeds cannot "improve"
    assert analysis.verdict([0.2, 0.1, math.nan]) == "inconclusive (1 run(s) without a final accuracy)"  # aborted
    assert analysis.verdict([-0.1, 0.0]) == "does not improve"  # decided before the third seed


def test_run_endpoints_lead_and_final():
    evals = [{"step": 10, "eval/mean@1": 0.5}, {"step": 20, "eval/mean@1": 0.3}, {"step": 30, "eval/mean@1": 0.3}]
    metrics = [{"step": s, "mei/query": 1.0 + 0.01 * (s % 2)} for s in range(1, 11)]
    metrics += [{"step": s, "mei/query": 9.0} for s in range(11, 31)]
    r = analysis.run_endpoints(0.2, evals, metrics, horizon=30)
    assert r["final"] == 0.3 and r["gain"] == pytest.approx(0.1) and (r["best"], r["best_step"]) == (0.5, 10)
    assert r["fall"] == "harm" and r["fall_step"] == 20 and r["mei_cross"] == 11 and r["lead"] == 9
    assert not r["in_time"]


def test_data_is_fixed_by_seed_zero(tmp_path):
    a = experiment.write_data(tmp_path / "a.jsonl", 20, 50).read_text()
    assert a == experiment.write_data(tmp_path / "b.jsonl", 20, 50).read_text()
    rows = [json.loads(x) for x in a.splitlines()]
    assert len(rows) == 50 and all(r["answer"] == sum(map(int, r["problem"][8:-1].split(" + "))) for r in rows)


@pytest.mark.slow  # two tiny runs of 2 steps, a pilot and two step-0 evaluations (~20 s)
def test_the_pipeline_on_the_tiny_model(tmp_path):
    s = experiment.Settings(model="tiny", steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6,
                            warmup_steps=0, eval_every=1, eval_n=2, problems=40, seeds=(0,), arms=("grpo", "fork"),
                            extra=("train.micro_batch_size=8", "health.every=0"))
    out = tmp_path / "runs"
    experiment.run_all(s, out)
    pilot = json.loads((out / "pilot.json").read_text())
    assert pilot["tried"]["20"] < 0.10 and pilot["chosen"] == 9  # an untrained model solves nothing
    assert all((out / "runs" / arm / "seed_0" / "done.json").is_file() for arm in ("grpo", "fork"))
    experiment.run_all(s, out)  # finished runs are skipped
    pack = experiment.pack(out, tmp_path / "pack.json.gz")
    packed = experiment.read_pack(pack)["runs"]["grpo/seed_0"]
    assert packed["code"] == code_version() and packed["machine"]["capability"]  # what made the run
    result = analysis.analyse(experiment.read_pack(pack))
    assert set(result["runs"]) == {"grpo/seed_0", "fork/seed_0"}
    r = result["runs"]["grpo/seed_0"]
    assert [s for s, _ in r["curve"]] == [0, 1, 2] and math.isfinite(r["mei_threshold"])  # steps 1-2 calibrate
    text = analysis.table(result)
    assert "| grpo | 0 |" in text and "chosen A = 9" in text
    table = tmp_path / "t.md"
    assert main(["table", "--pack-file", str(pack), "--table-file", str(table)]) == 0
    assert table.read_text() == text


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["run", "--seeds", "1", "1"]) == 2
    assert "--seeds names a seed twice" in capsys.readouterr().err
    assert main(["run", "--threads", "0"]) == 2


def _fake_out(root, seed, arm, *, lr=5e-6, acc=0.25):
    """An experiment directory holding one finished run, as ``run_all`` leaves it (the files ``pack`` reads)."""
    s = experiment.Settings(seeds=(seed,), arms=(arm,), lr=lr)
    (root / "step0" / f"seed_{seed}").mkdir(parents=True)
    (root / "settings.json").write_text(json.dumps(dataclasses.asdict(s)))
    (root / "pilot.json").write_text(json.dumps({"tried": {"20": 0.1275}, "chosen": 20}))
    (root / "step0" / f"seed_{seed}" / "eval.json").write_text(json.dumps({"overall": {"mean@4": 0.1}}))
    run = root / "runs" / arm / f"seed_{seed}"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "mei/query": 0.9, "other": 1}) + "\n")
    (run / "evals.jsonl").write_text(json.dumps({"step": 10, "eval/mean@1": acc}) + "\n")
    (run / "done.json").write_text(json.dumps({"seconds": 5.0, "machine": {"capability": "AVX2"}}))
    return root


def test_packs_made_on_different_machines_merge_into_one(tmp_path):
    dest = tmp_path / "pack.json.gz"
    experiment.pack(_fake_out(tmp_path / "a", 0, "grpo"), dest)
    experiment.pack(_fake_out(tmp_path / "b", 1, "fork", acc=0.5), dest)
    data = experiment.read_pack(dest)
    assert set(data["runs"]) == {"grpo/seed_0", "fork/seed_1"} and set(data["step0"]) == {"seed_0", "seed_1"}
    assert data["settings"]["seeds"] == [0, 1] and data["settings"]["arms"] == ["grpo", "fork"]
    # the run selection is what was packed, whatever the directory's last call asked for
    (tmp_path / "b" / "settings.json").write_text(json.dumps(dataclasses.asdict(experiment.Settings(seeds=(7,)))))
    assert experiment.read_pack(experiment.pack(tmp_path / "b", tmp_path / "b.json.gz"))["settings"]["seeds"] == [1]
    assert data["runs"]["grpo/seed_0"]["machine"] == {"capability": "AVX2"}
    assert data["runs"]["grpo/seed_0"]["metrics"] == [{"step": 1, "mei/query": 0.9}]  # only the kept metrics
    # the same run packed again is taken from the newer directory
    experiment.pack(_fake_out(tmp_path / "c", 0, "grpo", acc=0.75), dest)
    assert experiment.read_pack(dest)["runs"]["grpo/seed_0"]["evals"] == [{"step": 10, "eval/mean@1": 0.75}]


def test_a_pack_of_other_settings_is_refused_by_name(tmp_path):
    dest = tmp_path / "pack.json.gz"
    experiment.pack(_fake_out(tmp_path / "a", 0, "grpo"), dest)
    before = dest.read_bytes()
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        experiment.pack(_fake_out(tmp_path / "b", 1, "grpo", lr=1e-6), dest)
    assert dest.read_bytes() == before


def test_the_table_names_the_cpu_of_each_run():
    assert analysis.cpu_label({"capability": "AVX2", "bf16_native": False}) == "AVX2"  # no model recorded
    xeon = {"model": "Intel(R) Xeon(R) Processor", "capability": "AVX512", "flags": ["avx512f", "amx_tile"]}
    epyc = {"model": "AMD EPYC", "capability": "AVX512", "flags": ["avx512f", "avx512_bf16"]}
    # both AVX512, and they round differently: the label must tell them apart
    assert analysis.cpu_label(xeon) == "AVX512 (Intel(R) Xeon(R) Processor, AMX)"
    assert analysis.cpu_label(epyc) == "AVX512 (AMD EPYC)"
    assert analysis.cpu_label(None) == "-"  # a run made before runs recorded their machine


def test_fall_edges_exact_drop_step_zero_dips_and_the_depth_of_the_fall_itself():
    assert analysis.fall([(0, 0.2), (10, 0.35), (20, 0.25), (30, 0.25)])[:2] == ("harm", 20)  # exactly 0.1 counts
    assert analysis.fall([(0, 0.4), (10, 0.3), (20, 0.3)])[:2] == ("harm", 10)  # step 0 is in the running maximum
    curve = [(0, 0.2), (10, 0.5), (20, 0.3), (30, 0.5), (40, 0.38), (50, 0.5), (60, 0.35), (70, 0.3), (80, 0.45)]
    cls, step, depth, dips = analysis.fall(curve)
    assert (cls, step) == ("harm", 60) and depth == pytest.approx(0.2)  # the fall's own depth, not the first dip's
    assert [s for s, _ in dips] == [20, 40] and dips[0][1] == pytest.approx(0.2)  # every dip, reported apart


def test_crossing_needs_strictly_above_and_a_lead_of_ten_is_in_time():
    calib = [{"step": s, "mei/query": 1.0 + 0.01 * (s % 2)} for s in range(1, 11)]
    thr = analysis.mei_threshold([(r["step"], r["mei/query"]) for r in calib])
    at = [(s, thr) for s in range(11, 20)]
    assert analysis.crossing(at, thr) is None  # equal is not above
    broken = [(11, 9.0), (12, math.nan), (13, 9.0), (14, 9.0), (15, 9.0)]
    assert analysis.crossing(broken, thr) == 13  # a NaN step breaks the streak
    evals = [{"step": 10, "eval/mean@1": 0.5}, {"step": 20, "eval/mean@1": 0.5},
             {"step": 30, "eval/mean@1": 0.3}, {"step": 40, "eval/mean@1": 0.3}]
    metrics = calib + [{"step": s, "mei/query": 9.0} for s in range(20, 41)]
    r = analysis.run_endpoints(0.2, evals, metrics, horizon=40, every=10)
    assert (r["fall_step"], r["mei_cross"], r["lead"], r["in_time"]) == (30, 20, 10, True)
    assert r["mei_calibration_n"] == 10 and r["missing_evals"] == []


def test_a_missing_evaluation_is_named_and_a_missing_last_one_leaves_no_gain():
    evals = [{"step": 10, "eval/mean@1": 0.5}, {"step": 30, "eval/mean@1": 0.3}]
    r = analysis.run_endpoints(0.2, evals, [{"step": 1, "mei/query": 1.0}], horizon=40, every=10)
    assert r["missing_evals"] == [20, 40] and math.isnan(r["final"]) and math.isnan(r["gain"])
    assert r["mei_calibration_n"] == 1 and math.isnan(r["mei_threshold"])


def _pack(runs: dict, seeds=(0,)) -> dict:
    settings = dataclasses.asdict(experiment.Settings(steps=20, seeds=seeds))
    step0 = {f"seed_{s}": {"mean@4": 0.2} for s in seeds}
    return {"settings": settings, "pilot": {"tried": {"20": 0.1275}, "chosen": 20}, "step0": step0, "runs": runs}


def _run(accs: list[float], aborted: str | None = None) -> dict:
    evals = [{"step": 10 * (i + 1), "eval/mean@1": a} for i, a in enumerate(accs)]
    metrics = [{"step": s, "mei/query": 1.0 + 0.01 * (s % 2)} for s in range(1, 21)]
    return {"evals": evals, "metrics": metrics, "seconds": 1.0, "machine": None, "aborted": aborted}


def test_a_partial_grid_says_it_is_partial():
    text = analysis.table(analysis.analyse(_pack({"grpo/seed_0": _run([0.3, 0.4])})))
    assert "Runs in the pack: 1 of the 6 pre-registered" in text and "partial grid" in text
    assert "| grpo | 1 of 3 | incomplete (1 of 3 seeds) | +0.200 | 0 | not testable (no harm) | 0 |" in text
    assert "| fork | 0 of 3 | not run | - | 0 | - | - |" in text
    assert "no seed has both arms yet" in text and "A = 20: 0.1275" in text


def test_fork_minus_grpo_per_seed_and_an_aborted_run():
    runs = {"grpo/seed_0": _run([0.3, 0.4]), "fork/seed_0": _run([0.5, 0.45]),
            "fork/seed_1": _run([0.3], aborted="NonFiniteAbort at step 13: loss is nan")}
    result = analysis.analyse(_pack(runs, seeds=(0, 1)))
    assert result["pairs"] == {0: pytest.approx(0.05)}
    text = analysis.table(result)
    assert "seed 0: +0.050" in text and "aborted (NonFiniteAbort at step 13: loss is nan)" in text
    assert "| fork | 2 of 3 | incomplete (1 of 3 seeds) | +0.250 | 0 (+1 aborted) |" in text
    assert "(evaluations missing at 20)" in text


def test_the_committed_pilot_is_used_with_the_preregistered_settings(tmp_path, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the pilot was made again")

    monkeypatch.setattr(experiment, "held_out_accuracy", must_not_run)
    assert experiment.pilot(experiment.Settings(threads=2, seeds=(1,)), tmp_path / "a") == json.loads(
        experiment.COMMITTED_PILOT.read_text())
    monkeypatch.setattr(experiment, "held_out_accuracy", lambda *a, **k: 0.2)
    assert experiment.pilot(experiment.Settings(model="tiny"), tmp_path / "b") == {"tried": {"20": 0.2},
                                                                                    "chosen": 20}


def test_a_run_the_trainer_ends_is_recorded_and_the_grid_goes_on(tmp_path, monkeypatch):
    import meshrl.trainer
    from meshrl.trainer import NonFiniteAbort

    calls = []

    def aborting(cfg, run_dir, resume=False):
        calls.append(run_dir.parent.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 7}) + "\n")
        raise NonFiniteAbort("3 consecutive non-finite steps")
        yield

    monkeypatch.setattr(meshrl.trainer, "train", aborting)
    monkeypatch.setattr(experiment, "held_out_accuracy", lambda *a, **k: 0.2)
    s = experiment.Settings(model="tiny", problems=20, seeds=(0,), extra=("health.every=0",))
    experiment.run_all(s, tmp_path / "out")
    assert calls == ["grpo", "fork"]
    done = json.loads((tmp_path / "out" / "runs" / "grpo" / "seed_0" / "done.json").read_text())
    assert done["aborted"] == "NonFiniteAbort at step 7: 3 consecutive non-finite steps"
    (tmp_path / "out" / "step0" / "seed_0").mkdir(parents=True)
    (tmp_path / "out" / "step0" / "seed_0" / "eval.json").write_text(json.dumps({"overall": {"mean@4": 0.2}}))
    packed = experiment.read_pack(experiment.pack(tmp_path / "out", tmp_path / "p.json.gz"))
    assert packed["runs"]["fork/seed_0"]["aborted"].startswith("NonFiniteAbort at step 7")


def test_the_committed_table_is_the_committed_packs():
    from experiments.real_model.__main__ import PACK, TABLE

    assert analysis.table(analysis.analyse(experiment.read_pack(PACK))) == TABLE.read_text()


def test_a_runs_gain_keeps_its_own_step0_when_another_machine_packs_the_seed(tmp_path):
    dest = tmp_path / "pack.json.gz"
    experiment.pack(_fake_out(tmp_path / "a", 0, "grpo"), dest)
    b = _fake_out(tmp_path / "b", 0, "fork", acc=0.5)
    (b / "step0" / "seed_0" / "eval.json").write_text(json.dumps({"overall": {"mean@4": 0.2}}))  # another CPU
    result = analysis.analyse(experiment.read_pack(experiment.pack(b, dest)))
    assert result["runs"]["grpo/seed_0"]["acc0"] == 0.1 and result["runs"]["fork/seed_0"]["acc0"] == 0.2


def test_an_aborted_run_leaves_the_verdict_inconclusive_once_every_seed_has_run():
    assert analysis.verdict([0.3, 0.2, math.nan]) == "inconclusive (1 run(s) without a final accuracy)"
    runs = {"grpo/seed_0": _run([0.3, 0.4]), "fork/seed_0": _run([0.3], aborted="StalledRun at step 12: x")}
    assert analysis.analyse(_pack(runs))["pairs"] == {}  # no gain to compare


def test_the_live_doctors_findings_are_listed_with_their_first_step_and_accuracy():
    run = _run([0.3, 0.5])
    run["events"] = [{"event": "health_check", "step": 5, "findings": ["truncation"]},
                     {"event": "health_finding", "step": 5, "finding": "truncation", "severity": "info"},
                     {"event": "health_finding", "step": 10, "finding": "entropy_collapse", "severity": "warning"},
                     {"event": "health_check", "step": 10, "findings": ["entropy_collapse"]},
                     {"event": "health_check", "step": 15, "findings": ["entropy_collapse", "reward_collapse"]},
                     {"event": "health_finding", "step": 15, "finding": "reward_collapse", "severity": "alarm"},
                     {"event": "health_check", "step": 20, "findings": ["reward_collapse"]}]
    quiet = _run([0.3, 0.4])
    quiet["events"] = [{"event": "health_check", "step": 5, "findings": []}]
    result = analysis.analyse(_pack({"grpo/seed_0": run, "grpo/seed_1": quiet, "fork/seed_0": _run([0.3])},
                                    seeds=(0, 1)))
    assert result["runs"]["grpo/seed_0"]["doctor"] == {
        "checks": 4, "found": {"truncation": (5, 1), "entropy_collapse": (10, 2), "reward_collapse": (15, 2)},
        "severity": {"truncation": ["info"], "entropy_collapse": ["warning"], "reward_collapse": ["alarm"]}}
    text = analysis.table(result)
    # a finding before the first evaluation is read against step 0's accuracy (0.2 in _pack)
    assert ("- grpo/seed_0: truncation (info) from step 5 (accuracy 0.20; 1 of 4 checks); entropy_collapse "
            "(warning) from step 10 (accuracy 0.30; 2 of 4 checks); reward_collapse (alarm) from step 15 (accuracy "
            "0.30; 2 of 4 checks)") in text
    assert "- grpo/seed_1: none in 1 check\n" in text and "- fork/seed_0: no health checks recorded" in text


def test_a_run_stopped_by_a_signal_ends_with_one_line_and_the_signals_status(monkeypatch, capsys):
    import signal

    from meshrl.trainer import RunInterrupted

    def stop(*_args, **_kwargs):
        raise RunInterrupted(signal.SIGTERM)

    monkeypatch.setattr(experiment, "run_all", stop)
    assert main(["run", "--seeds", "0"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped (stopped by SIGTERM)" in err and "resumes them" in err and "Traceback" not in err


def test_the_post_hoc_description_by_hand():
    """Replies and entropy over the first and last steps, and the forking-token shares by hand: a resumed step's
    later record counts once, the positive-advantage share is a ratio of sums, and a run without `fork/*` has none."""
    def step(s: int, **kw: float) -> dict:
        return {"step": s, "reward/mean": s / 10, "len/response_mean": 20.0, "len/truncated_frac": 0.5,
                "entropy/mean": 2.0, **kw}
    metrics = [step(s) for s in range(1, 7)]
    metrics[1]["reward/mean"] = 99.0  # step 2 recorded twice: only the later record counts
    metrics.append(step(2))
    assert analysis.describe(metrics, edge=2)["reward/mean"] == (pytest.approx(0.15), pytest.approx(0.55))
    assert analysis.describe(metrics, edge=7) == {}  # fewer steps than the edge: nothing described
    assert analysis.fork_selection(metrics, horizon=6) is None
    fork = [step(s, **{"fork/rows_unkept": u, "fork/rows_adv_pos": p, "fork/rows_unkept_adv_pos": up,
                       "fork/first_kept": f})
            for s, (u, p, up, f) in enumerate([(0.5, 0.5, 0.25, 1.0), (0.25, 0.25, 0.25, 0.0), (0.0, 0.0, 0.0, 0.0),
                                               (0.5, 0.5, 0.5, 0.0), (0.25, 0.5, 0.0, 0.5), (0.5, 0.25, 0.25, 0.0)],
                                              start=1)]
    s = analysis.fork_selection(fork, horizon=6, edge=2)
    assert s["unkept"] == pytest.approx(2.0 / 6) and s["steps"] == 6
    assert s["unkept_pos"] == pytest.approx(1.25 / 2.0)
    assert s["unkept_pos_thirds"] == [(1, 2, pytest.approx(0.5 / 0.75)), (3, 4, pytest.approx(1.0)),
                                      (5, 6, pytest.approx(0.25 / 0.75))]
    assert s["first_kept"] == (pytest.approx(0.5), pytest.approx(0.125)) and s["first_kept_steps"] == 2
    text = analysis.table(analysis.analyse(_pack({"fork/seed_0": _run([0.3, 0.4])})))
    assert "Post hoc (no pre-registered endpoint)" in text and "What the forking-token plug-in left" not in text
