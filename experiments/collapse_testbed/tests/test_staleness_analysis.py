"""The staleness experiment's analysis (staleness.py) on hand-made runs: the planned families, Holm, the decision
rules, the lag figures and the k = 0 check."""

from __future__ import annotations

import json
import shutil

import pytest

from experiments.collapse_testbed import persistence as P
from experiments.collapse_testbed import staleness as S


def _curve(values: list[float]) -> list[tuple[int, float]]:
    return [(i * 8, v) for i, v in enumerate(values)]


FAST = _curve([0.3, 0.1, 0.6] + [0.9] * 18)  # T = 16
SLOW = _curve([0.3, 0.1] + [0.05] * 10 + [0.9] * 9)  # T = 96
NEVER = _curve([0.3] + [0.02] * 20)  # censored at 160


def _runs(curves: dict[str, list[tuple[int, float]]], seeds: int = 8) -> list[P.RunEndpoints]:
    return [P.endpoints("W2", arm, s, c) for arm, c in curves.items() for s in range(seeds)]


def test_the_planned_comparisons_are_the_preregistered_ones():
    plan = S.planned()
    primary = [(a, r, e) for f, a, r, e in plan if f == "primary"]
    assert primary == [("grpo_k8_none", "grpo", ("relearn",)), ("grpo_k8_tis", "grpo_k8_none", ("relearn",)),
                       ("grpo_k8_m2po", "grpo_k8_none", ("relearn",))]
    secondary = [(a, r) for f, a, r, _ in plan if f == "secondary"]
    assert ("grpo_k2_tis", "grpo_k2_none") in secondary and ("grpo_k8_tis", "grpo") in secondary
    assert len(secondary) == 3 + 9 + 1


def test_staleness_that_slows_relearning_and_a_correction_that_undoes_it():
    runs = _runs({"grpo": FAST, "grpo_k8_none": SLOW, "grpo_k8_tis": FAST, "grpo_k8_m2po": SLOW})
    rows = S.comparisons(runs)
    prim = {r["arm"]: r for r in rows if r["family"] == "primary"}
    assert prim["grpo_k8_none"]["n"] == 8 and prim["grpo_k8_none"]["mean_diff"] == 80
    # 8 pairs all one way: p = 2 / 2^8; M2PO equals k8_none in every pair (p = 1); Holm over the 3
    assert prim["grpo_k8_none"]["p"] == pytest.approx(2 / 256)
    assert prim["grpo_k8_m2po"]["p"] == 1.0
    assert prim["grpo_k8_none"]["p_holm"] == pytest.approx(3 * 2 / 256)
    text = S.decision(rows)
    assert text.startswith("**Partial grid**") and "k = 8: 8 of 8 pairs; k = 1: no complete pair" in text
    assert "S1 passes" in text and "later" in text and "undoes it: grpo_k8_tis." in text
    # arms never run (k = 1, 2, 4) are listed with no pairs and no Holm p of their own
    k2 = [r for r in rows if r["arm"] == "grpo_k2_none"]
    assert k2 and all(r["n"] == 0 and "p_holm" not in r for r in k2)


def test_no_effect_detected_reads_as_such_and_only_at_eight_pairs():
    runs = _runs({"grpo": FAST, "grpo_k8_none": FAST, "grpo_k8_tis": NEVER, "grpo_k8_m2po": FAST})
    assert "No effect of an 8-step lag detected at 8 pairs" in S.decision(S.comparisons(runs))
    assert "S1 not testable yet" in S.decision([])
    runs = _runs({"grpo": FAST, "grpo_k8_none": SLOW}, seeds=4)
    text = S.decision(S.comparisons(runs))
    assert "k = 8: 4 of 8 pairs" in text and "No effect" not in text and "S1 passes" not in text
    assert ("S1 so far at 4 of 8 pairs: mean difference in T 80 steps, differences 80 to 80, Holm p = 0.375 (at 4 "
            "pairs the smallest reachable Holm p is 0.375)") in text  # Holm over the 3 pre-registered, 1 testable
    # pairs in which both arms never re-learn differ by 0: they bound what the full 8 pairs can reach
    runs = _runs({"grpo": FAST, "grpo_k8_none": SLOW}, seeds=2) + [
        P.endpoints("W2", arm, s, NEVER) for arm in ("grpo", "grpo_k8_none") for s in (2, 3, 4)]
    text = S.decision(S.comparisons(runs))
    assert ("S1 so far at 5 of 8 pairs: mean difference in T 32 steps, differences 0 to 80, Holm p = 1 (at 5 pairs "
            "the smallest reachable Holm p is 1; with 3 difference(s) of 0, which no sign flip moves, the smallest "
            "Holm p reachable at 8 pairs is 0.188, so S1 cannot pass).") in text


def test_the_primary_family_is_holm_over_three_however_much_of_the_grid_is_in():
    """S1 at 8 pairs with neither correction arm run: Holm over 3 (not over the 1 test with pairs), and the
    correction comparisons are undecided, not "no correction undoes it"."""
    rows = S.comparisons(_runs({"grpo": FAST, "grpo_k8_none": SLOW}))
    prim = {r["arm"]: r for r in rows if r["family"] == "primary"}
    assert prim["grpo_k8_none"]["p"] == pytest.approx(2 / 256)
    assert prim["grpo_k8_none"]["p_holm"] == pytest.approx(3 * 2 / 256)
    assert "p_holm" not in prim["grpo_k8_tis"] and prim["grpo_k8_tis"]["n"] == 0
    text = S.decision(rows)
    assert "S1 passes" in text and "No correction undoes it" not in text
    assert ("Whether a correction undoes it is not decided yet (grpo_k8_tis at 0 of 8 pairs; grpo_k8_m2po at 0 of 8 "
            "pairs).") in text
    # a correction arm at 4 pairs that would undo it is not decided either
    runs = _runs({"grpo": FAST, "grpo_k8_none": SLOW}) + _runs({"grpo_k8_tis": FAST}, seeds=4)
    assert "grpo_k8_tis at 4 of 8 pairs; grpo_k8_m2po at 0 of 8 pairs" in S.decision(S.comparisons(runs))
    # the secondary family also counts its comparisons not run yet (p = 1): its Holm p is the family's size x p
    rows = S.comparisons(_runs({"grpo": FAST, "grpo_k8_none": SLOW, "grpo_k2_none": SLOW}, seeds=5))
    k2 = next(r for r in rows if r["arm"] == "grpo_k2_none" and r["endpoint"] == "relearn")
    secondary = [r for r in rows if r["family"] == "secondary"]
    assert k2["p"] == pytest.approx(2 / 32) and k2["p_holm"] == pytest.approx(min(1.0, len(secondary) * 2 / 32))


def test_lag_figures_average_each_run_once(tmp_path):
    for arm, seed, rows in (("grpo_k8_tis", 0, [{"lag/staleness_mean": 8.0, "rollout_corr/ess": 0.5}] * 3),
                            ("grpo_k8_tis", 1, [{"lag/staleness_mean": 4.0, "rollout_corr/ess": 0.9}]),
                            ("grpo", 0, [{"acc/mean": 0.5}])):
        d = tmp_path / "runs" / arm / f"seed_{seed}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figs = S.lag_figures(tmp_path)
    assert figs == {"grpo_k8_tis": {"lag/staleness_mean": 6.0, "rollout_corr/ess": pytest.approx(0.7)}}


def test_the_k0_check_names_the_first_difference():
    mine = _runs({"grpo": FAST}, seeds=2)
    other = _curve([0.3, 0.1, 0.6, 0.85] + [0.9] * 17)
    ref = [P.endpoints("W2", "grpo", 0, FAST), P.endpoints("W2", "grpo", 1, other),
           P.endpoints("W2", "cp_only", 0, SLOW)]
    check = S.reproduces(mine, ref)
    assert check == [{"seed": 0, "checkpoints": 21, "identical": True, "first_difference": None},
                     {"seed": 1, "checkpoints": 21, "identical": False, "first_difference": 24}]
    md = S.markdown(mine, S.comparisons(mine), {}, check)
    assert "1 of 2 seeds identical (first differences: seed 1 at step 24)." in md
    # a seed made on another CPU says so: float rounding alone can part the curves
    check = S.reproduces(mine, ref, {1: "AVX2"})
    assert check[1]["machine"] == "AVX2" and "machine" not in check[0]
    md = S.markdown(mine, S.comparisons(mine), {}, check)
    assert ("(first differences: seed 1 at step 24, made on AVX2). A run repeats bit "
            "for bit only on a like CPU") in md
    # the stop rule's post hoc reading names the recorded CPUs, whatever they are, and claims no more
    assert ("Recorded CPUs: the seeds that differ, AVX2; the identical ones, 1 seed without a record; the reference "
            "runs, none. The CPU is a likely cause, not a shown one.") in md


def test_run_machines_reads_the_cpu_each_run_recorded(tmp_path):
    for seed, record in ((0, {"arm": "grpo"}), (1, {"machine": {"capability": "AVX512"}})):
        d = tmp_path / "runs" / "grpo" / f"seed_{seed}"
        d.mkdir(parents=True)
        (d / "done.json").write_text(json.dumps(record))
    assert S.run_machines(tmp_path) == {1: "AVX512"}
    d = tmp_path / "runs" / "grpo_k8_tis" / "seed_1"
    d.mkdir(parents=True)
    (d / "done.json").write_text(json.dumps({"machine": {"capability": "AVX2"}}))
    assert S.run_machines(tmp_path, None) == {("grpo", 1): "AVX512", ("grpo_k8_tis", 1): "AVX2"}


def test_a_cpu_is_its_capability_model_and_amx_where_recorded():
    # two AVX512 CPUs that round differently are two machines: the model and AMX tell them apart
    intel = {"model": "Intel(R) Xeon(R) Processor", "capability": "AVX512", "flags": ["avx512f", "amx_tile"]}
    amd = {"model": "AMD EPYC", "capability": "AVX512", "flags": ["avx512f"]}
    assert S.machine_label(intel) == "AVX512 (Intel(R) Xeon(R) Processor, AMX)"
    assert S.machine_label(amd) == "AVX512 (AMD EPYC)"
    assert S.machine_label({"capability": "AVX2"}) == "AVX2"  # a record without the model: the capability alone
    assert S.machine_label({"model": "AMD EPYC", "capability": "AVX512"}) == "AVX512 (AMD EPYC, flags not recorded)"
    runs = _runs({"grpo": FAST, "grpo_k1_none": SLOW}, seeds=1)
    machines = {("grpo", 0): S.machine_label(intel), ("grpo_k1_none", 0): S.machine_label(amd)}
    assert S.machine_note(machines, runs) == "Pairs made on two CPUs: seed 0."


def test_lag_figures_leave_out_runs_still_training_and_overall_accuracy_is_read_per_run(tmp_path):
    for seed, lag in ((0, 8.0), (1, 2.0)):
        d = tmp_path / "runs" / "grpo_k8_none" / f"seed_{seed}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text(json.dumps({"lag/staleness_mean": lag}) + "\n")
    assert S.lag_figures(tmp_path, {("grpo_k8_none", 0)}) == {"grpo_k8_none": {"lag/staleness_mean": 8.0}}
    e = tmp_path / "runs" / "grpo_k8_none" / "seed_0" / "ckpt_eval" / "step_160"
    e.mkdir(parents=True)
    (e / "eval.json").write_text(json.dumps({"overall": {"pass@1": 0.06}}))
    assert S.overall_at_horizon(tmp_path) == {("grpo_k8_none", 0): 0.06}
    runs = [P.endpoints("W2", "grpo_k8_none", 0, NEVER)]
    md = S.markdown(runs, S.comparisons(runs), {}, None, S.overall_at_horizon(tmp_path))
    assert "| grpo_k8_none | 0 | yes | 0.02 | lost | >160 | " in md and " | 0.06 | - | 0:0.30" in md
    assert "| secondary | grpo_k1_none | grpo | kept | 0 | McNemar exact | not run |" in md


def _events(d, findings_per_check):
    d.mkdir(parents=True, exist_ok=True)
    (d / "events.jsonl").write_text("".join(json.dumps({"step": 4 * i, "event": "health_check", "findings": f}) + "\n"
                                            for i, f in enumerate(findings_per_check)))


def test_diverging_lagged_runs_are_named_and_s1_is_repeated_without_them(tmp_path):
    runs = _runs({"grpo": FAST, "grpo_k8_none": SLOW}, seeds=3)
    _events(tmp_path / "runs" / "grpo_k8_none" / "seed_0", [["stale_rollouts"]] * 3 + [[]])  # 3 of 4: most
    _events(tmp_path / "runs" / "grpo_k8_none" / "seed_1", [["ratio_tail"]] * 2 + [[]] * 2)  # 2 of 4: not most
    d = tmp_path / "runs" / "grpo_k8_none" / "seed_2"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss/total": 0.1}) + "\n"
                                     + json.dumps({"step": 2, "loss/total": "nan"}) + "\n")
    _events(tmp_path / "runs" / "grpo" / "seed_0", [["ratio_tail"]] * 4)  # k = 0 is never named
    complete = {(r.arm, r.seed) for r in runs}
    gone = S.divergent(tmp_path, complete)
    assert gone == {("grpo_k8_none", 0): "stale_rollouts at 3 of 4 health checks",
                    ("grpo_k8_none", 2): "non-finite at 1 step(s), first 2"}
    text = S.without_divergent(runs, gone)
    assert "grpo_k8_none seed 0 (stale_rollouts at 3 of 4 health checks)" in text
    assert "*Post hoc*, S1 without them: 1 pairs, mean difference in T 80 steps, p = 1 (" in text
    assert "no pair is left" in S.without_divergent(runs, {("grpo_k8_none", s): "x" for s in range(3)})
    assert "stale_rollouts is raised on every uncorrected lagged run by its definition" in text
    assert "by its definition" not in S.without_divergent(runs, {("grpo_k8_tis", 0): "ratio_tail at 3 of 4"})
    assert S.without_divergent(runs, {}).startswith("No lagged run diverges")


def test_pairs_made_on_two_cpus_are_said():
    runs = _runs({"grpo": FAST, "grpo_k8_none": SLOW}, seeds=3)
    note = S.machine_note({("grpo", 0): "AVX2", ("grpo_k8_none", 0): "AVX512", ("grpo", 1): "AVX2",
                           ("grpo_k8_none", 1): "AVX2"}, runs)
    assert note == ("Pairs made on two CPUs: seed 0. Seed 2 has pairs with a run that records no CPU (made before runs "
                    "recorded it).")
    note = S.machine_note({("grpo", 0): "AVX2", ("grpo", 1): "AVX2", ("grpo_k8_none", 1): "AVX2"}, runs[:2] + runs[3:5])
    assert note == ("Every compared pair whose two runs record their CPU was made on one CPU. Seed 0 has pairs with a "
                    "run that records no CPU (made before runs recorded it).")
    # a run still training (incomplete) is in no pair yet, so it says nothing about its seed
    training = P.endpoints("W2", "grpo_k8_none", 0, FAST[:5])
    assert not training.complete
    note = S.machine_note({("grpo", 0): "AVX2"}, [runs[0], training])
    assert note == "Every compared pair whose two runs record their CPU was made on one CPU."


def test_the_cpu_note_judges_the_pairs_the_comparisons_use():
    """A seed whose k = 0 and k = 8 runs came from one CPU and whose k = 2 and remade k = 0 runs from another has no
    pair across CPUs; a k = 2 run paired with a k = 0 run of another CPU (no remade run) is one."""
    runs = _runs({"grpo": FAST, "grpo_k8_none": SLOW, "grpo_k2_none": SLOW}, seeds=2)
    runs.append(P.endpoints("W2", S.REMADE, 0, FAST))
    machines = {("grpo", 0): "AVX2", ("grpo_k8_none", 0): "AVX2", ("grpo_k2_none", 0): "AVX512",
                (S.REMADE, 0): "AVX512", ("grpo", 1): "AVX2", ("grpo_k8_none", 1): "AVX2",
                ("grpo_k2_none", 1): "AVX512"}
    assert S.compared_pairs(runs) >= {(("grpo_k2_none", 0), (S.REMADE, 0)), (("grpo_k8_none", 0), ("grpo", 0)),
                                      (("grpo_k2_none", 1), ("grpo", 1))}
    assert S.machine_note(machines, runs) == "Pairs made on two CPUs: seed 1."


def test_a_lagged_run_the_trainer_aborted_is_named_diverging(tmp_path):
    d = tmp_path / "runs" / "grpo_k8_none" / "seed_4"
    d.mkdir(parents=True)
    (d / "done.json").write_text(json.dumps({"aborted": "NonFiniteAbort at step 9: loss is nan"}))
    assert S.divergent(tmp_path, set()) == {
        ("grpo_k8_none", 4): "aborted by the trainer: NonFiniteAbort at step 9: loss is nan"}


def test_a_cut_done_json_is_not_an_abort(tmp_path):
    from experiments.collapse_testbed.experiment import aborted

    (tmp_path / "done.json").write_text('{"arm": "grpo", "se')
    assert aborted(tmp_path) is None and aborted(tmp_path / "missing") is None


def test_the_k1_2_4_arms_pair_with_the_k0_run_remade_on_their_cpu():
    """A seed with a remade k = 0 run: its k = 1, 2, 4 arms are paired with it, its k = 8 arms with the packed one."""
    runs = _runs({"grpo": FAST, "grpo_k8_none": SLOW, "grpo_k2_none": SLOW}, seeds=3)
    runs.append(P.endpoints("W2", S.REMADE, 0, NEVER))
    rows = {(r["arm"], r["reference"], r["endpoint"]): r for r in S.comparisons(runs)}
    k2 = rows["grpo_k2_none", "grpo", "relearn"]
    assert k2["n"] == 3 and k2["mean_diff"] == pytest.approx((96 - 160 + 80 + 80) / 3)  # seed 0 against NEVER
    assert rows["grpo_k8_none", "grpo", "relearn"]["mean_diff"] == 80  # seed 0 against the packed FAST
    runs.append(P.endpoints("W2", "grpo_k8_tis", 0, SLOW))
    assert {(r["arm"], r["reference"], r["endpoint"]): r for r in S.comparisons(runs)}[
        "grpo_k8_tis", "grpo", "relearn"]["mean_diff"] == 80  # the secondary k = 8 row keeps it too
    runs.pop()
    # a remade run not finished yet leaves its seed's k = 1, 2, 4 pairs out rather than pairing across CPUs
    runs[-1] = P.endpoints("W2", S.REMADE, 0, NEVER[:5])
    assert S.comparisons(runs)[0]["n"] == 3
    assert {(r["arm"], r["reference"]): r["n"] for r in S.comparisons(runs)}["grpo_k2_none", "grpo"] == 2


def test_the_remade_k0_runs_are_described_against_the_packed_ones():
    runs = _runs({"grpo": FAST}, seeds=2) + [P.endpoints("W2", S.REMADE, s, c) for s, c in ((0, FAST), (1, NEVER))]
    again = S.reproduces([P.endpoints("W2", "grpo", 0, FAST), P.endpoints("W2", "grpo", 1, NEVER)], runs,
                         {0: "AVX512", 1: "AVX512"})
    note = S.remade_note(again, runs)
    assert note == ("k = 0 remade for the k = 1, 2, 4 arms (grpo_remade; *post hoc*: one CPU per pair, as a run "
                    "repeats bit for bit only on a like CPU): made on AVX512; against the packed k = 0 run: seed 0 "
                    "niche curve identical at 21 checkpoints, re-learned at 16 (packed at 16); seed 1 niche curves "
                    "parted at step 8, re-learned not by 160 "
                    "(packed at 16). The k = 8 arms keep the packed k = 0 run they were made beside.")
    md = S.markdown(runs, S.comparisons(runs), {}, None, again=again)
    assert note in md and "| grpo_remade | 1 | yes |" in md


def _k0_run(root, seed: int, curve, metrics: list[dict], machine: dict | None = None) -> None:
    """A finished GRPO run of a staleness-like experiment under ``root``: its niche curve as checkpoint
    evaluations, its training metrics, and the CPU its done.json records."""
    d = root / "runs" / "grpo" / f"seed_{seed}"
    for step, v in curve:
        e = d / "ckpt_eval" / f"step_{step}"
        e.mkdir(parents=True)
        (e / "eval.json").write_text(json.dumps({"config": {"seed": 0}, "overall": {"pass@1": v},
                                                 "by": {"groups": {"decade": {"pass@1": v}}}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "done.json").write_text(json.dumps({"machine": machine} if machine else {}))


def test_a_cpu_check_that_repeats_the_reference_shows_the_cpu_as_the_cause(tmp_path):
    intel = {"model": "Intel", "capability": "AVX512", "flags": ["amx_tile"]}
    amd = {"model": "AMD EPYC", "capability": "AVX512", "flags": []}
    trained = [{"loss/policy": 0.1 * i, "time/step_s": 1.0} for i in range(3)]
    clocked = [dict(m, **{"time/step_s": 9.0, "throughput/tokens_per_s": 5.0}) for m in trained]  # speed only
    w2, packed, again = tmp_path / "W2", tmp_path / "packed", tmp_path / "again"
    for seed in range(5):
        _k0_run(w2, seed, FAST, trained)
    # seed 0 agreed in the k = 0 check; seeds 1-4 parted from W2 on the Intel Xeon
    _k0_run(packed, 0, FAST, trained)
    for seed in range(1, 5):
        _k0_run(packed, seed, SLOW, trained, intel)
    # made again on the AMD EPYC: seeds 0, 1 repeat W2; seed 2 only in its niche curve; seed 3 not at all;
    # seed 4 was made again on the Intel Xeon itself, so repeating W2 there would not show the CPU; seed 5 has no W2
    _k0_run(again, 0, FAST, clocked, amd)
    _k0_run(again, 1, FAST, clocked, amd)
    _k0_run(again, 2, FAST, trained[:2] + [{"loss/policy": 7.0}], amd)
    _k0_run(again, 3, NEVER, trained, amd)
    _k0_run(again, 4, FAST, trained, intel)
    _k0_run(again, 5, FAST, trained, amd)
    runs, reference = P.read_runs("W2", packed), P.read_runs("W2", w2)
    note, shown, against = S.cpu_check_result(again, w2, runs, S.run_machines(packed), reference)
    assert shown == [1] and against == [4]
    assert note.startswith(
        "CPU check (*post hoc*): GRPO at k = 0 made again on AVX512 (AMD EPYC), AVX512 (Intel, AMX): "
        "seed 0 (on AVX512 (AMD EPYC)) identical to the W2 run (training metrics at 3 steps; niche curve at 21 "
        "checkpoints), identical to the packed k = 0 run at 21 checkpoints (its CPU not recorded); "
        "seed 1 (on AVX512 (AMD EPYC)) identical to the W2 run (training metrics at 3 steps; niche curve at 21 "
        "checkpoints), parted from the packed k = 0 run at step 16 (made on AVX512 (Intel, AMX)); "
        "seed 2 (on AVX512 (AMD EPYC)) parted from the W2 run (training metrics parted at step 3; niche curve at 21 "
        "checkpoints)")
    assert ("seed 3 (on AVX512 (AMD EPYC)) parted from the W2 run (training metrics at 3 steps; niche curves parted "
            "at step 8)") in note
    assert "Seed 5 made again: no finished W2 run to compare with." in note
    check = S.reproduces(runs, reference, S.run_machines(packed))
    stop = S.k0_stop_text(check, shown, against)
    # seed 0 never differed, so only seed 1 is shown; seed 4 repeating W2 on its packed run's own CPU speaks against
    # the CPU; seeds 2 and 3 (parted from W2 again) stay likely cases
    assert stop.endswith("The CPU is shown to be the cause for seed 1 (made again on another CPU, it repeats the "
                         "reference run: the CPU check below); not explained by the CPU as recorded for seed 4 (made "
                         "again on the CPU its packed run records, it repeats the reference run: the CPU check "
                         "below); a likely cause for seeds 2, 3.")
    assert S.k0_stop_text(check).endswith("The CPU is a likely cause, not a shown one.")
    md = S.markdown(runs, S.comparisons(runs), {}, check, cpu_check=note, shown=shown, against=against)
    assert note in md and md.index("The CPU is shown") < md.index(note)
    assert S.cpu_check_note([], [], {}) == "CPU check (*post hoc*): no finished k = 0 run made again yet."
    # a run made again without a CPU record, or with no metrics, shows nothing; an unfinished one is named
    for seed in (1, 4):
        shutil.rmtree(again / "runs" / "grpo" / f"seed_{seed}")
    _k0_run(again, 1, FAST, clocked)  # no CPU recorded
    _k0_run(again, 4, FAST, [], amd)  # no training metrics
    _k0_run(again, 6, FAST[:5], trained, amd)  # still training
    note, shown, against = S.cpu_check_result(again, w2, runs, S.run_machines(packed), reference)
    assert shown == [] and against == []
    assert "seed 4 (on AVX512 (AMD EPYC)) parted from the W2 run (training metrics parted at step 1;" in note
    assert note.endswith("Not finished, left out: seed 6.")
    assert S.cpu_check_note([], [], {}, [6]) == ("CPU check (*post hoc*): seed 6 made again, with no finished W2 run "
                                                 "to compare with.")


def test_metrics_agree_leaves_the_clock_out_and_finds_the_first_difference(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, rows in ((a, [{"x": 1, "time/s": 1}, {"x": 2}]), (b, [{"x": 1, "time/s": 5}, {"x": 3}, {"x": 4}])):
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert S.metrics_agree(a, b) == (2, 2)
    assert S.metrics_agree(a, a) == (2, None)
    assert S.metrics_agree(a, tmp_path / "none") == (0, 1)  # a step only one run holds differs
    c = tmp_path / "c"  # records matched by their step, not their line
    c.mkdir()
    (c / "metrics.jsonl").write_text(json.dumps({"step": 2, "x": 2}) + "\n" + json.dumps({"step": 1, "x": 1}) + "\n")
    d = tmp_path / "d"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "x": 1}) + "\n" + json.dumps({"step": 2, "x": 2}) + "\n")
    assert S.metrics_agree(c, d) == (2, None)


def test_a_cpu_check_needs_the_reference(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    assert S.main([str(tmp_path), "--cpu-check", str(tmp_path)]) == 2
    assert "give --reference too" in capsys.readouterr().err
