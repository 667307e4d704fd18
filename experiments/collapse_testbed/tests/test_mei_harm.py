"""Item 4's MEI-versus-harm analysis (mei_harm.py) on hand-computed cases and a small synthetic experiment."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments.collapse_testbed import mei_harm as M

STEPS = list(range(0, 161, 4))


def _jsonl(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _eval(path, decade: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "eval.json").write_text(json.dumps({"by": {"groups": {"decade": {"pass@1": decade}}}}))


def _run(out, arm: str, seed: int, niche, mei=None, events=None) -> None:
    """A run: ``niche(step)`` at checkpoints 8..160; ``mei(step)`` the signal (two queries at mei -/+ 1)."""
    d = out / "runs" / arm / f"seed_{seed}"
    for step in range(8, 161, 8):
        _eval(d / "ckpt_eval" / f"step_{step}", niche(step))
    if mei is not None:
        _jsonl(d / "probes_per_problem.jsonl",
               [{"step": t, "id": q, "mei/bias": mei(t) + sign, "mei_distinct/bias": (mei(t) + sign) / 10}
                for t in STEPS for q, sign in (("a", -1.0), ("b", 1.0))])
        _jsonl(d / "probes.jsonl", [{"step": t, "mei/bias": mei(t)} for t in STEPS])
    if events is not None:
        _jsonl(d / "events.jsonl", events)


def _experiment(tmp_path):
    """Baseline per-query MEI 1 (x5) and 3 (x5): mean 2, sd (ddof 1) sqrt(10/9), 3-sigma line 2 + sqrt(10) = 5.162
    (ddof 0 would give 5.0)."""
    out = tmp_path / "W"
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({"task": "testbed:add"}))
    _jsonl(out / "baseline_per_problem.jsonl",
           [{"probe_seed": 10_000 + k, "id": q, "mei/bias": v, "mei_distinct/bias": v / 10}
            for k in range(5) for q, v in (("a", 1.0), ("b", 3.0))])
    for seed in range(2):
        _eval(out / "warm_eval" / f"seed_{seed}", 0.4)
    # harmful (both label rules): 0.9 to step 24, then 0.1 from step 32; MEI high from step 20; doctor warns at 16
    _run(out, "grpo", 0, lambda s: 0.9 if s < 32 else 0.1, lambda t: 6.0 if t >= 20 else 2.0,
         [{"step": 4, "event": "health_finding", "finding": "truncation", "severity": "info"},
          {"step": 16, "event": "health_finding", "finding": "strategy_collapse", "severity": "warning"},
          {"step": 16, "event": "health_check", "findings": []}])
    # none: MEI high at steps 0 (the warm start) and 4 only, and 5.1 (above ddof-0's line, below ddof-1's) at 40, 44
    _run(out, "grpo", 1, lambda s: 0.9, lambda t: 6.0 if t <= 4 else 5.1 if t in (40, 44) else 2.0, [])
    # none: MEI high only at 156 and 160 (a crossing after step 152 is no false alarm)
    _run(out, "cp_only", 0, lambda s: 0.9, lambda t: 6.0 if t >= 156 else 2.0, [])
    _run(out, "cp_only", 1, lambda s: 0.9)  # evaluated, never probed: missing
    return out


def test_thresholds_by_hand(tmp_path):
    base = M.baseline(_experiment(tmp_path))
    sd = math.sqrt(10 / 9)
    assert base["mei/bias"]["mean"] == pytest.approx(2.0) and base["mei/bias"]["sd"] == pytest.approx(sd)
    assert base["mei/bias"]["3sigma"] == pytest.approx(2 + 3 * sd) and base["mei/bias"]["n"] == 10
    assert base["mei_distinct/bias"]["3sigma"] == pytest.approx(0.2 + 0.3 * sd)
    assert base["mei/bias"]["1.013"] == 1.013
    assert math.isnan(base["mei/head"]["3sigma"])  # no head values in the baseline


def test_crossing_needs_two_consecutive_probes_strictly_above():
    s = [(4, 0.5), (8, 2.0), (12, 0.5), (16, 2.0), (20, 2.0)]
    assert M.crossing(s, 1.0) == 16
    assert M.crossing([(4, 1.0), (8, 1.0), (12, 2.0)], 1.0) is None  # equal is not above
    assert M.crossing([(4, 0.0), (8, 2.0)], 1.0) is None  # the last probe has no next one
    assert M.crossing(s, math.nan) is None


def test_crossing_counts_from_step_4():
    assert M.crossing([(2, 2.0), (4, 2.0), (8, 0.0)], 1.0) is None
    assert M.crossing([(0, 2.0), (4, 2.0), (8, 2.0)], 1.0) == 4


def test_signal_is_the_query_mean_after_step_0(tmp_path):
    d = tmp_path / "run"
    recs = [{"step": 0, "id": "a", "mei/bias": 9.0}, {"step": 4, "id": "a", "mei/bias": 1.0},
            {"step": 4, "id": "b", "mei/bias": 3.0}, {"step": 8, "id": "a", "mei/bias": 5.0},
            {"step": 8, "id": "a", "mei/bias": 1.0}, {"step": 8, "id": "b", "mei/bias": float("nan")},
            {"step": 12, "id": "a", "mei/bias": 7.0}]  # step 8 repeated after a resume; step 12 never finished
    _jsonl(d / "probes_per_problem.jsonl", recs)
    _jsonl(d / "probes.jsonl", [{"step": t} for t in (0, 4, 8)])
    assert M.signal(d, "mei/bias") == [(4, 2.0), (8, 1.0)]


def _rs(cls: str, fall, crossing) -> M.RunSignals:
    return M.RunSignals("W", "grpo", 0, True, 40, {"verbatim": (cls, fall), "after_hold": (cls, fall)},
                        {M.PRIMARY_SIGNAL: crossing}, [])


def test_eight_step_lead_and_the_others_window():
    runs = [_rs("harm", 32, 24), _rs("harm", 32, 28), _rs("harm", 32, None), _rs("harm", 32, 40),
            _rs("dip", None, 152), _rs("none", None, 156), _rs("none", None, None)]
    c = M.criterion(runs, M.PRIMARY_SIGNAL, "verbatim")
    assert (c["harmful"], c["warned_in_time"], c["others"], c["others_crossed"]) == (4, 1, 3, 1)
    assert c["leads"] == [-8, 4, 8] and c["lead_median"] == 4 and (c["lead_min"], c["lead_max"]) == (-8, 8)
    assert c["verdict"] == "failure"
    ok = M.criterion([_rs("harm", 32, 24)] * 7 + [_rs("harm", 32, 28)] * 3 + [_rs("none", None, 100)] * 3
                     + [_rs("none", None, None)] * 7, M.PRIMARY_SIGNAL, "verbatim")
    assert (ok["hit_rate"], ok["false_rate"], ok["verdict"]) == (0.7, 0.3, "success")  # both ends included


def test_criterion_undefined_without_harmful_runs_or_others():
    none = M.criterion([_rs("none", None, 20), _rs("dip", None, None)], M.PRIMARY_SIGNAL, "verbatim")
    assert none["verdict"] == "undefined" and math.isnan(none["hit_rate"]) and none["false_rate"] == 0.5
    assert M.criterion([_rs("harm", 32, 20)], M.PRIMARY_SIGNAL, "verbatim")["verdict"] == "undefined"


def test_auroc_by_hand_with_ties():
    # pairs: 0.9>0.5, 0.9>0.1, 0.5=0.5 (1/2), 0.5>0.1 -> 3.5 / 4
    assert M.auroc([0.9, 0.5], [0.5, 0.1]) == pytest.approx(0.875)
    assert M.auroc([1.0], [1.0]) == 0.5 and M.auroc([0.0], [1.0]) == 0.0
    assert M.auroc([-math.inf], [0.0, -math.inf]) == 0.25
    assert math.isnan(M.auroc([], [1.0]))


def test_score_window_and_z():
    s = [(4, 3.0), (8, 2.0), (24, 4.0), (28, 9.0)]
    assert M.mei_score(s, 2.0, 0.5, M.window_end(True, 32)) == pytest.approx(4.0)  # 28 is past fall - 8
    assert M.mei_score(s, 2.0, 0.5, M.window_end(False, None)) == pytest.approx(14.0)
    assert M.mei_score(s, 2.0, 0.5, M.window_end(True, 8)) == -math.inf  # no probe in 4..0
    assert math.isnan(M.mei_score(s, 2.0, math.nan, 152))


def _brute(items, n_boot, seed):
    clusters = sorted({c for c, _, _ in items}, key=str)
    draws = np.random.default_rng(seed).integers(0, len(clusters), size=(n_boot, len(clusters)))
    vals = []
    for row in draws:
        picked = [it for k in row for it in items if it[0] == clusters[k]]
        a = M.auroc([s for _, h, s in picked if h], [s for _, h, s in picked if not h])
        if a == a:
            vals.append(a)
    return np.quantile(vals, [0.025, 0.975]), n_boot - len(vals)


def test_cluster_bootstrap_is_exact_reproducible_and_contains_the_estimate():
    items = [(("W", 0), True, 3.0), (("W", 0), False, 1.0), (("W", 1), True, 0.5), (("W", 1), False, 2.0),
             (("W", 2), True, 2.0), (("W", 3), False, 2.0), (("V", 0), False, -1.0)]
    point = M.auroc([s for _, h, s in items if h], [s for _, h, s in items if not h])
    a = M.cluster_bootstrap(items)
    assert a["n_boot"] == 10_000 and a["low"] <= point <= a["high"]
    assert a == M.cluster_bootstrap(items) and a != M.cluster_bootstrap(items, seed=1)
    small = M.cluster_bootstrap(items, n_boot=300, seed=3)
    (low, high), undefined = _brute(items, 300, 3)
    assert (small["low"], small["high"], small["undefined"]) == (pytest.approx(low), pytest.approx(high), undefined)


def test_whole_clusters_are_resampled():
    # one cluster of harmful runs, one of others: a resample is undefined when it draws one cluster twice (1/2)
    items = [("A", True, 1.0), ("A", True, 2.0), ("B", False, 0.0)]
    b = M.cluster_bootstrap(items, n_boot=4000)
    assert abs(b["undefined"] - 2000) < 150 and (b["low"], b["high"]) == (1.0, 1.0)


def test_synthetic_experiment_end_to_end(tmp_path):
    out = _experiment(tmp_path)
    res = M.analyse({"W": out}, n_boot=500)
    runs = {(r.arm, r.seed): r for r in res["runs"]}
    assert not runs["cp_only", 1].complete and runs["cp_only", 1].probe_steps == 0
    harmful = runs["grpo", 0]
    assert harmful.labels == {"verbatim": ("harm", 32), "after_hold": ("harm", 32)}
    assert harmful.crossings[M.PRIMARY_SIGNAL] == 20 and harmful.crossings["mei/bias @ 1.013"] == 4
    assert harmful.crossings[M.DOCTOR] == 16
    assert runs["grpo", 1].crossings[M.PRIMARY_SIGNAL] is None  # 5.1 < 5.162; step 0 is not in S (else 0)
    assert runs["grpo", 1].crossings["mei/bias @ 1.013"] == 4  # S >= 2 > 1.013 at every probe
    assert runs["cp_only", 0].crossings[M.PRIMARY_SIGNAL] == 156
    crit = {(c["label"], c["signal"]): c for c in res["criteria"]}
    c = crit["verbatim", M.PRIMARY_SIGNAL]
    assert (c["harmful"], c["warned_in_time"], c["others"], c["others_crossed"], c["verdict"], c["leads"]) == (
        1, 1, 2, 0, "success", [12])
    assert crit["verbatim", "mei/bias @ 1.013"]["verdict"] == "failure"  # every run is above 1.013
    assert crit["verbatim", M.DOCTOR]["leads"] == [16] and crit["verbatim", M.DOCTOR]["verdict"] == "success"
    head = crit["verbatim", "mei/head @ 3sigma"]
    assert head["verdict"] == "undefined" and head["unavailable"] == 3
    auc = {(a["label"], a["signal"]): a for a in res["auroc"]}
    # harmful z = (6 - 2) / sd; grpo seed 1 ties it at step 4 (1/2), cp_only seed 0's 6.0 lies after 152 (1)
    assert auc["verbatim", "mei/bias"]["auroc"] == 0.75 and auc["verbatim", "mei/bias"]["others"] == 2
    assert auc["verbatim", M.DOCTOR]["auroc"] == 1.0  # warned by 24 (fall - 8); the others never
    assert main_writes(tmp_path, out)


def main_writes(tmp_path, out) -> bool:
    md, js = tmp_path / "mei.md", tmp_path / "mei.json"
    assert M.main([f"W={out}", "--out", str(md), "--json", str(js)]) == 0
    text, data = md.read_text(), json.loads(js.read_text())
    assert "| W | cp_only | 1 | 0 (missing) |" in text and "| verbatim | mei/bias @ 3sigma | 1 | 1 (1) |" in text
    assert data["thresholds"]["W"]["mei/bias"]["3sigma"] == pytest.approx(2 + math.sqrt(10))
    assert M.main(["nodir"]) == 2
    return True
