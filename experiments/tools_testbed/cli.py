"""``python -m experiments.tools_testbed``: run the tool-use collapse experiment (all arms x seeds), then its
tables. Bad input is one line on stderr and exit status 2, as in ``meshrl``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from experiments._args import check_at_least, check_seeds
from meshrl.kernel_caches import bound_kernel_caches


def build_parser() -> argparse.ArgumentParser:
    from experiments.tools_testbed.experiment import ARMS

    p = argparse.ArgumentParser(
        prog="python -m experiments.tools_testbed",
        description="Trains each arm (arms.yaml) x seed on testbed:tools from one warm start, measures the tool "
        "share and the accuracy per problem type on held-out problems at the warm start and every checkpoint, "
        "and writes results.json and results.md. Resumable: finished runs and measured steps are reused.")
    p.add_argument("--out", type=Path, default=Path("runs/tools_experiment"))
    p.add_argument("--arms", nargs="+", default=None, choices=list(ARMS), metavar="ARM")
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--report-problems", type=int, default=None)
    p.add_argument("--summarize", action="store_true", help="only rebuild results.json / results.md")
    return p


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the option for a value no experiment can use, before any work."""
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a directory")
    if args.summarize and not (args.out / "settings.json").is_file():
        raise ValueError(f"--summarize: {args.out} holds no experiment (no settings.json)")
    check_at_least((("--steps", args.steps, 1), ("--ckpt-every", args.ckpt_every, 1),
                    ("--report-problems", args.report_problems, 2)))
    check_seeds(args.seeds)


def main(argv: list[str] | None = None) -> int:
    bound_kernel_caches()  # first: oneDNN reads its cache sizes once (meshrl.kernel_caches)
    from experiments.tools_testbed.experiment import ToolsSettings, run_experiment, summarize

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    changes = {"arms": tuple(args.arms) if args.arms else None, "seeds": tuple(args.seeds) if args.seeds else None,
               "steps": args.steps, "ckpt_every": args.ckpt_every, "report_problems": args.report_problems}
    try:
        check_args(args)
        if args.summarize:
            summarize(args.out)
        else:
            run_experiment(args.out, ToolsSettings(**{k: v for k, v in changes.items() if v is not None}))
    except (ValueError, FileNotFoundError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print((args.out / "results.md").read_text())
    return 0
