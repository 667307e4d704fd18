"""``meshrl report``: PNG plots and one index.html from run directories and eval directories."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plots and an HTML page from run and eval directories",
                       description="Overlays the given runs (reward, accuracy, MEI, effective directions, "
                       "strategy masses, entropy, length, KL/JS, balancing gradient ratio, held-out evals) and "
                       "compares eval directories (pass@k); writes OUT/*.png and OUT/index.html.")
    p.add_argument("paths", nargs="+", type=Path, metavar="DIR", help="run directories and/or eval directories")
    p.add_argument("--out", type=Path, default=Path("report_out"), help="output directory (default report_out)")
    p.add_argument("--title", default="meshrl report", help="page title")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshrl.report import build_report

    try:
        index = build_report(args.paths, args.out, title=args.title)
    except ImportError as e:
        print(f"meshrl report: error: {e}", file=sys.stderr)
        return 1
    print(index)
    return 0
