"""``meshrl demo``: watch strategy collapse, its harm and its prevention on the testbed, on a CPU.

Warm start (cached) -> GRPO, GRPO with forking-token training, CP-only and Mesh at the matched rollout budget,
with MEI and the true strategy masses logged every step -> held-out evaluation with pass@k broken down by problem
type -> paired comparisons. The CLI adds the report (plots + HTML) on top, since the report is a face above this layer.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("meshrl")

#: demo arm -> its ``meshrl train`` keys on top of :func:`meshrl.testbed.runconfig.base_overrides` (the same keys
#: as the experiment arms grpo, grpo_fork, cp_only and mesh_mu1e-5 of experiments/collapse_testbed/arms.yaml).
#: "mesh" is the paper's form, "fork" the best method the testbed found (forking-token training, plugins.fork:
#: kept the niche in 3/3 + 5/5 seeds where GRPO kept it in 1/3 and 2/5, experiments/collapse_testbed/README.md).
DEMO_ARMS: dict[str, list[str]] = {
    "grpo": ["recipe=grpo"],
    "fork": ["recipe=grpo", "plugins.fork.enabled=true"],
    "cp_only": ["recipe=cp_only"],
    "mesh": ["recipe=mesh", "mesh.mu=1e-5"],
}
ARMS = tuple(DEMO_ARMS)
#: The demo runs meshrl's default engines on top of the testbed's base, which pins transformers' ``generate``, one
#: update process and no prompt sharing or zero-advantage skip so that the experiments' documented results
#: reproduce sample for sample. Here: the native decoder, forked update workers, shared prompts: 179 s instead of
#: 360 s on 2 cores, the same verdict (benchmarks/JOURNAL.md, "Speed claims and their spread"); the demo's table is
#: its own (README).
DEMO_ENGINE: tuple[str, ...] = ("rollout.backend=auto", "train.share_prompts=true", "train.update_workers=0",
                                "train.skip_zero_advantage=true")


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo; ``quick()`` is the CI-sized version (about a minute on 2 cores). It checks the plumbing
    only: a 120-step warm start solves almost nothing, so no arm gets a reward to learn from in 3 steps and every
    row of its table is the warm start's (a 300-step warm start, twice the time, still left them identical)."""

    warm_steps: int = 700
    steps: int = 30
    prompts_per_step: int = 16
    group_size: int = 12  # m = 3 procedures x 4 rollouts at the matched budget
    lr: float = 3e-4
    ppo_epochs: int = 1
    mini_batches: int = 2
    eval_problems: int = 256
    eval_n: int = 8
    ks: tuple[int, ...] = (1, 2, 4, 8)
    threads: int = 2
    extra: tuple[str, ...] = DEMO_ENGINE  # more ``meshrl train`` keys for every arm (after the testbed's pins)

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(warm_steps=120, steps=3, prompts_per_step=4, group_size=6, eval_problems=48, eval_n=4,
                   ks=(1, 2, 4))


def arm_config(arm: str, model_path: Path, s: DemoSettings, seed: int, max_new_tokens: int):
    """The run config of demo ``arm``: the testbed's shared base and the arm's keys at the demo's sizes."""
    from meshrl.testbed.runconfig import base_overrides
    from meshrl.trainer import load_config

    return load_config(overrides=[*base_overrides(s, model_path, max_new_tokens), *DEMO_ARMS[arm],
                                  f"seed={seed}", "log.samples_per_step=4", "log.progress=true",
                                  f"checkpoint.every={max(s.steps, 1)}", "checkpoint.keep_last=1"])


def run_demo(out: Path, *, quick: bool = False, seed: int = 0, settings: DemoSettings | None = None,
             progress: bool = True) -> dict[str, Any]:
    """Run the whole demo into ``out``; return the paths of its runs and evaluations and a summary."""
    import torch

    from meshrl.evaluation import run_eval
    from meshrl.evaluation.compare import compare_evals
    from meshrl.runs.checkpoint import latest_checkpoint
    from meshrl.tasks import load_task
    from meshrl.testbed.runconfig import eval_config
    from meshrl.testbed.warm import warm_info, warm_start
    from meshrl.trainer import train

    s = settings or (DemoSettings.quick() if quick else DemoSettings())
    torch.set_num_threads(s.threads)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_path = warm_start(seed=seed, steps=s.warm_steps, progress=progress)
    task = load_task("testbed:add", seed=seed)
    max_new = task.max_new_tokens
    runs, evals = {}, {}
    for arm in ARMS:
        run_dir = out / "runs" / arm
        cfg = arm_config(arm, model_path, s, seed, max_new)
        if not progress:
            cfg.log.progress = False
        ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
        done = json.loads((ckpt / "state.json").read_text())["step"] if ckpt else 0
        if done < cfg.steps:
            log.info("demo: training %s (%d steps)", arm, cfg.steps)
            train(cfg, run_dir, resume=ckpt is not None)
        runs[arm] = run_dir
        run_eval(eval_config(str(run_dir), s, seed, max_new), out / "evals" / arm, progress=progress)
        evals[arm] = out / "evals" / arm
    run_eval(eval_config(str(model_path), s, seed, max_new), out / "evals" / "warm_start", progress=progress)
    evals["warm_start"] = out / "evals" / "warm_start"
    comparisons = {f"{a}_vs_grpo": [r.as_dict() for r in compare_evals(evals[a], evals["grpo"], n_boot=2000)]
                   for a in ("fork", "cp_only", "mesh")}
    summary = {"settings": asdict(s), "seed": seed, "warm_start": str(model_path),
               "warm_info": warm_info(model_path), "runs": {k: str(v) for k, v in runs.items()},
               "evals": {k: str(v) for k, v in evals.items()}, "comparisons": comparisons,
               "final": _final_table(runs, evals), "seconds": time.perf_counter() - t0}
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _final_table(runs: dict[str, Path], evals: dict[str, Path]) -> dict[str, Any]:
    """Per arm: last-step training figures (max strategy mass, MEI) and held-out results by type."""
    from meshrl.jsonl import read_jsonl
    from meshrl.tasks import load_task
    from meshrl.testbed.measure import eval_shares

    task = load_task("testbed:add")
    table: dict[str, Any] = {}
    for arm, ev_dir in evals.items():
        ev = json.loads((ev_dir / "eval.json").read_text())
        row: dict[str, Any] = {"eval": ev["overall"], "eval_by_type": ev.get("by", {}).get("groups", {}),
                               "shares": eval_shares(ev_dir, task)}
        if arm in runs:
            last = read_jsonl(runs[arm] / "metrics.jsonl")[-1]
            row["train_last"] = {k: v for k, v in last.items()
                                 if k.startswith(("strategy/", "mei/query", "mei/effective", "acc/", "reward/mean"))}
        table[arm] = row
    return table


def summary_markdown(summary: dict[str, Any]) -> str:
    """The demo's result table: held-out accuracy (c/n) overall and per type, pass@k, and which procedure the
    unconditioned policy uses on each type (shares c / t / r)."""
    k = max(summary["settings"]["ks"])
    types = ("low", "carry", "decade")
    lines = [f"| policy | accuracy | pass@{k} | " + " | ".join(f"{t} accuracy" for t in types)
             + " | " + " | ".join(f"{t} c/t/r" for t in types) + " |", "|---" * (3 + 2 * len(types)) + "|"]
    for arm, row in summary["final"].items():
        by, sh = row["eval_by_type"], row["shares"]["by_type"]
        lines.append(f"| {arm} | {row['eval']['pass@1']:.3f} | {row['eval'].get(f'pass@{k}', float('nan')):.3f} | "
                     + " | ".join(f"{by[t]['pass@1']:.3f}" if t in by else "–" for t in types) + " | "
                     + " | ".join("/".join(f"{sh[t][x]:.2f}" for x in ("c", "t", "r")) if t in sh else "–"
                                  for t in types) + " |")
    return "\n".join(lines)


def plumbing_note(summary: dict[str, Any]) -> str | None:
    """A plain warning when the table cannot compare the policies: every trained arm evaluated exactly like the
    warm start (no arm got a gradient: the quick demo's warm start solves almost nothing). ``None`` otherwise."""
    final = summary["final"]
    rows = [(row["eval"], row["eval_by_type"]) for arm, row in final.items() if arm != "warm_start"]
    if not rows or any(r != (final["warm_start"]["eval"], final["warm_start"]["eval_by_type"]) for r in rows):
        return None
    return ("note: every policy evaluated exactly like the warm start, so this table checks the plumbing only "
            "(warm start, training, evaluation, report), not the methods: the warm start "
            f"({summary['settings']['warm_steps']} steps) solves too few problems for any arm to get a reward to "
            "learn from. `meshrl demo` without --quick (about 3 minutes on 2 cores) compares them.")
