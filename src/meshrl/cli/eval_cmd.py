"""``meshrl eval``: sample n completions per problem and report mean@k and unbiased pass@k."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model or run checkpoint on a benchmark",
                       description="Writes OUT/eval_samples.jsonl (every sample with its extracted answer and "
                       "verdict) and OUT/eval.json (summary). Re-running with the same OUT resumes.")
    p.add_argument("--model", required=True,
                   help="tiny | smollm2-135m | local HF dir | RUN_DIR | RUN_DIR/checkpoints/step_N")
    p.add_argument("--data", required=True, help="task spec: math500 | gsm8k | jsonl:PATH?... | rg:NAME | tiny:add ...")
    p.add_argument("--n", type=int, default=4, help="samples per problem")
    p.add_argument("--k", default="1", help="comma list of k for mean@k / pass@k, each <= n")
    p.add_argument("--split", default="all", help="task split (all | train | eval)")
    p.add_argument("--limit", type=int, help="first N problems only")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", choices=["auto", "hf", "native", "vllm"],
                   help="rollout backend: auto = native for Llama-family models, else hf (transformers generate)")
    p.add_argument("--kind", help="grade with this reward kind (math | number | last_number | choice | exact) "
                   "instead of the task's own; e.g. the kind a run was trained with")
    p.add_argument("--by", help="problem meta field to break results down by (e.g. type, level)")
    p.add_argument("--out", type=Path, help="output directory (default eval_out/<data name>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshrl.evaluation import EvalConfig, run_eval

    try:
        ks = [int(k) for k in args.k.split(",") if k.strip()]
    except ValueError as e:
        raise ValueError(f"--k must be a comma list of integers, got {args.k!r}") from e
    cfg = EvalConfig(model=args.model, data=args.data, n=args.n, ks=ks, split=args.split, limit=args.limit,
                     max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                     seed=args.seed, by=args.by, backend=args.backend, kind=args.kind)
    out = args.out or Path("eval_out") / args.data.split("?")[0].replace(":", "_").replace("/", "_")
    summary = run_eval(cfg, out, progress=not args.no_progress)
    unscored = summary.get("unscored")  # run_eval has logged its warning; the counts go beside the scores
    print(json.dumps({"overall": summary["overall"], "out": str(out),
                      **({"unscored": {k: unscored[k] for k in ("errors", "timeouts")}} if unscored else {})},
                     indent=1))
    return 0
