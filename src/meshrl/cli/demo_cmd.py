"""``meshrl demo``: strategy collapse, its harm and its prevention on the built-in testbed, on a CPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="warm start, GRPO vs forking tokens vs CP-only vs Mesh on the testbed, report",
                       description="Trains a small built-in model on the collapse testbed (cached warm start), "
                       "then GRPO, GRPO with forking-token training, CP-only and Mesh at the matched rollout budget "
                       "with MEI and true strategy masses logged, evaluates pass@k on held-out problems by type and "
                       "writes a report. "
                       "Re-running with the same --out reuses finished parts.")
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--quick", action="store_true",
                   help="CI-sized plumbing check (about a minute): too little training for the policies to differ")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshrl.report import build_report
    from meshrl.testbed.demo import plumbing_note, run_demo, summary_markdown

    summary = run_demo(args.out, quick=args.quick, seed=args.seed, progress=not args.no_progress)
    paths = [Path(p) for p in summary["runs"].values()] + [Path(p) for p in summary["evals"].values()]
    index = build_report(paths, args.out / "report", title="meshrl demo: GRPO vs forking tokens vs CP-only vs Mesh")
    md = summary_markdown(summary)
    (args.out / "results.md").write_text(md + "\n")
    print(md)
    note = plumbing_note(summary)
    if note:
        print(note)
    print(json.dumps({"summary": str(args.out / "demo_summary.json"), "seconds": round(summary["seconds"], 1)}))
    print(f"report: {index}")
    return 0
