"""The run loop: build the trainer, run its steps, write their records and checkpoints, stop cleanly.

The step itself is :class:`meshrl.trainer.step.Trainer` (read it first); this module is what turns steps into a
run directory: ``metrics.jsonl``, ``samples.jsonl``, ``events.jsonl``, ``evals.jsonl``, checkpoints every
``checkpoint.every`` steps, the doctor's checks every ``health.every`` steps (:mod:`meshrl.trainer.live_health`),
and on SIGTERM / Ctrl-C a finished step saved before the run stops (``docs/reliability.md``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from meshrl.cpu import cpu_info
from meshrl.cpu import describe as describe_cpu
from meshrl.jsonl import JsonlWriter
from meshrl.progress import progress_bar
from meshrl.provenance import code_version
from meshrl.provenance import describe as describe_code
from meshrl.runs.run_dir import prepare_fresh, prepare_resume, rewind_records, write_config
from meshrl.trainer.config import RunConfig, config_record
from meshrl.trainer.failure import NonFiniteAbort, RewardsFailed, StalledRun, record_stop
from meshrl.trainer.history import StepHistory
from meshrl.trainer.live_health import LiveHealth
from meshrl.trainer.periodic_eval import write_summary
from meshrl.trainer.signals import RunInterrupted, StopRequests
from meshrl.trainer.step import Trainer
from meshrl.trainer.trackers import Trackers

__all__ = ["NonFiniteAbort", "RewardsFailed", "StalledRun", "StepHistory", "Trainer", "train"]

log = logging.getLogger("meshrl")


# ---------------------------------------------------------------------- entry point
def train(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False) -> StepHistory:
    """Run (or resume) training into ``run_dir``; return the metrics of the steps run now (a read-only sequence of
    dicts read back from ``metrics.jsonl``: :class:`meshrl.trainer.history.StepHistory`, constant memory).

    SIGTERM / Ctrl-C finish the step, save it and raise :class:`RunInterrupted`; see ``docs/reliability.md``.
    """
    run_dir = Path(run_dir)
    (prepare_resume if resume else prepare_fresh)(run_dir)
    code = code_version()  # git runs before the trainer starts any thread or engine (vLLM's hold locks)
    trainer = Trainer(cfg, run_dir)
    if resume:
        try:
            trainer.restore()
        except BaseException:  # e.g. a checkpoint of another rollout.max_staleness: hand back what it holds
            trainer.close()
            raise
        rewind_records(run_dir, trainer.step_idx)
    record = config_record(trainer.cfg, trainer.task)  # the trainer's: a correction a setting turned on shows
    write_config(record, run_dir)
    writers = {n: JsonlWriter(run_dir / f"{n}.jsonl") for n in ("metrics", "samples", "events", "evals")}
    # the code and the CPU of this start (a resumed run's later steps may come from others): with the seed and the
    # settings, what a run's numbers are a function of
    machine = cpu_info()
    writers["events"].write({"step": trainer.step_idx, "event": "run_start", "resumed": resume, "code": code,
                             "machine": machine})
    log.info("%s at step %d: %s; %s", "resuming" if resume else "starting", trainer.step_idx, describe_code(code),
             describe_cpu(machine))
    health = LiveHealth(cfg, run_dir, record, writers) if cfg.health.every else None
    trackers = Trackers(cfg.log.report_to, run_dir, cfg.to_dict())
    history = StepHistory(run_dir / "metrics.jsonl", trainer.step_idx)
    with StopRequests() as stops:
        stopping = False
        try:
            if trainer.evaluator and cfg.eval.at_start and trainer.step_idx == 0:  # the starting policy's figure
                writers["evals"].write({"step": 0, **trainer.evaluator(0)})
            with progress_bar("train", cfg.steps, cfg.log.progress, start=trainer.step_idx) as advance:
                while trainer.step_idx < cfg.steps and not stops.requested:
                    metrics = _step_and_record(trainer, writers, trackers)
                    history.append(metrics)
                    failure = trainer.health.verdict(metrics, trainer.bad_in_row, run_dir,
                                                     trainer.last_reward_failure())
                    if failure is not None:
                        raise failure
                    if health is not None:
                        with stops.critical():
                            health.after_step(trainer, writers["events"])
                    if trainer.step_idx % cfg.checkpoint.every == 0 or trainer.step_idx == cfg.steps:
                        with stops.critical():
                            trainer.save()
                    advance(description=f"reward {metrics.get('reward/mean', float('nan')):.3f} "
                                        f"acc {metrics.get('acc/mean', float('nan')):.3f}")
            if stops.requested:
                raise RunInterrupted(stops.signum)
        except BaseException as err:
            stopping = True
            record_stop(trainer, writers["events"], err, stops)
            raise
        finally:
            _close_run(trainer, writers, trackers, run_dir, stopping=stopping)
    return history


def _close_run(trainer: Trainer, writers: dict[str, JsonlWriter], trackers: Trackers, run_dir: Path, *,
               stopping: bool) -> None:
    """Close everything the run holds and write its summary, each even when an earlier one fails.

    While an error is stopping the run, a failure here is logged, never raised: it is most often the same cause
    again (a full disk fails the record writers' last flush too), and raised from ``finally`` it would replace the
    first, clear error with a traceback. Otherwise the first failure is raised once all are closed."""
    first: Exception | None = None
    closers = [trainer.close, *(w.close for w in writers.values()), trackers.close, lambda: write_summary(run_dir)]
    for close in closers:
        try:
            close()
        except Exception as err:  # noqa: BLE001 - reported below, after the others are closed
            if stopping:
                log.warning("while the run stopped, closing it failed too: %s", err)
            elif first is None:
                first = err
    if first is not None:
        raise first


def _step_and_record(trainer: Trainer, writers: dict[str, JsonlWriter], trackers: Trackers) -> dict[str, Any]:
    """One step, its held-out evaluation when due, and its records; the trainer is at a boundary after it."""
    cfg = trainer.cfg
    metrics = trainer.step()
    if trainer.evaluator and (trainer.step_idx % cfg.eval.every == 0 or trainer.step_idx == cfg.steps):
        ev = trainer.evaluator(trainer.step_idx)
        metrics.update(ev)
        writers["evals"].write({"step": trainer.step_idx, **ev})
    _write_samples(writers["samples"], trainer, metrics["step"])
    writers["metrics"].write(metrics)
    trackers.log(metrics, metrics["step"])
    for event in trainer.pending_events:
        writers["events"].write(event)
    trainer.pending_events.clear()
    if "skipped/nonfinite" in metrics:
        writers["events"].write({"step": metrics["step"], "event": "nonfinite_skip"})
    trainer.end_step()
    return metrics


def _write_samples(writer: JsonlWriter, trainer: Trainer, step: int) -> None:
    """Log ``log.samples_per_step`` random rollouts of the step (-1: all of them, e.g. for ``meshrl census``)."""
    data = trainer.last_data
    want = trainer.cfg.log.samples_per_step
    k = len(data) if want < 0 else min(want, len(data))
    if k == 0:
        return
    picks = torch.randperm(len(data), generator=torch.Generator().manual_seed(step))[:k].tolist()
    for i in sorted(picks):
        p, strategy = data.problems[i], data.strategy_ids[i]
        row = {"step": step, "problem_id": p.id, "prompt": trainer.task.format_prompt(p),
               "completion": data.texts[i], "reward": float(data.rewards[i]), "score": data.scores[i],
               "advantage": float(data.advantages[i]), "truncated": data.truncated[i], "strategy": strategy,
               "group_id": data.group_ids[i]}
        if strategy >= 0:  # the coach text the rollout was conditioned on, so it can be re-scored as sampled
            row.update(trainer.sampler.conditioning(p, strategy))
        row.update(_exact_tokens(data, i))
        if i < len(data.policy_versions):  # lagged rollouts: the weights (trainer step) that sampled the row
            row["policy_version"] = data.policy_versions[i]
        label = _strategy_label(trainer.task, data, i)
        if label is not None:
            row["strategy_label"] = label
        writer.write(row)


def _exact_tokens(data: Any, i: int) -> dict[str, Any]:
    """An episode's exact ids and model-token mask (``meshrl census`` scores the tokens the model sampled, never a
    re-tokenised transcript with the tool output in it); nothing for a single-turn rollout."""
    if not data.response_masks:
        return {}
    response = list(data.response_ids[i])
    mask = data.model_mask(i)
    return {"prompt_ids": list(data.prompt_ids[i]), "response_ids": response,
            "model_mask": list(mask) if mask is not None else [1] * len(response)}


def _strategy_label(task: Any, data: Any, i: int) -> str | None:
    """The task parser's strategy label of row ``i`` (a procedure; the tool pattern of an episode), None without
    a parser. Episodes are labelled from their transcript (``label_texts``), never from the text with the tool
    output in it."""
    if not getattr(task, "strategies", ()):
        return None
    if data.label_texts:
        return task.label_strategy(data.label_texts[i]) if len(data.label_texts) == len(data) else None
    return None if data.response_masks else task.label_strategy(data.texts[i])
