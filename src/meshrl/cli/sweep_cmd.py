"""``meshrl sweep GRID.yaml``: arms x seeds, run one after another (resumable) or printed for a scheduler."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a grid of arms x seeds with budget-parity checks",
                       description="See src/meshrl/trainer/sweep.py for the grid file format. Finished runs are "
                       "skipped and interrupted ones resumed, so re-running the same command continues a sweep.")
    p.add_argument("grid", type=Path, help="grid YAML file")
    p.add_argument("--print-commands", action="store_true",
                   help="print one `meshrl train` command per arm and seed instead of running them")
    p.add_argument("--summary-only", action="store_true", help="summarise finished runs without training")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshrl.trainer import command_lines, load_sweep, run_sweep, summarize_sweep

    sweep = load_sweep(args.grid)
    if args.print_commands:
        print("\n".join(command_lines(sweep)))
        return 0
    summary = summarize_sweep(sweep) if args.summary_only else run_sweep(sweep)
    print(json.dumps(summary, indent=1))
    if not summary["budget_parity"]:
        print("WARNING: arms sampled different numbers of rollouts; do not compare them as they stand.")
    return 0
