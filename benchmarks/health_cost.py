"""Cost of the live run-health checks (``health.every``) against the step they follow, in one run.

Trains ``--steps`` steps with ``health.every=1`` and reads back, per check, its seconds (``events.jsonl``,
``health_check``) and the step's ``time/step_s``: a check costs one pass of the doctor's checks over every record
logged so far, so its time grows with the run's length. Prints the check time at a few step counts, the ratio to
the median step time, and what ``health.every=K`` costs as a share of training (check time / (K x step time)).

    python benchmarks/health_cost.py                                  # tiny on tiny:add, 200 steps
    python benchmarks/health_cost.py --model smollm2-135m --steps 40  # a real model's step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from meshrl.cpu import cpu_info, describe
from meshrl.trainer import load_config, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--task", default="tiny:add")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--samples-per-step", type=int, default=4, help="log.samples_per_step (the sample checks)")
    args = ap.parse_args()
    print(describe(cpu_info()))
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cfg = load_config(overrides=[f"model={args.model}", f"task={args.task}", f"steps={args.steps}",
                                     "health.every=1", "log.progress=false", "checkpoint.every=100000",
                                     f"log.samples_per_step={args.samples_per_step}"])
        history = train(cfg, run)
        step_s = [m["time/step_s"] for m in history]
        checks = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        check_s = [e["seconds"] for e in checks if e.get("event") == "health_check"]
    median_step = statistics.median(step_s)
    print(f"model {args.model}, task {args.task}, {args.steps} steps, median step {median_step:.3f} s, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| steps logged | check s | check / median step | share of training at every=1 | every=10 |")
    print("|---|---|---|---|---|")
    for n in sorted({10, 50, 100, args.steps // 2, args.steps} - {0}):
        if n <= len(check_s):
            c = check_s[n - 1]
            print(f"| {n} | {c:.4f} | {c / median_step:.2%} | {c / (median_step + c):.2%} | "
                  f"{c / (10 * median_step + c):.2%} |")
    per_step = check_s[-1] / len(check_s)
    print(f"per logged step: {1e3 * per_step:.3f} ms of check time")


if __name__ == "__main__":
    main()
