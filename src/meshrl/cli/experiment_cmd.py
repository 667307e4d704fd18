"""``meshrl experiment``: the testbed experiment of docs/testbed.md (all arms x seeds), then its tables."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from meshrl.testbed.experiment import ARMS, ExperimentSettings

    d = ExperimentSettings()
    p = sub.add_parser("experiment", help="the testbed experiment: every arm x seeds, evaluation, warning signals",
                       description="Runs GRPO, DAPO, GRPO+KL, GRPO+JS, CP-only, Mesh at several mu and the "
                       "support-balancing variant on the collapse testbed from one warm start, at a matched "
                       "rollout budget; evaluates pass@k by problem type; probes the baselines' checkpoints "
                       "for the warning-signal table; writes results.json, results.md and figures. Resumable: "
                       "finished runs, evaluations and probes are reused.")
    p.add_argument("--out", type=Path, default=Path("runs/testbed_experiment"))
    p.add_argument("--arms", nargs="+", default=list(d.arms), choices=list(ARMS), metavar="ARM")
    p.add_argument("--seeds", nargs="+", type=int, default=list(d.seeds))
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--workers", type=int, default=d.workers, help="runs in parallel (one thread each)")
    p.add_argument("--summarize-only", action="store_true", help="only rebuild the tables and figures")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshrl.report.testbed import plot_results, results_markdown
    from meshrl.testbed.experiment import ExperimentSettings, run_experiment
    from meshrl.testbed.results import summarize_experiment

    if not args.summarize_only:
        s = ExperimentSettings(steps=args.steps, seeds=tuple(args.seeds), arms=tuple(args.arms), workers=args.workers)
        run_experiment(args.out, s, progress=not args.no_progress)
    if not (args.out / "runs").is_dir():
        raise SystemExit(f"error: no runs in {args.out}")
    res = summarize_experiment(args.out)
    md = results_markdown(res)
    (args.out / "results.md").write_text(md + "\n")
    figures = plot_results(res, args.out / "figures")
    print(md)
    print(json.dumps({"results": str(args.out / "results.json"), "figures": [str(f) for f in figures]}, indent=1))
    return 0
