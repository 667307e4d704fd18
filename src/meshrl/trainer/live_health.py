"""``health.every``: meshrl doctor's checks during training, on the records the run has written so far.

Every ``health.every`` steps, after the step's records are written, :class:`meshrl.doctor.live.HealthMonitor`
runs the post-hoc doctor's checks and thresholds on the records up to that step (nothing later exists yet, and
the monitor reads only what the run's writers wrote: the verdict at step t is ``meshrl doctor`` on the records cut
at t). Each check writes ``{"event": "health_check", "step", "seconds", "findings"}`` to ``events.jsonl``; a
finding raised for the first time writes ``health_finding`` (what, evidence, the knob to turn) and acts as
``health.on`` says:

- ``warn``: a log line; ``ignore``: the record only;
- ``checkpoint``: a checkpoint of this step, whatever ``checkpoint.every`` says;
- ``stop``: the run ends (:class:`meshrl.trainer.failure.HealthStop`, one line naming the finding) without saving
  the unhealthy step. So that a healthy checkpoint exists to go back to, a run with any ``stop`` action saves a
  checkpoint at every check that raises no stop (``checkpoint.keep_last`` still prunes the older ones). The stop
  names, and points ``checkpoints/latest`` at, the newest kept checkpoint from before the finding's first step
  (:func:`meshrl.trainer.failure.healthy_checkpoint`), or says that none is kept.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

from meshrl.doctor.live import HealthMonitor, HealthReport, check_records, log_raised, records_of_run, stop_reason
from meshrl.doctor.thresholds import DEFAULT
from meshrl.jsonl import JsonlWriter
from meshrl.trainer.failure import HealthStop


class LiveHealth:
    """The run-health seam of the run loop: taps the run's record writers and checks after due steps."""

    def __init__(self, cfg: Any, run_dir: Path, config_record: dict[str, Any],
                 writers: dict[str, JsonlWriter]) -> None:
        health = cfg.health
        records = records_of_run(run_dir, config_record)
        self.monitor = HealthMonitor(records, every=health.every, on=health.on,
                                     thresholds=DEFAULT.with_overrides(health.thresholds))
        self.keeps_healthy = "stop" in self.monitor.on.values()
        for kind, writer in writers.items():
            writer.listeners.append(partial(records.add, kind))

    def after_step(self, trainer: Any, events: JsonlWriter) -> HealthReport | None:
        """Check when due: write the records, act on new findings; raise :class:`HealthStop` for ``stop``."""
        step = trainer.step_idx
        if not self.monitor.due(step):
            return None
        start = time.perf_counter()
        report = self.monitor.check(step)
        seconds = time.perf_counter() - start
        for record in check_records(report, seconds):
            events.write(record)
        log_raised(report)
        action = report.action()
        if action == "stop":
            onsets = [min(f.steps) for f, a in report.raised if a == "stop" and f.steps]
            raise HealthStop(stop_reason(report), onset=min(onsets) if onsets else None)
        if action == "checkpoint" or self.keeps_healthy:
            trainer.save()
        return report
