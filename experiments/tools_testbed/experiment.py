"""The tool-use collapse experiment on ``testbed:tools``: every arm x seed from one warm start, with the tool share
and the accuracy per problem type measured at every checkpoint.

``run_experiment(out, settings)`` trains each (arm, seed) into ``out/runs/ARM/seed_S`` (one at a time, in this
process: the experiment runs on one core), measures :func:`meshrl.testbed.tools_measure.tool_report` on held-out
problems at the warm start (``out/warm_report.json``, once) and at every kept checkpoint
(``tool_report.jsonl``, one line per step), then writes ``done.json``. Everything is resumable: a run with
``done.json`` is skipped, a half-trained run resumes from its last checkpoint, a measured step is not measured
again. ``summarize(out)`` reads it all back into ``results.json`` and ``results.md``.

The arms (``arms.yaml``) share ``meshrl.testbed.runconfig.base_overrides`` (a matched budget: every arm samples
P x G episodes a step) plus :data:`TOOLS_KEYS`; the settings pinned by a finished run (:data:`PINNED`) cannot
change on resume.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from experiments.collapse_testbed.experiment import checkpoint_dirs, experiment_lock, prune_checkpoints
from meshrl.testbed.runconfig import base_overrides
from meshrl.yaml_files import read_yaml_mapping

log = logging.getLogger("meshrl")
HERE = Path(__file__).resolve().parent
ARMS_FILE = HERE / "arms.yaml"
#: keys every arm of this testbed adds to the shared base: two coach plans (Mesh), no periodic trainer evaluation
#: (the tool report replaces it) and no MEI diagnostic (it would score every episode once more per step)
TOOLS_KEYS = ("mesh.m=2", "eval.every=0", "diag.mei.every=0")


def load_arms(path: Path = ARMS_FILE) -> dict[str, list[str]]:
    """Arm name -> ``meshrl train`` keys, in the file's order; every entry a list of ``key=value`` strings."""
    data = read_yaml_mapping(path, "arms file")  # file and line named; a repeated arm name is refused
    for name, keys in data.items():
        if not isinstance(keys, list) or not all(isinstance(k, str) and "=" in k for k in keys):
            raise ValueError(f"{path}: arm {name!r} must be a list of key=value strings, got {keys!r}")
    return {str(k): list(v) for k, v in data.items()}


ARMS: dict[str, list[str]] = load_arms()


@dataclass(frozen=True)
class ToolsSettings:
    """Sizes of the experiment (``base_overrides`` reads ``steps`` ... ``mini_batches``, ``task`` and ``extra``)."""

    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 8  # = mesh.m 2 x 4 episodes per plan at the matched budget
    lr: float = 3e-4
    ppo_epochs: int = 1
    mini_batches: int = 2
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    arms: tuple[str, ...] = ("grpo", "fork", "mesh", "guide_log")
    ckpt_every: int = 8  # measure a checkpoint every this many steps (the last one always)
    report_problems: int = 64  # held-out problems per measurement, half of each type
    report_n: int = 4  # episodes per problem
    task: str = "testbed:tools"
    warm_seed: int = 0
    warm_recipe: str = "two-stage"  # meshrl.testbed.tools_warm.default_tools_warm_start (STAGE1, STAGE2)
    extra: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}; known (arms.yaml): {', '.join(ARMS)}")
        if self.steps < 1 or self.ckpt_every < 1 or self.report_problems < 2 or self.report_n < 1:
            raise ValueError(f"need steps, ckpt_every, report_n >= 1 and report_problems >= 2, got {self}")
        if self.group_size % 2:
            raise ValueError(f"group_size must be even (mesh.m = 2 plans share it), got {self.group_size}")


#: settings that change what a finished run means; resuming with other values would mix two experiments
PINNED = ("steps", "prompts_per_step", "group_size", "lr", "ppo_epochs", "mini_batches", "ckpt_every",
          "report_problems", "report_n", "task", "warm_seed", "warm_recipe", "extra")


def check_resumable(out: Path, s: ToolsSettings) -> None:
    """Refuse to resume ``out`` with settings that would change its finished runs (arms and seeds may grow)."""
    path = out / "settings.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    new = json.loads(json.dumps(asdict(s)))
    diff = [k for k in PINNED if k in old and old[k] != new[k]]
    if diff:
        was = ", ".join(f"{k}={old[k]!r}" for k in diff)
        raise ValueError(f"{path}: this experiment was run with other settings ({was}); use another --out or the "
                         "same settings")


def write_settings(out: Path, s: ToolsSettings, model_path: Path) -> None:
    path = out / "settings.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    new = {**asdict(s), "warm_start": str(model_path)}
    for key in ("arms", "seeds"):
        new[key] = list(dict.fromkeys([*old.get(key, []), *new[key]]))
    path.write_text(json.dumps(new, indent=1))


def report_problems(s: ToolsSettings, seed: int) -> list[Any]:
    """The held-out problems of a measurement: ``report_problems`` eval-pool problems, half of each type (the niche
    is a minority in training, not in the measurement)."""
    from meshrl.testbed.tools_task import ToolsTestbed

    return ToolsTestbed(seed=seed, size=1, eval_size=s.report_problems, mix="add:1,mul:1").problems("eval")


def measure(model_dir: Path, s: ToolsSettings, seed: int) -> dict[str, Any]:
    """:func:`tool_report` of the model in ``model_dir`` (a warm start or a checkpoint) on the seed's report
    problems (sampling seeded)."""
    from meshrl.tasks import load_task
    from meshrl.testbed.tools_measure import tool_report
    from meshrl.trainer import load_policy

    model, tok, _ = load_policy(str(model_dir))  # a warm start, or a run's checkpoint step_N
    task = load_task(s.task, seed=seed)
    return tool_report(model, tok, task, report_problems(s, seed), n=s.report_n, seed=10_000 + seed)


def train_keys(arm: str, s: ToolsSettings, model_path: Path, seed: int) -> list[str]:
    """The ``meshrl train`` keys of one (arm, seed)."""
    from meshrl.testbed.tools_task import MAX_TURN_TOKENS

    keep = s.steps // s.ckpt_every + 1
    return [*base_overrides(s, model_path, MAX_TURN_TOKENS), *TOOLS_KEYS, *ARMS[arm],
            f"checkpoint.every={min(s.ckpt_every, s.steps)}", f"checkpoint.keep_last={keep}", f"seed={seed}"]


def run_job(arm: str, seed: int, run_dir: Path, s: ToolsSettings, model_path: Path) -> dict[str, Any]:
    """Train (or resume) one (arm, seed), measure its checkpoints, prune them, write ``done.json``."""
    import torch

    import meshrl.testbed  # noqa: F401  (registers testbed:tools)
    from experiments._runs import made_by
    from meshrl.runs.checkpoint import latest_checkpoint
    from meshrl.trainer import load_config, train

    if (run_dir / "done.json").is_file():
        return {"arm": arm, "seed": seed, "skipped": "done"}
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = load_config(overrides=train_keys(arm, s, model_path, seed))
    ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
    done = json.loads((ckpt / "state.json").read_text())["step"] if ckpt else 0
    if done < cfg.steps:
        train(cfg, run_dir, resume=ckpt is not None)
    measure_checkpoints(run_dir, s, seed)
    prune_checkpoints(run_dir)
    (run_dir / "done.json").write_text(json.dumps({"arm": arm, "seed": seed, "wall_s": time.perf_counter() - t0,
                                                   **made_by()}))
    return {"arm": arm, "seed": seed, "seconds": time.perf_counter() - t0}


def measure_checkpoints(run_dir: Path, s: ToolsSettings, seed: int) -> list[int]:
    """A ``tool_report.jsonl`` line for every kept checkpoint at a multiple of ``ckpt_every`` (and the last)."""
    from meshrl.jsonl import read_jsonl

    path = run_dir / "tool_report.jsonl"
    have = {r["step"] for r in read_jsonl(path)} if path.is_file() else set()
    ckpts = checkpoint_dirs(run_dir)
    steps = [k for k in sorted(ckpts) if (k % s.ckpt_every == 0 or k == max(ckpts)) and k not in have]
    for step in steps:
        report = measure(ckpts[step], s, seed)
        with path.open("a") as fh:
            fh.write(json.dumps({"step": step, "report": report}) + "\n")
    return steps


def run_experiment(out: Path, s: ToolsSettings, *, progress: bool = False) -> Path:
    """Every (arm, seed) of ``s`` into ``out/runs/ARM/seed_S``, seeds outermost (a partial experiment has every
    arm at its first seeds); then ``summarize``."""
    from meshrl.testbed.tools_warm import default_tools_warm_start

    check_resumable(out, s)
    out.mkdir(parents=True, exist_ok=True)
    with experiment_lock(out):
        model_path = default_tools_warm_start(seed=s.warm_seed, threads=1, progress=progress)
        write_settings(out, s, model_path)
        warm = out / "warm_report.json"
        if not warm.is_file():
            warm.write_text(json.dumps({"report": measure(model_path, s, s.warm_seed)}, indent=1))
        for seed in s.seeds:
            for arm in s.arms:
                result = run_job(arm, seed, out / "runs" / arm / f"seed_{seed}", s, model_path)
                log.info("tools experiment: %s", result)
                summarize(out)
    return out


# ----------------------------------------------------------------------------------------------- results
def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def summarize(out: Path) -> dict[str, Any]:
    """``results.json`` (per run: the report at every measured step) and ``results.md`` (the tables)."""
    from meshrl.jsonl import read_jsonl

    settings = json.loads((out / "settings.json").read_text())
    warm = json.loads((out / "warm_report.json").read_text())["report"] if (out / "warm_report.json").is_file() \
        else None
    runs: dict[str, dict[str, Any]] = {}
    for arm in settings["arms"]:
        for seed in settings["seeds"]:
            run_dir = out / "runs" / arm / f"seed_{seed}"
            if (run_dir / "done.json").is_file():
                rows = read_jsonl(run_dir / "tool_report.jsonl")
                runs.setdefault(arm, {})[str(seed)] = {str(r["step"]): r["report"] for r in rows}
    results = {"settings": settings, "warm": warm, "runs": runs}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(results_markdown(results))
    return results


def results_markdown(results: dict[str, Any]) -> str:
    """The tables of ``results.md``: final held-out accuracy and niche tool share per arm, the niche tool share at
    every measured step, and how many seeds stopped calling the tool on the niche."""
    s, warm, runs = results["settings"], results["warm"], results["runs"]
    lines = [f"# testbed:tools: {s['steps']} steps, P={s['prompts_per_step']} x G={s['group_size']}, "
             f"{s['report_problems']} held-out problems (half mul) x {s['report_n']} episodes per measurement", ""]
    if warm:
        lines += ["Warm start: " + ", ".join(
            f"{t}: acc {warm[t]['accuracy']:.2f}, tool share {warm[t]['tool_share']:.2f}, acc with tool "
            f"{_fmt(warm[t]['acc_tool'])}, direct {_fmt(warm[t]['acc_direct'])}" for t in ("add", "mul")), ""]
    lines += ["| arm | seeds | acc add | acc mul | tool share add | tool share mul | seeds mul share < 0.1 |",
              "|---|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        finals = [rep[max(rep, key=int)] for rep in seeds.values()]
        mul_share = [f["mul"]["tool_share"] or 0.0 for f in finals]
        lines.append(f"| {arm} | {len(finals)} | {_mean_sd([f['add']['accuracy'] for f in finals])} | "
                     f"{_mean_sd([f['mul']['accuracy'] for f in finals])} | "
                     f"{_mean_sd([f['add']['tool_share'] or 0.0 for f in finals])} | {_mean_sd(mul_share)} | "
                     f"{sum(v < 0.1 for v in mul_share)} |")
    for metric, title in (("tool_share", "Tool share"), ("accuracy", "Accuracy")):
        lines += ["", f"{title} on the niche (mul) by step (0 = the warm start), mean over seeds:", ""]
        lines += _by_step(runs, warm, metric)
    return "\n".join(lines) + "\n"


def _by_step(runs: dict[str, Any], warm: dict[str, Any] | None, metric: str) -> list[str]:
    steps = sorted({int(k) for seeds in runs.values() for rep in seeds.values() for k in rep})
    lines = ["| arm | " + " | ".join(["0", *map(str, steps)]) + " |", "|---" * (len(steps) + 2) + "|"]
    for arm, seeds in runs.items():
        cells = [_fmt(warm["mul"][metric]) if warm else "-"]
        for step in steps:
            vals = [rep[str(step)]["mul"][metric] or 0.0 for rep in seeds.values() if str(step) in rep]
            cells.append(_fmt(statistics.mean(vals)) if vals else "-")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
