"""Experiment sweeps: arms (recipe x overrides) x seeds, sequential, resumable, with budget parity.

Grid file (YAML)::

    out: runs/mu_sweep            # one run directory per arm and seed: OUT/ARM/seed_S
    seeds: [0, 1, 2]
    base:                         # any RunConfig keys, shared by every arm
      model: tiny
      task: tiny:add
      steps: 20
    arms:
      - name: grpo
        recipe: grpo
      - name: mesh
        recipe: mesh
        set: {mesh.m: 4}
        grid: {mesh.mu: [0, 1.0e-5, 1.0e-3, 1.0e-1]}   # expands into one arm per value

Arms compared in one table must have sampled the same number of rollouts; a mismatch is reported
loudly, because a method that saw more samples wins for that reason alone.
"""

from __future__ import annotations

import itertools
import json
import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshrl.jsonl import read_jsonl
from meshrl.runs.checkpoint import latest_checkpoint
from meshrl.trainer.config import RunConfig, load_config

log = logging.getLogger("meshrl")


@dataclass
class Arm:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted key -> value, recipe included


@dataclass
class Sweep:
    out: Path
    seeds: list[int]
    base: dict[str, Any]
    arms: list[Arm]

    def runs(self) -> list[tuple[Arm, int, Path]]:
        return [(a, s, self.out / a.name / f"seed_{s}") for a in self.arms for s in self.seeds]

    def config(self, arm: Arm, seed: int) -> RunConfig:
        return load_config(base=self.base, overrides=[f"{k}={_yaml_scalar(v)}" for k, v in arm.overrides.items()]
                           + [f"seed={seed}"])


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def load_sweep(path: Path) -> Sweep:
    """Parse and validate a grid file; every arm's config is built once here so errors come first."""
    if not path.is_file():
        raise ValueError(f"sweep file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    for key in ("arms",):
        if key not in data:
            raise ValueError(f"{path}: missing top-level key {key!r}")
    unknown = sorted(set(data) - {"out", "seeds", "base", "arms", "name"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {unknown}")
    arms: list[Arm] = []
    for i, spec in enumerate(data["arms"]):
        arms.extend(_expand_arm(spec, f"{path}: arms[{i}]"))
    names = [a.name for a in arms]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{path}: duplicate arm names {dupes}")
    sweep = Sweep(out=Path(data.get("out", path.with_suffix(""))), seeds=list(data.get("seeds", [0])),
                  base=dict(data.get("base") or {}), arms=arms)
    for arm in arms:
        try:
            sweep.config(arm, sweep.seeds[0])
        except ValueError as e:
            raise ValueError(f"{path}: arm {arm.name!r}: {e}") from e
    return sweep


def _expand_arm(spec: dict[str, Any], where: str) -> list[Arm]:
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(f"{where} must be a mapping with a 'name'")
    unknown = sorted(set(spec) - {"name", "recipe", "set", "grid"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}")
    base = dict(spec.get("set") or {})
    if "recipe" in spec:
        base["recipe"] = spec["recipe"]
    grid = spec.get("grid") or {}
    if not grid:
        return [Arm(spec["name"], base)]
    keys = list(grid)
    arms = []
    for values in itertools.product(*(grid[k] for k in keys)):
        label = ",".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values, strict=True))
        arms.append(Arm(f"{spec['name']}[{label}]", {**base, **dict(zip(keys, values, strict=True))}))
    return arms


def command_lines(sweep: Sweep) -> list[str]:
    """One ``meshrl train`` command per arm and seed, for an external scheduler."""
    lines = []
    for arm, seed, run_dir in sweep.runs():
        flat = {**_flatten(sweep.base), **arm.overrides}
        parts = ["meshrl", "train", "--out", str(run_dir), "--seed", str(seed), "--no-progress"]
        for k, v in flat.items():
            parts += ["--set", f"{k}={_yaml_scalar(v)}"]
        lines.append(shlex.join(parts))
    return lines


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("algo", "task_options"):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def run_sweep(sweep: Sweep) -> dict[str, Any]:
    """Run every arm x seed in turn (finished runs are skipped, partial ones resumed); then summarise."""
    from meshrl.trainer.loop import train

    for arm, seed, run_dir in sweep.runs():
        cfg = sweep.config(arm, seed)
        ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
        done = json.loads((ckpt / "state.json").read_text())["step"] if ckpt else 0
        if done >= cfg.steps:
            log.info("sweep: %s seed %d already finished (%d steps)", arm.name, seed, done)
            continue
        log.info("sweep: %s seed %d %s", arm.name, seed, "resuming" if ckpt else "starting")
        train(cfg, run_dir, resume=ckpt is not None)
    return summarize_sweep(sweep)


def summarize_sweep(sweep: Sweep) -> dict[str, Any]:
    rows = []
    for arm in sweep.arms:
        per_seed = []
        for seed in sweep.seeds:
            path = sweep.out / arm.name / f"seed_{seed}" / "metrics.jsonl"
            if path.is_file():
                per_seed.append(read_jsonl(path))
        rows.append(_arm_row(arm.name, per_seed))
    totals = {t for r in rows for t in r["rollouts_per_seed"]}
    parity = len(totals) <= 1
    if not parity:
        log.warning("BUDGET PARITY VIOLATED: arms sampled different numbers of rollouts %s; their results are "
                    "not comparable as they stand", sorted(totals))
    summary = {"out": str(sweep.out), "seeds": sweep.seeds, "budget_parity": parity, "arms": rows}
    sweep.out.mkdir(parents=True, exist_ok=True)
    (sweep.out / "sweep_summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _arm_row(name: str, per_seed: list[list[dict[str, Any]]]) -> dict[str, Any]:
    def final(key: str) -> list[float]:
        return [rows[-1][key] for rows in per_seed if rows and isinstance(rows[-1].get(key), int | float)]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    totals = [sum(r.get("rollouts/count", 0) for r in rows) for rows in per_seed]
    return {
        "arm": name,
        "seeds_done": len(per_seed),
        "steps": [len(rows) for rows in per_seed],
        "rollouts_per_seed": totals,
        "final_reward_mean": mean(final("reward/mean")),
        "final_acc_mean": mean(final("acc/mean")),
        "final_eval_mean@1": mean(final("eval/mean@1")),
    }
