"""The doctor during training: the same checks and thresholds on the records a run has so far.

The live verdict at step ``t`` is :func:`~meshrl.doctor.diagnose.diagnose_records` on the run's records cut at
``t`` (:func:`truncate_records`): nothing logged after ``t`` is read, so by construction it equals the post-hoc
doctor's verdict on the same truncated records (tested against ``meshrl doctor`` on the finished run). What it
cannot do is see further than the records: a check built on a trend (the first window against the last) judges
the trend so far, and a check that needs ``min_steps`` logged steps says "not checked" before that.

:class:`LiveRecords` keeps a run's records in memory as they are written (each one as it reads back from its
JSONL line), so a check costs one pass of the checks over the records, not a reread of the files.
:class:`HealthMonitor` runs the checks every ``every`` steps, reports a finding once when it is first raised
(again only after it cleared), and maps each finding to an action: ``ignore``, ``warn`` (a log line and a
record), ``checkpoint`` (a checkpoint now) or ``stop`` (end the run, leaving the last healthy checkpoint).
Which action: ``on[finding id]``, else ``on[severity]``, else :data:`DEFAULT_ACTIONS`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrl.doctor.diagnose import CHECKS, Diagnosis, diagnose_records, json_safe
from meshrl.doctor.findings import SEVERITIES, Finding
from meshrl.doctor.records import RunRecords, by_step
from meshrl.doctor.thresholds import DEFAULT, Thresholds

log = logging.getLogger("meshrl")

ACTIONS = ("ignore", "warn", "checkpoint", "stop")
#: What a finding does when neither its id nor its severity is named in ``on``.
DEFAULT_ACTIONS = {"alarm": "warn", "warning": "warn", "info": "ignore"}
#: Every finding id a check can raise.
FINDING_IDS = tuple(fid for ids, _ in CHECKS for fid in ids)
#: The ``event`` names a monitor writes to events.jsonl.
CHECK_EVENT, FINDING_EVENT, CLEARED_EVENT = "health_check", "health_finding", "health_cleared"


def _step_of(record: Mapping[str, Any]) -> float | None:
    s = record.get("step")
    return float(s) if isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s) else None


def truncate_records(rec: RunRecords, step: int) -> RunRecords:
    """``rec`` as it stood when step ``step`` had been logged: every record of a later step left out (records
    without a step, such as a set-up event, are kept)."""

    def upto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rows if (s := _step_of(r)) is None or s <= step]

    return dataclasses.replace(rec, steps=[r for r in rec.steps if r["step"] <= step], samples=upto(rec.samples),
                               events=upto(rec.events), evals=upto(rec.evals), notes=list(rec.notes))


def check_actions(on: Mapping[str, str], where: str = "health.on") -> dict[str, str]:
    """``on`` validated: keys are severities or finding ids, values actions; ``ValueError`` naming the key."""
    out = {}
    for key, value in on.items():
        if key not in SEVERITIES and key not in FINDING_IDS:
            raise ValueError(f"{where}.{key}: not a severity ({', '.join(SEVERITIES)}) or a finding id of "
                             f"meshrl doctor ({', '.join(FINDING_IDS)})")
        if value not in ACTIONS:
            raise ValueError(f"{where}.{key}={value!r}; known: {', '.join(ACTIONS)}")
        out[str(key)] = str(value)
    return out


def action_for(finding: Finding, on: Mapping[str, str]) -> str:
    """The action ``on`` asks for ``finding`` (its id first, then its severity, then the default)."""
    return on.get(finding.id) or on.get(finding.severity) or DEFAULT_ACTIONS[finding.severity]


class LiveRecords:
    """A run's records, kept up to date from the records as they are written (meshrl's names)."""

    def __init__(self, base: RunRecords) -> None:
        self.path, self.engine, self.config, self.mapping = base.path, base.engine, base.config, base.mapping
        self.notes = list(base.notes)
        self._steps = {int(r["step"]): dict(r) for r in base.steps}
        self.samples, self.events = list(base.samples), list(base.events)
        in_steps = {id(r) for r in base.steps}
        self.evals = [r for r in base.evals if id(r) not in in_steps]  # evals.jsonl rows, not metric rows
        # metric rows with held-out figures: the held-out records when evals.jsonl has none (as the reader does)
        self._eval_steps = {s for s, r in self._steps.items() if any(k.startswith("eval/") for k in r)}

    def add(self, kind: str, record: dict[str, Any]) -> None:
        """One record as it reads back from its line of ``<kind>.jsonl`` (metrics, samples, events, evals)."""
        if kind == "metrics":
            for row in by_step([record]) if "step" in record else []:
                merged = self._steps.setdefault(int(row["step"]), {})
                merged.update(row)
                if any(k.startswith("eval/") for k in row):
                    self._eval_steps.add(int(row["step"]))
                if "clip/frac" not in row and ("clip/frac_low" in merged or "clip/frac_high" in merged):
                    merged["clip/frac"] = merged.get("clip/frac_low", 0.0) + merged.get("clip/frac_high", 0.0)
        elif kind in ("samples", "events", "evals"):
            getattr(self, kind).append(record)
        else:
            raise ValueError(f"unknown record kind {kind!r}; known: metrics, samples, events, evals")

    def records(self) -> RunRecords:
        steps = [self._steps[s] for s in sorted(self._steps)]
        evals = self.evals or [self._steps[s] for s in sorted(self._eval_steps)]
        return RunRecords(path=self.path, engine=self.engine, steps=steps, samples=self.samples,
                          events=self.events, evals=evals, config=self.config, notes=list(self.notes),
                          mapping=self.mapping)


@dataclass
class HealthReport:
    """What one check found new: findings raised since the last check (with their actions) and ids cleared."""

    step: int
    diagnosis: Diagnosis
    raised: list[tuple[Finding, str]] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)

    def action(self) -> str:
        """The strongest action asked for by a newly raised finding."""
        return max((a for _, a in self.raised), key=ACTIONS.index, default="ignore")

    def events(self) -> list[dict[str, Any]]:
        """Records for events.jsonl: one per raised finding (its whole evidence), one per cleared id."""
        out = [{"step": self.step, "event": FINDING_EVENT, "finding": f.id, "severity": f.severity,
                "action": a, "what": f.what, "knob": f.knob, "steps": f.steps, "confidence": f.confidence,
                "evidence": json_safe(f.evidence)} for f, a in self.raised]
        out += [{"step": self.step, "event": CLEARED_EVENT, "finding": fid} for fid in self.cleared]
        return out


def open_findings(events: list[dict[str, Any]]) -> set[str]:
    """Finding ids raised and not cleared, from a run's health events (a resumed run reports nothing twice)."""
    active: set[str] = set()
    for e in events:
        if e.get("event") == FINDING_EVENT:
            active.add(str(e.get("finding")))
        elif e.get("event") == CLEARED_EVENT:
            active.discard(str(e.get("finding")))
    return active


class HealthMonitor:
    """The checks every ``every`` steps on :class:`LiveRecords`; each finding reported when first raised."""

    def __init__(self, records: LiveRecords, *, every: int, on: Mapping[str, str] | None = None,
                 thresholds: Thresholds = DEFAULT) -> None:
        if every < 1:
            raise ValueError(f"health.every must be >= 1 for a monitor, got {every}")
        self.records, self.every, self.thresholds = records, every, thresholds
        self.on = check_actions(on or {})
        self.active = open_findings(records.events)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def check(self, step: int) -> HealthReport:
        """Diagnose the records up to ``step`` and say what changed since the last check."""
        diagnosis = diagnose_records(truncate_records(self.records.records(), step), self.thresholds)
        found = {f.id: f for f in diagnosis.findings}
        # a finding folded into its cause (``also``) is not open on its own, nor reported twice
        report = HealthReport(step, diagnosis,
                              raised=[(f, action_for(f, self.on)) for fid, f in found.items()
                                      if fid not in self.active],
                              cleared=sorted(self.active - set(found)))
        self.active = set(found)
        return report


def check_records(report: HealthReport, seconds: float) -> list[dict[str, Any]]:
    """The records of one check: ``health_check`` (its time and every open finding's id), then one per raised
    or cleared finding (:meth:`HealthReport.events`)."""
    check = {"step": report.step, "event": CHECK_EVENT, "seconds": round(seconds, 6),
             "findings": [f.id for f in report.diagnosis.findings]}
    return [check, *report.events()]


def log_raised(report: HealthReport) -> None:
    """One warning line per newly raised finding whose action is not ``ignore``."""
    for finding, action in report.raised:
        if action != "ignore":
            log.warning("run health, step %d: %s %s: %s (what helps: %s)", report.step, finding.severity,
                        finding.id, finding.what, finding.knob)


def write_check(path: Path, report: HealthReport, seconds: float) -> None:
    """Append one check's records to a JSONL file and log its newly raised findings (the TRL and verl hooks)."""
    from meshrl.jsonl import JsonlWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = JsonlWriter(path)
    try:
        for record in check_records(report, seconds):
            writer.write(record)
    finally:
        writer.close()
    log_raised(report)


def stop_reason(report: HealthReport) -> str:
    """One line: why a ``stop`` action ended the run."""
    stops = [f for f, a in report.raised if a == "stop"]
    head = "; ".join(f"{f.severity} {f.id}: {f.what}" for f in stops)
    knobs = "; ".join(dict.fromkeys(f.knob for f in stops))
    return f"run health at step {report.step}: {head} (what helps: {knobs})"


def records_of_run(path: Path, config: dict[str, Any] | None = None) -> LiveRecords:
    """:class:`LiveRecords` of a meshrl run directory as it is now (an empty one for a fresh run)."""
    from meshrl.doctor.records import is_meshrl_run, load_meshrl, meshrl_config

    if is_meshrl_run(path):
        return LiveRecords(load_meshrl(path))
    notes: list[str] = []
    return LiveRecords(RunRecords(path=path, engine="meshrl", steps=[],
                                  config=meshrl_config(config or {}, notes), notes=notes))
