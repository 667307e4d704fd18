"""The testbed experiment (issue 7): every arm x seeds at a matched rollout budget, evaluated and probed.

``run_experiment(out)`` trains each (arm, seed) from the same warm start, evaluates the final policy on
held-out problems (pass@k, by problem type), and for the baseline arms probes every saved checkpoint
with :func:`meshrl.testbed.signals.probe_signals` (the warning-signal data). Runs go two at a time (one
thread each) and everything is resumable: a finished run, evaluation or probe is never redone.
``summarize_experiment(out)`` reads it all back into ``results.json`` (see ``docs/testbed.md``).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("meshrl")

#: arm name -> config overrides on top of the shared base (matched budget: every arm samples P x G).
ARMS: dict[str, list[str]] = {
    "grpo": ["recipe=grpo"],
    # DAPO without refill rounds (a refill samples extra rollouts: not a matched budget) and without
    # overlong shaping (the testbed's budget is already the length rule; shaping would fine legal traces).
    "dapo": ["recipe=dapo", "dynamic_sampling.max_rounds=1", "algo.overlong_shaping=false"],
    "grpo_kl": ["recipe=grpo_kl"],
    "grpo_js": ["recipe=grpo_js"],
    "cp_only": ["recipe=cp_only"],  # = the paper's Mesh at mu = 0
    **{f"mesh_mu{mu}": ["recipe=mesh", f"mesh.mu={mu}"] for mu in ("1e-5", "1e-3", "1e-2", "1e-1")},
    **{f"support_mu{mu}": ["recipe=mesh", "mesh.balance=support", f"mesh.mu={mu}"] for mu in ("1e-1", "1")},
    # meshrl extension: a fourth, prefix-free group per query (G = 4 groups of 3), so the policy that is
    # evaluated (no coach at test time) is trained too.
    "cp_bare": ["recipe=cp_only", "mesh.bare_group=true"],
    # ablations of the DAPO collapse: its token-mean aggregation alone on GRPO, and DAPO without it
    "grpo_tokenmean": ["recipe=grpo", "algo.loss_agg=token-mean"],
    "dapo_seqmean": ["recipe=dapo", "dynamic_sampling.max_rounds=1", "algo.overlong_shaping=false",
                     "algo.loss_agg=seq-mean-token-mean"],
    "support_bare_mu1e-1": ["recipe=mesh", "mesh.balance=support", "mesh.mu=1e-1", "mesh.bare_group=true"],
}
PROBE_ARMS = ("grpo", "dapo", "grpo_kl", "grpo_js")


@dataclass(frozen=True)
class ExperimentSettings:
    steps: int = 40
    prompts_per_step: int = 16
    group_size: int = 12  # = mesh.m 3 x 4 rollouts per prefix at the matched budget
    lr: float = 3e-4
    ppo_epochs: int = 1
    mini_batches: int = 2
    probe_every: int = 4
    probe_problems: int = 16
    probe_group: int = 12
    eval_problems: int = 256
    eval_n: int = 8
    ks: tuple[int, ...] = (1, 2, 4, 8)
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[str, ...] = tuple(ARMS)
    warm_seed: int = 0
    warm_steps: int = 700  # = meshrl.testbed.warm.DEFAULT_STEPS, the default (cached) warm start
    workers: int = 2
    extra: tuple[str, ...] = field(default_factory=tuple)  # more overrides for every arm


def base_overrides(s: ExperimentSettings, model_path: Path, max_new_tokens: int) -> list[str]:
    return [
        f"model={model_path}", "task=testbed:add", f"steps={s.steps}",
        f"rollout.prompts_per_step={s.prompts_per_step}", f"rollout.group_size={s.group_size}",
        f"rollout.max_new_tokens={max_new_tokens}", "rollout.temperature=1.0", f"optim.lr={s.lr}",
        "optim.warmup_steps=3", f"train.ppo_epochs={s.ppo_epochs}", f"train.mini_batches={s.mini_batches}",
        "train.micro_batch_size=96", "mesh.m=3", "mesh.template=plain", "diag.mei.every=1",
        "log.progress=false", "log.samples_per_step=-1",
        # The documented results (docs/testbed.md, README's demo table) were sampled with transformers'
        # generate and scored in one pass in one process; pinned so that they reproduce sample for sample.
        "rollout.backend=hf", "train.share_prompts=false", "train.update_workers=1",
        "train.skip_zero_advantage=false", *s.extra,
    ]


def checkpoint_overrides(arm: str, s: ExperimentSettings) -> list[str]:
    """Probed arms keep a checkpoint every ``probe_every`` steps; the others only the last one."""
    if arm in PROBE_ARMS:
        return [f"checkpoint.every={s.probe_every}", f"checkpoint.keep_last={s.steps // s.probe_every + 1}"]
    return [f"checkpoint.every={max(s.steps, 1)}", "checkpoint.keep_last=1"]


def eval_config(model: str, s, seed: int, max_new: int):
    """The held-out evaluation of the testbed for settings ``s`` (experiment or demo; ``generate`` sampling
    pinned, as in ``base_overrides``)."""
    from meshrl.evaluation import EvalConfig

    return EvalConfig(model=model, data="testbed:add", split="eval", n=s.eval_n, ks=list(s.ks),
                      limit=s.eval_problems, max_new_tokens=max_new, temperature=1.0, seed=seed, by="type",
                      backend="hf")


def _job(arm: str, seed: int, run_dir: Path, s: ExperimentSettings, model_path: Path) -> dict[str, Any]:
    """Train (or resume), evaluate and probe one (arm, seed); runs in a worker process."""
    import torch

    from meshrl.evaluation import run_eval
    from meshrl.tasks import load_task
    from meshrl.trainer import load_config, train
    from meshrl.trainer.checkpoint import latest_checkpoint

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    task = load_task("testbed:add", seed=seed)
    cfg = load_config(overrides=[*base_overrides(s, model_path, task.max_new_tokens), *ARMS[arm],
                                   *checkpoint_overrides(arm, s), f"seed={seed}"])
    ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
    done = json.loads((ckpt / "state.json").read_text())["step"] if ckpt else 0
    if done < cfg.steps:
        train(cfg, run_dir, resume=ckpt is not None)
    if not (run_dir / "eval" / "eval.json").is_file():
        run_eval(eval_config(str(run_dir), s, seed, task.max_new_tokens), run_dir / "eval", progress=False)
    if arm in PROBE_ARMS:
        probe_run(run_dir, s, seed, model_path)
    return {"arm": arm, "seed": seed, "seconds": time.perf_counter() - t0}


def probe_run(run_dir: Path, s: ExperimentSettings, seed: int, model_path: Path) -> Path:
    """``probes.jsonl``: :func:`probe_signals` at the warm start (step 0) and at every checkpoint."""
    from meshrl.tasks import load_task
    from meshrl.testbed.signals import probe_signals
    from meshrl.trainer.policy import load_policy
    from meshrl.trainer.runlog import read_jsonl

    path = run_dir / "probes.jsonl"
    done = {r["step"] for r in read_jsonl(path)} if path.is_file() else set()
    task = load_task("testbed:add", seed=seed)
    problems = task.problems("eval")[-s.probe_problems:]  # disjoint from the first eval_problems when possible
    ckpts = {0: model_path}
    for d in sorted((run_dir / "checkpoints").glob("step_*")):
        ckpts[int(d.name.split("_")[1])] = d
    with path.open("a") as fh:
        for step, ckpt in sorted(ckpts.items()):
            if step in done:
                continue
            model, tok, _ = load_policy(str(ckpt))
            res = probe_signals(model, tok, task, problems, group_size=s.probe_group, seed=seed * 1000 + step)
            with (run_dir / "probes_per_problem.jsonl").open("a") as pp:
                pp.writelines(json.dumps({"step": step, **rec}) + "\n" for rec in res["per_problem"])
            fh.write(json.dumps({"step": step, **res["scalars"]}) + "\n")
            fh.flush()
    return path


def baseline_probes(out: Path, s: ExperimentSettings, model_path: Path, n: int = 5) -> dict[str, Any]:
    """Probe the warm start ``n`` times with different sampling seeds: the spread that calibrates each
    signal's threshold (mean +- 3 sd)."""
    from meshrl.models import load_model
    from meshrl.tasks import load_task
    from meshrl.testbed.signals import probe_signals
    from meshrl.trainer.runlog import read_jsonl

    path = out / "baseline_probes.jsonl"
    have = len(read_jsonl(path)) if path.is_file() else 0
    task = load_task("testbed:add", seed=0)
    problems = task.problems("eval")[-s.probe_problems:]
    model, tok = load_model(str(model_path))
    with path.open("a") as fh:
        for k in range(have, n):
            res = probe_signals(model, tok, task, problems, group_size=s.probe_group, seed=10_000 + k)
            fh.write(json.dumps({"probe_seed": 10_000 + k, **res["scalars"]}) + "\n")
            with (out / "baseline_per_problem.jsonl").open("a") as pp:
                pp.writelines(json.dumps({"probe_seed": 10_000 + k, **rec}) + "\n" for rec in res["per_problem"])
    return {"baseline_probes": str(path)}


def run_experiment(out: Path, s: ExperimentSettings | None = None, *, progress: bool = True) -> Path:
    """Run every (arm, seed) of ``s`` into ``out/runs/ARM/seed_S``; return ``out``."""
    import multiprocessing as mp

    from meshrl.progress import progress_bar
    from meshrl.testbed.warm import warm_start

    s = s or ExperimentSettings()
    unknown = [a for a in s.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    out.mkdir(parents=True, exist_ok=True)
    model_path = warm_start(seed=s.warm_seed, steps=s.warm_steps, progress=progress)
    (out / "settings.json").write_text(json.dumps({**asdict(s), "warm_start": str(model_path)}, indent=1))
    jobs = [(a, seed, out / "runs" / a / f"seed_{seed}") for seed in s.seeds for a in s.arms]
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=s.workers, mp_context=ctx) as pool, \
            progress_bar("experiment", total=len(jobs) + 1, enabled=progress) as bar:
        futures = [pool.submit(_job, a, seed, d, s, model_path) for a, seed, d in jobs]
        futures.append(pool.submit(baseline_probes, out, s, model_path))
        for fut in as_completed(futures):
            res = fut.result()
            log.info("experiment: %s", res)
            bar()
    return out
