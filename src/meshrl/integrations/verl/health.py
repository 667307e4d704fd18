"""meshrl doctor's checks during a verl run (``+meshrl.health_every=N`` with ``trainer.v1.trainer_mode=meshrl``).

verl hands every step's metrics to its ``Tracking`` logger as one flat dict, after the trainer's
``_compute_metrics`` stage. meshrl's verl trainer (:mod:`meshrl.integrations.verl.trainer`) overrides that stage:
after verl's own metrics are computed it passes the dict to :class:`VerlHealth`, which keeps the rows, reads them
the way ``meshrl doctor`` reads verl's file-logger JSONL (:func:`meshrl.doctor.engines.verl_records`, the same
names) and every ``health_every`` steps runs the doctor's checks on the rows up to that step; so the verdict at
step t is the post-hoc doctor's on the log cut at t. The check's figures go back into the same dict, so they
reach every logger verl writes to: ``health/findings`` (open findings), ``health/alarms``, ``health/new``
(raised this step) and ``health/check_s``. Each check and each newly raised finding (what, evidence, the knob)
is a line of ``health_events.jsonl`` in ``meshrl.health_dir`` (default ``trainer.default_local_dir``).

Actions (``+meshrl.health_on.alarm=stop``, per finding id or severity; default: alarms and warnings warn):
``warn`` logs a line; ``checkpoint`` saves verl's checkpoint of this step; ``stop`` ends training after this
step. verl saves a step's checkpoint (``save_freq``) before its metrics exist, so a stop cannot keep that step
from being saved: the stop line names the last step the checks found healthy, whose checkpoint to resume from
when ``save_freq`` divides it. verl logs no completions to its metrics, so the checks on samples report
"not checked", as the post-hoc doctor does on a verl log.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from meshrl.doctor.engines import verl_records
from meshrl.doctor.live import HealthMonitor, LiveRecords, stop_reason, write_check


class VerlHealth:
    """The live checks over a verl run's metric dicts (module docstring)."""

    def __init__(self, every: int, on: dict[str, str], out_dir: str | Path) -> None:
        self.out = Path(out_dir)
        self.rows: list[dict[str, Any]] = []
        self.monitor = HealthMonitor(LiveRecords(verl_records(self.out, [], [])), every=every, on=on)
        self.healthy_step: int | None = None

    def after_step(self, step: int, metrics: dict[str, Any]) -> tuple[dict[str, float], str, str]:
        """(figures to add to the step's metrics, the action, the stop line or ""); the check runs when due."""
        self.rows.append({"step": step, "data": dict(metrics)})
        if not self.monitor.due(step):
            return {}, "ignore", ""
        start = time.perf_counter()
        self.monitor.records = LiveRecords(verl_records(self.out, self.rows, []))
        report = self.monitor.check(step)
        seconds = time.perf_counter() - start
        write_check(self.out / "health_events.jsonl", report, seconds)
        action = report.action()
        figures = {"health/findings": float(len(report.diagnosis.findings)),
                   "health/alarms": float(len(report.diagnosis.alarming())),
                   "health/new": float(len(report.raised)), "health/check_s": seconds}
        if action == "stop":
            healthy = "none" if self.healthy_step is None else f"step {self.healthy_step}"
            return figures, action, f"{stop_reason(report)}; last step the checks found healthy: {healthy}"
        self.healthy_step = step
        return figures, action, ""
