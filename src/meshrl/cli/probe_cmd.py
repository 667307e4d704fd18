"""``meshrl probe``: per coach strategy, accuracy when conditioned on it and log-prob of its text."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe", help="strategy accessibility probe over coach prefixes",
        description="For each strategy index k (the k-th coach prefix of each problem): accuracy of n samples "
        "conditioned on that prefix (system placement by default, anti-hacking template) and the mean "
        "log-probability of the prefix text itself as the start of the assistant turn under the "
        "unconditioned prompt. Run it on successive checkpoints (RUN_DIR/checkpoints/step_N) to see which "
        "strategies become inaccessible.")
    p.add_argument("--model", required=True, help="tiny | smollm2-135m | local HF dir | RUN_DIR | "
                   "RUN_DIR/checkpoints/step_N")
    p.add_argument("--prefixes", required=True, type=Path, help="prefixes JSONL from `meshrl coach`")
    p.add_argument("--task", required=True, help="task spec the prefixes were made for")
    p.add_argument("--n", type=int, default=4, help="samples per (problem, strategy)")
    p.add_argument("--limit", type=int, help="first K problems of the split only")
    p.add_argument("--split", default="train")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=4, help="problems per generate call")
    p.add_argument("--placement", choices=["system", "assistant"], default="system")
    p.add_argument("--no-baseline", action="store_true", help="skip the unconditioned accuracy")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--json", action="store_true", help="print the full result as JSON instead of a table")
    p.add_argument("--out", type=Path, help="also write the full JSON result here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"strategy probe  model={result['model_description']}  task={result['task']}  "
                  f"n={result['n']}  T={result['temperature']}")
    for col in ("strategy", "problems", "accuracy", "solved", "log p(prefix)", "per token"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    table.add_column("prefix (first problem)", overflow="ellipsis", no_wrap=True, max_width=50)  # type: ignore[arg-type]
    for s in result["strategies"]:
        example = s["example"] or ""
        table.add_row(str(s["strategy"]), str(s["n_problems"]), _num(s["accuracy"]), _num(s["solved_frac"]),
                      _num(s["logp_sum_mean"], ".1f"), _num(s["logp_per_token_mean"]),
                      example)
    if result["baseline"] is not None:
        b = result["baseline"]
        table.add_section()
        table.add_row("none", str(b["n_problems"]), _num(b["accuracy"]), _num(b["solved_frac"]), "", "",
                      "(no prefix)")
    console = Console()
    console.print(table)
    console.print(f"problems used: {result['problems_used']} of {result['problems_total']}  "
                  f"skipped (no prefixes): {result['problems_skipped_no_prefix']}  placement: {result['placement']}",
                  soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    from meshrl.analysis import nan_to_none, probe

    result = probe(args.model, args.task, args.prefixes, n=args.n, split=args.split, limit=args.limit,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, chunk=args.chunk, placement=args.placement, baseline=not args.no_baseline,
                   device=args.device, progress=not args.no_progress)
    text = json.dumps(nan_to_none(result), indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print_table(result)
    return 0
