"""GRPO and forking tokens on SmolLM2-135M-Instruct, as pre-registered in preregistration.md: the data, the pilot
that fixes the task's operand range, the runs (resumable), the step-0 evaluations and the pack.

Every run is ``meshrl train`` with :func:`run_overrides`; a run resumes from its last checkpoint, and a finished one
(``done.json``) is skipped, so the command can be stopped and started again. The pack keeps what the analysis reads:
per run the held-out evaluations and the per-step metrics it needs (MEI, reward, time) and the CPU that made it, not
the weights. A run takes hours and a machine may not outlive it, so the grid can be made a few runs at a time on
different machines: ``pack`` adds the finished runs of ``out`` to an existing pack of the same experiment.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshrl.jsonl import atomic_write_text

log = logging.getLogger("meshrl")

ARMS: dict[str, list[str]] = {"grpo": ["recipe=grpo"], "fork": ["recipe=grpo", "plugins.fork.enabled=true"]}
PILOT_RANGES = (20, 9, 99)  # A = 20 first; below 0.10 -> 9, above 0.40 -> 99 (preregistration.md)
PILOT_BAND = (0.10, 0.40)
#: the pilot made once, before any run (preregistration.md): every machine's runs use it, none makes its own
COMMITTED_PILOT = Path(__file__).resolve().parent / "data" / "pilot.json"
#: the settings the pilot's figure depends on
PILOT_SETTINGS = ("model", "problems", "eval_n", "max_new_tokens", "extra")
#: the per-step metrics the pack keeps (besides ``step``): MEI, reward, accuracy, timing, and what the table
#: describes post hoc (replies, entropy, what the forking-token plug-in left untrained)
KEPT_METRICS = ("mei/query", "mei/directions", "reward/mean", "acc/mean", "time/step_s", "len/response_mean",
                "eval/mean@1", "len/truncated_frac", "entropy/mean", "fork/rows_unkept", "fork/rows_adv_pos",
                "fork/rows_unkept_adv_pos", "fork/first_kept")


@dataclass(frozen=True)
class Settings:
    """The pre-registered sizes (defaults) or a smaller plumbing check (tests)."""

    model: str = "smollm2-135m"
    steps: int = 150
    prompts_per_step: int = 8
    group_size: int = 16
    max_new_tokens: int = 64
    lr: float = 5e-6
    warmup_steps: int = 10
    eval_every: int = 10
    eval_n: int = 4
    problems: int = 1000
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[str, ...] = ("grpo", "fork")
    threads: int = 1
    extra: tuple[str, ...] = field(default=())  # more ``meshrl train`` keys (tests: a tiny model)


def write_data(path: Path, high: int, n: int = 1000) -> Path:
    """``n`` problems "What is a + b?" with a, b uniform on 1..``high`` from ``random.Random(0)``."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, high), rng.randint(1, high)
        rows.append(json.dumps({"problem": f"What is {a} + {b}?", "answer": a + b}))
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(rows) + "\n"
    if not path.is_file() or path.read_text() != text:  # atomic: another call's run may be reading it
        atomic_write_text(path, text)
    return path


def task_spec(data: Path) -> str:
    return f"jsonl:{data}?kind=last_number&eval_fraction=0.1"


def run_overrides(s: Settings, arm: str, seed: int, data: Path) -> list[str]:
    """The ``meshrl train`` keys of one run (preregistration.md, "Model, task, settings")."""
    return [f"model={s.model}", f"task={task_spec(data)}", f"steps={s.steps}", f"seed={seed}",
            f"rollout.prompts_per_step={s.prompts_per_step}", f"rollout.group_size={s.group_size}",
            f"rollout.max_new_tokens={s.max_new_tokens}", "rollout.temperature=1.0", f"optim.lr={s.lr}",
            f"optim.warmup_steps={s.warmup_steps}", "train.ppo_epochs=1", "train.mini_batches=1",
            f"eval.every={s.eval_every}", f"eval.n={s.eval_n}", "eval.limit=0", "eval.temperature=1.0",
            "diag.mei.every=1", "health.every=5", f"checkpoint.every={s.eval_every}", "checkpoint.keep_last=1",
            "log.progress=false", *ARMS[arm], *s.extra]


def held_out_accuracy(s: Settings, data: Path, seed: int, out: Path) -> float:
    """Step 0: the base model on the run's held-out split (the seed's), ``eval_n`` samples at T = 1."""
    from meshrl.evaluation import EvalConfig, run_eval

    cfg = EvalConfig(model=s.model, data=task_spec(data), split="eval", n=s.eval_n, ks=[s.eval_n], limit=None,
                     max_new_tokens=s.max_new_tokens, temperature=1.0, seed=seed)
    # mean@n averages all n samples of a problem: the training loop's eval/mean@1 (periodic_eval.py)
    return float(run_eval(cfg, out, progress=False)["overall"][f"mean@{s.eval_n}"])


def pilot(s: Settings, out: Path) -> dict[str, Any]:
    """Fix the operand range A (preregistration.md): the base model on A = 20, then 9 or 99 if outside the band.
    Kept in ``out/pilot.json``; a second call reads it. With the pre-registered settings the committed pilot is
    used (copied into ``out``): the choice was made once, and another machine's rounding must not remake it."""
    path = out / "pilot.json"
    if path.is_file():
        return json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    preregistered = Settings()
    if COMMITTED_PILOT.is_file() and all(getattr(s, k) == getattr(preregistered, k) for k in PILOT_SETTINGS):
        atomic_write_text(path, COMMITTED_PILOT.read_text())
        log.info("real model: the committed pilot (%s)", COMMITTED_PILOT)
        return json.loads(path.read_text())
    tried: dict[int, float] = {}
    high = PILOT_RANGES[0]
    acc = held_out_accuracy(s, write_data(out / f"add_{high}.jsonl", high, s.problems), 0, out / "pilot" / str(high))
    tried[high] = acc
    if not PILOT_BAND[0] <= acc <= PILOT_BAND[1]:
        high = PILOT_RANGES[1] if acc < PILOT_BAND[0] else PILOT_RANGES[2]
        data = write_data(out / f"add_{high}.jsonl", high, s.problems)
        tried[high] = held_out_accuracy(s, data, 0, out / "pilot" / str(high))
    result = {"tried": {str(k): v for k, v in tried.items()}, "chosen": high}
    atomic_write_text(path, json.dumps(result, indent=1))
    return result


def run_all(s: Settings, out: Path) -> None:
    """The pilot, then every (seed, arm) run and its step-0 evaluation, skipping what is done."""
    import torch

    from experiments._runs import abort_reason, made_by, trainer_stops
    from meshrl.runs.checkpoint import latest_checkpoint
    from meshrl.trainer import load_config, train

    torch.set_num_threads(s.threads)
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(asdict(s), indent=1))
    high = pilot(s, out)["chosen"]
    data = write_data(out / f"add_{high}.jsonl", high, s.problems)
    for seed in s.seeds:
        step0 = out / "step0" / f"seed_{seed}"
        if not (step0 / "eval.json").is_file():
            held_out_accuracy(s, data, seed, step0)
        for arm in s.arms:
            run_dir = out / "runs" / arm / f"seed_{seed}"
            if (run_dir / "done.json").is_file():
                continue
            t0 = time.perf_counter()
            cfg = load_config(overrides=run_overrides(s, arm, seed, data))
            ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
            log.info("real model: %s seed %d (%s)", arm, seed, "resuming" if ckpt else "starting")
            record: dict[str, Any] = {}
            try:
                for _ in train(cfg, run_dir, resume=ckpt is not None):
                    pass
            except trainer_stops() as err:
                # a run the trainer ended is a result (a blow-up is the likeliest collapse), not a hole in the grid
                record["aborted"] = abort_reason(err, run_dir)
                log.warning("real model: %s seed %d ended early: %s", arm, seed, record["aborted"])
            # the CPU that made it: float rounding follows its vector instructions (a seed repeats bit for bit only
            # on a like machine), and "seconds" is this call's, a resumed run's last stretch only
            record.update(seconds=time.perf_counter() - t0, **made_by())
            atomic_write_text(run_dir / "done.json", json.dumps(record))


#: settings that choose which runs a call makes, not what a run is: packs that differ only in these merge
RUN_SELECTION = ("seeds", "arms", "threads")


def pack(out: Path, dest: Path) -> Path:
    """The compact data of every finished run (evaluations, kept metrics, events, machine) and the step-0
    evaluations, added to ``dest`` when it already holds runs of the same experiment (same settings but the run
    selection, same pilot); a run in both is taken from ``out``. Anything else in ``dest`` is a ValueError."""
    from meshrl.jsonl import read_jsonl

    runs: dict[str, Any] = {}
    for done in sorted(out.glob("runs/*/seed_*/done.json")):
        run_dir = done.parent
        metrics = [{k: r[k] for k in ("step", *KEPT_METRICS) if k in r} for r in read_jsonl(run_dir / "metrics.jsonl")
                   if "step" in r]
        record = json.loads(done.read_text())
        step0_file = out / "step0" / run_dir.name / "eval.json"
        runs[f"{run_dir.parent.name}/{run_dir.name}"] = {
            # the run's own step 0 (its machine's): a later pack's step 0 of the seed, made elsewhere, must not
            # change this run's gain
            "step0": json.loads(step0_file.read_text())["overall"] if step0_file.is_file() else None,
            # a run the trainer ended before its first evaluation has none
            "evals": read_jsonl(run_dir / "evals.jsonl") if (run_dir / "evals.jsonl").is_file() else [],
            "metrics": metrics,
            "events": read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").is_file() else [],
            "seconds": record["seconds"], "machine": record.get("machine"), "code": record.get("code"),
            "aborted": record.get("aborted")}
    step0 = {p.parent.name: json.loads(p.read_text())["overall"] for p in sorted(out.glob("step0/seed_*/eval.json"))}
    # the run selection is what was packed (settings.json holds the last call's, which may be running other seeds)
    settings = {**json.loads((out / "settings.json").read_text()),
                "seeds": sorted({int(k.split("_")[-1]) for k in runs}),
                "arms": [a for a in ARMS if any(k.startswith(f"{a}/") for k in runs)]}
    data = {"settings": settings,
            "pilot": json.loads((out / "pilot.json").read_text()), "step0": step0, "runs": runs}
    if dest.is_file():
        data = merged(read_pack(dest), data, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(dest, "wt") as fh:
        json.dump(data, fh, sort_keys=True)
    return dest


def merged(old: dict[str, Any], new: dict[str, Any], where: Path) -> dict[str, Any]:
    """``new``'s runs and step-0 evaluations added to ``old``'s; the settings' run selection becomes the union."""
    def what(settings: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in settings.items() if k not in RUN_SELECTION}

    if what(old["settings"]) != what(new["settings"]):
        diff = sorted(k for k in what(old["settings"]).keys() | what(new["settings"]).keys()
                      if old["settings"].get(k) != new["settings"].get(k))
        raise ValueError(f"{where}: holds runs made with other settings ({', '.join(diff)}); pack into another file")
    if old["pilot"] != new["pilot"]:
        raise ValueError(f"{where}: holds runs of another pilot ({old['pilot']} against {new['pilot']})")
    settings = {**new["settings"], "seeds": sorted({*old["settings"]["seeds"], *new["settings"]["seeds"]}),
                "arms": [a for a in ARMS if a in {*old["settings"]["arms"], *new["settings"]["arms"]}]}
    return {"settings": settings, "pilot": new["pilot"], "step0": {**old["step0"], **new["step0"]},
            "runs": {**old["runs"], **new["runs"]}}


def read_pack(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)
