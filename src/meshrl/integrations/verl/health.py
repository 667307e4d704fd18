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
when ``save_freq`` divides it. The checks on completions read verl's generation dumps (``trainer.rollout_data_dir``, or
``meshrl.health_samples_dir``): verl writes a step's dump after its metrics, so the check at step t reads the
dumps of the steps before t (the post-hoc doctor, ``meshrl doctor LOG --samples DIR``, reads them all).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from meshrl.doctor.completions import VERL_FILE, verl_dump_file
from meshrl.doctor.engines import verl_records
from meshrl.doctor.live import HealthMonitor, LiveRecords, stop_reason, write_check


class VerlHealth:
    """The live checks over a verl run's metric dicts (module docstring)."""

    def __init__(self, every: int, on: dict[str, str], out_dir: str | Path,
                 samples_dir: str | Path | None = None) -> None:
        self.out = Path(out_dir)
        self.samples_dir = Path(samples_dir) if samples_dir else None
        self.dumps: dict[str, list[dict[str, Any]]] = {}  # dump file name -> its samples (read once)
        self.rows: list[dict[str, Any]] = []
        self.monitor = HealthMonitor(LiveRecords(verl_records(self.out, [], [])), every=every, on=on)
        self.healthy_step: int | None = None

    def after_step(self, step: int, metrics: dict[str, Any]) -> tuple[dict[str, float], str, str]:
        """(figures to add to the step's metrics, the action, the stop line or ""); the check runs when due."""
        self.rows.append({"step": step, "data": dict(metrics)})
        if not self.monitor.due(step):
            return {}, "ignore", ""
        start = time.perf_counter()
        self.monitor.records = LiveRecords(verl_records(self.out, self.rows, [], samples=self._samples(step)))
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

    def _samples(self, step: int) -> list[dict[str, Any]]:
        """The generation dumps of the steps before ``step`` (verl writes a step's dump after its metrics, in a
        background thread: the previous step's file is read again at every check until a later one exists, so
        a file caught mid-write is never kept)."""
        if self.samples_dir is None or not self.samples_dir.is_dir():
            return []
        recent: list[dict[str, Any]] = []
        for path in sorted(self.samples_dir.glob("*.jsonl")):
            if not VERL_FILE.match(path.name) or int(path.stem) >= step or path.name in self.dumps:
                continue
            if int(path.stem) < step - 1:
                self.dumps[path.name] = verl_dump_file(path, [])
            else:
                recent += verl_dump_file(path, [])
        return sorted([*(s for rows in self.dumps.values() for s in rows), *recent], key=lambda s: s["step"])
