"""Lagged rollouts against fresh ones on SmolLM2-135M-Instruct, as pre-registered in preregistration.md: the runs
(resumable, two at a time), their pack.

docs/training.md ("Asynchronous rollouts") measures what ``rollout.max_staleness = k`` costs and buys in speed, not
what it does to the accuracy GRPO reaches; this asks that at k = 2 with the default correction (``tis``). The data and
the task spec are the real-model experiment's (:mod:`experiments.real_model.experiment`, A = 20 from its pilot), so
the two experiments share a task. Every run is ``meshrl train`` with :func:`run_overrides`, in a spawned worker with
one torch thread (the collapse testbed's :func:`~experiments.collapse_testbed.experiment.worker_pool`: the workers
die with the parent), under the testbed's directory lock. A finished run (``done.json`` for at least the asked
steps) is skipped, a stopped one resumes from its last checkpoint, so ``run`` can be stopped and started again. The
pack keeps what ``analysis.py`` reads: per run its config, held-out evaluations, the kept per-step metrics and the
summary, not the weights.
"""

from __future__ import annotations

import gzip
import json
import logging
import sys
import time
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from experiments.real_model.experiment import task_spec, write_data
from meshrl.jsonl import atomic_write_text

log = logging.getLogger("meshrl")

#: the arms' own keys: k = 2 lags every batch by two optimiser steps (one mini-batch, one epoch), corrected by TIS;
#: ``inline`` samples the same batches as the forked sampler, bit for bit, without a second process
ARMS: dict[str, tuple[str, ...]] = {
    "k0": ("rollout.max_staleness=0",),
    "k2": ("rollout.max_staleness=2", "rollout.staleness_correction=tis", "rollout.sampler_process=inline"),
}
#: the per-step metrics the pack keeps (besides ``step``)
KEPT_METRICS = ("reward/mean", "acc/mean", "len/response_mean", "time/step_s", "lag/staleness_mean",
                "lag/staleness_max", "rollout_corr/ess", "rollout_corr/frac_truncated", "rollout_corr/weight_max")
#: settings a rerun into the same directory may change: more steps continue the runs (constant lr after warm-up)
CHANGEABLE = ("steps",)
#: settings that choose which runs a directory holds, not what a run is: packs that differ only in these merge
RUN_SELECTION = ("seeds", "arms")


@dataclass(frozen=True)
class Settings:
    """The pre-registered sizes (defaults), or a plumbing check (tests: ``model="tiny"`` and ``extra``)."""

    model: str = "smollm2-135m"
    high: int = 20  # A: the real-model pilot's choice (experiments/real_model/data/pilot.json)
    problems: int = 1000
    steps: int = 100
    prompts_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 32
    lr: float = 1e-5
    warmup_steps: int = 5
    eval_every: int = 25
    eval_limit: int = 100
    eval_n: int = 4
    checkpoint_every: int = 25
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[str, ...] = ("k0", "k2")
    extra: tuple[str, ...] = ()  # more ``meshrl train`` keys, last (tests: a tiny task)


def data_path(s: Settings, out: Path) -> Path:
    """The addition problems, absolute: a run's config names them, and a rerun may start from another directory."""
    return out.resolve() / f"add_{s.high}.jsonl"


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / arm / f"seed_{seed}"


def run_overrides(s: Settings, arm: str, seed: int, data: Path) -> list[str]:
    """The ``meshrl train`` keys of one run (preregistration.md, "Protocol")."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    return [f"model={s.model}", f"task={task_spec(data)}", f"steps={s.steps}", f"seed={seed}",
            f"rollout.prompts_per_step={s.prompts_per_step}", f"rollout.group_size={s.group_size}",
            f"rollout.max_new_tokens={s.max_new_tokens}", "rollout.temperature=1.0", f"optim.lr={s.lr}",
            f"optim.warmup_steps={s.warmup_steps}", "optim.schedule=constant", "train.ppo_epochs=1",
            "train.mini_batches=1", "train.dtype=float32", f"eval.every={s.eval_every}", "eval.at_start=true",
            f"eval.limit={s.eval_limit}", f"eval.n={s.eval_n}", "eval.temperature=1.0",
            f"checkpoint.every={s.checkpoint_every}", "checkpoint.keep_last=1", "log.progress=false",
            *ARMS[arm], *s.extra]


def finished_steps(d: Path) -> int:
    """The steps a finished run reached (``done.json``), 0 for one never finished; a run the trainer ended counts as
    finished at any number of steps (it is a result, never resumed: a resume would reset the failure counters)."""
    done = d / "done.json"
    if not done.is_file():
        return 0
    record = json.loads(done.read_text())
    return sys.maxsize if record.get("aborted") else int(record["steps"])


def run_one(s: Settings, arm: str, seed: int, data: Path, d: Path) -> dict[str, Any]:
    """Train one (arm, seed) into ``d``, from its last checkpoint when it has one; ``done.json`` last, with the CPU
    that made the run and, for a run the trainer ended (non-finite, stalled, a health stop, failed rewards), the
    step and reason: such a run is a result, recorded and not resumed (preregistration.md, "Amendments")."""
    from experiments._runs import abort_reason, made_by, trainer_stops
    from meshrl.runs.checkpoint import latest_checkpoint
    from meshrl.trainer import load_config, train

    t0 = time.perf_counter()
    cfg = load_config(overrides=run_overrides(s, arm, seed, data))
    ckpt = latest_checkpoint(d) if d.exists() else None
    start = json.loads((ckpt / "state.json").read_text())["step"] if ckpt else 0
    log.info("lagged accuracy: %s seed %d (%s)", arm, seed, f"resuming at step {start}" if ckpt else "starting")
    aborted = None
    if start < s.steps:
        try:
            train(cfg, d, resume=ckpt is not None)
        except trainer_stops() as err:
            aborted = abort_reason(err, d)
            log.warning("lagged accuracy: %s seed %d ended early: %s", arm, seed, aborted)
    record = {"arm": arm, "seed": seed, "steps": s.steps, "from_step": start, "seconds": time.perf_counter() - t0,
              **made_by(), "aborted": aborted}
    atomic_write_text(d / "done.json", json.dumps(record))
    return record


def write_settings(out: Path, s: Settings) -> None:
    """``out/settings.json``; a directory started with other settings (but :data:`CHANGEABLE`) is refused."""
    path, now = out / "settings.json", json.loads(json.dumps(asdict(s)))
    if path.is_file():
        before = json.loads(path.read_text())
        differ = sorted(k for k in set(before) | set(now) if k not in CHANGEABLE and before.get(k) != now.get(k))
        if differ:
            raise ValueError(f"{out} holds runs made with other settings ({', '.join(differ)}); use another --out")
    path.write_text(json.dumps(now, indent=1))


def run_all(s: Settings, out: Path, workers: int = 2) -> list[dict[str, Any]]:
    """Every (seed, arm) run not finished to ``s.steps``, ``workers`` at a time (spawned, one thread each); the
    records of the runs made now. Seed-major order: a seed's two arms run side by side."""
    from experiments.collapse_testbed.experiment import experiment_lock, worker_pool

    unknown = [a for a in s.arms if a not in ARMS]
    if unknown or workers < 1:
        raise ValueError(f"unknown arm(s) {unknown}" if unknown else f"workers must be >= 1, got {workers}")
    out.mkdir(parents=True, exist_ok=True)
    with experiment_lock(out):
        write_settings(out, s)
        data = write_data(data_path(s, out), s.high, s.problems)
        jobs = [(a, seed) for seed in s.seeds for a in s.arms if finished_steps(run_dir(out, a, seed)) < s.steps]
        if not jobs:
            return []
        with worker_pool(min(workers, len(jobs))) as pool:
            futures = [pool.submit(run_one, s, a, seed, data, run_dir(out, a, seed)) for a, seed in jobs]
            records = [fut.result() for fut in as_completed(futures)]
    return sorted(records, key=lambda r: (r["seed"], r["arm"]))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    from meshrl.jsonl import read_jsonl

    return read_jsonl(path) if path.is_file() else []


def collect(out: Path) -> dict[str, Any]:
    """What the analysis reads, from a run directory: the settings and every finished run's config (text),
    evaluations, kept metrics, summary and ``done.json``."""
    if not (out / "settings.json").is_file():
        raise ValueError(f"{out}: no settings.json; not a lagged_accuracy run directory")
    runs: dict[str, Any] = {}
    for done in sorted(out.glob("runs/*/seed_*/done.json")):
        d = done.parent
        metrics = [{k: r[k] for k in ("step", *KEPT_METRICS) if k in r} for r in _jsonl(d / "metrics.jsonl")
                   if "step" in r]
        summary = d / "summary.json"
        runs[f"{d.parent.name}/{d.name}"] = {
            "config": (d / "config.yaml").read_text(), "evals": _jsonl(d / "evals.jsonl"), "metrics": metrics,
            "summary": json.loads(summary.read_text()) if summary.is_file() else {},
            "done": json.loads(done.read_text())}
    return {"settings": json.loads((out / "settings.json").read_text()), "runs": runs}


def pack(out: Path, dest: Path) -> Path:
    """:func:`collect` as gzipped JSON at ``dest``, added to the runs ``dest`` already holds (made on another machine:
    a session's machine may not outlive the grid) when the settings agree but for the run selection and the steps
    (the endpoint is step 100 whatever they say); a run in both is taken from ``out``. Refused when no run has
    finished, or ``dest`` holds another experiment's runs (by name)."""
    data = collect(out)
    if not data["runs"]:
        raise ValueError(f"{out}: no finished run to pack")
    if dest.is_file():
        data = merged(read_pack(dest), data, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(dest, "wt") as fh:
        json.dump(data, fh, sort_keys=True)
    return dest


def merged(old: dict[str, Any], new: dict[str, Any], where: Path) -> dict[str, Any]:
    """``new``'s runs added to ``old``'s; the run selection becomes the union, the steps the larger."""
    free = (*RUN_SELECTION, *CHANGEABLE)
    differ = sorted(k for k in set(old["settings"]) | set(new["settings"])
                    if k not in free and old["settings"].get(k) != new["settings"].get(k))
    if differ:
        raise ValueError(f"{where}: holds runs made with other settings ({', '.join(differ)}); pack into another file")
    settings = {**new["settings"], "seeds": sorted({*old["settings"]["seeds"], *new["settings"]["seeds"]}),
                "arms": [a for a in ARMS if a in {*old["settings"]["arms"], *new["settings"]["arms"]}],
                "steps": max(old["settings"]["steps"], new["settings"]["steps"])}
    return {"settings": settings, "runs": {**old["runs"], **new["runs"]}}


def read_pack(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: no such pack; make one with `python -m experiments.lagged_accuracy pack`")
    with gzip.open(path, "rt") as fh:
        return json.load(fh)
