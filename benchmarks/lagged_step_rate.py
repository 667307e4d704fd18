"""Step rate of lagged rollouts (``rollout.max_staleness`` k = 0, 1, 2) on one CPU machine, with the phase split,
against what the overlap cost model (``benchmarks/async_model.py``) predicts from the k = 0 phases.

Runs the same training ``--repeats`` times per k, interleaved (k0, k1, k2, k0, ...) so that drift in the machine's
speed hits every arm alike; the first ``--warmup`` steps of each run (start-up, first fork) are left out. Per run:
steps per second, and the medians of the sampler's time per batch (``time/rollout_s``, measured where the batch is
sampled: in the sampler process when k >= 1), the trainer's wait for its batch and its update (``time/train_s``).
The model's prediction for k >= 1 is ``max(S(c), U(C - c))`` from the k = 0 medians (:func:`async_model.split_step`,
the sampler on ``rollout.sampler_threads`` of the ``C`` torch threads). How each phase scales with cores is measured
by one more arm, k = 0 on one thread (``k0@1``; :func:`async_model.scaling_exponent`), unless ``--exponent`` fixes
it (1 = linear); the ratio measured / predicted is in the output.

    python benchmarks/lagged_step_rate.py --out benchmarks/data/lagged_step_rate_tiny.json
    python benchmarks/lagged_step_rate.py --protocol smollm2 --steps 8 --repeats 2 --out ...
    python benchmarks/lagged_step_rate.py --dry-run     # 2 steps per arm, 1 repeat: the CI check that it runs

Time only on a quiet machine; the CPU flags, the load average before and after, and torch's thread count are
recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from async_model import Phases, scaling_exponent, split_step  # noqa: E402

PROTOCOLS = {
    # tiny: the test-suite model on its repeat task (sampling-bound: 8 prompts x G 8, 32 new tokens)
    "tiny": ["model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=8", "rollout.group_size=8",
             "rollout.max_new_tokens=32", "optim.lr=1e-3"],
    # smollm2: the SmolLM2-135M addition protocol (docs/results.md), shortened
    "smollm2": ["model=smollm2-135m", "task=tiny:add", "rollout.prompts_per_step=4", "rollout.group_size=8",
                "rollout.max_new_tokens=32", "optim.lr=1e-5", "train.micro_batch_size=8"],
}
COMMON = ["eval.every=0", "log.samples_per_step=0", "checkpoint.every=1000", "rollout.backend=native"]


def run_once(protocol: str, k: int, steps: int, seed: int, root: Path, correction: str = "tis",
             extra: tuple[str, ...] = ()) -> list[dict]:
    from meshrl.trainer.config import load_config
    from meshrl.trainer.loop import train

    overrides = [*PROTOCOLS[protocol], *COMMON, f"steps={steps}", f"seed={seed}", f"rollout.max_staleness={k}",
                 "log.progress=false"]
    if k:
        overrides += ["rollout.sampler_process=process", f"rollout.staleness_correction={correction}"]
    overrides += list(extra)
    run = root / f"k{k}_s{seed}_{time.monotonic_ns()}"
    t0 = time.perf_counter()
    train(load_config(None, overrides), run)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows[-1]["_wall_s"] = wall
    return rows


def summarise(rows: list[dict], warmup: int) -> dict[str, float]:
    """Steps per second and the phase medians of one run, its first ``warmup`` steps left out."""
    kept = rows[warmup:] or rows
    step_s = [r["time/step_s"] for r in kept]
    return {"steps_per_s": len(kept) / sum(step_s),
            "step_s": statistics.median(step_s),
            "sample_s": statistics.median(r["time/rollout_s"] for r in kept),
            "wait_s": statistics.median(r["time/step_s"] - r["time/train_s"] for r in kept),
            "train_s": statistics.median(r["time/train_s"] for r in kept)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), default="tiny")
    ap.add_argument("--ks", default="0,1,2", help="comma list of rollout.max_staleness values")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exponent", type=float, default=None,
                    help="core-scaling exponent of both phases in the model (default: measured, k=0 on one thread)")
    ap.add_argument("--correction", choices=("tis", "m2po", "none"), default="tis",
                    help="rollout.staleness_correction of the lagged arms (tis and m2po act on the update: one "
                         "update process, rows with advantage 0 forward only)")
    ap.add_argument("--every-row", action="store_true",
                    help="also each lagged arm with train.skip_zero_advantage=false (every row's backward), "
                         "labelled '<k>_every_row': what the zero-advantage shortcut buys, in the same run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true", help="2 steps per arm, one repeat, warm-up 0")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from meshrl.cpu import cpu_info, describe

    if args.dry_run:
        args.steps, args.repeats, args.warmup = 2, 1, 0
    ks = [int(x) for x in args.ks.split(",")]
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    arms = [(str(k), k, ()) for k in ks] + [(f"{k}_every_row", k, ("train.skip_zero_advantage=false",))
                                             for k in ks if k and args.every_row]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in arms}
    one_thread: list[dict[str, float]] = []  # k = 0 on one thread: how each phase scales with cores
    measure = args.exponent is None and 0 in ks and threads >= 2
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.repeats):
            for label, k, extra in arms:
                rows = run_once(args.protocol, k, args.steps, rep, Path(d), args.correction, extra)
                runs[label].append(summarise(rows, args.warmup))
                torch.set_num_threads(threads)  # a lagged run hands the cores back at its end; be sure
                print(f"repeat {rep} k={label}: " + ", ".join(f"{n} {v:.4g}" for n, v in runs[label][-1].items()),
                      flush=True)
            if measure:
                torch.set_num_threads(1)
                try:
                    one_thread.append(summarise(run_once(args.protocol, 0, args.steps, rep, Path(d)), args.warmup))
                finally:
                    torch.set_num_threads(threads)
                print(f"repeat {rep} k=0 on 1 thread: " + ", ".join(f"{n} {v:.4g}" for n, v in one_thread[-1].items()),
                      flush=True)
    out: dict[str, object] = {"protocol": args.protocol, "correction": args.correction, "steps": args.steps,
                              "warmup": args.warmup,
                              "repeats": args.repeats, "cpu": cpu_info(), "torch_threads": threads,
                              "load_before": load_before, "load_after": os.getloadavg(), "arms": {}}
    for label, rs in runs.items():
        out["arms"][label] = {n: statistics.median(r[n] for r in rs) for n in rs[0]} | {"runs": rs}
    if "0" in runs and threads >= 2:
        base = out["arms"]["0"]
        if measure:
            one = {n: statistics.median(r[n] for r in one_thread) for n in one_thread[0]}
            out["arms"]["0@1"] = one | {"runs": one_thread}
            e_sample = scaling_exponent(one["sample_s"], 1, base["sample_s"], threads)
            e_update = scaling_exponent(one["train_s"], 1, base["train_s"], threads)
        else:
            e_sample = e_update = args.exponent
        p = Phases(sample=base["sample_s"], update=base["train_s"], cores=threads,
                   sample_exponent=e_sample, update_exponent=e_update)
        predicted = split_step(p, max(1, threads // 2))
        out["model"] = {"k0_step_s": base["step_s"], "predicted_lagged_step_s": predicted,
                        "predicted_gain": base["step_s"] / predicted, "sample_exponent": e_sample,
                        "update_exponent": e_update, "exponents": "measured" if measure else "given"}
        for label, k, _ in arms:
            if k:
                arm = out["arms"][label]
                arm["gain_vs_k0"] = arm["steps_per_s"] / base["steps_per_s"]
                arm["measured_over_predicted_step_s"] = arm["step_s"] / predicted
    print(describe(out["cpu"]), f"; load {load_before[0]:.2f} -> {out['load_after'][0]:.2f}")
    for k in out["arms"]:
        arm = out["arms"][k]
        extra = f", {arm['gain_vs_k0']:.2f}x k=0" if "gain_vs_k0" in arm else ""
        print(f"k={k}: {arm['steps_per_s']:.3f} steps/s (sample {arm['sample_s']:.3f} s, wait {arm['wait_s']:.3f} s, "
              f"update {arm['train_s']:.3f} s){extra}")
    if "model" in out:
        m = out["model"]
        print(f"model ({m['exponents']} core-scaling exponents: sample {m['sample_exponent']:.2f}, update "
              f"{m['update_exponent']:.2f}): lagged step {m['predicted_lagged_step_s']:.3f} s predicted, gain "
              f"{m['predicted_gain']:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
