"""``meshrl coach``: generate, validate and cache m strategy prefixes per training query (offline)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coach", help="write coach strategy prefixes for a task (Coach Prompting)",
                       description="Generate m strategy prefixes per query once, validate them (format, count, "
                       "distinctness, length, no leak of the reference answer) and cache them keyed by a "
                       "hash of the query; re-running resumes.")
    p.add_argument("--task", required=True, help="task spec (see meshrl train --help)")
    p.add_argument("--backend", choices=["openai", "hf", "rule"], required=True)
    p.add_argument("--m", type=int, default=4, help="prefixes per query")
    p.add_argument("--out", type=Path, required=True, help="prefixes JSONL (reused and extended)")
    p.add_argument("--rejects", type=Path, help="rejects JSONL (default OUT with .rejects.jsonl)")
    p.add_argument("--split", default="train")
    p.add_argument("--limit", type=int, help="first N queries only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--base-url", help="openai: endpoint base, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="openai: model name; hf: model spec or local directory")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="openai: env var holding the key (never logged; '' for an endpoint without a key)")
    p.add_argument("--concurrency", type=int, default=8, help="openai: parallel requests")
    p.add_argument("--timeout", type=float, default=120.0, help="openai: seconds per request")
    p.add_argument("--max-new-tokens", type=int, default=512, help="hf: generation budget")
    p.set_defaults(func=run)


def _backend(args: argparse.Namespace, task, by_id):
    from meshrl.mesh import CallableBackend, OpenAIChatBackend, RuleCoach

    if args.backend == "rule":
        if task.coach_strategies(next(iter(by_id.values()))) is None:
            raise ValueError(f"task {task.name} has no rule strategies; use --backend openai or hf")
        return RuleCoach(lambda q: task.coach_strategies(by_id[q["id"]]), name=f"rule:{task.name}")
    if not args.model:
        raise ValueError(f"--backend {args.backend} needs --model")
    if args.backend == "openai":
        if not args.base_url:
            raise ValueError("--backend openai needs --base-url")
        if args.api_key_env and not os.environ.get(args.api_key_env):
            raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is not set (export it, "
                             "or pass --api-key-env '' for an endpoint without a key)")
        return OpenAIChatBackend(args.base_url, args.model, api_key_env=args.api_key_env or None,
                                 timeout_s=args.timeout, concurrency=args.concurrency)
    return CallableBackend(_hf_generate(args.model, args.max_new_tokens, args.seed), name=f"hf:{args.model}")


def _hf_generate(spec: str, max_new_tokens: int, seed: int):
    """A local transformers chat model as ``fn(messages) -> str`` (greedy, deterministic)."""
    import torch

    from meshrl.models import load_model

    model, tok = load_model(spec, seed=seed)

    def generate(messages: list[dict]) -> str:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return generate


def run(args: argparse.Namespace) -> int:
    from meshrl.mesh import generate_prefixes
    from meshrl.progress import progress_bar
    from meshrl.tasks import load_task

    task = load_task(args.task, seed=args.seed)
    problems = task.problems(args.split)[: args.limit] if args.limit else task.problems(args.split)
    if not problems:
        raise ValueError(f"{args.task} split {args.split!r} has no problems")
    by_id = {p.id: p for p in problems}
    backend = _backend(args, task, by_id)
    queries = [{"id": p.id, "problem": p.prompt, "answer": p.answer} for p in problems]
    with progress_bar("coach", len({q["problem"] for q in queries})) as advance:
        summary = generate_prefixes(queries, backend, m=args.m, out_path=args.out, rejects_path=args.rejects,
                                    max_attempts=args.max_attempts,
                                    progress=lambda done, total, status: advance(completed=done, description=status))
    print(json.dumps(summary.as_dict(), indent=1))
    usable = summary.generated + summary.cached
    if usable == 0:
        print(f"meshrl coach: error: no usable prefixes: all {summary.rejected} queries were rejected "
              f"(reasons in {summary.rejects_path})", file=sys.stderr)
        return 1
    if summary.rejected:
        print(f"meshrl coach: warning: {summary.rejected} of {summary.unique} queries were rejected "
              f"(reasons in {summary.rejects_path})", file=sys.stderr)
    return 0
