"""Cost of each ``plugins.*`` technique per training step, relative to plain GRPO, side by side in one process.

Two measurements, both interleaved round by round so that machine load hits every arm alike:

1. **Update on shared rollouts.** Each round samples one batch with the baseline's sampler; every arm's trainer
   then runs its update (old-policy pass, loss, backward, optimiser step) on a copy of that same batch, so the
   figures differ only by what the plug-in computes (and by what it turns off: with any plug-in on, the update
   runs in one process and without the zero-advantage shortcut). Two baselines: ``grpo`` with meshrl's defaults
   (``train.update_workers=0`` auto, the shortcut on) and ``grpo_plain`` (one process, no shortcut: what a
   plug-in arm runs, and what the testbed experiment pins).
2. **Whole step** (``Trainer.step``: sampling included) for the arms whose sampling differs: ``plugins.replay``
   (rollouts reused), ``plugins.coach_guide`` (forced openings; against ``cp_only``, its recipe without it).

Prints medians of the process's CPU seconds (``time.process_time``: on a shared machine far steadier than wall
time, since waiting for a core is not counted; one torch thread, and ``grpo``'s update worker processes, if its
auto setting forks any, are not counted, which flatters it) and of wall seconds, the ratios to the baselines and
the load average at start and end.

    python benchmarks/plugin_cost.py                              # tiny:small on testbed:add, P16 G12 L23
    python benchmarks/plugin_cost.py --model PATH --rounds 12     # e.g. the testbed's warm start
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
from meshrl.cpu import cpu_info, describe
from meshrl.trainer import Trainer, load_config
from meshrl.trainer.mismatch import unsampled_rows

UPDATE_ARMS: dict[str, list[str]] = {
    "grpo": [],
    "grpo_plain": ["train.update_workers=1", "train.skip_zero_advantage=false"],
    "clip_cov": ["plugins.clip_cov.enabled=true"],
    "kl_cov": ["plugins.kl_cov.enabled=true"],
    "entropy_adv": ["plugins.entropy_adv.enabled=true"],
    "fork": ["plugins.fork.enabled=true"],
    "m2po": ["plugins.m2po.enabled=true"],
    "rollout_corr": ["plugins.rollout_corr.enabled=true"],
    "dpo": ["plugins.dpo.enabled=true"],
    "distill": ["plugins.distill.enabled=true", "plugins.distill.teacher=tiny:small", "plugins.distill.teacher_seed=1"],
    "estr": ["plugins.estr.enabled=true", "plugins.estr.tau=0.5"],
    "future_kl": ["plugins.future_kl.enabled=true"],
    "calib": ["plugins.calib.enabled=true", "plugins.calib.traces={traces}"],
    "implicit_value": ["plugins.implicit_value.enabled=true"],
    "opsd": ["plugins.opsd.enabled=true"],
    "ssd": ["plugins.ssd.enabled=true"],  # its extra samples are drawn in begin_update here: inside the update
    "remix": ["plugins.remix.enabled=true"],  # no history in an update on shared rollouts: the KL-Convex scoring
}
STEP_ARMS: dict[str, list[str]] = {
    "grpo": [],
    "replay_s1": ["plugins.replay.reuse_steps=1"],
    "cp_only": ["recipe=cp_only", "mesh.m=3", "mesh.template=plain", "mesh.adv_unit=query", "mesh.bare_group=true",
                "mesh.bare_groups=3"],
    "coach_guide": ["recipe=cp_only", "mesh.m=3", "mesh.template=plain", "mesh.adv_unit=query", "mesh.bare_group=true",
                    "mesh.bare_groups=3", "plugins.coach_guide.enabled=true"],
    "sft_mix": ["plugins.sft_mix.enabled=true", "plugins.sft_mix.traces={traces}", "plugins.sft_mix.hard_max_acc=0.99",
                "plugins.sft_mix.batch_size=8"],
    "remix": ["plugins.remix.enabled=true"],  # its history fills from the second step on
}


def write_traces(task_spec: str, root: Path) -> Path:
    """Expert traces for ``calib`` and ``sft_mix``: each training problem's reference trace of its home procedure
    where the task has one (the testbed), else its answer."""
    from meshrl.tasks import load_task

    task = load_task(task_spec, seed=0)
    path = root / "traces.jsonl"
    with path.open("w") as fh:
        for p in task.problems("train"):
            text = task.reference_trace(p, p.meta["home"]) if hasattr(task, "reference_trace") else p.answer
            fh.write(json.dumps({"id": p.id, "completion": text}) + "\n")
    return path


def make_trainer(args, extra: list[str], root: Path, name: str) -> Trainer:
    over = [f"model={args.model}", f"task={args.task}", "recipe=grpo", "steps=1000", "seed=0", "log.progress=false",
            f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
            f"rollout.max_new_tokens={args.tokens}", "train.mini_batches=2", "train.micro_batch_size=96",
            "checkpoint.every=100000", "optim.lr=3e-4"]
    traces = root / "traces.jsonl"
    extra = [k.replace("{traces}", str(traces)) for k in extra]
    return Trainer(load_config(overrides=[*over, *extra]), root / name)


def bench_updates(args, root: Path) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    trainers = {name: make_trainer(args, extra, root, f"u_{name}") for name, extra in UPDATE_ARMS.items()}
    sampler = trainers["grpo_plain"]
    times: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    try:
        for rnd in range(args.rounds + 1):
            data, _ = sampler.plugins.sample(sampler.sampler, sampler.step_idx, sampler.cursor)
            order = list(trainers) if rnd % 2 == 0 else list(reversed(trainers))
            for name in order:
                t = trainers[name]
                batch = copy.deepcopy(data)
                t.mismatch.begin(batch, unsampled_rows(batch))  # what Trainer.step does before its update
                t0, c0 = time.perf_counter(), time.process_time()
                t.update(batch)
                t.mismatch_metrics()
                if rnd > 0:  # round 0 warms caches and forks the update workers
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
            sampler.step_idx += 1
    finally:
        for t in trainers.values():
            t.close()
    return cpu, times


def bench_steps(args, root: Path) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    trainers = {name: make_trainer(args, extra, root, f"s_{name}") for name, extra in STEP_ARMS.items()}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    try:
        for rnd in range(args.rounds + 1):
            order = list(trainers) if rnd % 2 == 0 else list(reversed(trainers))
            for name in order:
                t0, c0 = time.perf_counter(), time.process_time()
                trainers[name].step()
                if rnd > 0:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
    finally:
        for t in trainers.values():
            t.close()
    return cpu, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:small")
    ap.add_argument("--task", default="testbed:add")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=23)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    print(f"model {args.model}, task {args.task}, P{args.prompts} G{args.group} L{args.tokens}, {args.rounds} rounds, "
          f"{args.threads} thread(s); load average at start {os.getloadavg()[0]:.2f}")
    print(describe(cpu_info()))
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        write_traces(args.task, root)
        cpu, wall = bench_updates(args, root)
        print("\nupdate on shared rollouts (median CPU s | wall s; CPU ratio to grpo_plain and to grpo)")
        plain, base = statistics.median(cpu["grpo_plain"]), statistics.median(cpu["grpo"])
        for name in cpu:
            c, w = statistics.median(cpu[name]), statistics.median(wall[name])
            print(f"  {name:13s} {c:7.3f} | {w:7.3f} s   x{c / plain:5.2f} vs grpo_plain   x{c / base:5.2f} vs grpo")
        cpu, wall = bench_steps(args, root)
        print("\nwhole step, sampling included (median CPU s | wall s; CPU ratio to grpo)")
        base = statistics.median(cpu["grpo"])
        for name in cpu:
            c, w = statistics.median(cpu[name]), statistics.median(wall[name])
            print(f"  {name:13s} {c:7.3f} | {w:7.3f} s   x{c / base:5.2f}")
        cp, guide = statistics.median(cpu["cp_only"]), statistics.median(cpu["coach_guide"])
        print(f"  coach_guide / cp_only (its recipe without the plug-in, same bare groups): x{guide / cp:.2f}")
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
