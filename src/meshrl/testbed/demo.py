"""``meshrl demo``: the dip and the recovery, on the collapse testbed, on a CPU.

From the shipped warm start, GRPO and GRPO with forking-token training (``plugins.fork``) train on three RL seeds
fixed in advance (:data:`DEMO_SEEDS`), each evaluated by the trainer every few steps on held-out problems by type,
MEI logged every step. :mod:`meshrl.testbed.demo_story` reads each run's niche curve off its records (when it fell,
when it came back, kept or lost at the end, MEI beside it); the caption's rates come from the same demo over ten
seeds (:data:`RATES_FILE`, written by ``meshrl demo --seeds 0 1 ... 9 --rates-out``). The CLI adds the report.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

log = logging.getLogger("meshrl")

#: demo arm -> its ``meshrl train`` keys on top of :func:`meshrl.testbed.runconfig.base_overrides` (the same keys
#: as the experiment arms grpo and grpo_fork of experiments/collapse_testbed/arms.yaml).
DEMO_ARMS: dict[str, list[str]] = {
    "grpo": ["recipe=grpo"],
    "fork": ["recipe=grpo", "plugins.fork.enabled=true"],
}
ARMS = tuple(DEMO_ARMS)
#: The first three RL seeds, fixed when this version of the demo was written, before its first run: not chosen
#: by outcome. The warm start is the same for every seed (the shipped one, seed 0).
DEMO_SEEDS: tuple[int, ...] = (0, 1, 2)
#: Where the caption's rates over ten seeds live (package data, measured by the demo itself).
RATES_FILE = Path(__file__).parent / "shipped" / "demo_rates.json"
#: Why CP-only and Mesh are not among the arms.
MESH_NOTE = ("Mesh at the paper's mu = 1e-5 is not run here because it trains as CP-only does: its balancing "
             "gradient is about 1e-4 of the policy gradient's norm (mesh/grad_ratio), too small to change a "
             "sample; in the pre-registered persistence experiment CP-only lost the niche for good in most seeds "
             "where GRPO came back (docs/testbed.md).")
#: The demo runs meshrl's default engines on top of the testbed's base, which pins transformers' ``generate``, one
#: update process and no prompt sharing or zero-advantage skip so that the experiments' documented results
#: reproduce sample for sample. Here: the native decoder, shared prompts, the zero-advantage skip; the demo's
#: figures are its own (README).
DEMO_ENGINE: tuple[str, ...] = ("rollout.backend=auto", "train.share_prompts=true", "train.update_workers=0",
                                "train.skip_zero_advantage=true")


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo; ``quick()`` is the CI-sized version (about a minute on 2 cores). It checks the plumbing
    only: a 120-step warm start solves almost nothing, so no arm gets a reward to learn from in 3 steps."""

    warm_steps: int = 700
    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 12  # m = 3 procedures x 4 rollouts at the matched budget
    lr: float = 3e-4
    ppo_epochs: int = 1
    mini_batches: int = 2
    eval_every: int = 4
    eval_problems: int = 128  # the first of the held-out split, as in the persistence experiment (26-38 niche)
    eval_n: int = 4
    threads: int = 1  # per run: the same figures whether runs go one or two at a time
    workers: int = 2  # runs at a time (processes); numbers do not depend on it
    extra: tuple[str, ...] = DEMO_ENGINE  # more ``meshrl train`` keys for every arm (after the testbed's pins)

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(warm_steps=120, steps=3, prompts_per_step=4, group_size=6, eval_every=1, eval_problems=24,
                   eval_n=2)

    def numeric(self) -> dict[str, Any]:
        """The settings the figures depend on (not ``workers``), in their JSON form (lists, as stored)."""
        return json.loads(json.dumps({f.name: getattr(self, f.name) for f in fields(self) if f.name != "workers"}))


def demo_keys(s: DemoSettings, seed: int) -> list[str]:
    """The demo's own keys after the arm's: its evaluation (every ``eval_every`` steps from step 0, by type),
    checkpoints for resuming, and quiet logs."""
    return [f"seed={seed}", "log.samples_per_step=4", "log.progress=false", f"eval.every={s.eval_every}",
            "eval.at_start=true", "eval.by=type", f"eval.limit={s.eval_problems}", f"eval.n={s.eval_n}",
            f"checkpoint.every={max(1, min(20, s.steps))}", "checkpoint.keep_last=1"]


def arm_config(arm: str, model_path: Path, s: DemoSettings, seed: int, max_new_tokens: int):
    """The run config of demo ``arm``: the testbed's shared base and the arm's keys at the demo's sizes."""
    from meshrl.testbed.runconfig import base_overrides
    from meshrl.trainer import load_config

    return load_config(overrides=[*base_overrides(s, model_path, max_new_tokens), *DEMO_ARMS[arm],
                                  *demo_keys(s, seed)])


def _train_one(arm: str, seed: int, model_path: str, s: DemoSettings, run_dir: str, threads: int) -> str:
    """Train (or resume, or skip when finished) one run; also the worker processes' job."""
    import torch

    from meshrl.runs.checkpoint import latest_checkpoint
    from meshrl.tasks import load_task
    from meshrl.trainer import train

    torch.set_num_threads(threads)
    cfg = arm_config(arm, Path(model_path), s, seed, load_task("testbed:add", seed=seed).max_new_tokens)
    out = Path(run_dir)
    ckpt = latest_checkpoint(out) if out.exists() else None
    done = json.loads((ckpt / "state.json").read_text())["step"] if ckpt else 0
    if done < cfg.steps:
        train(cfg, out, resume=ckpt is not None)
    return run_dir


def _worker_init() -> None:
    """Die with the demo (its runs resume on the next call); each job sets its own thread count."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_demo(out: Path, *, quick: bool = False, seeds: tuple[int, ...] = DEMO_SEEDS,
             settings: DemoSettings | None = None, progress: bool = True) -> dict[str, Any]:
    """Run the whole demo into ``out`` (finished runs are reused, stopped ones resumed); return its summary."""
    from meshrl.progress import progress_bar
    from meshrl.testbed.demo_story import rates, run_story
    from meshrl.testbed.warm import warm_info, warm_start

    s = settings or (DemoSettings.quick() if quick else DemoSettings())
    out.mkdir(parents=True, exist_ok=True)
    check_settings(out, s)
    t0 = time.perf_counter()
    model_path = warm_start(seed=0, steps=s.warm_steps, progress=progress)
    # longest first (forking tokens' update takes about 15% longer than GRPO's), so that two workers end together
    jobs = [(arm, seed, str(out / "runs" / arm / f"seed_{seed}")) for arm in reversed(ARMS) for seed in seeds]
    with progress_bar("demo runs", len(jobs), progress) as advance:
        if s.workers > 1 and len(jobs) > 1:
            _train_in_workers(jobs, str(model_path), s, advance)
        else:
            _train_here(jobs, str(model_path), s, advance)
    stories = {arm: {seed: run_story(Path(d)) for a, seed, d in jobs if a == arm} for arm in ARMS}
    summary = {"settings": asdict(s), "seeds": list(seeds), "warm_start": str(model_path),
               "warm_info": warm_info(model_path), "runs": {f"{a}/seed_{seed}": d for a, seed, d in jobs},
               "stories": stories, "rates": rates(stories), "seconds": time.perf_counter() - t0,
               "machine": machine()}
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


SETTINGS_FILE = "demo_settings.json"


def check_settings(out: Path, s: DemoSettings) -> None:
    """Refuse to reuse ``out`` whose runs were made with other settings (``--quick`` and the full demo share the
    default ``--out``); record the settings in a new one."""
    path = out / SETTINGS_FILE
    mine = s.numeric()
    if path.is_file():
        theirs = json.loads(path.read_text())
        if theirs != mine:
            changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ValueError(f"{out} holds a demo made with other settings ({', '.join(changed)} differ; "
                             f"{path}): choose another --out, or delete it to start again")
        return
    path.write_text(json.dumps(mine, indent=1) + "\n")


def _train_here(jobs: list[tuple[str, int, str]], model_path: str, s: DemoSettings, advance: Any) -> None:
    """The runs one after another in this process (its torch thread count restored afterwards)."""
    import torch

    before = torch.get_num_threads()
    try:
        for arm, seed, d in jobs:
            _train_one(arm, seed, model_path, s, d, s.threads)
            advance(description=f"{arm}/seed_{seed}")
    finally:
        torch.set_num_threads(before)


def _train_in_workers(jobs: list[tuple[str, int, str]], model_path: str, s: DemoSettings, advance: Any) -> None:
    """The runs ``s.workers`` at a time in spawned processes. The first failure (or Ctrl-C) cancels the runs not
    yet started and is raised at once; a stopped run resumes on the next call."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    pool = ProcessPoolExecutor(max_workers=min(s.workers, len(jobs)), mp_context=mp.get_context("spawn"),
                               initializer=_worker_init)
    try:
        futures = [pool.submit(_train_one, arm, seed, model_path, s, d, s.threads) for arm, seed, d in jobs]
        for f in as_completed(futures):
            done = Path(f.result())
            advance(description=f"{done.parent.name}/{done.name}")
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def machine() -> dict[str, Any]:
    """What the figures depend on besides the settings: the CPU record benchmarks keep (:func:`meshrl.cpu.cpu_info`:
    model, kernel-deciding flags, native bf16, the torch version)."""
    from meshrl.cpu import cpu_info

    return cpu_info()


def settings_of(summary: dict[str, Any]) -> DemoSettings:
    """The :class:`DemoSettings` a summary was made with (its JSON form has lists where the dataclass has tuples)."""
    return DemoSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in summary["settings"].items()})


def rates_record(summary: dict[str, Any]) -> dict[str, Any]:
    """What ``--rates-out`` writes: the rates with the settings, seeds and machine that produced them."""
    return {"settings": settings_of(summary).numeric(), "seeds": summary["seeds"], "rates": summary["rates"],
            "machine": summary["machine"], "date": time.strftime("%Y-%m-%d"),
            "command": "meshrl demo --seeds " + " ".join(map(str, summary["seeds"])) + " --rates-out PATH"}


def caption(settings: DemoSettings, path: Path = RATES_FILE) -> str:
    """The rates over ten seeds of this demo's configuration, or why there are none for these settings."""
    from meshrl.testbed.demo_story import rates_line

    if not path.is_file():
        return "(no multi-seed rates recorded for this demo)"
    rec = json.loads(path.read_text())
    mine = settings.numeric()
    if rec["settings"] != mine:
        return ("(the recorded multi-seed rates were measured with other settings: "
                f"{sorted(k for k in mine if rec['settings'].get(k) != mine[k])}; not shown)")
    seeds = rec["seeds"]
    head = (f"Over RL seeds {seeds[0]}-{seeds[-1]} of this configuration ({len(seeds)} runs per arm; "
            f"measured {rec['date']} on {rec['machine']['model']}, where every digit may differ from this machine's):")
    return "\n".join([head, *(f"- {rates_line(arm, r)}" for arm, r in rec["rates"].items())])


def summary_markdown(summary: dict[str, Any]) -> str:
    """What the demo prints: each run's story, the counts over the demo's seeds, why Mesh is not run, and the
    multi-seed caption."""
    from meshrl.testbed.demo_story import rates_line, story_table

    s = settings_of(summary)
    stories = {arm: {int(k): v for k, v in by.items()} for arm, by in summary["stories"].items()}
    seeds = summary["seeds"]
    return "\n".join([
        f"The niche (held-out `decade` accuracy) every {s.eval_every} steps from the warm start, {s.steps} steps, "
        f"RL seeds {', '.join(map(str, seeds))}:", "",
        story_table(stories, s.eval_every), "",
        *(f"- {rates_line(arm, r)}" for arm, r in summary["rates"].items()), "",
        MESH_NOTE, "", caption(s),
    ])


def plumbing_note(summary: dict[str, Any]) -> str | None:
    """A plain warning when the table cannot compare the policies: every run's held-out accuracy and niche ended
    exactly where they started (no arm got a reward to learn from: the quick demo's warm start solves almost
    nothing). ``None`` otherwise."""
    stories = [r for by in summary["stories"].values() for r in by.values()]
    if not stories or any(len({v for _, v in r["curve"]}) > 1 for r in stories):
        return None
    return ("note: no run's niche moved from its step-0 value, so this table checks the plumbing only "
            "(warm start, training, evaluation, report), not the methods: the warm start "
            f"({summary['settings']['warm_steps']} steps) solves too few problems for any arm to get a reward to "
            "learn from. `meshrl demo` without --quick (about 5 minutes on 2 cores) compares them.")
