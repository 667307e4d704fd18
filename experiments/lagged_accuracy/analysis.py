"""The lagged-accuracy experiment's endpoints and decision, exactly as preregistration.md defines them, and its table.

Per run (one arm, one seed; the seed is the unit): the held-out curve from the trainer's evaluations (``evals.jsonl``,
step 0 included: ``eval.at_start``), ``acc0``, the accuracy at the last pre-registered step and ``gain``. Per seed
pair: ``D = final(k2) - final(k0)``. The decision reads k0's improvement first: an equivalence claim about a gain
that is not there would say nothing. Per arm: the lag and the correction's weights as the trainer logged them
(docs/training.md, "Asynchronous rollouts") and the median step time. With 3 pairs the exact two-sided sign-flip
p is at least 2/8 = 0.25, so the verdict is descriptive.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from experiments.lagged_accuracy.experiment import ARMS, Settings
from experiments.real_model.analysis import cpu_label

EVAL_KEY = "eval/mean@1"  # the mean over the held-out problems and their samples
LAG_KEYS = ("lag/staleness_mean", "rollout_corr/ess", "rollout_corr/frac_truncated")
STEP_KEY = "time/step_s"
IMPROVE_MEAN = 0.03
WITHIN = 0.02
REFERENCE, LAGGED = "k0", "k2"
TOL = 1e-9  # accuracies are multiples of 1 / (problems x samples): 0.02 must count as within 0.02
HORIZON = Settings().steps  # the endpoint's step (acc100), whatever steps the runs were continued to
PLANNED_SEEDS = len(Settings().seeds)
ESS_MIN, TRUNCATED_MAX = 0.5, 0.2  # meshrl doctor's stale_rollouts thresholds: the correction no longer holds the lag
Curve = list[tuple[int, float]]


def curve(evals: list[dict[str, Any]]) -> Curve:
    """``(step, accuracy)`` of each evaluation, by step (a repeated step keeps its last record)."""
    return sorted({int(r["step"]): float(r[EVAL_KEY]) for r in evals if EVAL_KEY in r}.items())


def run_endpoints(evals: list[dict[str, Any]], horizon: int, every: int | None = None) -> dict[str, Any]:
    """``acc0``, ``final`` (at ``horizon``; NaN when not evaluated there), ``gain = final - acc0``, the curve and
    the evaluations missing from it (steps 0, ``every``, ... ``horizon``)."""
    c = curve(evals)
    at = dict(c)
    acc0, final = at.get(0, math.nan), at.get(horizon, math.nan)
    missing = [s for s in range(0, horizon + 1, every) if s not in at] if every else []
    return {"acc0": acc0, "final": final, "gain": final - acc0, "curve": c, "missing_evals": missing}


def improvement(gains: list[float], planned: int = PLANNED_SEEDS) -> str:
    """GRPO "improves" when gain > 0 in every seed (3 or more) and the mean gain is >= 0.03; "does not improve"
    when gain <= 0 in 2 or more seeds; else "inconclusive" once the ``planned`` seeds have runs, "incomplete" before
    (a NaN gain, a run without the endpoint's evaluation, decides nothing but counts as made)."""
    done = [g for g in gains if g == g]
    if len(done) >= 3 and all(g > 0 for g in done) and statistics.fmean(done) >= IMPROVE_MEAN - TOL:
        return "improves"
    if sum(g <= 0 for g in done) >= 2:
        return "does not improve"
    if len(gains) < planned:
        return f"incomplete ({len(done)} of {planned} seeds)"
    missing = len(gains) - len(done)  # runs in, but without the endpoint's evaluation (aborted): as made
    return "inconclusive" + (f" ({missing} run(s) without acc100)" if missing else "")


def differences(runs: dict[str, dict[str, Any]]) -> dict[int, float]:
    """Per seed with both arms finished and evaluated at the horizon: ``D = final(k2) - final(k0)``."""
    final = {(r["arm"], r["seed"]): r["final"] for r in runs.values() if math.isfinite(r["final"])}
    seeds = sorted({s for a, s in final if a == REFERENCE} & {s for a, s in final if a == LAGGED})
    return {s: final[(LAGGED, s)] - final[(REFERENCE, s)] for s in seeds}


def comparison(mean_d: float) -> str:
    if abs(mean_d) <= WITHIN + TOL:
        return "within 2 points"
    return f"k2 {'above' if mean_d > 0 else 'below'} k0 by {abs(mean_d):.3f}"


def decision(k0_gains: list[float], k2_gains: list[float], diffs: dict[int, float], planned: int) -> dict[str, Any]:
    """The pre-registered verdict: uninformative when k0 does not improve, else the mean D against 2 points;
    marked partial with fewer pairs than planned, and with k0's improvement when it is inconclusive."""
    k0, k2 = improvement(k0_gains, planned), improvement(k2_gains, planned)
    values = list(diffs.values())
    mean_d = statistics.fmean(values) if values else math.nan
    if k0 == "does not improve":
        verdict = "uninformative (both flat)" if k2 == "does not improve" else f"uninformative (k0 flat, k2 {k2})"
    elif not values:
        verdict = "no complete pair"
    else:
        verdict = comparison(mean_d) + ("" if k0 == "improves" else f"; k0's improvement {k0}")
    if len(values) < planned:  # said first: a partial grid's figures are not the verdict
        verdict = f"partial ({len(values)} of {planned} pairs), so far: {verdict}"
    return {"k0": k0, "k2": k2, "pairs": len(values), "mean_d": mean_d, "min_d": min(values, default=math.nan),
            "max_d": max(values, default=math.nan), "verdict": verdict}


def _mean(values: list[float]) -> float:
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def arm_figures(runs: dict[str, dict[str, Any]], arm: str) -> dict[str, Any]:
    """Per arm: the mean gain; for each of :data:`LAG_KEYS` the mean over runs of each run's mean over its steps
    (NaN where never logged, e.g. k0); the median ``time/step_s`` over all the arm's steps."""
    mine = [r for r in runs.values() if r["arm"] == arm]
    lag = {k: _mean([_mean([_num(m[k]) for m in r["metrics"] if k in m]) for r in mine]) for k in LAG_KEYS}
    times = [t for r in mine for m in r["metrics"] if STEP_KEY in m and math.isfinite(t := _num(m[STEP_KEY]))]
    weak = sum(1 for r in mine for m in r["metrics"]  # NaN (not logged) compares false
               if _num(m.get("rollout_corr/ess")) < ESS_MIN
               or _num(m.get("rollout_corr/frac_truncated")) > TRUNCATED_MAX)
    return {"runs": len(mine), "mean_gain": _mean([r["gain"] for r in mine]), **lag,
            "median_step_s": statistics.median(times) if times else math.nan, "weak_correction_steps": weak,
            "aborted": sum(r["aborted"] is not None for r in mine)}


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def analyse(pack: dict[str, Any]) -> dict[str, Any]:
    """Endpoints per run, D per seed, the decision and the per-arm figures, from a pack (or :func:`load`). The
    endpoint is step 100 (the pre-registered horizon) or the runs' last step when they were made shorter."""
    settings = pack["settings"]
    horizon = min(int(settings["steps"]), HORIZON)
    runs = {}
    for key, run in sorted(pack["runs"].items()):
        arm, seed = key.split("/")
        done = run.get("done", {})
        runs[key] = {"arm": arm, "seed": int(seed.removeprefix("seed_")), "metrics": run["metrics"],
                     **run_endpoints(run["evals"], horizon, int(settings.get("eval_every", 0)) or None),
                     "cpu": cpu_label(done.get("machine")), "aborted": done.get("aborted")}
    gains = {a: [r["gain"] for r in runs.values() if r["arm"] == a] for a in (REFERENCE, LAGGED)}
    diffs = differences(runs)
    return {"horizon": horizon, "runs": runs, "differences": diffs,
            "decision": decision(gains[REFERENCE], gains[LAGGED], diffs, PLANNED_SEEDS),
            "arms": {a: arm_figures(runs, a) for a in ARMS}}


def load(path: Path) -> dict[str, Any]:
    """A pack (a ``.json.gz`` file) or a run directory's finished runs, in the pack's form."""
    from experiments.lagged_accuracy import experiment

    return experiment.collect(path) if path.is_dir() else experiment.read_pack(path)


def _f(x: float, digits: int = 3, sign: bool = False) -> str:
    return "-" if x != x else f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _run_rows(result: dict[str, Any]) -> list[str]:
    steps = sorted({s for r in result["runs"].values() for s, _ in r["curve"]})
    lines = ["| arm | seed | " + " | ".join(f"step {s}" for s in steps) + " | gain | CPU | note |",
             "|---|---|" + "---|" * (len(steps) + 3)]
    for r in result["runs"].values():
        at = dict(r["curve"])
        cells = " | ".join(_f(at.get(s, math.nan)) for s in steps)
        notes = ([f"aborted ({r['aborted']})"] if r["aborted"] else []) + (
            [f"evaluations missing at {', '.join(map(str, r['missing_evals']))}"] if r["missing_evals"] else [])
        lines.append(f"| {r['arm']} | {r['seed']} | {cells} | {_f(r['gain'], sign=True)} | {r['cpu']} | "
                     f"{'; '.join(notes) or '-'} |")
    return lines


def _pair_rows(result: dict[str, Any]) -> list[str]:
    by = {(r["arm"], r["seed"]): r for r in result["runs"].values()}
    h = result["horizon"]
    lines = [f"| seed | acc{h} k0 | acc{h} k2 | D | note |", "|---|---|---|---|---|"]
    for seed, d in result["differences"].items():
        a, b = by[(REFERENCE, seed)], by[(LAGGED, seed)]
        # a pair is one base model on one split: equal acc0, and on one CPU (rounding differs between CPUs)
        notes = (["made on two CPUs"] if a["cpu"] != b["cpu"] else []) + (
            [f"acc0 differs ({_f(a['acc0'])} against {_f(b['acc0'])})"] if a["acc0"] != b["acc0"] else [])
        lines.append(f"| {seed} | {_f(a['final'])} | {_f(b['final'])} | {_f(d, sign=True)} | "
                     f"{'; '.join(notes) or '-'} |")
    return lines


def _arm_rows(result: dict[str, Any]) -> list[str]:
    d = result["decision"]
    lines = ["| arm | runs | GRPO improves? | mean gain | " + " | ".join(f"mean {k}" for k in LAG_KEYS)
             + f" | median {STEP_KEY} | steps with ESS < {ESS_MIN} or truncated > {TRUNCATED_MAX} | aborted |",
             "|---|---|---|---|" + "---|" * (len(LAG_KEYS) + 3)]
    for arm, a in result["arms"].items():
        if not a["runs"]:
            lines.append(f"| {arm} | 0 of {PLANNED_SEEDS} | not run |" + " - |" * (len(LAG_KEYS) + 4))
            continue
        lag = " | ".join(_f(a[k]) for k in LAG_KEYS)
        lines.append(f"| {arm} | {a['runs']} of {PLANNED_SEEDS} | {d.get(arm, '-')} | {_f(a['mean_gain'], sign=True)} "
                     f"| {lag} | {_f(a['median_step_s'], 1)} | {a['weak_correction_steps']} | {a['aborted']} |")
    return lines


def table(result: dict[str, Any]) -> str:
    """The markdown report of :func:`analyse`'s result: verdict, every run's curve, D per seed, the arms."""
    d = result["decision"]
    n, planned = len(result["runs"]), len(ARMS) * PLANNED_SEEDS
    horizon = "" if result["horizon"] == HORIZON else f" The endpoint is step {result['horizon']}, not the " \
                                                      f"pre-registered {HORIZON}: these runs were made shorter."
    head = ["# Lagged rollouts (k = 2, TIS) against k = 0: GRPO's held-out accuracy on SmolLM2-135M-Instruct",
            "", "Pre-registered in preregistration.md. Descriptive: with 3 pairs the exact two-sided sign-flip p "
                f"cannot go below 0.25. Runs in the pack: {n} of the {planned} pre-registered.{horizon}", "",
            f"**Verdict: {d['verdict']}.** Mean D = {_f(d['mean_d'], sign=True)} over {d['pairs']} pair(s) "
            f"(range {_f(d['min_d'], sign=True)} to {_f(d['max_d'], sign=True)}); k0: {d['k0']}, k2: {d['k2']}.",
            "", "Held-out accuracy (T = 1) by step:", ""]
    return "\n".join([*head, *_run_rows(result), "", *_pair_rows(result), "", *_arm_rows(result)]) + "\n"
