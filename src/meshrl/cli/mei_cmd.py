"""``meshrl mei calibrate``: MEI of the model before RL on calibration queries -> threshold.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mei", help="MEI early-warning tools (calibrate the threshold)",
                       description="Mirrored Entanglement Index (docs/method.md §1.2) tools.")
    mei_sub = p.add_subparsers(dest="mei_command", metavar="ACTION", required=True)
    c = mei_sub.add_parser(
        "calibrate", help="per-query MEI of the model before RL; threshold = mean + 3 std",
        description="Samples G rollouts for each of N calibration queries with the untrained model, computes "
        "the per-query MEI of the chosen feature map at the sampling temperature and writes "
        "{mean, std, n, threshold = mean + 3 std, per_query, ...} to --out. Use the run's model, G, feature "
        "map, temperature and max_new_tokens: MEI depends on all of them (never reuse the paper's 1.013). "
        "Point the trainer at the file with diag.mei.threshold=FILE.")
    c.add_argument("--model", required=True, help="tiny | smollm2-135m | local HF dir | RUN_DIR | "
                   "RUN_DIR/checkpoints/step_N")
    c.add_argument("--task", required=True, help="task spec (tiny:add, math500, jsonl:PATH, rg:NAME, ...)")
    c.add_argument("--n-queries", type=int, default=64, help="calibration queries N (a seeded sample of the split)")
    c.add_argument("--group-size", type=int, default=16, help="rollouts per query G (the run's group size)")
    c.add_argument("--feature", choices=["bias", "head"], default="bias")
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--split", default="train")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--chunk", type=int, default=8, help="queries per generate call")
    c.add_argument("--proj-dim", type=int, help="head only: TensorSketch size instead of the exact Gram")
    c.add_argument("--device", default="auto", help="auto | cpu | cuda")
    c.add_argument("--out", type=Path, default=Path("threshold.json"), help="output JSON (default threshold.json)")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshrl.analysis import calibrate_mei, nan_to_none

    result = calibrate_mei(args.model, args.task, n_queries=args.n_queries, group_size=args.group_size,
                           feature=args.feature, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, split=args.split, seed=args.seed, chunk=args.chunk,
                           proj_dim=args.proj_dim, device=args.device, progress=not args.no_progress)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(nan_to_none(result), indent=1) + "\n")
    keys = ("threshold", "mean", "std", "n", "group_size", "feature", "temperature", "directions_mean",
            "g_over_mei_mean")
    print(json.dumps(nan_to_none({**{k: result[k] for k in keys}, "out": str(args.out)}), indent=1))
    return 0
