"""Rollout throughput of the three backends side by side: meshrl's ``native`` decoder, ``hf`` (transformers
``generate``) and ``vllm`` (vLLM's CPU build on the CPU), on the same model, prompts and sampling settings.

The backends are built once and then called in alternation, ``--reps`` rounds, so that load on the machine hits
them alike; the engine start (vLLM compiles) is timed separately. Tokens/s counts generated tokens (up to and
including eos). Run it in the environment that has vLLM (``.venv-vllm``, built by scripts/vllm_env.sh); without
vLLM the vllm row is left out with a printed reason.

    .venv-vllm/bin/python benchmarks/rollout_backends.py [--model smollm2-135m] [--groups 8 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshrl.models import load_model
from meshrl.rollout import SamplingParams, make_backend

PROMPTS = [
    "What is 17 + 25? Answer with a number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether?",
    "Write the next number: 2, 4, 8, 16,",
    "A train travels 60 km in 1.5 hours. What is its average speed in km/h?",
]


def build(name: str, model, tokenizer) -> tuple[object | None, float, str]:
    start = time.perf_counter()
    try:
        backend = make_backend(name, model, tokenizer)
    except ImportError as exc:
        return None, 0.0, str(exc)
    return backend, time.perf_counter() - start, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=["native", "vllm", "hf"])
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    backends, starts = {}, {}
    for name in args.backends:
        backend, seconds, why = build(name, model, tokenizer)
        if backend is None:
            print(f"{name}: left out ({why})")
            continue
        backends[name], starts[name] = backend, seconds
        print(f"{name}: built in {seconds:.1f} s")
    rates: dict[tuple[str, int], list[float]] = {}
    for group in args.groups:
        params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, n=group)
        for backend in backends.values():  # warm-up call, not timed
            backend.generate(prompts, params, seed=0)
        for rep in range(args.reps):
            for name, backend in backends.items():
                t0 = time.perf_counter()
                out = backend.generate(prompts, params, seed=rep + 1)
                seconds = time.perf_counter() - t0
                tokens = sum(len(r) for r in out.response_ids)
                rates.setdefault((name, group), []).append(tokens / seconds)
    print(f"\n{args.model}, {len(prompts)} prompts x G samples x up to {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads; tokens/s, median of {args.reps} alternating rounds")
    print("| backend | engine start (s) | " + " | ".join(f"G={g}" for g in args.groups) + " |")
    print("|---|---|" + "---|" * len(args.groups))
    for name in backends:
        cells = " | ".join(f"{statistics.median(rates[(name, g)]):.0f}" for g in args.groups)
        print(f"| {name} | {starts[name]:.1f} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "starts": starts,
                       "rates": {f"{n}/G{g}": v for (n, g), v in rates.items()}}, f, indent=1)
    for backend in backends.values():
        close = getattr(backend, "close", None)
        if close:
            close()


if __name__ == "__main__":
    main()
