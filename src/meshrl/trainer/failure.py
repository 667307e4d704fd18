"""Failed runs: the checks that stop a run that can no longer learn, and the record a stopped run leaves.

Three ways a run goes on computing without learning anything:

- non-finite steps: a NaN or inf in the loss, the gradient or the log-probs skips the update (the weights
  stay as they were); after ``failure.max_nonfinite`` such steps in a row the run stops (:class:`NonFiniteAbort`).
- a dead policy: the gradient norm is exactly 0 although some advantages are not (each row's gradient is its
  advantage times the gradient of its log-probability, so only saturated weights give 0; ``optim.lr=1e6``
  does it in one step, leaving the output uniform: ``entropy/mean`` = ln V). After ``failure.max_stalled``
  such steps in a row the run stops (:class:`StalledRun`). Steps whose advantages are all 0 (every group
  scored alike) have a zero gradient by construction and neither count nor reset the tally.
- a broken scorer: every reward call of the step raised, timed out, or returned NaN, a non-number or a value
  outside [0, 1] (all counted in ``reward/errors`` / ``reward/timeouts``: a failed call scores 0, a value out of
  range is clamped), and the run would go on looking healthy but for those counters. After
  ``failure.max_reward_failed`` such steps in a row the run stops (:class:`RewardsFailed`), naming the
  scorer's last failure.

Whatever stops a run, :func:`record_stop` writes an ``events.jsonl`` record and, when the trainer holds the
state of a step boundary, a checkpoint of it (not after :class:`HealthStop`: that state is the unhealthy one).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

from meshrl.jsonl import DiskFullError
from meshrl.runs.checkpoint import CheckpointError
from meshrl.trainer.signals import RunInterrupted

log = logging.getLogger("meshrl")


class NonFiniteAbort(RuntimeError):
    """Raised after ``failure.max_nonfinite`` consecutive steps with a non-finite loss, gradient or log-prob."""


class StalledRun(RuntimeError):
    """Raised after ``failure.max_stalled`` consecutive steps with a zero gradient and non-zero advantages."""


class RewardsFailed(RuntimeError):
    """Raised after ``failure.max_reward_failed`` consecutive steps in which every reward call failed."""


class HealthStop(RuntimeError):
    """Raised when a finding of the live run-health checks asks for ``stop`` (``health.on``): the run ends at the
    last healthy checkpoint, the state of the unhealthy step is not saved.

    ``onset``: the first step whose records show the finding (None: unknown). Step ``s``'s records measure the
    policy the step started from, the one checkpoint ``s - 1`` holds, so the last healthy checkpoint is the newest
    one at or before ``onset - 2`` (:func:`healthy_checkpoint`); ``detail`` says which, or that none is kept."""

    def __init__(self, message: str, onset: int | None = None) -> None:
        super().__init__(message)
        self.onset, self.detail = onset, ""

    def __str__(self) -> str:
        return f"{super().__str__()}{self.detail}"


def healthy_checkpoint(trainer, err: HealthStop) -> Path | None:
    """The newest complete checkpoint of the run from before ``err``'s onset, which ``checkpoints/latest`` is moved
    to (so ``--resume`` continues from it); None when none is kept. Sets ``err.detail`` to say so either way."""
    from meshrl.jsonl import atomic_write_text
    from meshrl.runs.checkpoint import step_dirs, step_of

    if err.onset is None:
        return trainer.saved_path()
    root = trainer.run_dir / "checkpoints"
    kept = [p for p in step_dirs(root) if (p / "state.json").is_file()]
    healthy = [p for p in kept if step_of(p) <= err.onset - 2]
    later = ", ".join(p.name for p in kept if step_of(p) > err.onset - 2)
    if not healthy:
        err.detail = (f"; no checkpoint from before the finding is kept (seen in step {err.onset}'s records, which "
                      f"measure the policy after step {err.onset - 1}" + (f"; {later} hold the unhealthy policy"
                                                                         if later else "")
                      + "): start the run again, or keep more checkpoints (checkpoint.keep_last)")
        return None
    atomic_write_text(root / "latest", healthy[-1].name)
    if later:
        err.detail = f"; {later} already hold the unhealthy policy: --resume continues from {healthy[-1].name}"
    return healthy[-1]


class RunHealth:
    """Counts consecutive dead-policy and failed-reward steps and decides when a run must stop (module docstring)."""

    def __init__(self, max_nonfinite: int, max_stalled: int, vocab_size: int | None,
                 max_reward_failed: int = 0) -> None:
        self.max_nonfinite, self.max_stalled, self.max_reward_failed = max_nonfinite, max_stalled, max_reward_failed
        self.log_vocab = math.log(vocab_size) if vocab_size else None
        self.stalled_in_row = 0
        self.reward_failed_in_row = 0

    def verdict(self, metrics: dict[str, Any], bad_in_row: int, run_dir: Path,
                last_reward_failure: str | None = None) -> RuntimeError | None:
        """The error that must stop the run after the step with ``metrics`` (None: go on).
        ``last_reward_failure``: the scorer's last failure message, quoted when the rewards check stops the run."""
        step = metrics["step"]
        failed = self._rewards_failed(metrics)
        if failed is not None:
            return RewardsFailed(self._rewards_message(failed, step, last_reward_failure))
        if "skipped/nonfinite" in metrics and bad_in_row >= self.max_nonfinite:
            return NonFiniteAbort(
                f"{bad_in_row} consecutive steps had a non-finite loss, gradient or log-prob (last at step {step}, "
                f"failure.max_nonfinite={self.max_nonfinite}); aborting. Lower optim.lr or check the reward/model; "
                f"the last good state is saved in {run_dir / 'checkpoints'}")
        grad, adv = metrics.get("grad/norm"), metrics.get("adv/abs_mean", 0.0)
        if grad is None or not math.isfinite(grad):
            return None
        if grad > 0:
            self.stalled_in_row = 0
        elif adv > 0:
            self.stalled_in_row += 1
        if self.max_stalled > 0 and self.stalled_in_row >= self.max_stalled:
            return StalledRun(self._stalled_message(metrics, step))
        return None

    def _rewards_failed(self, metrics: dict[str, Any]) -> tuple[int, int, int] | None:
        """(errors, timeouts, rollouts) when this step makes ``max_reward_failed`` all-failed steps in a row."""
        scored = metrics.get("rollouts/count", 0.0)
        errors, timeouts = int(metrics.get("reward/errors", 0)), int(metrics.get("reward/timeouts", 0))
        if not scored:  # nothing was scored (an empty batch): the tally neither grows nor resets
            return None
        self.reward_failed_in_row = self.reward_failed_in_row + 1 if errors + timeouts >= scored else 0
        if self.max_reward_failed > 0 and self.reward_failed_in_row >= self.max_reward_failed:
            return errors, timeouts, int(scored)
        return None

    def _rewards_message(self, failed: tuple[int, int, int], step: int, last: str | None) -> str:
        errors, timeouts, rollouts = failed
        return (f"every reward call failed in {self.reward_failed_in_row} steps in a row (to step {step}; its "
                f"{rollouts} rollouts: {errors} errors, {timeouts} timeouts; a reward must be a number in [0, 1])"
                + (f"; last: {last}" if last else "") + ". Fix the scorer (reward.strict=true / "
                "--strict-rewards raises its first error with the traceback) or raise reward.timeout_s "
                f"(failure.max_reward_failed={self.max_reward_failed} sets this check, 0 turns it off)")

    def _stalled_message(self, metrics: dict[str, Any], step: int) -> str:
        entropy = metrics.get("entropy/mean")
        shape = ""
        if entropy is not None and self.log_vocab is not None:
            uniform = abs(entropy - self.log_vocab) <= 1e-3 * self.log_vocab
            shape = (f"; entropy/mean {entropy:.4f} = ln V {self.log_vocab:.4f}: the output is uniform" if uniform
                     else f"; entropy/mean {entropy:.4f}")
        return (f"the policy stopped learning: {self.stalled_in_row} steps in a row (to step {step}) had gradient "
                f"norm 0 although advantages were non-zero{shape}. The weights are saturated, typically by too "
                f"high a learning rate (optim.lr={metrics.get('lr')}); start again with a lower optim.lr "
                f"(failure.max_stalled={self.max_stalled} sets this check, 0 turns it off)")


def event_kind(err: BaseException) -> str:
    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    if isinstance(err, NonFiniteAbort):
        return "nonfinite_abort"
    if isinstance(err, StalledRun):
        return "stalled"
    if isinstance(err, HealthStop):
        return "health_stop"
    if isinstance(err, RewardsFailed):
        return "rewards_failed"
    return "error"


def record_stop(trainer, events, err: BaseException, stops) -> Path | None:
    """Write the ``events.jsonl`` record of a run stopped by ``err`` and, when the trainer is at a step
    boundary, a checkpoint; return the checkpoint that holds the run's state now (None if there is none)."""
    kind = event_kind(err)
    path = None
    if isinstance(err, CheckpointError):  # the save itself failed; the last checkpoint stands
        log.error("%s", err)
    elif isinstance(err, HealthStop):  # the step's state is the unhealthy one: the last healthy checkpoint stands
        path = healthy_checkpoint(trainer, err)
    elif trainer.dirty:
        log.warning("stopped in the middle of step %d: that state is no step boundary, so it is not saved; "
                    "a resume continues from the last checkpoint (step %s)", trainer.step_idx + 1,
                    trainer.saved_step)
    else:
        try:
            with stops.critical():
                path = trainer.save()
        except Exception as save_err:  # noqa: BLE001 - the original error is the one to report
            log.error("could not save a checkpoint after the run stopped: %s", save_err)
    record = {"step": trainer.step_idx, "event": kind, "checkpoint": None if path is None else str(path)}
    if kind == "interrupted" and isinstance(err, RunInterrupted):
        record["signal"] = err.signum
    elif kind != "interrupted":
        record["error"] = f"{type(err).__name__}: {err}"
    if path is not None:
        with contextlib.suppress(AttributeError):  # for the CLI's one-line message
            err.checkpoint = path
    try:
        events.write(record)
    except (OSError, DiskFullError) as write_err:  # e.g. the full disk that stopped the run: report that, not this
        log.error("could not record the stop in events.jsonl: %s", write_err)
    if kind == "interrupted" and path is not None:
        log.warning("interrupted: checkpoint saved at %s; continue with --resume %s", path, trainer.run_dir)
    return path
