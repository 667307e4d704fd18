"""``meshrl compare EVAL_A EVAL_B``: paired statistics of two evaluated models per benchmark."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="paired comparison of two evaluations (CI, z, bootstrap, Holm)",
                       description="Each argument is an eval directory or a folder of eval directories (one "
                       "per benchmark). Problems are paired by id; the bootstrap and permutation tests resample "
                       "problems, the z-test pools samples as the paper's readers did.")
    p.add_argument("eval_a", type=Path)
    p.add_argument("eval_b", type=Path)
    p.add_argument("--metric", default="mean", help="mean (per-problem accuracy) or pass@K")
    p.add_argument("--alpha", type=float, default=0.05, help="family-wise error rate for the Holm correction")
    p.add_argument("--correct", default="bootstrap", choices=["bootstrap", "permutation", "z"],
                   help="which p-value is Holm-corrected across benchmarks")
    p.add_argument("--n-boot", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print rows as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshrl.evaluation.compare import compare_evals
    from meshrl.stats import format_compare_table

    rows = compare_evals(args.eval_a, args.eval_b, metric=args.metric, seed=args.seed, n_boot=args.n_boot,
                         alpha=args.alpha, correct=args.correct)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        print(f"A = {args.eval_a}   B = {args.eval_b}   metric = {args.metric}")
        print(format_compare_table(rows))
    return 0
