"""Rollout throughput of the three backends side by side: meshrl's ``native`` decoder, ``hf`` (transformers
``generate``) and ``vllm`` (vLLM's CPU build on the CPU), on the same model, prompts and sampling settings.

A shape is ``SEQUENCESxTOKENS``: that many sequences per ``generate`` call, each sampling exactly ``TOKENS`` new
tokens (``SamplingParams(ignore_eos=True)``: eos does not end a row, so every backend does the same work; ``hf``
masks eos instead, which costs the same). The sequences are P prompts x G samples (:func:`split_shape`: the most
prompts of 4, 2, 1 that leave G >= 8; 64x64 is 4 prompts x G=16, 16x512 is 2 prompts x G=8).

Each backend lives in its own process (vLLM binds its threads to cores and forbids forking beside its engine,
which would take the native decoder's worker processes away), is built once, and then the backends are called in
alternation, ``--reps`` rounds after one untimed warm-up round per shape, one at a time, so that load on the
machine hits them alike. Reported apart from the steady tokens/s: the process start (spawn to a built backend:
imports, model load, engine build), the backend build alone (vLLM: engine start with its compile) and each
shape's first call (vLLM: graph capture / warm-up). Tokens/s counts generated tokens, checked to be
sequences x tokens. Run it in the environment that has vLLM (``.venv-vllm``, built by scripts/vllm_env.sh);
without vLLM the vllm row is left out with a printed reason.

    .venv-vllm/bin/python benchmarks/rollout_backends.py [--model smollm2-135m] [--shapes 64x64 16x512]
    .venv-vllm/bin/python benchmarks/rollout_backends.py --dtype bfloat16 --hf-shapes        # bf16, no hf row
    .venv-vllm/bin/python benchmarks/rollout_backends.py --step --groups 8    # whole training steps (tiny:add)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from meshrl.cpu import cpu_info, describe
from meshrl.models import load_model
from meshrl.rollout import SamplingParams, make_backend

PROMPTS = [
    "What is 17 + 25? Answer with a number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether?",
    "Write the next number: 2, 4, 8, 16,",
    "A train travels 60 km in 1.5 hours. What is its average speed in km/h?",
]


def split_shape(sequences: int) -> tuple[int, int]:
    """``(prompts, G)`` with ``prompts * G == sequences``: the most prompts of 4, 2, 1 that leave G >= 8 (GRPO
    groups), else one prompt."""
    for prompts in (4, 2):
        if sequences % prompts == 0 and sequences // prompts >= 8:
            return prompts, sequences // prompts
    return 1, sequences


def parse_shape(text: str) -> tuple[int, int]:
    """``"64x512"`` -> ``(64, 512)`` (sequences, new tokens)."""
    try:
        sequences, tokens = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected SEQUENCESxTOKENS, e.g. 64x64") from None
    if sequences < 1 or tokens < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: both numbers must be >= 1")
    return sequences, tokens


def serve(name: str, model_spec: str, conn, dtype: str, spawned_at: float) -> None:
    """One backend in its own process: build it, report the process start (from ``spawned_at``, wall clock) and
    the build time, then run ``(sequences, tokens, seed)`` requests until told to stop. Separate processes keep
    vLLM's thread binding (and its ban on forking beside its engine, which would otherwise stop the native
    decoder's worker processes) away from the others."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model_spec, dtype=dtype)
    kwargs = {"dtype": dtype} if name == "vllm" else {}
    start = time.perf_counter()
    try:
        backend = make_backend(name, model, tokenizer, **kwargs)
    except ImportError as exc:
        conn.send(("missing", str(exc)))
        return
    built = time.perf_counter() - start
    conn.send(("ready", (time.time() - spawned_at, built)))
    while (request := conn.recv()) is not None:
        sequences, tokens, seed = request
        prompts_n, group = split_shape(sequences)
        prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:prompts_n]]
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, n=group, ignore_eos=True)
        t0 = time.perf_counter()
        out = backend.generate(prompts, params, seed=seed)
        seconds = time.perf_counter() - t0
        generated = sum(len(r) for r in out.response_ids)
        if generated != sequences * tokens:
            raise RuntimeError(f"{name}: generated {generated} tokens, expected {sequences} x {tokens}")
        conn.send((generated, seconds, torch.get_num_threads()))
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


def main_steps(args, cpu: dict) -> None:
    """Whole training steps with each backend, alternating one step at a time across the backends' processes;
    ``cpu``: this machine's :func:`meshrl.cpu.cpu_info`, written beside the figures."""
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
                       "threads": threads, "steps": rows, "cpu": cpu}, f, indent=1)


def start_workers(args, target, extra: tuple = (), stamp: bool = False) -> tuple[dict, dict]:
    """One process per backend, built one after the other (engine starts timed on an otherwise idle box).
    ``stamp``: pass the spawn time (wall clock) last, for the process-start figure."""
    ctx = mp.get_context("spawn")
    workers, starts = {}, {}
    for name in args.backends:
        parent, child = ctx.Pipe()
        when = (time.time(),) if stamp else ()
        proc = ctx.Process(target=target, args=(name, args.model, child, *extra, *when))  # not daemonic: native forks
        proc.start()
        kind, value = parent.recv()
        if kind == "missing":
            print(f"{name}: left out ({value})")
            proc.join()
            continue
        workers[name], starts[name] = (parent, proc), value
        print(f"{name}: built in {value if isinstance(value, float) else value[-1]:.1f} s")
    return workers, starts


def stop_workers(workers: dict) -> None:
    for conn, proc in workers.values():
        conn.send(None)
        proc.join(timeout=60)


def uptime() -> str:
    """``uptime``'s line (load averages over 1, 5, 15 minutes)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run_shapes(args, workers: dict) -> tuple[dict, dict, dict]:
    """For each shape: one warm-up call per backend (its time kept as the first call), then ``--reps`` rounds
    calling the backends in alternation. Returns ``(rates[(name, shape)], first_call_s, threads)``."""
    rates: dict[tuple[str, str], list[float]] = {}
    first: dict[tuple[str, str], float] = {}
    threads: dict[str, int] = {}
    for sequences, tokens in args.shapes:
        shape = f"{sequences}x{tokens}"
        names = [n for n in workers if n != "hf" or shape in args.hf_shapes]
        for rep in range(-1, args.reps):
            for name in names:
                conn = workers[name][0]
                conn.send((sequences, tokens, rep + 1))
                generated, seconds, threads[name] = conn.recv()
                if rep < 0:
                    first[(name, shape)] = seconds
                else:
                    rates.setdefault((name, shape), []).append(generated / seconds)
            done = (f"{n} {rates[(n, shape)][-1]:.0f} tok/s" if rep >= 0
                    else f"{n} first call {first[(n, shape)]:.1f} s" for n in names)
            print(f"{shape} round {rep + 1}: " + ", ".join(done), flush=True)
    return rates, first, threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[(64, 64), (16, 512)],
                    help="SEQUENCESxTOKENS per generate call")
    ap.add_argument("--hf-shapes", nargs="*", default=["64x64"], help="the shapes hf runs (it is slow)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights, every backend")
    ap.add_argument("--groups", type=int, nargs="+", default=[8], help="--step only: G (first value)")
    ap.add_argument("--tokens", type=int, default=64, help="--step only: max new tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=["native", "vllm", "hf"])
    ap.add_argument("--json", default="")
    ap.add_argument("--step", action="store_true", help="time whole training steps (tiny:add, G = first --groups)")
    args = ap.parse_args()
    cpu = cpu_info()  # torch_threads: this process's; the backends' own are in the table (and "threads")
    print(describe(cpu))
    if args.step:
        main_steps(args, cpu)
        return
    load0, up0 = os.getloadavg(), uptime()
    workers, starts = start_workers(args, serve, (args.dtype,), stamp=True)
    rates, first, threads = run_shapes(args, workers)
    stop_workers(workers)
    load1, up1 = os.getloadavg(), uptime()
    shapes = [f"{s}x{t}" for s, t in args.shapes]
    print(f"\n{args.model} ({args.dtype}), sequences x new tokens (every row the full length); tokens/s, median of "
          f"{args.reps} alternating rounds after a warm-up; one process per backend")
    print(f"load before: {up0}\nload after:  {up1}")
    print("| backend | torch threads | process start (s) | build (s) | "
          + " | ".join(f"{s}: first call (s) | {s} tok/s" for s in shapes) + " |")
    print("|---|---|---|---|" + "---|---|" * len(shapes))
    for name in workers:
        cells = " | ".join(f"{first[(name, s)]:.1f} | {statistics.median(rates[(name, s)]):.0f}"
                           if (name, s) in rates else "- | -" for s in shapes)
        print(f"| {name} | {threads[name]} | {starts[name][0]:.1f} | {starts[name][1]:.1f} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "starts": starts, "threads": threads,
                       "load": [load0, load1], "uptime": [up0, up1],
                       "first_call_s": {f"{n}/{s}": v for (n, s), v in first.items()},
                       "rates": {f"{n}/{s}": v for (n, s), v in rates.items()}, "cpu": cpu}, f, indent=1)


if __name__ == "__main__":
    main()
