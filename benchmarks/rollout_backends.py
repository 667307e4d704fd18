"""Rollout throughput of the three backends side by side: meshrl's ``native`` decoder, ``hf`` (transformers
``generate``) and ``vllm`` (vLLM's CPU build on the CPU), on the same model, prompts and sampling settings.

Each backend lives in its own process (vLLM binds its threads to cores and forbids forking beside its engine,
which would take the native decoder's worker processes away), is built once, and then the backends are called in
alternation, ``--reps`` rounds, one at a time, so that load on the machine hits them alike; the engine start (vLLM
compiles) is timed separately. Tokens/s counts generated tokens (up to and
including eos). Run it in the environment that has vLLM (``.venv-vllm``, built by scripts/vllm_env.sh); without
vLLM the vllm row is left out with a printed reason.

    .venv-vllm/bin/python benchmarks/rollout_backends.py [--model smollm2-135m] [--groups 8 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
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


def serve(name: str, model_spec: str, conn) -> None:
    """One backend in its own process: build it, report the start time, then run ``(group, tokens, seed)``
    requests until told to stop. Separate processes keep vLLM's thread binding (and its ban on forking beside
    its engine, which would otherwise stop the native decoder's worker processes) away from the others."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model_spec)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    start = time.perf_counter()
    try:
        backend = make_backend(name, model, tokenizer)
    except ImportError as exc:
        conn.send(("missing", str(exc)))
        return
    conn.send(("ready", time.perf_counter() - start))
    while (request := conn.recv()) is not None:
        group, tokens, seed = request
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, n=group)
        t0 = time.perf_counter()
        out = backend.generate(prompts, params, seed=seed)
        conn.send((sum(len(r) for r in out.response_ids), time.perf_counter() - t0, torch.get_num_threads()))
    close = getattr(backend, "close", None)
    if close:
        close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=["native", "vllm", "hf"])
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    load0 = os.getloadavg()
    ctx = mp.get_context("spawn")
    workers, starts = {}, {}
    for name in args.backends:  # built one after the other: engine starts are timed on an otherwise idle box
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(name, args.model, child))  # not daemonic: native forks
        proc.start()
        kind, value = parent.recv()
        if kind == "missing":
            print(f"{name}: left out ({value})")
            proc.join()
            continue
        workers[name], starts[name] = (parent, proc), value
        print(f"{name}: built in {value:.1f} s")
    rates: dict[tuple[str, int], list[float]] = {}
    threads: dict[str, int] = {}
    for group in args.groups:
        for rep in range(-1, args.reps):  # round -1 warms each backend up for this shape, untimed
            for name, (conn, _) in workers.items():
                conn.send((group, args.tokens, rep + 1))
                tokens, seconds, threads[name] = conn.recv()
                if rep >= 0:
                    rates.setdefault((name, group), []).append(tokens / seconds)
    for conn, proc in workers.values():
        conn.send(None)
        proc.join(timeout=60)
    load1 = os.getloadavg()
    print(f"\n{args.model}, {len(PROMPTS)} prompts x G samples x up to {args.tokens} tokens; tokens/s, median of "
          f"{args.reps} alternating rounds; one process per backend; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print("| backend | torch threads | engine start (s) | " + " | ".join(f"G={g}" for g in args.groups) + " |")
    print("|---|---|---|" + "---|" * len(args.groups))
    for name in workers:
        cells = " | ".join(f"{statistics.median(rates[(name, g)]):.0f}" for g in args.groups)
        print(f"| {name} | {threads[name]} | {starts[name]:.1f} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "starts": starts, "threads": threads,
                       "load": [load0[0], load1[0]],
                       "rates": {f"{n}/G{g}": v for (n, g), v in rates.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
