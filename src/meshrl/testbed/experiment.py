"""The testbed experiment: every arm x seeds from one warm start, evaluated, checkpoint-evaluated and probed.

``run_experiment(out)`` trains each (arm, seed) from the same warm start, evaluates the final policy on
held-out problems (pass@k, by problem type), evaluates every kept checkpoint on a smaller held-out set
(``ckpt_eval``: final vs best checkpoint), and for the probed arms probes every checkpoint with
:func:`meshrl.testbed.signals.probe_signals` (the warning-signal data). Runs go ``workers`` at a time
(one thread each) and everything is resumable: a finished run, evaluation or probe is never redone.
``summarize_experiment(out)`` reads it all back into ``results.json`` (see ``docs/testbed.md``).

Three presets (``PRESETS``): ``round1`` is issue 7's experiment (15 arms x 3 seeds, the figures of
docs/testbed.md's first part); ``round2`` (the default) is issue 16's: the headline arms x 5 seeds, the
rollout-budget arms and the variants designed from round one's mechanism; ``plugins`` is issue 14's: GRPO with
each of the reading list's entropy-collapse plug-ins (Clip-Cov, KL-Cov, entropy advantage, forking tokens) x 5
seeds from round one's warm start.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
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
    # ---- round two (issue 16) ----
    # The rollout-budget question: each of the m = 3 prefixes gets a whole group of G = 12 (36 rollouts per
    # query), against GRPO with the same 36 rollouts per query and the same optimiser steps.
    "mesh_pp_mu1e-5": ["recipe=mesh", "mesh.budget=per_prefix"],
    "cp_pp": ["recipe=cp_only", "mesh.budget=per_prefix"],
    "grpo_g36": ["recipe=grpo", "rollout.group_size=36"],
    # Variants from round one's mechanism (the paper's Mesh at mu = 1e-5 underneath, matched budget):
    # the coach proposes only procedures that can solve the problem ...
    "mesh_applicable": ["recipe=mesh", "task_options.coach=applicable"],
    # ... a conditioned rollout that abandons its prefix's procedure earns 0 ...
    "mesh_follow": ["recipe=mesh", "task_options.follow=true"],
    "mesh_applicable_follow": ["recipe=mesh", "task_options.coach=applicable", "task_options.follow=true"],
    # ... and half the budget prefix-free (3 bare groups of 2 + 3 prefix groups of 2), with balancing of
    # the unconditioned strategy masses (support balancing) or without (CP only).
    "support_bare_half_mu1e-1": ["recipe=mesh", "mesh.balance=support", "mesh.mu=1e-1", "mesh.bare_group=true",
                                 "mesh.bare_groups=3"],
    "cp_bare_half": ["recipe=cp_only", "mesh.bare_group=true", "mesh.bare_groups=3"],
    # Coach-guided exploration (plugins.coach_guide): the coach's procedure opens the *response* (the tag, forced,
    # off-policy, LUFFY-shaped) under the unconditioned prompt, one advantage group per query; "half": 3 strategies
    # x 2 guided + 3 bare groups x 2 free rollouts per query, "all": 3 x 4 guided.
    "guide_half": ["recipe=cp_only", "plugins.coach_guide.enabled=true", "mesh.adv_unit=query",
                   "mesh.bare_group=true", "mesh.bare_groups=3"],
    "guide_all": ["recipe=cp_only", "plugins.coach_guide.enabled=true", "mesh.adv_unit=query"],
    # ... with the forced openings trained as if sampled (-A log p: a gradient that does not vanish at small p)
    "guide_half_log": ["recipe=cp_only", "plugins.coach_guide.enabled=true", "plugins.coach_guide.shape=log",
                       "mesh.adv_unit=query", "mesh.bare_group=true", "mesh.bare_groups=3"],
    # ... and every rollout guided (3 x 4): the policy never samples its own opening in training
    "guide_all_log": ["recipe=cp_only", "plugins.coach_guide.enabled=true", "plugins.coach_guide.shape=log",
                      "mesh.adv_unit=query"],
    # ---- the reading list's entropy-collapse plug-ins on GRPO (issue 14; docs/plugins.md), paper defaults ----
    "grpo_clip_cov": ["recipe=grpo", "plugins.clip_cov.enabled=true"],
    "grpo_kl_cov": ["recipe=grpo", "plugins.kl_cov.enabled=true"],
    "grpo_entropy_adv": ["recipe=grpo", "plugins.entropy_adv.enabled=true"],
    "grpo_fork": ["recipe=grpo", "plugins.fork.enabled=true"],
}
PROBE_ARMS = ("grpo", "dapo", "grpo_kl", "grpo_js")  # round one's probed baselines
ROUND1_ARMS: tuple[str, ...] = (
    "grpo", "dapo", "grpo_kl", "grpo_js", "cp_only", "mesh_mu1e-5", "mesh_mu1e-3", "mesh_mu1e-2", "mesh_mu1e-1",
    "support_mu1e-1", "support_mu1", "cp_bare", "grpo_tokenmean", "dapo_seqmean", "support_bare_mu1e-1")
ROUND2_ARMS: tuple[str, ...] = (
    "grpo", "mesh_mu1e-5", "cp_only", "grpo_g36", "mesh_pp_mu1e-5", "cp_pp", "mesh_applicable", "mesh_follow",
    "mesh_applicable_follow", "support_bare_half_mu1e-1", "cp_bare_half")
PLUGIN_ARMS: tuple[str, ...] = ("grpo", "grpo_clip_cov", "grpo_kl_cov", "grpo_entropy_adv", "grpo_fork")
#: preset -> settings that differ from ExperimentSettings' defaults
PRESETS: dict[str, dict[str, Any]] = {
    "round1": {"arms": ROUND1_ARMS, "seeds": (0, 1, 2), "probe_arms": PROBE_ARMS, "ckpt_eval_every": 0,
               "warm_coach_variants": False},
    "round2": {},
    # Do the entropy-collapse techniques keep the niche where GRPO loses it? (issue 14) Round one's warm start.
    "plugins": {"arms": PLUGIN_ARMS, "probe_arms": ("grpo",), "warm_coach_variants": False},
}


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
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # >= 5: GRPO's outcome is bimodal across seeds
    arms: tuple[str, ...] = ROUND2_ARMS
    probe_arms: tuple[str, ...] = ("grpo", "grpo_g36", "mesh_mu1e-5")  # warning signals (checkpoint probes)
    ckpt_eval_every: int = 8  # evaluate a checkpoint every this many steps, every arm (0 = final only)
    ckpt_eval_problems: int = 128
    task: str = "testbed:add"  # or "testbed:audit", the second family
    warm_seed: int = 0
    warm_steps: int = 700  # = meshrl.testbed.warm.DEFAULT_STEPS
    # Round two's applicable coach repeats procedures in other words (COACH_VARIANTS): every arm starts from
    # a warm start that was taught all the phrasings, so that all arms share one starting point.
    warm_coach_variants: bool = True
    prune_checkpoints: bool = True  # keep only the last checkpoint once a run is evaluated and probed
    workers: int = 2
    niche_kept_at: float = 0.5  # a seed keeps the niche when its held-out headline-niche accuracy >= this
    extra: tuple[str, ...] = field(default_factory=tuple)  # more overrides for every arm


def base_overrides(s: ExperimentSettings, model_path: Path, max_new_tokens: int) -> list[str]:
    return [
        f"model={model_path}", f"task={s.task}", f"steps={s.steps}",
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


def checkpoint_every(arm: str, s: ExperimentSettings) -> int:
    """Probed arms keep a checkpoint every ``probe_every`` steps, the others every ``ckpt_eval_every``
    (only the last one when that is 0)."""
    if arm in s.probe_arms:
        return max(1, s.probe_every)
    return s.ckpt_eval_every if 0 < s.ckpt_eval_every < s.steps else max(s.steps, 1)


def checkpoint_overrides(arm: str, s: ExperimentSettings) -> list[str]:
    every = checkpoint_every(arm, s)
    return [f"checkpoint.every={every}", f"checkpoint.keep_last={s.steps // every + 1}"]


def eval_config(model: str, s, seed: int, max_new: int, limit: int | None = None):
    """The held-out evaluation of the testbed for settings ``s`` (experiment or demo; ``generate`` sampling
    pinned, as in ``base_overrides``); ``limit`` problems instead of ``s.eval_problems`` when given."""
    from meshrl.evaluation import EvalConfig

    return EvalConfig(model=model, data=getattr(s, "task", "testbed:add"), split="eval", n=s.eval_n,
                      ks=list(s.ks), limit=limit or s.eval_problems, max_new_tokens=max_new, temperature=1.0,
                      seed=seed, by="type", backend="hf")


def checkpoint_dirs(run_dir: Path) -> dict[int, Path]:
    """Step -> checkpoint directory of a run."""
    return {int(d.name.split("_")[1]): d for d in sorted((run_dir / "checkpoints").glob("step_*"))}


def eval_checkpoints(run_dir: Path, s: ExperimentSettings, seed: int, max_new: int) -> list[int]:
    """``ckpt_eval/step_N/eval.json`` for every kept checkpoint at a multiple of ``ckpt_eval_every`` (the
    last one always): the same ``ckpt_eval_problems`` held-out problems, by type. Returns the steps."""
    from meshrl.evaluation import run_eval

    if s.ckpt_eval_every <= 0:
        return []
    ckpts = checkpoint_dirs(run_dir)
    steps = [k for k in ckpts if k % s.ckpt_eval_every == 0 or k == max(ckpts)]
    for step in steps:
        out = run_dir / "ckpt_eval" / f"step_{step}"
        if not (out / "eval.json").is_file():
            run_eval(eval_config(str(ckpts[step]), s, seed, max_new, s.ckpt_eval_problems), out, progress=False)
    return steps


def prune_checkpoints(run_dir: Path) -> None:
    """Remove every checkpoint but the last (after the evaluations and probes that read them)."""
    import shutil

    ckpts = checkpoint_dirs(run_dir)
    for step, d in ckpts.items():
        if step != max(ckpts):
            shutil.rmtree(d)


def _job(arm: str, seed: int, run_dir: Path, s: ExperimentSettings, model_path: Path) -> dict[str, Any]:
    """Train (or resume), evaluate and probe one (arm, seed); runs in a worker process."""
    import torch

    import meshrl.testbed  # noqa: F401  (registers the testbed tasks in this worker process)
    from meshrl.evaluation import run_eval
    from meshrl.tasks import load_task
    from meshrl.trainer import load_config, train
    from meshrl.trainer.checkpoint import latest_checkpoint

    if (run_dir / "done.json").is_file():
        # Finished: trained, evaluated, probed and pruned. Its checkpoints may be gone (pruned, or the run came
        # from a pack), so the checkpoint test below would retrain it from scratch over its own files.
        return {"arm": arm, "seed": seed, "seconds": 0.0, "skipped": "done"}
    torch.set_num_threads(1)
    t0, cpu0 = time.perf_counter(), time.process_time()
    task = load_task(s.task, seed=seed)
    cfg = load_config(overrides=[*base_overrides(s, model_path, task.max_new_tokens), *ARMS[arm],
                                   *checkpoint_overrides(arm, s), f"seed={seed}"])
    ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
    done = json.loads((ckpt / "state.json").read_text())["step"] if ckpt else 0
    if done < cfg.steps:
        train(cfg, run_dir, resume=ckpt is not None)
    if not (run_dir / "eval" / "eval.json").is_file():
        run_eval(eval_config(str(run_dir), s, seed, task.max_new_tokens), run_dir / "eval", progress=False)
    eval_checkpoints(run_dir, s, seed, task.max_new_tokens)
    if arm in s.probe_arms:
        probe_run(run_dir, s, seed, model_path)
    if s.prune_checkpoints:
        prune_checkpoints(run_dir)
    # written last, after the pruning: done.json marks a run that is never touched again. Compute of this call
    # (a resumed run adds its calls' figures; training time is in metrics.jsonl)
    (run_dir / "done.json").write_text(json.dumps({"arm": arm, "seed": seed, "wall_s": time.perf_counter() - t0,
                                                   "cpu_s": time.process_time() - cpu0}))
    return {"arm": arm, "seed": seed, "seconds": time.perf_counter() - t0}


def probe_run(run_dir: Path, s: ExperimentSettings, seed: int, model_path: Path) -> Path:
    """``probes.jsonl``: :func:`probe_signals` at the warm start (step 0) and at every checkpoint."""
    from meshrl.tasks import load_task
    from meshrl.testbed.signals import probe_signals
    from meshrl.trainer.policy import load_policy
    from meshrl.trainer.runlog import read_jsonl

    path = run_dir / "probes.jsonl"
    done = {r["step"] for r in read_jsonl(path)} if path.is_file() else set()
    task = load_task(getattr(s, "task", "testbed:add"), seed=seed)
    problems = task.problems("eval")[-s.probe_problems:]  # disjoint from the first eval_problems when possible
    ckpts = {0: model_path, **checkpoint_dirs(run_dir)}
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
    task = load_task(s.task, seed=0)
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
    check_resumable(out, s)
    out.mkdir(parents=True, exist_ok=True)
    with experiment_lock(out):
        model_path = warm_start(seed=s.warm_seed, steps=s.warm_steps, progress=progress, task=s.task,
                                coach_variants=s.warm_coach_variants)
        write_settings(out, s, model_path)
        jobs = [(a, seed, out / "runs" / a / f"seed_{seed}") for seed in s.seeds for a in s.arms]
        jobs.sort(key=lambda j: j[0] not in s.probe_arms)  # probed baselines first: the signal data comes early
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


@contextmanager
def experiment_lock(out: Path) -> Iterator[None]:
    """Hold ``out/.lock`` exclusively for the whole experiment: two experiments training into one directory
    would resume each other's half-written runs. A second one fails at once, naming the holder's pid; the
    lock is the kernel's (``flock``), so a killed experiment never leaves a stale lock behind. Workers that
    outlive a killed parent are not covered: kill them too (docs/testbed.md, Reproduce)."""
    import fcntl
    import os

    fh = (out / ".lock").open("a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise RuntimeError(f"{out}: another `meshrl experiment` (pid {holder}) is running in this directory; wait "
                           "for it or use another --out") from None
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield
    finally:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def write_settings(out: Path, s: ExperimentSettings, model_path: Path) -> None:
    """``out/settings.json``: ``s``, with the arms, seeds and probed arms of earlier calls on the same
    directory kept (a call that adds one arm must not drop the others from the tables, which read these)."""
    path = out / "settings.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    new = {**asdict(s), "warm_start": str(model_path)}
    for key in ("arms", "seeds", "probe_arms"):
        new[key] = list(dict.fromkeys([*old.get(key, []), *new[key]]))
    path.write_text(json.dumps(new, indent=1))


#: settings that change what a finished run means; resuming with other values would mix two experiments
_PINNED = ("steps", "prompts_per_step", "group_size", "lr", "ppo_epochs", "mini_batches", "task", "warm_seed",
           "warm_steps", "warm_coach_variants", "eval_problems", "eval_n", "extra")


def check_resumable(out: Path, s: ExperimentSettings) -> None:
    """Refuse to resume ``out`` with settings that would change its finished runs (arms, seeds, workers and
    probing may change: new ones are added)."""
    path = out / "settings.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    new = json.loads(json.dumps(asdict(s)))  # tuples -> lists, as stored
    diff = [k for k in _PINNED if k in old and old[k] != new[k]]
    if diff:
        was = ", ".join(f"{k}={old[k]!r}" for k in diff)
        raise ValueError(f"{path}: this experiment was run with other settings ({was}); use another --out or the "
                         "same settings")


def preset_settings(name: str, **changes: Any) -> ExperimentSettings:
    """``ExperimentSettings`` of preset ``name`` (``PRESETS``) with ``changes`` on top (None = keep)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return ExperimentSettings(**{**PRESETS[name], **{k: v for k, v in changes.items() if v is not None}})
