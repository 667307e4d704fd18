"""``meshrl census``: epsilon-strategies and their masses per query from logged rollouts."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "census", help="count the strategies each query's rollouts still span (coupling kernel)",
        description="Reads rollout rows (JSONL with prompt, completion, problem_id and optional step, truncated, "
        "system; e.g. a run's samples.jsonl), groups them by --group-key, computes exact Fisher scores of "
        "every rollout under --model, the coupling kernel, the epsilon-partition into strategies and the "
        "strategy masses by count and by normalised sequence probability. Malformed rows and groups with "
        "fewer than 2 rollouts are skipped and counted.")
    p.add_argument("--model", required=True, help="tiny | smollm2-135m | local HF dir | RUN_DIR | "
                   "RUN_DIR/checkpoints/step_N")
    p.add_argument("--rollouts", required=True, type=Path, help="rollouts JSONL")
    p.add_argument("--eps", type=float, default=0.05, help="neighbourhood radius of the partition")
    p.add_argument("--params", help="comma list of parameter names or globs (default: all trainable)")
    p.add_argument("--sketch-dim", type=int, help="count-sketch size of the scores (large models)")
    p.add_argument("--group-key", default="step,problem_id", help="comma list of fields that define a group")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--json", action="store_true", help="print the full result as JSON instead of a table")
    p.add_argument("--out", type=Path, help="also write the full JSON result here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _masses(x: list[float] | None, top: int = 4) -> str:
    """The ``top`` largest masses, then how many smaller ones were left out."""
    if x is None:
        return "-"
    ordered = sorted(x, reverse=True)
    shown = " ".join(f"{v:.2f}" for v in ordered[:top])
    return shown + (f" (+{len(ordered) - top})" if len(ordered) > top else "")


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    keys = result["group_key"]
    table = Table(title=f"strategy census  eps={result['eps']}  model={result['model_description']}")
    for k in keys:
        table.add_column(k)
    for col in ("rollouts", "strategies", "count masses", "prob masses", "mean cos"):
        table.add_column(col, justify="right" if col in ("rollouts", "strategies", "mean cos") else "left")
    for g in result["groups"]:
        table.add_row(*[str(g["key"][k]) for k in keys], str(g["n_rollouts"]), str(g["n_strategies"]),
                      _masses(g["count_mass"]), _masses(g["prob_mass"]), _num(g["mean_kernel_cos"]))
    t = result["total"]
    table.add_section()
    table.add_row("total", *[""] * (len(keys) - 1), str(t["n_rollouts"]),
                  f"{t['strategies_total']} (mean {_num(t['strategies_mean'], '.2f')})",
                  f"max mean {_num(t['max_count_mass_mean'])}", f"max mean {_num(t['max_prob_mass_mean'])}", "")
    sketch = f" sketched to {result['sketch_dim']}" if result["sketch_dim"] else ""
    console = Console()
    console.print(table)
    console.print(f"groups: {t['n_groups']}  strategies per group (histogram): {t['n_strategies_hist']}",
                  soft_wrap=True)
    console.print(f"rows read: {result['rows_read']}  rows skipped (malformed): {result['rows_skipped']}  "
                  f"groups skipped (< 2 rollouts): {result['groups_skipped_small']}", soft_wrap=True)
    console.print(f"params: {result['n_params']}{sketch}  temperature: {result['temperature']}", soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    from meshrl.analysis import census, nan_to_none

    group_key = tuple(s.strip() for s in args.group_key.split(",") if s.strip())
    result = census(args.model, args.rollouts, eps=args.eps, params=args.params, sketch_dim=args.sketch_dim,
                    group_key=group_key, temperature=args.temperature, seed=args.seed, device=args.device,
                    progress=not args.no_progress)
    text = json.dumps(nan_to_none(result), indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print_table(result)
    return 0
