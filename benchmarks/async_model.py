"""A cost model of asynchronous rollouts: what overlapping sampling with the update can buy, from measured phase times.

A synchronous step (staleness k = 0, meshrl today) costs ``S + U + W``: sampling, the update (old log-probs, backward,
optimiser) and the weight sync, one after another. With staleness k >= 1 the sampler draws the batches of the next
steps while the update runs, so in steady state a step costs the slower of the two stages (a two-stage pipeline):

* **one machine, cores split** between the sampler (``c`` cores) and the update (``C - c``): each stage slows down
  from its all-core time by how its work scales with cores, ``T(c) = T(C) * (C / c) ** e`` (``e`` = 1: perfectly
  parallel; 0: no gain from cores; measured ``e`` per phase from two core counts, :func:`scaling_exponent`); a step
  costs ``max(S(c), U(C - c) + W)`` at the best split (:func:`best_split`);
* **separate devices** (a sampling device and a training device, as verl's one-step-off and NeMo RL's): a step costs
  ``max(S, U + W)`` with each stage at its own device's full speed, ``W`` now the transfer.

k >= 2 has the same steady-state period in this model (throughput is bound by the slower stage); what more
staleness buys is slack against step-to-step variation, which the model leaves out. It also leaves out the
correction's cost (importance weights: a few elementwise operations) and memory.

    python benchmarks/async_model.py runs/some_run        # phase times from its metrics.jsonl (median)
    python benchmarks/async_model.py --sample 30 --update 60 --sync 0.5 --cores 2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Phases:
    """Seconds per step of each phase on all ``cores`` of one machine, and each phase's core-scaling exponent."""

    sample: float
    update: float
    sync: float = 0.0
    cores: int = 2
    sample_exponent: float = 1.0
    update_exponent: float = 1.0

    def __post_init__(self) -> None:
        for name in ("sample", "update", "sync"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        for name in ("sample_exponent", "update_exponent"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def on(self, phase: str, cores: int) -> float:
        """Seconds of ``phase`` ("sample" or "update") on ``cores`` of the machine's cores."""
        t, e = (self.sample, self.sample_exponent) if phase == "sample" else (self.update, self.update_exponent)
        return t * (self.cores / cores) ** e


def synchronous(p: Phases) -> float:
    """Seconds per step at k = 0: the phases one after another on every core."""
    return p.sample + p.update + p.sync


def split_step(p: Phases, sample_cores: int) -> float:
    """Seconds per step at k >= 1 with ``sample_cores`` cores sampling and the rest updating."""
    if not 1 <= sample_cores < p.cores:
        raise ValueError(f"sample_cores must be in [1, {p.cores - 1}], got {sample_cores}")
    return max(p.on("sample", sample_cores), p.on("update", p.cores - sample_cores) + p.sync)


def best_split(p: Phases) -> tuple[int, float]:
    """``(sample cores, seconds per step)`` of the best split at k >= 1; with one core nothing overlaps, so
    ``(1, synchronous)``."""
    if p.cores < 2:
        return 1, synchronous(p)
    return min(((c, split_step(p, c)) for c in range(1, p.cores)), key=lambda cs: (cs[1], cs[0]))


def separate_devices(p: Phases, transfer: float | None = None) -> float:
    """Seconds per step at k >= 1 with sampling and training on devices of their own (each phase at its full
    speed); ``transfer`` replaces the sync time (weights sent between the devices)."""
    return max(p.sample, p.update + (p.sync if transfer is None else transfer))


def scaling_exponent(t_few: float, cores_few: int, t_all: float, cores_all: int) -> float:
    """``e`` with ``t_few = t_all * (cores_all / cores_few) ** e`` from one phase timed at two core counts, clipped to
    [0, 1] (a phase cannot gain more than linearly, nor lose from more cores in this model)."""
    if cores_few >= cores_all or min(t_few, t_all) <= 0:
        raise ValueError("time the phase on fewer cores first and on more cores second, both times > 0")
    return min(1.0, max(0.0, math.log(t_few / t_all) / math.log(cores_all / cores_few)))


def phases_of_run(run_dir: Path, cores: int) -> Phases:
    """Median phase times of a meshrl run's steps (``time/rollout_s`` and ``time/train_s`` of metrics.jsonl; the
    first step, which pays for start-up, left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/rollout_s" in r and "time/train_s" in r][1:]
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no steps with time/rollout_s and time/train_s after the first")
    return Phases(sample=statistics.median(r["time/rollout_s"] for r in rows),
                  update=statistics.median(r["time/train_s"] for r in rows), cores=cores)


def report(p: Phases, transfer: float | None = None) -> dict[str, float]:
    k0 = synchronous(p)
    cores, split = best_split(p)
    sep = separate_devices(p, transfer)
    return {"k0_s": k0, "split_s": split, "split_sample_cores": cores, "split_gain": k0 / split,
            "separate_devices_s": sep, "separate_devices_gain": (p.sample + p.update + (transfer or p.sync)) / sep}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", type=Path, help="a meshrl run directory (phase times from its metrics)")
    ap.add_argument("--sample", type=float, help="seconds of sampling per step (instead of a run)")
    ap.add_argument("--update", type=float, help="seconds of the update per step")
    ap.add_argument("--sync", type=float, default=0.0)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--sample-exponent", type=float, default=1.0)
    ap.add_argument("--update-exponent", type=float, default=1.0)
    ap.add_argument("--transfer", type=float, default=None, help="separate devices: seconds to send the weights")
    args = ap.parse_args(argv)
    try:
        if args.run is not None:
            p = phases_of_run(args.run, args.cores)
            p = Phases(p.sample, p.update, args.sync, args.cores, args.sample_exponent, args.update_exponent)
        elif args.sample is not None and args.update is not None:
            p = Phases(args.sample, args.update, args.sync, args.cores, args.sample_exponent, args.update_exponent)
        else:
            raise ValueError("give a run directory, or --sample and --update")
    except (ValueError, OSError) as err:
        print(f"async_model: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"phases": p.__dict__, **report(p, args.transfer)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
