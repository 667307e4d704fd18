"""The testbed experiment: every arm x seeds from one warm start, evaluated, checkpoint-evaluated and probed.

``run_experiment(out)`` trains each (arm, seed) from the same warm start, evaluates the final policy on
held-out problems (pass@k, by problem type), evaluates every kept checkpoint on a smaller held-out set
(``ckpt_eval``: final vs best checkpoint), and for the probed arms probes every checkpoint with
:func:`meshrl.testbed.signals.probe_signals` (the warning-signal data). Runs go ``workers`` at a time
(one thread each) and everything is resumable: a finished run, evaluation or probe is never redone.
``summarize_experiment(out)`` (``results.py``) reads it all back into ``results.json`` (README.md).

The arms (``arms.yaml``) and the presets (``presets.yaml``: ``round1``, the first experiment; ``round2``, the
default, the second; ``plugins``, GRPO with each of the reading list's entropy-collapse plug-ins) are data,
read once at import.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from experiments.collapse_testbed.results import BASELINE_PROBES
from meshrl.testbed.runconfig import base_overrides, eval_config
from meshrl.yaml_files import read_yaml_mapping

log = logging.getLogger("meshrl")
HERE = Path(__file__).resolve().parent
ARMS_FILE = HERE / "arms.yaml"
PRESETS_FILE = HERE / "presets.yaml"
__all__ = ["ARMS", "PRESETS", "ExperimentSettings", "base_overrides", "eval_config", "run_experiment"]


def load_arms(path: Path = ARMS_FILE) -> dict[str, list[str]]:
    """Arm name -> ``meshrl train`` keys, in the file's order; every entry a list of ``key=value`` strings."""
    arms = read_yaml_mapping(path, "experiment file")  # file and line named; a repeated name is refused
    for name, keys in arms.items():
        if not isinstance(keys, list) or not all(isinstance(k, str) and "=" in k for k in keys):
            raise ValueError(f"{path}: arm {name!r} must be a list of key=value strings, got {keys!r}")
    return {str(name): list(keys) for name, keys in arms.items()}


def load_presets(arms: dict[str, list[str]], path: Path = PRESETS_FILE) -> dict[str, dict[str, Any]]:
    """Preset name -> ExperimentSettings fields (lists as tuples); fields and arm names are checked."""
    known = {f.name for f in fields(ExperimentSettings)}
    presets: dict[str, dict[str, Any]] = {}
    for name, values in read_yaml_mapping(path, "experiment file").items():
        values = values or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: preset {name!r} must be a mapping of settings, got {values!r}")
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: preset {name!r}: unknown setting(s) {unknown}; known: {sorted(known)}")
        for key in ("arms", "probe_arms"):
            bad = [a for a in values.get(key, ()) if a not in arms]
            if bad:
                raise ValueError(f"{path}: preset {name!r}: {key} has unknown arm(s) {bad}; see {ARMS_FILE.name}")
        presets[str(name)] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return presets


#: arm name -> config overrides on top of the shared base (matched budget: every arm samples P x G).
ARMS: dict[str, list[str]] = load_arms()
#: the default preset: its arms, seeds and probed arms are ExperimentSettings' defaults
DEFAULT_PRESET = "round2"
_DEFAULTS = {k: tuple(v) for k, v in yaml.safe_load(PRESETS_FILE.read_text())[DEFAULT_PRESET].items()}


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
    # feature maps the probes compute MEI and kernels on (meshrl.testbed.signals.FEATURES); "full", the exact
    # Fisher score over every parameter, is most of a probe's time (about 7 of 9 s at 16 x 16 rollouts)
    probe_features: tuple[str, ...] = ("bias", "head", "full")
    eval_problems: int = 256
    eval_n: int = 8
    ks: tuple[int, ...] = (1, 2, 4, 8)
    seeds: tuple[int, ...] = _DEFAULTS["seeds"]  # >= 5: GRPO's outcome is bimodal across seeds
    arms: tuple[str, ...] = _DEFAULTS["arms"]
    probe_arms: tuple[str, ...] = _DEFAULTS["probe_arms"]  # warning signals (checkpoint probes)
    ckpt_eval_every: int = 8  # evaluate a checkpoint every this many steps, every arm (0 = final only)
    ckpt_eval_problems: int = 128
    task: str = "testbed:add"  # or "testbed:audit", the second family
    warm_seed: int = 0
    warm_steps: int = 700  # = meshrl.testbed.warm.DEFAULT_STEPS
    # The applicable coach (arms.yaml) repeats procedures in other words (COACH_VARIANTS): every arm starts from
    # a warm start that was taught all the phrasings, so that all arms share one starting point.
    warm_coach_variants: bool = True
    # A shipped warm start (shipped.py: W1, W2, W3) by name: its weights, SHA-256 checked, instead of a build from
    # the warm_* settings above (which it sets to its own). "" builds or reuses the cached one, as before.
    warm: str = ""
    # Also evaluate the warm start on each seed's checkpoint-evaluation problems (warm_eval/seed_S): the step-0
    # point of every arm's niche curve (persistence.py); off by default, so earlier experiments are unchanged.
    ckpt_eval_warm: bool = False
    prune_checkpoints: bool = True  # keep only the last checkpoint once a run is evaluated and probed
    workers: int = 2
    niche_kept_at: float = 0.5  # a seed keeps the niche when its held-out headline-niche accuracy >= this
    extra: tuple[str, ...] = field(default_factory=tuple)  # more overrides for every arm


def checkpoint_every(arm: str, s: ExperimentSettings) -> int:
    """Probed arms keep a checkpoint every ``probe_every`` steps, the others every ``ckpt_eval_every``
    (only the last one when that is 0)."""
    if arm in s.probe_arms:
        return max(1, s.probe_every)
    return s.ckpt_eval_every if 0 < s.ckpt_eval_every < s.steps else max(s.steps, 1)


def checkpoint_overrides(arm: str, s: ExperimentSettings) -> list[str]:
    every = checkpoint_every(arm, s)
    return [f"checkpoint.every={every}", f"checkpoint.keep_last={s.steps // every + 1}"]


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
    from experiments._runs import abort_reason, made_by, trainer_stops
    from meshrl.evaluation import run_eval
    from meshrl.jsonl import atomic_write_text
    from meshrl.runs.checkpoint import latest_checkpoint
    from meshrl.tasks import load_task
    from meshrl.trainer import load_config, train

    if (run_dir / "done.json").is_file():
        # Finished: trained, evaluated, probed and pruned. Its checkpoints may be gone (pruned, or the run came
        # from a pack), so the checkpoint test below would retrain it from scratch over its own files.
        return {"arm": arm, "seed": seed, "seconds": 0.0, "skipped": "done"}
    torch.set_num_threads(1)
    t0, cpu0 = time.perf_counter(), time.process_time()
    task = load_task(s.task, seed=seed)
    traces = expert_traces(run_dir.parents[2], task, seed) if reads_expert_traces(arm) else None
    cfg = load_config(overrides=[*base_overrides(s, model_path, task.max_new_tokens), *arm_keys(arm, traces),
                                   *checkpoint_overrides(arm, s), f"seed={seed}"])
    ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
    done = json.loads((ckpt / "state.json").read_text())["step"] if ckpt else 0
    if done < cfg.steps:
        try:
            train(cfg, run_dir, resume=ckpt is not None)
        except trainer_stops() as err:
            # the trainer ended the run: a result (a divergence), recorded and never resumed (a resume would reset
            # the failure counters and could finish it looking normal); not evaluated, so out of the tables, which
            # name it (results.incomplete_parts)
            record = {"arm": arm, "seed": seed, "aborted": abort_reason(err, run_dir),
                      "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, **made_by()}
            atomic_write_text(run_dir / "done.json", json.dumps(record))
            return {"arm": arm, "seed": seed, "seconds": record["wall_s"], "aborted": record["aborted"]}
    if not (run_dir / "eval" / "eval.json").is_file():
        run_eval(eval_config(str(run_dir), s, seed, task.max_new_tokens), run_dir / "eval", progress=False)
    eval_checkpoints(run_dir, s, seed, task.max_new_tokens)
    if arm in s.probe_arms:
        probe_run(run_dir, s, seed, model_path)
    if s.prune_checkpoints:
        prune_checkpoints(run_dir)
    # written last, after the pruning: done.json marks a run that is never touched again. Compute of this call
    # (a resumed run adds its calls' figures; training time is in metrics.jsonl), the CPU that made it (float
    # rounding follows the CPU's vector instructions, so a seed reproduces bit for bit only on a like machine) and
    # the code of this call (meshrl.provenance; each start's is in events.jsonl's run_start records)
    atomic_write_text(run_dir / "done.json", json.dumps({"arm": arm, "seed": seed, "wall_s": time.perf_counter() - t0,
                                                         "cpu_s": time.process_time() - cpu0, **made_by()}))
    return {"arm": arm, "seed": seed, "seconds": time.perf_counter() - t0}


def aborted(run_dir: Path) -> str | None:
    """Why the trainer ended this run early (its ``done.json``), None for a run that was not."""
    done = run_dir / "done.json"
    try:
        return json.loads(done.read_text()).get("aborted") if done.is_file() else None
    except json.JSONDecodeError:  # a done.json written before it was written atomically, cut by a kill
        return None


#: In an arm's keys, the path of the expert traces of the run's training problems (:func:`expert_traces`).
EXPERT_TRACES = "{expert_traces}"


def reads_expert_traces(arm: str) -> bool:
    return any(EXPERT_TRACES in k for k in ARMS[arm])


def arm_keys(arm: str, traces: Path | None) -> list[str]:
    """The arm's config keys with :data:`EXPERT_TRACES` replaced by ``traces``."""
    if reads_expert_traces(arm) and traces is None:
        raise ValueError(f"arm {arm} reads expert traces: give their file")
    return [k.replace(EXPERT_TRACES, str(traces)) for k in ARMS[arm]]


def expert_traces(out: Path, task: Any, seed: int) -> Path:
    """``OUT/expert_traces/seed_S.jsonl``: for every training problem of the task at ``seed``, the reference trace
    of its home procedure (the one its type needs: column addition on ``low``, round-and-adjust on ``carry``,
    tens-then-ones on ``decade``), as ``{"id", "completion"}`` lines (the format of ``plugins.luffy.traces``).
    The expert-guided arms (CalibRL, SFT inside RL) read it: an expert that always picks the procedure that
    fits, which is information the GRPO arms never get. Written once per seed, atomically."""
    from meshrl.jsonl import atomic_write_text

    path = out / "expert_traces" / f"seed_{seed}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"id": p.id, "completion": task.reference_trace(p, p.meta["home"])})
                 for p in task.problems("train")]
        atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def probe_run(run_dir: Path, s: ExperimentSettings, seed: int, model_path: Path) -> Path:
    """``probes.jsonl``: :func:`probe_signals` at the warm start (step 0) and at every checkpoint."""
    from meshrl.jsonl import read_jsonl
    from meshrl.tasks import load_task
    from meshrl.testbed.signals import probe_signals
    from meshrl.trainer import load_policy

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
            res = probe_signals(model, tok, task, problems, group_size=s.probe_group, seed=seed * 1000 + step,
                                features=s.probe_features)
            with (run_dir / "probes_per_problem.jsonl").open("a") as pp:
                pp.writelines(json.dumps({"step": step, **rec}) + "\n" for rec in res["per_problem"])
            fh.write(json.dumps({"step": step, **res["scalars"]}) + "\n")
            fh.flush()
    return path


def baseline_probes(out: Path, s: ExperimentSettings, model_path: Path, n: int = BASELINE_PROBES) -> dict[str, Any]:
    """Probe the warm start ``n`` times with different sampling seeds: the spread that calibrates each
    signal's threshold (mean +- 3 sd)."""
    from meshrl.jsonl import read_jsonl
    from meshrl.models import load_model
    from meshrl.tasks import load_task
    from meshrl.testbed.signals import probe_signals

    path = out / "baseline_probes.jsonl"
    have = len(read_jsonl(path)) if path.is_file() else 0
    task = load_task(s.task, seed=0)
    problems = task.problems("eval")[-s.probe_problems:]
    model, tok = load_model(str(model_path))
    with path.open("a") as fh:
        for k in range(have, n):
            res = probe_signals(model, tok, task, problems, group_size=s.probe_group, seed=10_000 + k,
                                features=s.probe_features)
            fh.write(json.dumps({"probe_seed": 10_000 + k, **res["scalars"]}) + "\n")
            with (out / "baseline_per_problem.jsonl").open("a") as pp:
                pp.writelines(json.dumps({"probe_seed": 10_000 + k, **rec}) + "\n" for rec in res["per_problem"])
    return {"baseline_probes": str(path)}


def experiment_warm_start(s: ExperimentSettings, *, progress: bool) -> Path:
    """The warm start's directory: the shipped one named by ``s.warm`` (SHA-256 verified), else built or
    reused from the cache by its settings."""
    from experiments.collapse_testbed.shipped import WARM_STARTS, shipped_warm_start
    from meshrl.testbed.warm import warm_start

    if s.warm:
        fields_of = WARM_STARTS[s.warm].experiment_fields() if s.warm in WARM_STARTS else {}
        differ = {k: getattr(s, k) for k, v in fields_of.items() if getattr(s, k) != v}
        if differ:
            raise ValueError(f"warm start {s.warm} is built with {fields_of}; these settings say {differ}")
        return shipped_warm_start(s.warm, s.task)
    return warm_start(seed=s.warm_seed, steps=s.warm_steps, progress=progress, task=s.task,
                      coach_variants=s.warm_coach_variants)


def eval_warm_start(out: Path, s: ExperimentSettings, seed: int, model_path: Path) -> dict[str, Any]:
    """``out/warm_eval/seed_S/eval.json``: the warm start on seed ``seed``'s checkpoint-evaluation problems, with
    the checkpoint evaluations' sampling (the step-0 point of the niche curves); done once per seed."""
    import torch

    import meshrl.testbed  # noqa: F401  (registers the testbed tasks in this worker process)
    from meshrl.evaluation import run_eval
    from meshrl.tasks import load_task

    target = out / "warm_eval" / f"seed_{seed}"
    if not (target / "eval.json").is_file():
        torch.set_num_threads(1)
        max_new = load_task(s.task, seed=seed).max_new_tokens
        run_eval(eval_config(str(model_path), s, seed, max_new, s.ckpt_eval_problems), target, progress=False)
    return {"warm_eval": seed}


def run_experiment(out: Path, s: ExperimentSettings | None = None, *, progress: bool = True) -> Path:
    """Run every (arm, seed) of ``s`` into ``out/runs/ARM/seed_S``; return ``out``."""
    from meshrl.progress import progress_bar

    s = s or ExperimentSettings()
    unknown = [a for a in s.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    check_resumable(out, s)
    out.mkdir(parents=True, exist_ok=True)
    with experiment_lock(out):
        model_path = experiment_warm_start(s, progress=progress)
        write_settings(out, s, model_path)
        jobs = [(a, seed, out / "runs" / a / f"seed_{seed}") for seed in s.seeds for a in s.arms]
        jobs.sort(key=lambda j: j[0] not in s.probe_arms)  # probed baselines first: the signal data comes early
        n_warm_evals = len(s.seeds) if s.ckpt_eval_warm and s.ckpt_eval_every > 0 else 0
        with worker_pool(s.workers) as pool, progress_bar("experiment", total=len(jobs) + 1 + n_warm_evals,
                                                          enabled=progress) as bar:
            # the warm start's evaluations and probes first (seconds each): a partial experiment's curves then
            # have step 0, and its signals their thresholds
            futures = [pool.submit(eval_warm_start, out, s, seed, model_path) for seed in s.seeds[:n_warm_evals]]
            futures.append(pool.submit(baseline_probes, out, s, model_path))
            futures += [pool.submit(_job, a, seed, d, s, model_path) for a, seed, d in jobs]
            for fut in as_completed(futures):
                res = fut.result()
                log.info("experiment: %s", res)
                bar()
    return out


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """The experiment's worker processes (spawned: a fresh interpreter each), set up by :func:`_worker_init`."""
    import multiprocessing as mp
    import os

    return ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                               initargs=(os.getpid(),))


def _worker_init(parent: int) -> None:
    """In each worker, before any job: die with the parent, and compute on exactly one thread.

    A worker that outlived a killed experiment would keep writing into its run directory while a rerun (the
    lock released with the parent) resumes the same runs. ``PR_SET_PDEATHSIG`` (Linux) makes the kernel send
    SIGKILL when the parent ends; the worker's own update workers and scorers end with it (they watch their
    pipes or arm the same signal). The one thread is set here, not left to torch's default, which follows the
    machine's cores, ``OMP_NUM_THREADS`` and the CPU affinity: a rerun on another thread count changes the
    reductions' order and so the probes' last bits (the baseline probes, which set no thread count of their
    own, differed at 1e-13 between a run and its rerun)."""
    import ctypes
    import os
    import signal
    import sys

    import torch

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
    torch.set_num_threads(1)


@contextmanager
def experiment_lock(out: Path, *, doing: str = "run") -> Iterator[None]:
    """Hold ``out/.lock`` exclusively while an experiment runs or is summarized: two experiments training into
    one directory would resume each other's half-written runs, and a summary taken during a run mixes finished
    and half-written ones. A second holder is refused at once (``ValueError``, one line naming the holder's
    pid); the lock is the kernel's (``flock``), so a killed experiment never leaves a stale lock behind, and
    its workers die with it (:func:`_worker_init`). ``doing`` names the refused action in the message."""
    import fcntl
    import os

    try:
        fh = (out / ".lock").open("a+")
    except OSError as e:  # --out is a file, or a directory this user cannot write
        raise ValueError(f"{out / '.lock'}: cannot create the experiment's lock ({e.strerror or e}); use another "
                         "--out") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise ValueError(f"{out}: cannot {doing}: another experiment (pid {holder}, lock {out / '.lock'}) is "
                         "running in this directory; wait for it or use another --out") from None
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
           "warm_steps", "warm_coach_variants", "warm", "eval_problems", "eval_n", "extra")


def check_resumable(out: Path, s: ExperimentSettings) -> None:
    """Refuse to resume ``out`` with settings that would change its finished runs (arms, seeds, workers and
    probing may change: new ones are added)."""
    path = out / "settings.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    old.setdefault("warm", "")  # written before shipped warm starts existed: built from the warm_* settings
    new = json.loads(json.dumps(asdict(s)))  # tuples -> lists, as stored
    diff = [k for k in _PINNED if k in old and old[k] != new[k]]
    if diff:
        was = ", ".join(f"{k}={old[k]!r}" for k in diff)
        raise ValueError(f"{path}: this experiment was run with other settings ({was}); use another --out or the "
                         "same settings")


PRESETS: dict[str, dict[str, Any]] = load_presets(ARMS)


def preset_settings(name: str, **changes: Any) -> ExperimentSettings:
    """``ExperimentSettings`` of preset ``name`` (``PRESETS``) with ``changes`` on top (None = keep)."""
    from experiments.collapse_testbed.shipped import apply_warm

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    values = {**PRESETS[name], **{k: v for k, v in changes.items() if v is not None}}
    if values.get("warm"):  # the shipped warm start's own settings replace the preset's warm_* settings
        values = apply_warm(values["warm"], values)
    return ExperimentSettings(**values)
