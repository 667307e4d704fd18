"""Scoring the doctor on a labelled corpus: onsets as HealthMonitor reports them, lead / delay / false alarms,
the tuning rule, the tune/report split, the pack."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.health_corpus.corpus import CorpusRun, check_label, label_testbed_run
from experiments.health_corpus.pack import pack_corpus, unpack_corpus, verify_trimmed
from experiments.health_corpus.score import (
    Onsets,
    Signal,
    choose,
    doctor_states,
    no_choice_reason,
    onset_steps,
    rates,
    score_run,
    signal_states,
    sweep_table,
)
from meshrl.doctor.live import HealthMonitor, LiveRecords
from meshrl.doctor.records import RunRecords
from meshrl.doctor.thresholds import DEFAULT


def _label(run_id: str, outcome: str, *, kind: str | None = None, harm: int | None = None,
           fault: int | None = None, steps: int = 40, split: str = "tune") -> dict:
    return check_label({"id": run_id, "source": "tiny/failure", "engine": "meshrl", "outcome": outcome,
                        "kind": kind or ("healthy" if outcome == "healthy" else "lr_blowup"), "fault_step": fault,
                        "harm_step": harm, "steps": steps, "split": split, "note": "constructed"}, run_id)


def _records(series: dict[str, list[float]], **config) -> RunRecords:
    n = len(next(iter(series.values())))
    steps = [{"step": float(i + 1), **{k: v[i] for k, v in series.items()}} for i in range(n)]
    return RunRecords(path=Path("constructed"), engine="meshrl", steps=steps,
                      config={"max_new_tokens": 64, **config})


def test_onsets_equal_health_monitor_on_a_run_whose_finding_clears_and_returns():
    """Truncation at the cap comes, clears, and comes back: two onsets, at the steps the monitor raises it."""
    block = [0.0] * 10 + [1.0] * 10
    rec = _records({"len/truncated_frac": block + block, "reward/mean": [0.3 + 0.01 * (i % 3) for i in range(40)]})
    monitor = HealthMonitor(LiveRecords(rec), every=1)
    raised: dict[str, list[int]] = {}
    for step in range(1, 41):
        for finding, _ in monitor.check(step).raised:
            if finding.severity != "info":
                raised.setdefault(finding.id, []).append(step)
    states, _ = doctor_states(rec, list(range(1, 41)), DEFAULT, {}, [])
    ours = {fid: onset_steps(s) for fid, s in states.items() if onset_steps(s)}
    assert ours == {fid: tuple(steps) for fid, steps in raised.items()}
    assert len(ours["truncation"]) == 2  # the test sees a clear-and-return, not only a first raise


def test_onsets_are_raises_after_clearing():
    assert onset_steps([(1, False), (2, True), (3, True), (4, False), (5, True)]) == (2, 5)
    assert onset_steps([(2, True)]) == (2,)
    assert onset_steps([(1, False)]) == ()


def test_rates_lead_delay_and_false_alarms():
    items = [(_label("a", "harmful", harm=20), Onsets((15,))),  # lead +5
             (_label("b", "harmful", harm=20), Onsets((26,))),  # lead -6, late
             (_label("c", "harmful", fault=10), Onsets((4, 13, 17))),  # delay 3 (the onset at 4 is before the fault)
             (_label("d", "harmful", fault=10), Onsets((), checked=False)),
             (_label("e", "healthy", steps=40), Onsets((5, 30), on_steps=10, evaluated=40)),
             (_label("f", "healthy", steps=60), Onsets((), on_steps=0, evaluated=60)),
             (_label("g", "ambiguous", harm=None), Onsets((3, 5, 7)))]
    r = rates(items)
    assert (r["harmful"], r["checked_harmful"], r["detected"], r["unchecked"]) == (4, 3, 3, 1)
    assert (r["with_harm"], r["in_time"], r["hits"]) == (2, 1, 2)  # c counts as a hit (no harm step, fired)
    assert r["lead_median"] == pytest.approx(-0.5)
    assert r["delay_median"] == 3 and r["pre_fault"] == 1
    assert r["fa_per_100"] == pytest.approx(2.0)  # 2 onsets over 100 healthy steps
    assert r["healthy_on_share"] == pytest.approx(0.1)
    assert (r["healthy_fired"], r["checked_healthy"]) == (1, 2)


def test_signal_rules_direction_and_relative_reference():
    up = Signal(("x",), "up")
    assert signal_states([1, 2, 3], [0.5, 1.5, 0.5], up, 1.0, {1, 2, 3}) == [(1, False), (2, True), (3, False)]
    rel = Signal(("x",), "down", relative=True)  # reference: mean of the first 3 values = 2.0
    assert signal_states([1, 2, 3, 4], [1.0, 2.0, 3.0, 0.9], rel, 0.5, {1, 2, 3, 4}) == \
        [(3, False), (4, True)]


def _mass_run(run_id: str, outcome: str, peak: float, split: str) -> CorpusRun:
    """A run whose strategy/max_mass climbs to ``peak`` at step 10 and holds; harm at step 12 when harmful."""
    mass = [min(peak, 0.4 + 0.05 * i) for i in range(20)]
    label = _label(run_id, outcome, kind="healthy" if outcome == "healthy" else "niche_lost",
                   harm=12 if outcome == "harmful" else None, steps=20, split=split)
    return CorpusRun(label, _records({"strategy/max_mass": mass}))


def test_sweep_picks_the_most_catching_threshold_within_the_false_alarm_limit():
    runs = [_mass_run("h0", "harmful", 0.95, "tune"), _mass_run("h1", "harmful", 0.9, "report"),
            _mass_run("ok0", "healthy", 0.65, "tune"), _mass_run("ok1", "healthy", 0.7, "report")]
    grids = {"mei/query": (), "mei/directions": (), "mei/g_over_mei": (), "entropy/mean": (),
             "strategy max mass": (0.5, 0.6, 0.7, 0.8, 0.99)}
    scores = [score_run(r, grids, sweeps={}) for r in runs]
    sw = sweep_table(scores, lambda s: s.signals["strategy max mass"], fa_limit=1.0)
    # 0.5, 0.6: the healthy tune run fires (5 onsets per 100 steps); 0.7 catches h0 (crossed at step 7 <= 12)
    assert sw["tune"][0.6]["fa_per_100"] == pytest.approx(5.0)
    assert sw["chosen"] == 0.7
    report = sw["report"][0.7]
    assert (report["in_time"], report["with_harm"]) == (1, 1)
    assert report["fa_per_100"] == pytest.approx(5.0)  # the report half's healthy run touches 0.7 (inclusive)
    assert sw["tune"][0.99]["hits"] == 0
    # a threshold that stays quiet on healthy runs but catches nothing is no tuned threshold
    quiet = {0.99: sw["tune"][0.99]}
    assert choose(quiet) is None
    assert no_choice_reason(quiet) == "none within FA/100 <= 1 catches a harmful tune run"


def _ckpt(run_dir: Path, step: int, decade: float) -> None:
    path = run_dir / "ckpt_eval" / f"step_{step}" / "eval.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"overall": {"pass@1": 0.5}, "by": {"groups": {"decade": {"pass@1": decade}}}}))


def test_testbed_labels_and_a_disjoint_seed_parity_split(tmp_path):
    curves = {0: [0.4, 0.05, 0.3], 1: [0.4, 0.5, 0.6], 2: [0.4, 0.3, 0.2], 3: [0.3, 0.09, 0.0]}
    labels = []
    for seed, accs in curves.items():
        d = tmp_path / "runs" / "grpo" / f"seed_{seed}"
        for i, acc in enumerate(accs):
            _ckpt(d, 8 * (i + 1), acc)
        labels.append(label_testbed_run(d, source="testbed:add/x", arm="grpo", seed=seed, niche="decade",
                                    fall_at=0.1, kept_at=0.5))
    assert [(lab["outcome"], lab["harm_step"]) for lab in labels] == \
        [("harmful", 16), ("healthy", None), ("ambiguous", None), ("harmful", 16)]
    tune = {lab["id"] for lab in labels if lab["split"] == "tune"}
    report = {lab["id"] for lab in labels if lab["split"] == "report"}
    assert tune.isdisjoint(report) and len(tune | report) == 4
    assert tune == {"testbed:add/x/grpo/s0", "testbed:add/x/grpo/s2"}


def test_a_label_with_a_bad_field_is_refused_by_name():
    bad = _label("a", "healthy") | {"outcome": "fine"}
    with pytest.raises(ValueError, match="'outcome'='fine'"):
        check_label(bad, "x/label.json")


def test_pack_round_trip_keeps_the_verdict_and_is_deterministic(tmp_path):
    rec = _records({"len/truncated_frac": [0.0] * 5 + [1.0] * 5, "reward/mean": [0.1 * i for i in range(10)],
                    "time/step_s": [1.0] * 10, "grad/norm": [1.0] * 9 + [math.nan]})
    rec.events = [{"step": 3, "event": "nonfinite_skip"}, {"step": 4, "event": "health_check"}]
    runs = [CorpusRun(_label("r", "harmful", harm=8, steps=10), rec)]
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    pack_corpus(runs, a, {"every": 1})
    pack_corpus(runs, b, {"every": 1})
    assert a.read_bytes() == b.read_bytes()
    back, settings = unpack_corpus(a)
    assert settings == {"every": 1} and back[0].label == runs[0].label
    assert "time/step_s" not in back[0].records.steps[0]  # not read by any check
    assert math.isnan(back[0].records.steps[-1]["grad/norm"])
    assert back[0].records.events == [{"step": 3, "event": "nonfinite_skip"}]
    assert verify_trimmed(runs, back) == []


def test_committed_tables_regenerate_from_the_committed_pack():
    from experiments.health_corpus.cli import tables_from_pack

    data = Path(__file__).resolve().parents[1] / "data"
    assert tables_from_pack(data / "corpus.json.gz") == (data / "results.md").read_text()
