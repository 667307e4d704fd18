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

FALL = 0.1
FALL_RUN = 2
CALIBRATION_STEPS = (1, 10)
SIGMAS = 3.0
PATIENCE = 3
IN_TIME = 10
Curve = list[tuple[int, float]]


def fall(curve: Curve, drop: float = FALL, run: int = FALL_RUN) -> tuple[str, int | None, float]:
    """``(class, step, depth)``: ``harm`` when the accuracy is >= ``drop`` below its running maximum for >= ``run``
    consecutive evaluations (step = the first of the first such run), ``dip`` when a shorter run is (step of the
    first), else ``none``; depth = the largest distance below the running maximum."""
    best, below, first_dip, depth = -math.inf, [], None, 0.0
    harm_step = None
    for step, value in curve:
        best = max(best, value)
        depth = max(depth, best - value)
        if best - value >= drop - 1e-12:
            below.append(step)
            if len(below) >= run and harm_step is None:
                harm_step = below[0]
        else:
            if below and first_dip is None:
                first_dip = below[0]
            below = []
    if harm_step is not None:
        return "harm", harm_step, depth
    if below and len(below) < run and first_dip is None:
        first_dip = below[0]
    return ("dip", first_dip, depth) if first_dip is not None else ("none", None, depth)


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
                  horizon: int) -> dict[str, Any]:
    """The endpoints of one run (preregistration.md, "Endpoints")."""
    curve: Curve = [(0, step0)] + sorted((int(r["step"]), float(r["eval/mean@1"])) for r in evals)
    final = dict(curve).get(horizon, math.nan)
    best_step, best = max(curve, key=lambda sv: (sv[1], -sv[0]))
    cls, fall_step, depth = fall(curve)
    mei = [(int(r["step"]), float(r["mei/query"])) for r in metrics if "mei/query" in r]
    thr = mei_threshold(mei)
    cross = crossing(mei, thr)
    lead = fall_step - cross if cls == "harm" and cross is not None and fall_step is not None else None
    return {"acc0": step0, "final": final, "gain": final - step0, "best": best, "best_step": best_step,
            "fall": cls, "fall_step": fall_step, "depth": depth, "mei_threshold": thr, "mei_cross": cross,
            "lead": lead, "in_time": lead is not None and lead >= IN_TIME, "curve": curve}


def verdict(gains: list[float]) -> str:
    """Q1 per arm: improves (gain > 0 in every seed, 3 or more, and mean >= 0.05), does not improve (gain <= 0 in
    2 or more seeds), else inconclusive."""
    if len(gains) >= 3 and all(g > 0 for g in gains) and statistics.fmean(gains) >= 0.05:
        return "improves"
    if sum(g <= 0 for g in gains) >= 2:
        return "does not improve"
    return "inconclusive"


def analyse(pack: dict[str, Any]) -> dict[str, Any]:
    horizon = int(pack["settings"]["steps"])
    runs = {}
    for key, run in sorted(pack["runs"].items()):
        arm, seed = key.split("/")
        step0 = float(pack["step0"][seed][f"mean@{pack['settings']['eval_n']}"])
        runs[key] = {"arm": arm, "seed": int(seed.split("_")[1]),
                     **run_endpoints(step0, run["evals"], run["metrics"], horizon), "seconds": run["seconds"],
                     "cpu": cpu_label(run.get("machine"))}
    arms = sorted({r["arm"] for r in runs.values()})
    per_arm = {}
    for arm in arms:
        mine = [r for r in runs.values() if r["arm"] == arm]
        per_arm[arm] = {"seeds": len(mine), "verdict": verdict([r["gain"] for r in mine]),
                        "mean_gain": statistics.fmean(r["gain"] for r in mine),
                        "harm": sum(r["fall"] == "harm" for r in mine),
                        "warned_in_time": sum(r["in_time"] for r in mine),
                        "false_alarms": sum(r["fall"] != "harm" and r["mei_cross"] is not None for r in mine)}
    return {"runs": runs, "arms": per_arm, "pilot": pack["pilot"]}


def cpu_label(machine: dict[str, Any] | None) -> str:
    """The CPU a run was made on, as the table names it: PyTorch's capability (what decides float rounding),
    with native bf16 said; ``-`` where the run recorded none."""
    if not machine:
        return "-"
    return f"{machine.get('capability', '?')}{', native bf16' if machine.get('bf16_native') else ''}"


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def table(result: dict[str, Any]) -> str:
    """The markdown table of :func:`analyse`'s result."""
    p = result["pilot"]
    tried = ", ".join(f"A = {a}: {float(v):.3f}" for a, v in p["tried"].items())
    lines = ["# SmolLM2-135M-Instruct: GRPO and forking tokens (preregistration.md)", "",
             f"Pilot (base model, held-out accuracy at T = 1): {tried}; chosen A = {p['chosen']}.", "",
             "| arm | seed | step 0 | final | gain | best (step) | fall | MEI threshold | MEI crossing | lead | CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"].values():
        fall_text = r["fall"] if r["fall"] == "none" else f"{r['fall']} at {r['fall_step']} (-{r['depth']:.3f})"
        lines.append(f"| {r['arm']} | {r['seed']} | {_f(r['acc0'])} | {_f(r['final'])} | {r['gain']:+.3f} | "
                     f"{_f(r['best'])} ({r['best_step']}) | {fall_text} | {_f(r['mei_threshold'], 4)} | "
                     f"{r['mei_cross'] if r['mei_cross'] is not None else '-'} | "
                     f"{r['lead'] if r['lead'] is not None else '-'} | {r['cpu']} |")
    lines += ["", "| arm | seeds | verdict (Q1) | mean gain | runs with harm (Q2) | warned in time (Q3) | "
                  "crossings without harm |", "|---|---|---|---|---|---|---|"]
    for arm, a in result["arms"].items():
        lines.append(f"| {arm} | {a['seeds']} | {a['verdict']} | {a['mean_gain']:+.3f} | {a['harm']} | "
                     f"{a['warned_in_time']} | {a['false_alarms']} |")
    lines += ["", "Curves (step: held-out accuracy):", ""]
    for key, r in result["runs"].items():
        lines.append(f"- {key}: " + ", ".join(f"{s}: {v:.2f}" for s, v in r["curve"]))
    return "\n".join(lines) + "\n"
