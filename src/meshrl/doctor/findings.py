"""What a check returns (:class:`Finding`, :class:`Unchecked`) and the small helpers every check shares."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from meshrl.doctor.records import RunRecords
from meshrl.doctor.thresholds import Thresholds

SEVERITIES = ("alarm", "warning", "info")  # alarm: the run is broken; warning: likely a problem; info: note


@dataclass
class Finding:
    """One diagnosis: ``what`` happened at ``steps``, the ``evidence`` (metric values, a few ``samples``),
    how sure (``confidence``: high / medium / low) and the ``knob`` that usually helps."""

    id: str
    title: str
    severity: str
    steps: list[int]
    what: str
    evidence: dict[str, Any]
    knob: str
    confidence: str = "medium"
    samples: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"finding {self.id}: severity {self.severity!r} not in {SEVERITIES}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Unchecked:
    """A finding that could not be checked, and why (which metric or file is missing)."""

    id: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def windows(values: list[float], th: Thresholds) -> tuple[float, float]:
    """Means of the first and the last window of ``values`` (see :class:`Thresholds`)."""
    w = max(th.min_window, int(round(len(values) * th.window_frac)))
    w = min(w, len(values))
    return statistics.fmean(values[:w]), statistics.fmean(values[-w:])


def smooth(values: list[float], k: int = 3) -> list[float]:
    """Centred moving average over ``k`` points (shorter at the ends)."""
    half = k // 2
    return [statistics.fmean(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def confidence(margin: float, n_steps: int, th: Thresholds, *, persistent: bool = True) -> str:
    """``high`` when the evidence passes its threshold by 2x (``margin`` = observed / threshold, >= 1) on a
    persistent pattern, ``low`` on a short run, else ``medium``."""
    if n_steps < 2 * th.min_steps:
        return "low" if margin < 2 else "medium"
    return "high" if margin >= 2 and persistent else "medium"


def sample_texts(rec: RunRecords, steps: list[int], k: int = 3, width: int = 120) -> list[str]:
    """Up to ``k`` logged completions from the given steps (the nearest logged step when none match)."""
    if not rec.samples or not steps:
        return []
    logged = sorted({int(s["step"]) for s in rec.samples if isinstance(s.get("step"), int | float)})
    if not logged:
        return []
    want = {min(logged, key=lambda x: abs(x - s)) for s in steps}
    out = []
    for s in rec.samples:
        if s.get("step") in want and isinstance(s.get("completion"), str):
            text = s["completion"].replace("\n", "\\n")
            reward = s.get("reward")
            head = f"step {int(s['step'])}" + (f", reward {reward:.3g}" if isinstance(reward, int | float) else "")
            out.append(f"[{head}] {text[:width]}" + ("..." if len(text) > width else ""))
            if len(out) == k:
                break
    return out


def fmt(x: float) -> float:
    """A value for the evidence dict: 4 significant digits (NaN / inf kept as they are)."""
    return float(f"{x:.4g}") if math.isfinite(x) else x


def need(rec: RunRecords, check: str, *keys: str, min_steps: int = 1) -> Unchecked | None:
    """``Unchecked`` naming the first of ``keys`` that is absent (or logged on fewer than ``min_steps``)."""
    for key in keys:
        n = len(rec.series(key)[1])
        if n == 0:
            return Unchecked(check, f"metric {key!r} is not in this {rec.engine} run's records")
        if n < min_steps:
            return Unchecked(check, f"metric {key!r} is logged on {n} step(s); the check needs {min_steps}")
    return None
