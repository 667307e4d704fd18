"""The alarms plot of ``meshrl report``: when did a run go wrong, and did meshrl say so (one picture per run).

Each run's panel draws its training reward (and its held-out accuracy where evaluated) with two kinds of marks:

- **live** findings (triangles at the step they were raised): the warnings and alarms the run's own
  ``health.every`` checks wrote to ``events.jsonl`` (``health_finding``) while it trained;
- **doctor** findings (dotted vertical lines at their first step): what ``meshrl doctor`` finds on the whole run
  afterwards (warnings and alarms; ``info`` is left off the picture).

The marks are listed in the caption too, so the page says in words what the picture shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrl.report.data import RunData, as_number, eval_key_order

SEVERITY_COLOUR = {"alarm": "#c0392b", "warning": "#e67e22", "info": "#7f8c8d"}
MAX_PANELS = 6


@dataclass(frozen=True)
class AlarmMark:
    step: int
    finding: str
    severity: str
    source: str  # "live" (raised during training) or "doctor" (post hoc)


def alarm_marks(runs: Sequence[RunData], diagnoses: Sequence[tuple[str, Any]]) -> dict[str, list[AlarmMark]]:
    """Run label -> its live findings (``health_finding`` events) and the doctor's warnings and alarms."""
    found = dict(diagnoses)
    marks: dict[str, list[AlarmMark]] = {}
    for run in runs:
        out = [AlarmMark(int(step), str(e.get("finding")), str(e.get("severity", "info")), "live")
               for e in run.events if e.get("event") == "health_finding"
               and (step := as_number(e.get("step"))) is not None and e.get("severity") in ("alarm", "warning")]
        diagnosis = found.get(run.label)
        if diagnosis is not None and not isinstance(diagnosis, str):
            out += [AlarmMark(int(f.steps[0]), f.id, f.severity, "doctor") for f in diagnosis.findings
                    if f.steps and f.severity != "info"]
        marks[run.label] = out
    return marks


def _reward_key(run: RunData) -> str | None:
    """The reward curve the marks sit on (None: the run has none, so no panel; its findings stay in the
    Diagnosis section)."""
    return next((k for k in ("reward/sampled_mean", "reward/mean") if run.series(k)[0]), None)


def _heldout(run: RunData) -> tuple[str | None, list[float], list[float]]:
    keys = sorted(run.eval_keys(), key=eval_key_order)
    if not keys:
        return None, [], []
    xs, ys = run.series(keys[0], run.eval_rows())
    return keys[0], xs, ys


def plot_alarms(runs: Sequence[RunData], marks: dict[str, list[AlarmMark]], out_dir: Path) -> Any:
    """``alarms.png``, one panel per run (at most :data:`MAX_PANELS`), or None when no run has a mark."""
    from meshrl.report.plots import Plot, _figure, _finish, _save

    shown = [r for r in runs if marks.get(r.label) and _reward_key(r)][:MAX_PANELS]
    if not shown:
        return None
    fig, axes = _figure(len(shown), 1, (8.0, 3.4 * len(shown)))
    lines = []
    for ax, run in zip(axes, shown, strict=True):
        key = _reward_key(run)
        xs, ys = run.series(key)
        ax.plot(xs, ys, "-", color="#2c3e50", label=key)
        hkey, hx, hy = _heldout(run)
        if hx:
            ax.plot(hx, hy, "--", marker=".", color="#16a085", label=f"held out: {hkey}")
        top = max([*ys, *hy, 1e-9])
        stacked: dict[int, int] = {}  # labels of several live findings at one step go one above the other
        for m in marks[run.label]:
            colour = SEVERITY_COLOUR[m.severity]
            if m.source == "live":
                y = next((v for x, v in zip(xs, ys, strict=True) if x >= m.step), ys[-1] if ys else 0.0)
                k = stacked[m.step] = stacked.get(m.step, -1) + 1
                ax.plot([m.step], [y], marker="v", ms=9, color=colour, ls="none")
                ax.annotate(m.finding, (m.step, y), textcoords="offset points", xytext=(3, 6 + 10 * k), fontsize=7,
                            color=colour)
            else:
                ax.axvline(m.step, ls=":", color=colour, lw=1.2)
                ax.text(m.step, top, f" {m.finding}", rotation=90, va="top", fontsize=7, color=colour)
        _finish(ax, "reward", title=run.label)
        parts = [f"{m.source} {m.severity} {m.finding} at step {m.step}" for m in marks[run.label]]
        lines.append(f"{run.label}: " + "; ".join(parts))
    caption = ("Training reward (solid) and held-out accuracy (dashed) with the findings: triangles = raised by the "
               "run's own checks during training (health.every), dotted lines = meshrl doctor on the whole run "
               "afterwards, at each finding's first step (red alarm, orange warning). " + " | ".join(lines))
    missing = [r.label for r in runs if r not in shown]
    return Plot(_save(fig, out_dir, "alarms.png"), "When it went wrong, and what meshrl said", caption,
                missing=missing)
