"""MEI overhead in the training loop: step time with ``diag.mei.every=1`` against the same run without it.

Both runs use the same seed, so they sample the same rollouts and do the same update; the only difference is
the bias-feature computation from the logits the update already has. Prints the figures and the ratio.

    python benchmarks/mei_overhead.py [--model tiny:small] [--steps 6] [--group-size 16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from meshrl.trainer import load_config, train


def timed_run(model: str, task: str, steps: int, group: int, tokens: int, mei: bool) -> list[dict]:
    cfg = load_config(overrides=[
        f"model={model}", f"task={task}", f"steps={steps}", "seed=0", "log.progress=false",
        "rollout.prompts_per_step=4", f"rollout.group_size={group}", f"rollout.max_new_tokens={tokens}",
        "train.micro_batch_size=16", "checkpoint.every=1000", f"diag.mei.every={1 if mei else 0}",
    ])
    with tempfile.TemporaryDirectory() as d:
        return list(train(cfg, Path(d) / "run"))  # read the records before the directory goes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny:small")
    ap.add_argument("--task", default="tiny:add")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    timed_run(args.model, args.task, 1, args.group_size, args.tokens, mei=True)  # warm-up (imports, caches)
    rows = {}
    for mei in (False, True, False, True):  # interleaved to spread machine-load drift over both arms
        hist = timed_run(args.model, args.task, args.steps, args.group_size, args.tokens, mei)[1:]
        rows.setdefault(mei, []).extend(hist)
    for key in ("time/train_s", "time/step_s"):
        base = statistics.median(r[key] for r in rows[False])
        with_mei = statistics.median(r[key] for r in rows[True])
        overhead = 100 * (with_mei / base - 1)
        print(f"{key:14s} without MEI {base:.4f}s  with MEI {with_mei:.4f}s  overhead {overhead:+.2f}%")
    print(f"mei/query last step: {rows[True][-1]['mei/query']:.3f} (G={args.group_size}, model {args.model})")


if __name__ == "__main__":
    main()
