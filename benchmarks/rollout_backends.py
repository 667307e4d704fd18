"""Rollout throughput of the three backends side by side: meshrl's ``native`` decoder, ``hf`` (transformers
``generate``) and ``vllm`` (vLLM's CPU build on the CPU), on the same model, prompts and sampling settings.

Each backend lives in its own process (vLLM binds its threads to cores and forbids forking beside its engine,
which would take the native decoder's worker processes away), is built once, and then the backends are called in
alternation, ``--reps`` rounds, one at a time, so that load on the machine hits them alike; the engine start (vLLM
compiles) is timed separately. Tokens/s counts generated tokens (up to and
including eos). Run it in the environment that has vLLM (``.venv-vllm``, built by scripts/vllm_env.sh); without
vLLM the vllm row is left out with a printed reason.

    .venv-vllm/bin/python benchmarks/rollout_backends.py [--model smollm2-135m] [--groups 8 32] [--tokens 64]
    .venv-vllm/bin/python benchmarks/rollout_backends.py --step --groups 8    # whole training steps (tiny:add)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

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


def serve_steps(name: str, model_spec: str, conn, group: int, tokens: int) -> None:
    """``--step``: a meshrl ``Trainer`` with ``rollout.backend=name`` in its own process, one step per request;
    sends the step's wall time and its rollout and update phases (``time/rollout_s``, ``time/train_s``; the
    update includes the weight sync into vLLM)."""
    import tempfile

    from meshrl.trainer import Trainer, load_config

    cfg = load_config(overrides=[f"model={model_spec}", "task=tiny:add", "recipe=grpo", "seed=0", "steps=1000000",
                                 f"rollout.backend={name}", f"rollout.prompts_per_step={len(PROMPTS)}",
                                 f"rollout.group_size={group}", f"rollout.max_new_tokens={tokens}",
                                 "log.progress=false"])
    start = time.perf_counter()
    try:
        trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix=f"meshrl-bench-{name}-")))
    except ImportError as exc:
        conn.send(("missing", str(exc)))
        return
    conn.send(("ready", time.perf_counter() - start))
    while conn.recv() is not None:
        t0 = time.perf_counter()
        m = trainer.step()
        conn.send((time.perf_counter() - t0, m["time/rollout_s"], m["time/train_s"], torch.get_num_threads()))


def main_steps(args) -> None:
    """Whole training steps with each backend, alternating one step at a time across the backends' processes."""
    workers, starts = start_workers(args, serve_steps, (args.groups[0], args.tokens))
    rows: dict[str, list[tuple[float, float, float]]] = {}
    threads: dict[str, int] = {}
    for rep in range(-1, args.reps):  # step 0 of each is the warm-up, not counted
        for name, (conn, _) in workers.items():
            conn.send(True)
            *phases, threads[name] = conn.recv()
            if rep >= 0:
                rows.setdefault(name, []).append(tuple(phases))
    stop_workers(workers)
    print(f"\n{args.model}, tiny:add, {len(PROMPTS)} prompts x G={args.groups[0]} x up to {args.tokens} tokens; "
          f"median of {args.reps} steps per backend, alternating")
    print("| backend | trainer start (s) | step (s) | rollout (s) | update + sync (s) |")
    print("|---|---|---|---|---|")
    for name, values in rows.items():
        cols = [statistics.median(v[i] for v in values) for i in range(3)]
        print(f"| {name} | {starts[name]:.1f} | {cols[0]:.2f} | {cols[1]:.2f} | {cols[2]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "group": args.groups[0], "starts": starts,
                       "threads": threads, "steps": rows}, f, indent=1)


def start_workers(args, target, extra: tuple = ()) -> tuple[dict, dict]:
    """One process per backend, built one after the other (engine starts timed on an otherwise idle box)."""
    ctx = mp.get_context("spawn")
    workers, starts = {}, {}
    for name in args.backends:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(name, args.model, child, *extra))  # not daemonic: native forks
        proc.start()
        kind, value = parent.recv()
        if kind == "missing":
            print(f"{name}: left out ({value})")
            proc.join()
            continue
        workers[name], starts[name] = (parent, proc), value
        print(f"{name}: built in {value:.1f} s")
    return workers, starts


def stop_workers(workers: dict) -> None:
    for conn, proc in workers.values():
        conn.send(None)
        proc.join(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=["native", "vllm", "hf"])
    ap.add_argument("--json", default="")
    ap.add_argument("--step", action="store_true", help="time whole training steps (tiny:add, G = first --groups)")
    args = ap.parse_args()
    if args.step:
        main_steps(args)
        return
    load0 = os.getloadavg()
    workers, starts = start_workers(args, serve)
    rates: dict[tuple[str, int], list[float]] = {}
    threads: dict[str, int] = {}
    for group in args.groups:
        for rep in range(-1, args.reps):  # round -1 warms each backend up for this shape, untimed
            for name, (conn, _) in workers.items():
                conn.send((group, args.tokens, rep + 1))
                tokens, seconds, threads[name] = conn.recv()
                if rep >= 0:
                    rates.setdefault((name, group), []).append(tokens / seconds)
    stop_workers(workers)
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
