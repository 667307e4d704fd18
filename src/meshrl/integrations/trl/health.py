"""``HealthCallback``: meshrl doctor's checks during a TRL run, on the log entries it has so far.

Every ``every`` logged optimiser steps (``on_log``), the callback reads ``TrainerState.log_history`` the way
``meshrl doctor OUTPUT_DIR`` reads ``trainer_state.json`` (the same mapping to meshrl's names,
:func:`meshrl.doctor.engines.trl_records`) and runs the same checks and thresholds on the entries up to the
current step; so the verdict at step t is the post-hoc doctor's on the log cut at t. The settings the checks use
(``max_completion_length``, ``num_generations``, the learning rate, warm-up, ``max_steps``) are written once to
``OUTPUT_DIR/training_args.json``, where the post-hoc doctor reads them too.

Each check appends ``{"event": "health_check", ...}`` and, per finding raised for the first time,
``health_finding`` (what, evidence, the knob) to ``OUTPUT_DIR/health_events.jsonl``, and acts as ``on`` says
(per finding id or severity; default: alarms and warnings ``warn``): ``warn`` logs a line, ``checkpoint`` sets
``control.should_save``, ``stop`` sets ``control.should_training_stop`` without saving that step; with any
``stop`` action, every check that raises no stop saves a checkpoint, so the last healthy step is on disk.
The checks on completions (garbled output) need them: attached to the trainer (``HealthCallback(...).attach(
trainer)``), the callback takes each logged step's completions from the trainer's completion log, the same rows
``log_completions=True`` writes to ``OUTPUT_DIR/completions/completions_<step>.parquet`` right after the log
callbacks (which the post-hoc doctor reads); added with ``trainer.add_callback`` only, it reads those files, so
it sees a step's completions from the next check on::

    HealthCallback(every=5, on={"alarm": "stop"}).attach(trainer)
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from meshrl.doctor.completions import trl_completions, trl_sample
from meshrl.doctor.engines import TRL_SETTINGS, trl_records
from meshrl.doctor.live import HealthMonitor, LiveRecords, check_actions, stop_reason, write_check
from meshrl.doctor.thresholds import DEFAULT

log = logging.getLogger("meshrl")



class HealthCallback(TrainerCallback):
    """The doctor's checks every ``every`` logged steps of a TRL trainer (module docstring).

    Args:
        every: check on every ``every``-th logged step (>= 1).
        on: action per finding id or severity: ``ignore``, ``warn``, ``checkpoint``, ``stop``.
        thresholds: :class:`meshrl.doctor.Thresholds` fields to override, by name.
    """

    def __init__(self, every: int = 1, *, on: dict[str, str] | None = None,
                 thresholds: dict[str, Any] | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"HealthCallback every must be an integer >= 1, got {every!r}")
        self.every, self.on = every, check_actions(on or {}, where="HealthCallback on")
        self.thresholds = DEFAULT.with_overrides(thresholds or {})
        self.monitor: HealthMonitor | None = None  # built at on_train_begin, its records replaced at each check
        self.config: dict[str, Any] = {}  # the settings the checks use, in meshrl's names
        self.out: Path | None = None
        self.last_report = None
        self.checked_step: int | None = None
        self.taken_step: int | None = None
        self.trainer: Any = None
        self.samples: list[dict[str, Any]] = []  # the attached trainer's logged completions, per checked step

    def attach(self, trainer: Any) -> HealthCallback:
        """Read each logged step's completions from ``trainer`` (and add the callback to it)."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        self.out = Path(args.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        theirs = {field: _plain_number(getattr(args, field, None)) for field in TRL_SETTINGS.values()}
        path = self.out / "training_args.json"
        if not path.exists():  # one the user saved is theirs: the post-hoc doctor reads it as it is
            path.write_text(json.dumps(theirs, indent=1) + "\n")
        self.config = {ours: theirs[field] for ours, field in TRL_SETTINGS.items()}
        if self.config["steps"] is None:  # as the post-hoc reader: the file's max_steps, else the state's
            self.config["steps"] = getattr(state, "max_steps", None)
        self.monitor = HealthMonitor(LiveRecords(trl_records(self.out, [], self.config, [])), every=self.every,
                                     on=self.on, thresholds=self.thresholds)

    def on_log(self, args, state, control, logs=None, **kwargs):
        step = int(state.global_step)
        # one check per step: the Trainer logs its end-of-training summary (train_runtime, ...) at the last step
        # again, and no check reads those keys
        if self.monitor is None:
            return
        if step != self.taken_step:  # every logged step, once, as log_completions writes them
            self._take_completions(step)
            self.taken_step = step
        if step % self.every or step == self.checked_step:
            return
        self.checked_step = step
        self.monitor.records = self._records(state)
        start = time.perf_counter()
        report = self.monitor.check(step)
        seconds = time.perf_counter() - start
        write_check(self.out / "health_events.jsonl", report, seconds)
        self.last_report = report
        action = report.action()
        if action == "stop":
            log.warning("%s; the last healthy checkpoint is in %s", stop_reason(report), self.out)
            control.should_training_stop, control.should_save = True, False
        elif action == "checkpoint" or "stop" in self.on.values():
            control.should_save = True

    def _take_completions(self, step: int) -> None:
        """Keep the attached trainer's completions of this logged step: the rows TRL's ``log()`` writes to
        ``completions_<step>.parquet`` just after the log callbacks."""
        logs = getattr(self.trainer, "_logs", None) if self.trainer is not None else None
        if logs is None:
            return
        columns = {"prompt": list(logs["prompt"]), "completion": list(logs["completion"]),
                   **{k: list(v) for k, v in logs["rewards"].items()}, **{k: list(v) for k, v in logs["extra"].items()},
                   "advantage": list(logs["advantages"])}
        rows = [{k: v[i] for k, v in columns.items() if i < len(v)} for i in range(len(columns["completion"]))]
        self.samples += [s for row in rows if (s := trl_sample({"step": step, **row}, step)) is not None]

    def _records(self, state) -> LiveRecords:
        notes: list[str] = []
        samples = self.samples if self.trainer is not None else trl_completions(self.out, notes)
        return LiveRecords(trl_records(self.out, list(state.log_history), dict(self.config), notes, samples=samples))


def _plain_number(value: Any) -> Any:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None
