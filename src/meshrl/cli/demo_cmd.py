"""``meshrl demo``: the dip and the recovery of a niche under GRPO and forking tokens, on the built-in testbed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="GRPO vs forking tokens on the testbed, 3 seeds: the niche's dip and recovery",
                       description="From a small built-in model's shipped warm start on the collapse testbed, "
                       "trains GRPO and GRPO with forking-token training on three RL seeds fixed in advance, "
                       "evaluates the niche problem type every few steps, and prints each run's niche curve, when "
                       "it fell and came back, MEI beside it, and the rates over ten seeds of the same "
                       "configuration; writes a report. Re-running with the same --out reuses finished runs and "
                       "resumes stopped ones.")
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--quick", action="store_true",
                   help="CI-sized plumbing check (about a minute): too little training for the policies to differ")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="RL seeds (default: the demo's three, 0 1 2)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs at a time, one process and one thread each (default 2); the figures do not "
                        "depend on it")
    p.add_argument("--rates-out", type=Path, default=None,
                   help="also write the seeds' rates with the settings and machine (the caption's source, "
                        "measured with --seeds 0 1 ... 9)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from meshrl.report import build_report
    from meshrl.testbed.demo import DEMO_SEEDS, DemoSettings, plumbing_note, rates_record, run_demo, summary_markdown

    settings = DemoSettings.quick() if args.quick else DemoSettings()
    if args.workers is not None:
        if args.workers < 1:
            raise SystemExit(f"meshrl demo: --workers must be >= 1, got {args.workers}")
        settings = dataclasses.replace(settings, workers=args.workers)
    seeds = tuple(args.seeds) if args.seeds else DEMO_SEEDS
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise SystemExit(f"meshrl demo: --seeds must be distinct and >= 0, got {list(seeds)}")
    summary = run_demo(args.out, seeds=seeds, settings=settings, progress=not args.no_progress)
    index = build_report([Path(p) for p in summary["runs"].values()], args.out / "report",
                         title="meshrl demo: the dip and the recovery (GRPO vs forking tokens)")
    md = summary_markdown(summary)
    (args.out / "results.md").write_text(md + "\n")
    print(md)
    note = plumbing_note(summary)
    if note:
        print(note)
    if args.rates_out:
        args.rates_out.write_text(json.dumps(rates_record(summary), indent=1) + "\n")
        print(f"rates: {args.rates_out}")
    print(json.dumps({"summary": str(args.out / "demo_summary.json"), "seconds": round(summary["seconds"], 1)}))
    print(f"report: {index}")
    return 0
