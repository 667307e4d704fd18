"""The real-model experiment's endpoints, exactly as preregistration.md defines them, and its table.

Per run (one arm, one seed): the held-out curve (step 0 from the base model's evaluation, then every
``eval_every`` steps), the gain, the best step, harm (a fall of >= 0.1 below the running maximum for >= 2
consecutive evaluations) or a transient dip, and the MEI crossing (3 consecutive steps above mean + 3 sd of steps
1-10) with its lead over the fall. Per arm: the pre-registered verdict on improvement. The seed is the unit.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from experiments.real_model.experiment import ARMS, Settings
from meshrl.cpu import machine_label
from meshrl.doctor.records import by_step

FALL = 0.1
FALL_RUN = 2
CALIBRATION_STEPS = (1, 10)
SIGMAS = 3.0
PATIENCE = 3
IN_TIME = 10
PLANNED_SEEDS = len(Settings().seeds)
#: described post hoc (no endpoint), as means over a run's first and last EDGE_STEPS steps
DESCRIBED = ("reward/mean", "len/response_mean", "len/truncated_frac", "entropy/mean")
EDGE_STEPS = 10
Curve = list[tuple[int, float]]


def below_runs(curve: Curve, drop: float = FALL) -> list[tuple[list[int], float]]:
    """The maximal runs of consecutive evaluations at least ``drop`` below the running maximum (step 0 included in
    it), each with its depth (the largest distance below the running maximum within the run)."""
    runs: list[tuple[list[int], float]] = []
    best, steps, depth = -math.inf, [], 0.0
    for step, value in curve:
        best = max(best, value)
        if best - value >= drop - 1e-12:  # 0.35 - 0.25 is 0.0999...98 in floats: a fall of exactly 0.1 counts
            steps, depth = [*steps, step], max(depth, best - value)
        elif steps:
            runs.append((steps, depth))
            steps, depth = [], 0.0
    if steps:
        runs.append((steps, depth))
    return runs


def fall(curve: Curve, drop: float = FALL, run: int = FALL_RUN) -> tuple[str, int | None, float, list]:
    """``(class, step, depth, dips)``: ``harm`` when the accuracy is >= ``drop`` below its running maximum for >=
    ``run`` consecutive evaluations (step and depth of the first such run), else ``dip`` when a shorter run is (the
    first one's), else ``none``; ``dips`` lists every shorter run as ``(step, depth)``, reported apart (a run with
    harm can have dips too)."""
    runs = below_runs(curve, drop)
    dips = [(steps[0], depth) for steps, depth in runs if len(steps) < run]
    harm = next(((steps[0], depth) for steps, depth in runs if len(steps) >= run), None)
    if harm is not None:
        return "harm", harm[0], harm[1], dips
    if dips:
        return "dip", dips[0][0], dips[0][1], dips
    return "none", None, 0.0, dips


def mei_threshold(series: list[tuple[int, float]], window: tuple[int, int] = CALIBRATION_STEPS,
                  sigmas: float = SIGMAS) -> float:
    """Mean + ``sigmas`` standard deviations (sample sd) of the MEI values at steps in ``window``; NaN with fewer
    than 2 values."""
    vals = [v for s, v in series if window[0] <= s <= window[1] and v == v]
    if len(vals) < 2:
        return math.nan
    return statistics.fmean(vals) + sigmas * statistics.stdev(vals)


def crossing(series: list[tuple[int, float]], threshold: float, patience: int = PATIENCE,
             after: int = CALIBRATION_STEPS[1]) -> int | None:
    """The first step of the first ``patience`` consecutive steps after ``after`` with MEI above ``threshold``."""
    if threshold != threshold:
        return None
    streak: list[int] = []
    for s, v in series:
        if s <= after:
            continue
        streak = [*streak, s] if v > threshold else []
        if len(streak) >= patience:
            return streak[0]
    return None


def run_endpoints(step0: float, evals: list[dict[str, Any]], metrics: list[dict[str, Any]],
                  horizon: int, every: int | None = None) -> dict[str, Any]:
    """The endpoints of one run (preregistration.md, "Endpoints"). ``every``: the evaluation interval, to name the
    evaluations missing from the curve (consecutive means next in the curve, so a gap is said, not bridged)."""
    curve: Curve = [(0, step0)] + sorted((int(r["step"]), float(r["eval/mean@1"])) for r in evals)
    final = dict(curve).get(horizon, math.nan)
    best_step, best = max(curve, key=lambda sv: (sv[1], -sv[0]))
    cls, fall_step, depth, dips = fall(curve)
    mei = [(int(r["step"]), float(r["mei/query"])) for r in metrics if "mei/query" in r]
    thr = mei_threshold(mei)
    cross = crossing(mei, thr)
    lead = fall_step - cross if cls == "harm" and cross is not None and fall_step is not None else None
    expected = range(0, horizon + 1, every) if every else []
    calibrated = [s for s, v in mei if CALIBRATION_STEPS[0] <= s <= CALIBRATION_STEPS[1] and v == v]
    return {"acc0": step0, "final": final, "gain": final - step0, "best": best, "best_step": best_step,
            "fall": cls, "fall_step": fall_step, "depth": depth, "dips": dips, "mei_threshold": thr,
            "mei_calibration_n": len(calibrated), "mei_cross": cross, "lead": lead,
            "in_time": lead is not None and lead >= IN_TIME, "curve": curve,
            "missing_evals": [s for s in expected if s not in dict(curve)]}


def verdict(gains: list[float], planned: int = PLANNED_SEEDS) -> str:
    """Q1 per arm: improves (gain > 0 in every seed, 3 or more, and mean >= 0.05), does not improve (gain <= 0 in
    2 or more seeds), else inconclusive once the ``planned`` seeds have runs, incomplete before (a NaN gain, a run
    without its last evaluation, decides nothing but counts as made)."""
    done = [g for g in gains if g == g]
    if len(done) >= 3 and all(g > 0 for g in done) and statistics.fmean(done) >= 0.05:
        return "improves"
    if sum(g <= 0 for g in done) >= 2:
        return "does not improve"
    if len(gains) < planned:
        return f"incomplete ({len(done)} of {planned} seeds)"
    missing = len(gains) - len(done)  # runs in, but without a step-150 accuracy (aborted): the grid is as made
    return "inconclusive" + (f" ({missing} run(s) without a final accuracy)" if missing else "")


def analyse(pack: dict[str, Any]) -> dict[str, Any]:
    horizon, every = int(pack["settings"]["steps"]), int(pack["settings"]["eval_every"])
    runs = {}
    for key, run in sorted(pack["runs"].items()):
        arm, seed = key.split("/")
        own = run.get("step0") or pack["step0"][seed]  # packs from before runs kept their own step 0
        step0 = float(own[f"mean@{pack['settings']['eval_n']}"])
        runs[key] = {"arm": arm, "seed": int(seed.split("_")[1]),
                     **run_endpoints(step0, run["evals"], run["metrics"], horizon, every), "seconds": run["seconds"],
                     "cpu": cpu_label(run.get("machine")), "aborted": run.get("aborted"),
                     "doctor": doctor_findings(run.get("events", [])), "described": describe(run["metrics"]),
                     "fork_selection": fork_selection(run["metrics"], horizon)}
    per_arm = {}
    for arm in ARMS:  # every pre-registered arm, run or not
        mine = [r for r in runs.values() if r["arm"] == arm]
        gains = [r["gain"] for r in mine if r["gain"] == r["gain"]]
        per_arm[arm] = {"seeds": len(mine), "verdict": verdict([r["gain"] for r in mine]) if mine else "not run",
                        "mean_gain": statistics.fmean(gains) if gains else math.nan,
                        "harm": sum(r["fall"] == "harm" for r in mine),
                        "aborted": sum(r["aborted"] is not None for r in mine),
                        "warned_in_time": sum(r["in_time"] for r in mine),
                        "false_alarms": sum(r["fall"] != "harm" and r["mei_cross"] is not None for r in mine)}
    return {"runs": runs, "arms": per_arm, "pilot": pack["pilot"], "pairs": fork_minus_grpo(runs)}


def describe(metrics: list[dict[str, Any]], edge: int = EDGE_STEPS) -> dict[str, tuple[float, float]]:
    """Post hoc, no endpoint: each of :data:`DESCRIBED`'s mean over the run's first and last ``edge`` steps (a key
    the run did not log is left out)."""
    rows = by_step(metrics)
    out = {}
    for key in DESCRIBED:
        values = [float(r[key]) for r in rows if key in r]
        if len(values) >= edge:
            out[key] = (statistics.fmean(values[:edge]), statistics.fmean(values[-edge:]))
    return out


def fork_selection(metrics: list[dict[str, Any]], horizon: int, edge: int = EDGE_STEPS) -> dict[str, Any] | None:
    """What the forking-token plug-in left untrained, post hoc (``None`` for a run that did not log it): the mean
    share of a step's rows with no kept token; the share of positive-advantage rows with none, as the ratio of the
    two shares summed over steps (every step has the same number of rows), overall and per third of ``horizon``;
    the share of rows whose first response token was kept over the first ``edge`` steps and after them, and the
    steps at which any was kept."""
    rows = [r for r in by_step(metrics) if "fork/rows_unkept" in r]
    if not rows:
        return None

    def unkept_pos(part: list[dict[str, Any]]) -> float:
        pos = sum(float(r["fork/rows_adv_pos"]) for r in part)
        return sum(float(r["fork/rows_unkept_adv_pos"]) for r in part) / pos if pos else math.nan

    bounds = [round(horizon * i / 3) for i in range(4)]
    thirds = [(lo + 1, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]  # under 3 steps: fewer parts
    first = [float(r["fork/first_kept"]) for r in rows]
    return {"steps": len(rows), "unkept": statistics.fmean(float(r["fork/rows_unkept"]) for r in rows),
            "unkept_pos": unkept_pos(rows),
            "unkept_pos_thirds": [(lo, hi, unkept_pos([r for r in rows if lo <= int(r["step"]) <= hi]))
                                  for lo, hi in thirds],
            "first_kept": (statistics.fmean(first[:edge]),
                           statistics.fmean(first[edge:]) if first[edge:] else math.nan),
            "first_kept_steps": sum(v > 0 for v in first)}


def doctor_findings(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The live doctor's findings in one run (reported post hoc: the pre-registration ran the doctor every 5 steps
    with no endpoint on it): per finding, the first check that raised it, at how many checks it was active, and the
    severities it was raised with (a check lists ``info`` findings too: a reader must see which were warnings)."""
    checks = [e for e in events if e.get("event") == "health_check"]
    found: dict[str, list[int]] = {}
    for e in checks:
        for name in e.get("findings", []):
            found.setdefault(name, []).append(int(e["step"]))
    severity: dict[str, set[str]] = {}
    for e in events:
        if e.get("event") == "health_finding":
            severity.setdefault(e["finding"], set()).add(str(e.get("severity", "?")))
    return {"checks": len(checks),
            "found": {name: (steps[0], len(steps)) for name, steps in found.items()},
            "severity": {name: sorted(severity.get(name, ())) for name in found}}


def fork_minus_grpo(runs: dict[str, Any]) -> dict[int, float]:
    """Per seed with both arms: fork's gain minus GRPO's (reported, not tested: 3 pairs cannot reach
    significance)."""
    gain = {(r["arm"], r["seed"]): r["gain"] for r in runs.values()}
    pairs = {seed: gain[("fork", seed)] - gain[("grpo", seed)]
             for arm, seed in sorted(gain) if arm == "fork" and ("grpo", seed) in gain}
    return {seed: d for seed, d in pairs.items() if d == d}  # an aborted run has no gain to compare


def cpu_label(machine: dict[str, Any] | None) -> str:
    """The CPU a run was made on, as the table names it (:func:`meshrl.cpu.machine_label`: PyTorch's capability,
    the model and AMX, which together decide float rounding); ``-`` where the run recorded none."""
    return machine_label(machine)


def _f(x: float | None, digits: int = 3, sign: str = "") -> str:
    return "-" if x is None or x != x else f"{x:{sign}.{digits}f}"


def _accuracy_at(curve: Curve, step: int) -> float:
    """The held-out accuracy of the last evaluation at or before ``step``."""
    return max((sv for sv in curve if sv[0] <= step), default=(0, math.nan))[1]


def _fall_text(r: dict[str, Any]) -> str:
    if r["aborted"] is not None:
        text = f"aborted ({r['aborted']})"
    else:
        text = r["fall"] if r["fall"] == "none" else f"{r['fall']} at {r['fall_step']} (-{r['depth']:.3f})"
    extra = [f"dip at {s} (-{d:.3f})" for s, d in r["dips"] if r["fall"] != "dip" or s != r["fall_step"]]
    return "; ".join([text, *extra])


def _threshold_text(r: dict[str, Any]) -> str:
    n, want = r["mei_calibration_n"], CALIBRATION_STEPS[1] - CALIBRATION_STEPS[0] + 1
    return _f(r["mei_threshold"], 4) + (f" ({n} of {want} steps)" if n < want else "")


def table(result: dict[str, Any]) -> str:
    """The markdown table of :func:`analyse`'s result."""
    p = result["pilot"]
    tried = ", ".join(f"A = {a}: {float(v):.4f}" for a, v in p["tried"].items())
    planned = len(ARMS) * PLANNED_SEEDS
    lines = ["# SmolLM2-135M-Instruct: GRPO and forking tokens (preregistration.md)", "",
             f"Pilot (base model, held-out accuracy at T = 1): {tried}; chosen A = {p['chosen']}.", "",
             f"Runs in the pack: {len(result['runs'])} of the {planned} pre-registered ({len(ARMS)} arms x "
             f"{PLANNED_SEEDS} seeds)" + ("." if len(result["runs"]) >= planned else
                                          "; verdicts on a partial grid say so."), "",
             "| arm | seed | step 0 | final | gain | best (step) | fall | MEI threshold | MEI crossing | lead | CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"].values():
        lines.append(f"| {r['arm']} | {r['seed']} | {_f(r['acc0'])} | {_f(r['final'])} | {_f(r['gain'], 3, '+')} | "
                     f"{_f(r['best'])} ({r['best_step']}) | {_fall_text(r)} | {_threshold_text(r)} | "
                     f"{r['mei_cross'] if r['mei_cross'] is not None else '-'} | "
                     f"{r['lead'] if r['lead'] is not None else '-'} | {r['cpu']} |")
    lines += ["", "| arm | seeds | verdict (Q1) | mean gain | runs with harm (Q2) | warned in time (Q3) | "
                  "crossings without harm |", "|---|---|---|---|---|---|---|"]
    for arm, a in result["arms"].items():
        harm = f"{a['harm']}" + (f" (+{a['aborted']} aborted)" if a["aborted"] else "")
        warned = f"{a['warned_in_time']} of {a['harm']}" if a["harm"] else "not testable (no harm)"
        lines.append(f"| {arm} | {a['seeds']} of {PLANNED_SEEDS} | {a['verdict']} | {_f(a['mean_gain'], 3, '+')} | "
                     f"{harm} | {warned if a['seeds'] else '-'} | {a['false_alarms'] if a['seeds'] else '-'} |")
    pairs = result["pairs"]
    lines += ["", "Forking tokens minus GRPO, gain per seed (no test: 3 pairs cannot reach significance): "
              + (", ".join(f"seed {s}: {d:+.3f}" for s, d in pairs.items()) if pairs else "no seed has both arms yet")
              + "."]
    lines += ["", "The live doctor (every 5 steps; reported post hoc, no pre-registered endpoint), per run: each "
              "finding with its severity, the step it was first raised, the held-out accuracy of the last "
              "evaluation at or before it, and the checks at which it was active:", ""]
    for key, r in result["runs"].items():
        d = r["doctor"]
        found = [f"{name} ({', '.join(d['severity'][name]) or 'severity not recorded'}) from step {first} "
                 f"(accuracy {_f(_accuracy_at(r['curve'], first), 2)}; {n} of {d['checks']} checks)"
                 for name, (first, n) in sorted(d["found"].items(), key=lambda kv: kv[1])]
        quiet = (f"none in {d['checks']} check" + ("" if d["checks"] == 1 else "s") if d["checks"]
                 else "no health checks recorded")
        lines.append(f"- {key}: " + ("; ".join(found) if found else quiet))
    lines += _post_hoc_lines(result)
    lines += ["", "Curves (step: held-out accuracy):", ""]
    for key, r in result["runs"].items():
        gaps = f" (evaluations missing at {', '.join(map(str, r['missing_evals']))})" if r["missing_evals"] else ""
        lines.append(f"- {key}: " + ", ".join(f"{s}: {v:.2f}" for s, v in r["curve"]) + gaps)
    return "\n".join(lines) + "\n"


def _post_hoc_lines(result: dict[str, Any]) -> list[str]:
    """The table's post hoc description: replies and entropy per run, and what the forking-token plug-in left
    untrained in the runs that logged it."""
    names = {"reward/mean": "training reward", "len/response_mean": "reply tokens",
             "len/truncated_frac": "truncated", "entropy/mean": "entropy"}
    digits = {k: 1 if k == "len/response_mean" else 2 for k in names}
    lines = ["", f"Post hoc (no pre-registered endpoint): means over steps 1-{EDGE_STEPS} -> the last {EDGE_STEPS} "
                 "steps:", ""]
    for key, r in result["runs"].items():
        parts = [f"{names[k]} {a:.{digits[k]}f} -> {b:.{digits[k]}f}" for k, (a, b) in r["described"].items()]
        lines.append(f"- {key}: " + ("; ".join(parts) if parts else "not logged"))
    logged = {k: r["fork_selection"] for k, r in result["runs"].items() if r["fork_selection"]}
    if logged:
        lines += ["", "What the forking-token plug-in left untrained (post hoc; the runs that logged `fork/*`): the "
                      "mean share of a step's rows with no kept token; the share of positive-advantage rows with "
                      "none (overall, then per third of the run); the share of rows whose first response token was "
                      f"kept, over steps 1-{EDGE_STEPS} and after:", ""]
        for key, s in logged.items():
            thirds = ", ".join(f"{lo}-{hi}: {v:.3f}" for lo, hi, v in s["unkept_pos_thirds"])
            lines.append(f"- {key}: rows with none {s['unkept']:.3f}; positive-advantage rows with none "
                         f"{s['unkept_pos']:.3f} ({thirds}); first token kept {s['first_kept'][0]:.3f}, then "
                         f"{s['first_kept'][1]:.3f} (above 0 at {s['first_kept_steps']} of {s['steps']} steps)")
    return lines
