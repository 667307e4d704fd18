"""Score the live doctor and the raw collapse signals on a labelled corpus (``corpus.py``).

**Live doctor.** At every evaluated step ``t`` (every ``every``-th logged step: ``t % every == 0``, as
``HealthMonitor.due``) the doctor runs on the run's records cut at ``t`` (``truncate_records`` +
``diagnose_records``), which is what ``HealthMonitor.check`` does. A finding is *on* at ``t`` when it is raised
at severity ``warning`` or ``alarm`` (``info`` is ignored). An *onset* is a step where it is on and was not on at
the previous evaluated step: the first raise, and each raise after it cleared. That is ``HealthMonitor``'s
``raised`` list restricted to warning/alarm findings (a finding that moves from info to warning, as
``strategy_collapse`` does once accuracy falls, counts as an onset there; the monitor raises it once, at info).

**Raw signals** (:data:`SIGNALS`), evaluated on their logged series at the same steps; on at ``t`` when:

- ``mei/query`` (MEI, up): ``mei/query > threshold``; the shipped threshold is the run's own (the
  ``mei_first_crossing`` event's, else ``diag.mei.threshold``), as the doctor's ``strategy_collapse`` reads it;
- ``mei/directions`` (effective directions = participation ratio, at most G; down): value ``< threshold``; no
  shipped threshold;
- ``mei/g_over_mei`` (G / MEI, down; logged as ``mei/effective_dirs`` by runs from before the rename): value
  ``< threshold``; no shipped threshold;
- ``entropy/mean`` (down, relative): value ``< frac x`` the mean of the first :data:`REF_STEPS` logged values
  (on from the :data:`REF_STEPS`-th value on); shipped ``frac`` = ``entropy_collapse_frac``;
- ``strategy max mass`` (``strategy/problem_max_mass``, else ``strategy/max_mass``; up): value ``>= threshold``;
  shipped = ``strategy_max_mass``.

**Per run** and per check / signal: first onset step, onset count, and whether it could be checked at all (a
doctor check that says "not checked" on the whole run; a signal whose series is absent).

**Doctor-threshold sweeps** (:data:`DOCTOR_SWEEPS`): only the check the threshold drives runs, on the same cut
records, with that one threshold changed (no folding into a cause, so at the shipped value it can differ from
the full doctor when e.g. ``update_blowup`` also fired).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from experiments.health_corpus.corpus import CorpusRun
from meshrl.doctor.diagnose import CHECKS, diagnose_records
from meshrl.doctor.findings import Unchecked
from meshrl.doctor.live import FINDING_IDS, truncate_records
from meshrl.doctor.records import RunRecords
from meshrl.doctor.thresholds import DEFAULT, Thresholds

SEVERE = ("alarm", "warning")
REF_STEPS = 3  # logged values that make the entropy reference
FA_LIMIT = 1.0  # tuning: at most this many false-alarm onsets per 100 healthy steps


@dataclass(frozen=True)
class Signal:
    """A raw signal: the first of ``keys`` logged, its harmful ``direction``, whether the threshold is a fraction
    of the reference (``relative``) and whether touching it counts (``inclusive``)."""

    keys: tuple[str, ...]
    direction: str
    relative: bool = False
    inclusive: bool = False


SIGNALS: dict[str, Signal] = {
    "mei/query": Signal(("mei/query",), "up"),
    "mei/directions": Signal(("mei/directions",), "down"),
    # runs from before the rename logged G/MEI as mei/effective_dirs (docs/doctor.md): the same quantity
    "mei/g_over_mei": Signal(("mei/g_over_mei", "mei/effective_dirs"), "down"),
    "entropy/mean": Signal(("entropy/mean",), "down", relative=True),
    "strategy max mass": Signal(("strategy/problem_max_mass", "strategy/max_mass"), "up", inclusive=True),
}
FIXED_GRIDS = {"entropy/mean": (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
               "strategy max mass": (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)}
QUANTILES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
#: doctor threshold -> (the finding it drives, grid; the shipped value is always added)
DOCTOR_SWEEPS: dict[str, tuple[str, tuple[float, ...]]] = {
    "strategy_max_mass": ("strategy_collapse", (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)),
    "eval_drop_min": ("strategy_collapse", (0.01, 0.02, 0.05, 0.1, 0.15, 0.2)),
    "entropy_collapse_frac": ("entropy_collapse", (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)),
    "collapse_drop_frac": ("reward_collapse", (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)),
}


@dataclass(frozen=True)
class Onsets:
    steps: tuple[int, ...]  # onset steps: first raise + each raise after clearing
    checked: bool = True
    on_steps: int = 0  # evaluated steps at which it was on
    evaluated: int = 0  # evaluated steps

    @property
    def count(self) -> int:
        return len(self.steps)

    def first_from(self, step: int | None) -> int | None:
        """The first onset at or after ``step`` (any onset when ``step`` is ``None``)."""
        return next((s for s in self.steps if step is None or s >= step), None)


@dataclass
class RunScore:
    label: dict[str, Any]
    doctor: dict[str, Onsets]
    sweeps: dict[str, dict[float, Onsets]]  # doctor threshold -> value -> its finding's onsets
    signals: dict[str, dict[float, Onsets]]  # raw signal -> threshold -> onsets
    shipped: dict[str, tuple[float, Onsets] | None] = field(default_factory=dict)  # raw signal at its shipped value
    errors: list[tuple[str, int, str]] = field(default_factory=list)  # checks that raised: (what, step, exception)


def onset_steps(states: Iterable[tuple[int, bool]]) -> tuple[int, ...]:
    """The onsets of a sequence of (step, on): steps where it is on after off (or on at the start)."""
    out, active = [], False
    for step, on in states:
        if on and not active:
            out.append(step)
        active = on
    return tuple(out)


def evaluated_steps(rec: RunRecords, every: int) -> list[int]:
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    return [int(r["step"]) for r in rec.steps if int(r["step"]) % every == 0]


def _check_of(fid: str) -> Callable[[RunRecords, Thresholds], Any]:
    return next(check for ids, check in CHECKS if fid in ids)


def _severe_ids(result: Any, fid: str) -> bool:
    return not isinstance(result, Unchecked) and any(f.id == fid and f.severity in SEVERE for f in result)


def doctor_states(rec: RunRecords, steps: list[int], thresholds: Thresholds,
                  sweeps: dict[str, tuple[str, tuple[float, ...]]], errors: list[tuple[str, int, str]]
                  ) -> tuple[dict[str, list[tuple[int, bool]]], dict[tuple[str, float], list[tuple[int, bool]]]]:
    """Per finding id, and per (swept threshold, value), the (step, on) sequence of the live doctor; a check
    that raises is recorded in ``errors`` (and counts as off at that step)."""
    states: dict[str, list[tuple[int, bool]]] = {fid: [] for fid in FINDING_IDS}
    variants = {(name, v): (_check_of(fid), fid, thresholds.with_overrides({name: v}))
                for name, (fid, grid) in sweeps.items() for v in sweep_grid(name, grid, thresholds)}
    swept: dict[tuple[str, float], list[tuple[int, bool]]] = {key: [] for key in variants}
    for t in steps:
        cut = truncate_records(rec, t)  # one cut, shared by every check below (its series cache too)
        try:
            on = {f.id for f in diagnose_records(cut, thresholds).findings if f.severity in SEVERE}
        except Exception as e:  # noqa: BLE001 - a crashing check is a result to report, not a reason to stop
            errors.append(("full doctor", t, f"{type(e).__name__}: {e}"))
            on = set()
        for fid in FINDING_IDS:
            states[fid].append((t, fid in on))
        for key, (check, fid, th) in variants.items():
            try:
                swept[key].append((t, _severe_ids(check(cut, th), fid)))
            except Exception as e:  # noqa: BLE001 - counted as "off" and reported
                errors.append((f"{fid} with {key[0]}={key[1]:g}", t, f"{type(e).__name__}: {e}"))
                swept[key].append((t, False))
    return states, swept


def sweep_grid(name: str, grid: tuple[float, ...], thresholds: Thresholds = DEFAULT) -> tuple[float, ...]:
    """``grid`` with the shipped value of ``name`` added, sorted."""
    return tuple(sorted({*grid, float(getattr(thresholds, name))}))


def unchecked_ids(rec: RunRecords, thresholds: Thresholds) -> set[str]:
    """Finding ids whose check says "not checked" on the whole run (every record)."""
    return {fid for ids, check in CHECKS if isinstance(check(rec, thresholds), Unchecked) for fid in ids}


def signal_series(rec: RunRecords, sig: Signal) -> tuple[list[int], list[float]]:
    key = rec.first_of(*sig.keys)
    return rec.series(key) if key else ([], [])


def signal_states(xs: list[int], ys: list[float], sig: Signal, threshold: float,
                  steps: set[int]) -> list[tuple[int, bool]]:
    """(step, on) of a raw signal at ``threshold`` (module docstring), at the evaluated ``steps``."""
    if sig.relative:
        if len(ys) < REF_STEPS:
            return []
        limit = threshold * statistics.fmean(ys[:REF_STEPS])
        pairs = list(zip(xs, ys, strict=True))[REF_STEPS - 1:]
    else:
        limit, pairs = threshold, list(zip(xs, ys, strict=True))
    out = []
    for x, y in pairs:
        if x in steps:
            on = (y > limit or (sig.inclusive and y == limit)) if sig.direction == "up" else \
                (y < limit or (sig.inclusive and y == limit))
            out.append((x, on))
    return out


def shipped_threshold(name: str, rec: RunRecords, thresholds: Thresholds) -> float | None:
    """The threshold the doctor applies to signal ``name`` on this run, or ``None`` when it applies none."""
    if name == "mei/query":
        logged = next((e.get("threshold") for e in rec.events if e.get("event") == "mei_first_crossing"), None)
        value = logged if isinstance(logged, int | float) else rec.config.get("mei_threshold")
        return float(value) if isinstance(value, int | float) else None
    if name == "entropy/mean":
        return thresholds.entropy_collapse_frac
    if name == "strategy max mass":
        return thresholds.strategy_max_mass
    return None


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def family(label: dict[str, Any]) -> str:
    """The model family of a run: its source up to the first "/" (``tiny/failure`` and ``tiny/healthy`` are one
    model; the testbed's experiments share theirs), the unit within which a raw threshold is comparable."""
    return str(label["source"]).split("/")[0]


def _quantiles(values: list[float]) -> set[float]:
    pooled = sorted(values)
    return {_round(pooled[min(len(pooled) - 1, int(q * len(pooled)))]) for q in QUANTILES} if pooled else set()


def signal_grids(runs: list[CorpusRun]) -> dict[str, tuple[float, ...]]:
    """Per raw signal, the thresholds swept: fixed grids for the relative entropy rule and the mass (a share),
    else quantiles (:data:`QUANTILES`, 4 significant digits) of the ``tune`` runs' values, pooled over all runs
    and within each :func:`family` (MEI's scale depends on the model and G, so one family's range can be
    narrow)."""
    grids: dict[str, tuple[float, ...]] = {}
    sources = sorted({family(r.label) for r in runs})
    for name, sig in SIGNALS.items():
        if name in FIXED_GRIDS:
            grids[name] = FIXED_GRIDS[name]
            continue
        values = {src: [y for r in runs if r.label["split"] == "tune" and family(r.label) == src
                        for y in signal_series(r.records, sig)[1]] for src in sources}
        grid = _quantiles([y for v in values.values() for y in v])
        for v in values.values():
            grid |= _quantiles(v)
        grids[name] = tuple(sorted(grid))
    return grids


def _onsets(states: list[tuple[int, bool]], checked: bool = True) -> Onsets:
    return Onsets(onset_steps(states), checked, sum(on for _, on in states), len(states))


def score_run(run: CorpusRun, grids: dict[str, tuple[float, ...]], *, every: int = 1,
              thresholds: Thresholds = DEFAULT,
              sweeps: dict[str, tuple[str, tuple[float, ...]]] = DOCTOR_SWEEPS) -> RunScore:
    rec = run.records
    steps = evaluated_steps(rec, every)
    errors: list[tuple[str, int, str]] = []
    states, swept = doctor_states(rec, steps, thresholds, sweeps, errors)
    unchecked = unchecked_ids(rec, thresholds)
    doctor = {fid: _onsets(s, fid not in unchecked) for fid, s in states.items()}
    sweep_out: dict[str, dict[float, Onsets]] = {}
    for (name, value), s in swept.items():
        sweep_out.setdefault(name, {})[value] = _onsets(s, sweeps[name][0] not in unchecked)
    signals: dict[str, dict[float, Onsets]] = {}
    shipped: dict[str, tuple[float, Onsets] | None] = {}
    step_set = set(steps)
    for name, sig in SIGNALS.items():
        xs, ys = signal_series(rec, sig)
        checked = len(ys) >= (REF_STEPS if sig.relative else 1)
        signals[name] = {v: _onsets(signal_states(xs, ys, sig, v, step_set), checked) for v in grids[name]}
        ship = shipped_threshold(name, rec, thresholds)
        shipped[name] = None if ship is None else (ship, _onsets(signal_states(xs, ys, sig, ship, step_set),
                                                                  checked))
    return RunScore(dict(run.label), doctor, sweep_out, signals, shipped, errors)


# ---------------------------------------------------------------------------------------------- aggregation


def first_alarm(label: dict[str, Any], o: Onsets) -> int | None:
    """The onset that counts as the alarm for this run: the first one at or after ``fault_step`` for a
    deliberate failure (an alarm already raised before the fault did not see it), else the first one."""
    return o.first_from(label["fault_step"])


def hit(label: dict[str, Any], o: Onsets) -> bool:
    """A harmful run caught: alarmed (:func:`first_alarm`) at or before ``harm_step`` when that is known, else
    alarmed at all."""
    first = first_alarm(label, o)
    return first is not None and (label["harm_step"] is None or first <= label["harm_step"])


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def rates(items: list[tuple[dict[str, Any], Onsets]]) -> dict[str, Any]:
    """Figures of one check / signal over ``(label, onsets)`` pairs of one group of runs (ambiguous runs are
    dropped here). Rates count the runs it could check; ``unchecked`` counts the others.

    - the alarm of a run is :func:`first_alarm` (for deliberate failures: the first onset from ``fault_step``;
      ``pre_fault`` counts the onsets before it);
    - ``detected``: runs with an alarm; ``in_time``: alarmed at or before ``harm_step`` (of ``with_harm`` runs
      that have one); ``hits``: :func:`hit` over all harmful runs (unchecked ones are misses);
    - ``lead_median``: harm_step - alarm step over alarmed runs with a harm_step (positive = warned first);
    - ``delay_median``: alarm step - fault_step over alarmed runs with a fault_step;
    - ``fa_per_100``: on healthy runs, onsets per 100 logged steps (pooled: all onsets / all steps x 100);
    - ``healthy_on_share``: on healthy runs, the share of evaluated steps at which it was on (an alarm that is
      raised once and never clears has one onset, however long it stays on).
    """
    items = [(lab, o) for lab, o in items if lab["outcome"] != "ambiguous"]
    harmful = [(lab, o) for lab, o in items if lab["outcome"] == "harmful"]
    healthy = [(lab, o) for lab, o in items if lab["outcome"] == "healthy"]
    checked_h = [(lab, o) for lab, o in harmful if o.checked]
    with_harm = [(lab, o) for lab, o in checked_h if lab["harm_step"] is not None]
    checked_ok = [(lab, o) for lab, o in healthy if o.checked]
    steps = sum(lab["steps"] for lab, _ in checked_ok)
    return {
        "harmful": len(harmful), "healthy": len(healthy),
        "unchecked": sum(not o.checked for _, o in items),
        "checked_harmful": len(checked_h),
        "detected": sum(first_alarm(lab, o) is not None for lab, o in checked_h),
        "with_harm": len(with_harm), "in_time": sum(hit(lab, o) for lab, o in with_harm),
        "hits": sum(o.checked and hit(lab, o) for lab, o in harmful),
        "lead_median": _median([lab["harm_step"] - f for lab, o in with_harm
                                if (f := first_alarm(lab, o)) is not None]),
        "delay_median": _median([f - lab["fault_step"] for lab, o in checked_h
                                 if lab["fault_step"] is not None and (f := first_alarm(lab, o)) is not None]),
        "pre_fault": sum(o.count - sum(s >= lab["fault_step"] for s in o.steps) for lab, o in checked_h
                         if lab["fault_step"] is not None),
        "checked_healthy": len(checked_ok), "healthy_fired": sum(o.count > 0 for _, o in checked_ok),
        "healthy_steps": steps,
        "fa_per_100": 100.0 * sum(o.count for _, o in checked_ok) / steps if steps else None,
        "healthy_on_share": (sum(o.on_steps for _, o in checked_ok) / evaluated
                             if (evaluated := sum(o.evaluated for _, o in checked_ok)) else None),
    }


def by_kind(items: list[tuple[dict[str, Any], Onsets]], field: str = "kind") -> dict[str, dict[str, Any]]:
    """:func:`rates` for every value of label ``field`` (kind, source), and ``all`` (pooled)."""
    groups = sorted({lab[field] for lab, _ in items})
    out = {g: rates([(lab, o) for lab, o in items if lab[field] == g]) for g in groups}
    out["all"] = rates(items)
    return out


def choose(tune: dict[float, dict[str, Any]], fa_limit: float = FA_LIMIT) -> float | None:
    """The tuned threshold: among values whose false alarms on the healthy tune runs are known and at most
    ``fa_limit`` per 100 steps, the one with the most harmful tune runs caught (:func:`hit`); ties: fewer false
    alarms, then the smaller value. ``None`` when no value qualifies or none that does catches a run."""
    ok = [(v, r) for v, r in tune.items() if r["fa_per_100"] is not None and r["fa_per_100"] <= fa_limit]
    best = min(ok, key=lambda p: (-p[1]["hits"], p[1]["fa_per_100"], p[0]), default=None)
    return best[0] if best is not None and best[1]["hits"] > 0 else None


def no_choice_reason(tune: dict[float, dict[str, Any]], fa_limit: float = FA_LIMIT) -> str:
    """Why :func:`choose` found no threshold."""
    if not tune:
        return "not logged on the tune runs"
    if not any(r["checked_healthy"] for r in tune.values()):
        return "no checked healthy tune run"
    if not any(r["fa_per_100"] <= fa_limit for r in tune.values() if r["fa_per_100"] is not None):
        return f"none with FA/100 <= {fa_limit:g}"
    return f"none within FA/100 <= {fa_limit:g} catches a harmful tune run"


def _split(scores: list[RunScore], split: str) -> list[RunScore]:
    return [s for s in scores if s.label["split"] == split]


def sweep_table(scores: list[RunScore], pick: Callable[[RunScore], dict[float, Onsets]],
                fa_limit: float = FA_LIMIT) -> dict[str, Any]:
    """Per grid value, :func:`rates` on the tune and the report half; the value :func:`choose` picks on tune."""
    values = sorted({v for s in scores for v in pick(s)})
    halves = {h: {v: rates([(s.label, pick(s)[v]) for s in _split(scores, h) if v in pick(s)]) for v in values}
              for h in ("tune", "report")}
    chosen = choose(halves["tune"], fa_limit)
    kinds = by_kind([(s.label, pick(s)[chosen]) for s in scores if chosen in pick(s)]) if chosen is not None else {}
    return {"grid": values, "tune": halves["tune"], "report": halves["report"], "chosen": chosen,
            "fa_limit": fa_limit, "chosen_by_kind": kinds,
            "why_none": no_choice_reason(halves["tune"], fa_limit) if chosen is None else None}


def detectors(s: RunScore, signal_sweeps: dict[str, Any], doctor_sweeps: dict[str, Any]) -> dict[str, Onsets]:
    """Every detector of one run: doctor findings (shipped thresholds), raw signals at a shipped threshold, and
    each swept signal / doctor threshold at its tuned value."""
    out = {f"doctor {fid}": o for fid, o in s.doctor.items()}
    out.update({f"{name} (shipped {v:g})": o for name, ship in s.shipped.items() if ship for v, o in [ship]})
    out.update({f"{name} at {sw['chosen']:g} (tuned)": s.signals[name][sw["chosen"]]
                for name, sw in signal_sweeps.items() if sw["chosen"] in s.signals[name]})
    out.update({f"{fid_of} {name}={sw['chosen']:g} (tuned)": s.sweeps[name][sw["chosen"]]
                for name, sw in doctor_sweeps.items() for fid_of in [DOCTOR_SWEEPS[name][0]]
                if sw["chosen"] in s.sweeps.get(name, {})})
    return out


def coverage(scores: list[RunScore], signal_sweeps: dict[str, Any], doctor_sweeps: dict[str, Any]
             ) -> dict[str, dict[str, Any]]:
    """Per harmful kind: runs, runs caught (:func:`hit`) by some doctor finding at its shipped thresholds, runs
    caught by any detector (:func:`detectors`), and the detector catching the most runs."""
    out: dict[str, dict[str, Any]] = {}
    for s in scores:
        if s.label["outcome"] != "harmful":
            continue
        row = out.setdefault(s.label["kind"], {"runs": 0, "doctor_any": 0, "any": 0, "by": {}})
        caught = {name for name, o in detectors(s, signal_sweeps, doctor_sweeps).items()
                  if o.checked and hit(s.label, o)}
        row["runs"] += 1
        row["doctor_any"] += any(name.startswith("doctor ") for name in caught)
        row["any"] += bool(caught)
        for name in caught:
            row["by"][name] = row["by"].get(name, 0) + 1
    for row in out.values():
        row["best"] = max(sorted(row["by"].items()), key=lambda p: p[1], default=None)
    return dict(sorted(out.items()))


def summarize(scores: list[RunScore]) -> dict[str, Any]:
    """Every figure the tables show."""
    doctor = {fid: by_kind([(s.label, s.doctor[fid]) for s in scores]) for fid in FINDING_IDS}
    shipped = {name: by_kind(items) if (items := [(s.label, s.shipped[name][1]) for s in scores
                                                  if s.shipped.get(name)]) else {}
               for name in SIGNALS}
    by_source = {fid: by_kind([(s.label, s.doctor[fid]) for s in scores], "source") for fid in FINDING_IDS}
    signal_sweeps = {name: sweep_table(scores, lambda s, n=name: s.signals[n]) for name in SIGNALS}
    sources = sorted({family(s.label) for s in scores})
    per_source = {src: {name: sweep_table([s for s in scores if family(s.label) == src],
                                          lambda s, n=name: s.signals[n]) for name in SIGNALS} for src in sources}
    doctor_sweeps = {name: sweep_table(scores, lambda s, n=name: s.sweeps.get(n, {})) for name in DOCTOR_SWEEPS}
    return {
        "runs": len(scores), "doctor": doctor, "doctor_by_source": by_source, "signals_shipped": shipped,
        "signal_sweeps": signal_sweeps, "doctor_sweeps": doctor_sweeps, "signal_sweeps_by_source": per_source,
        "coverage": coverage(scores, signal_sweeps, doctor_sweeps),
        "labels": [s.label for s in scores], "errors": error_counts(scores),
    }


def error_counts(scores: list[RunScore]) -> dict[str, int]:
    """Per (what raised, exception type): the number of runs where it did."""
    runs: dict[str, set[str]] = {}
    for s in scores:
        for what, _, exc in s.errors:
            runs.setdefault(f"{what}: {exc.split(':')[0]}", set()).add(s.label["id"])
    return {k: len(v) for k, v in sorted(runs.items())}

