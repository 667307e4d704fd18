"""What ``meshrl demo`` reads off each run: the niche's curve, when it fell and came back, MEI beside it, the
rates over seeds, and the printed table.

The niche is held-out ``decade`` accuracy (the problem type whose fitting procedure is the rare one), measured by
the trainer's own evaluation every few steps from the warm start on (``evals.jsonl``: ``eval.at_start``,
``eval.by=type``). The rules are adapted from the pre-registered persistence experiment
(experiments/collapse_testbed/preregistration.md) to a demo about dips, at its shorter horizon:

* **fell**: the niche at least :data:`FELL_BY` below its running maximum (from step 0) *and* below :data:`BACK_AT`
  (the niche lost, not just lower); one checkpoint is enough (the experiment's harm needs two: a transient dip
  counts here, which is what the demo is about); the step is the first such checkpoint, the depth the lowest niche
  after it and before it came back;
* **back**: after a fall, the first checkpoint with the niche at or above :data:`BACK_AT` again (the experiment's
  time to re-learn);
* **kept**: the niche at the last step above :data:`KEPT_ABOVE` (the top of the experiment's borderline band);
  ``lost`` below 0.4, ``borderline`` in between;
* **MEI crossed**: the batch MEI (``mei/query``, every step) above the mean + 3 standard deviations of its first
  :data:`MEI_CALIBRATION` steps for 3 steps in a row (the trainer's ``diag.mei.patience``); the step is the first
  of them. It **warned** when it crossed at least one evaluation interval before the fall (the fall happened
  somewhere in the interval before the checkpoint that saw it). Most falls come at step 4-8, during or right after
  the calibration, so the demo cannot test MEI as an early warning; the pre-registered test is the persistence
  experiment's (docs/testbed.md).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from meshrl.jsonl import read_jsonl

NICHE = "decade"
FELL_BY = 0.2
BACK_AT = 0.5
KEPT_ABOVE = 0.6
LOST_BELOW = 0.4
MEI_CALIBRATION = 4
MEI_PATIENCE = 3
BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], top: float = 1.0) -> str:
    """One character per value, ``▁`` at 0 to ``█`` at ``top``; ``·`` for a missing (NaN) value."""
    out = []
    for v in values:
        if v != v:
            out.append("·")
            continue
        out.append(BARS[min(len(BARS) - 1, max(0, round(v / top * (len(BARS) - 1))))] if top > 0 else BARS[0])
    return "".join(out)


def fall_and_return(curve: list[tuple[int, float]]) -> dict[str, Any]:
    """``fell`` (step or None), ``low`` (the lowest niche from the fall until it came back), ``back`` (step or
    None) for a niche curve ``[(step, value), ...]`` that starts at step 0 (see the module docstring)."""
    peak, fell, low, back = -math.inf, None, None, None
    for step, value in curve:
        if fell is None:
            if value <= peak - FELL_BY + 1e-12 and value < BACK_AT:
                fell, low = step, value
            peak = max(peak, value)
        elif back is None:
            if value >= BACK_AT:
                back = step
            else:
                low = min(low, value)
    return {"fell": fell, "low": low, "back": back}


def outcome(value: float) -> str:
    """``kept`` above :data:`KEPT_ABOVE`, ``lost`` below :data:`LOST_BELOW`, ``borderline`` in between."""
    return "kept" if value > KEPT_ABOVE else "lost" if value < LOST_BELOW else "borderline"


def mei_crossing(mei: list[tuple[int, float]]) -> tuple[float | None, int | None]:
    """``(threshold, step)``: the 3-sigma line of the first :data:`MEI_CALIBRATION` steps and the first step of
    :data:`MEI_PATIENCE` consecutive later steps above it (None: never; threshold None: too few steps)."""
    calib = [v for s, v in mei if s <= MEI_CALIBRATION and v == v]
    if len(calib) < 2:
        return None, None
    line = statistics.fmean(calib) + 3 * statistics.stdev(calib)
    run: list[int] = []
    for step, value in mei:
        if step <= MEI_CALIBRATION:
            continue
        run = [*run, step] if value == value and value > line else []
        if len(run) >= MEI_PATIENCE:
            return line, run[0]
    return line, None


def run_story(run_dir: Path) -> dict[str, Any]:
    """One run's story from its ``evals.jsonl`` and ``metrics.jsonl`` (``warned``: MEI crossed at least one
    evaluation interval before the checkpoint that saw the fall)."""
    evals, metrics = read_jsonl(run_dir / "evals.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    key = f"eval/by/{NICHE}/mean@1"
    missing = [e["step"] for e in evals if key not in e]
    if missing or not evals or evals[0]["step"] != 0:
        raise ValueError(f"{run_dir}/evals.jsonl: the demo needs the niche ({key}) from step 0 on "
                         f"(eval.at_start=true, eval.by=type); steps without it: {missing or 'no step 0'}")
    curve = [(e["step"], float(e[key])) for e in evals]
    mei = [(m["step"], float(m.get("mei/query", math.nan))) for m in metrics]
    line, crossed = mei_crossing(mei)
    story = {"curve": curve, **fall_and_return(curve), "last": curve[-1][1], "outcome": outcome(curve[-1][1]),
             "accuracy_last": float(evals[-1]["eval/mean@1"]), "mei": mei, "mei_line": line, "mei_crossed": crossed}
    every = curve[1][0] - curve[0][0] if len(curve) > 1 else 0
    story["warned"] = story["fell"] is not None and crossed is not None and crossed <= story["fell"] - every
    return story


def mei_per_checkpoint(story: dict[str, Any]) -> list[float]:
    """The mean MEI of the steps since the previous checkpoint, one value per checkpoint after step 0."""
    steps = [s for s, _ in story["curve"]]
    out = []
    for lo, hi in zip(steps, steps[1:], strict=False):
        vals = [v for s, v in story["mei"] if lo < s <= hi and v == v]
        out.append(statistics.fmean(vals) if vals else math.nan)
    return out


def rates(stories: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per arm over its seeds: runs, fell, came back (and after how many steps), kept / lost / borderline at the
    last step, MEI crossings before a fall (warned) and in runs without one (false alarms)."""
    out: dict[str, Any] = {}
    for arm, by_seed in stories.items():
        runs = list(by_seed.values())
        fell = [r for r in runs if r["fell"] is not None]
        back = [r for r in fell if r["back"] is not None]
        out[arm] = {
            "seeds": sorted(by_seed), "runs": len(runs), "fell": len(fell), "back": len(back),
            "steps_to_back": sorted(r["back"] - r["fell"] for r in back),
            **{o: sum(r["outcome"] == o for r in runs) for o in ("kept", "lost", "borderline")},
            "warned": sum(r["warned"] for r in fell),
            "false_alarms": sum(r["mei_crossed"] is not None for r in runs if r["fell"] is None),
            "no_fall": len(runs) - len(fell),
        }
    return out


def _cell_fell(r: dict[str, Any]) -> str:
    return "–" if r["fell"] is None else f"step {r['fell']} (to {r['low']:.2f})"


def _cell_mei(r: dict[str, Any]) -> str:
    if r["mei_crossed"] is None:
        return "never"
    if r["fell"] is None:
        return f"step {r['mei_crossed']} (no fall)"
    lead = r["fell"] - r["mei_crossed"]
    if lead == 0:
        return f"step {r['mei_crossed']} (at the fall)"
    return f"step {r['mei_crossed']} ({lead} before the fall)" if lead > 0 else \
        f"step {r['mei_crossed']} ({-lead} after the fall)"


def story_table(stories: dict[str, dict[int, dict[str, Any]]], every: int) -> str:
    """The markdown table: one row per (arm, seed) with the niche and MEI sparklines."""
    top = max((v for arm in stories.values() for r in arm.values() for v in mei_per_checkpoint(r) if v == v),
              default=1.0)
    lines = [f"| arm | seed | niche, every {every} steps from step 0 | fell | back >= {BACK_AT} | last | "
             f"held-out accuracy | MEI, same steps | MEI crossed |", "|---" * 9 + "|"]
    for arm, by_seed in stories.items():
        for seed, r in sorted(by_seed.items()):
            back = "–" if r["back"] is None else f"step {r['back']}"
            lines.append(f"| {arm} | {seed} | `{sparkline([v for _, v in r['curve']])}` | {_cell_fell(r)} | {back} | "
                         f"{r['last']:.2f} {r['outcome']} | {r['accuracy_last']:.3f} | "
                         f"` {sparkline(mei_per_checkpoint(r), top)}` | {_cell_mei(r)} |")
    return "\n".join(lines)


def rates_line(arm: str, r: dict[str, Any]) -> str:
    """One arm's counts over its seeds, as a sentence."""
    back = (f", back after {min(r['steps_to_back'])}-{max(r['steps_to_back'])} steps" if r["steps_to_back"]
            else "")
    return (f"{arm}: fell in {r['fell']} of {r['runs']}, came back in {r['back']} of those{back}; kept at the "
            f"last step in {r['kept']} of {r['runs']} (lost {r['lost']}, borderline {r['borderline']}); MEI "
            f"crossed an interval before the fall in {r['warned']} of {r['fell']} falls and in {r['false_alarms']} of "
            f"{r['no_fall']} runs without one")
