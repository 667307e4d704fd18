"""Where a step's memory goes, meshrl's GPU path beside TRL's ``GRPOTrainer``, measured on a CPU: the twin of
``gpu_check.py``'s memory figures, for while no GPU is lent.

The one GPU measurement (benchmarks/README.md, "GPU") gave meshrl 2.0x TRL's peak allocated memory at the
Qwen2.5-0.5B shape without saying where it went. Which tensors are alive at a step's peak does not depend on the
device: the same code allocates tensors of the same shapes and dtypes on a CPU. So this runs ``gpu_check.py``'s two
sides on a CPU, meshrl set up as on CUDA (one process: the serial update engine, no decode workers, the static
decoder that CUDA replays as a graph run eagerly, no float32 attention), and records every tensor allocation of one
step with PyTorch's profiler (``profile_memory``; the categories are those of ``torch.profiler``'s memory timeline:
parameter, optimizer state, gradient, activation, temporary, input, autograd detail, unclassified). Printed and
written per side: the step's peak of live tensor bytes, what it was made of, and (meshrl) each phase's own peak
(rollout, old log-probs, update, weight sync: gpu_check's ``PhaseProbe`` phases, those that run) with its
make-up; TRL marks its rollout only, so its peak's phase is None when the peak falls in its update.

What this is not: a GPU figure. CUDA kernels differ from CPU ones in their workspaces (flash or memory-efficient
attention against the CPU's), the caching allocator rounds and reserves, and a tensor that no operator touches
during the profiled step (nothing should be held so, but it would be) is not seen. Read the figures as where the
bytes go and as a ratio between the two sides, and check them against ``gpu_check.py`` on a device.
``--layers`` builds the shape with fewer layers (the head, the vocabulary and the per-layer sizes unchanged), so
that a 2-core CPU with 24 GiB can run it; activations scale with the layers, so two depths give the per-layer cost.

    python benchmarks/memory_twin.py --layers 4 --prompts 2 --group 8      # Qwen2.5-0.5B's sizes, 4 layers
    python benchmarks/memory_twin.py --dry-run                             # a tiny Qwen2 shape: what CI runs
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import SHAPES, PhaseProbe, build_model_dir, meshrl_trainer  # noqa: E402
from throughput_vs_trl import TASK, Side, trl_trainer  # noqa: E402

from meshrl.cpu import cpu_info, describe  # noqa: E402

#: meshrl's settings that make a CPU run take the GPU path's memory layout (the update engine and the rollout
#: backend as ``train.device=cuda`` chooses them, the cuda speed path's choices; meshrl.trainer.speed)
GPU_LAYOUT = ("train.update_workers=1", "rollout.decode_workers=1", "rollout.decoder=static",
              "rollout.prepack_weights=false", "train.float32_attention=false", "train.heap_mmap_kib=0")
PHASE_PREFIX = "phase:"
GIB = 2**30


def categories() -> list[str]:
    """The memory timeline's columns: index 0 is never filled, then one per category, ``None`` last."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    names = ["-"] * (len(_CATEGORY_TO_INDEX) + 1)
    for category, i in _CATEGORY_TO_INDEX.items():
        names[i + 1] = "unclassified" if category is None else category.name.lower()
    return names


def make_up(sizes: list[int], names: list[str]) -> dict[str, float]:
    """GiB per category of one moment of the timeline, the empty ones left out."""
    return {name: size / GIB for name, size in zip(names, sizes, strict=True) if size}


def timeline(prof) -> tuple[list[float], list[list[int]]]:
    """Times (microseconds, the trace's clock) and the live bytes per category after each, on the CPU."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    return MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")


def phase_windows(prof) -> dict[str, list[tuple[float, float]]]:
    """Each ``phase:<name>`` range of the profiled step, in the timeline's clock."""
    start_us = prof.profiler.kineto_results.trace_start_ns() / 1000
    windows: dict[str, list[tuple[float, float]]] = {}
    for e in prof.events():
        if e.name.startswith(PHASE_PREFIX):
            windows.setdefault(e.name[len(PHASE_PREFIX):], []).append(
                (start_us + e.time_range.start, start_us + e.time_range.end))
    return windows


def summarise_profile(prof) -> dict[str, Any]:
    """The step's peak of live tensor bytes with its make-up, the bytes alive at the step's start, and each
    phase's peak (over all its ranges) with its make-up. Allocations freed within the microsecond they were made in
    are not seen (the timeline's resolution)."""
    try:
        return _summarise(prof)
    except (ImportError, AttributeError, TypeError, ValueError) as e:  # the memory timeline is a private torch API
        raise RuntimeError(f"torch {torch.__version__}: the profiler's memory timeline API is not the one this "
                           f"script reads ({type(e).__name__}: {e})") from e


def _summarise(prof) -> dict[str, Any]:
    times, sizes = timeline(prof)
    names = categories()
    if not times:
        return {"peak_gib": None, "why": "the profiler saw no allocation"}
    totals = [sum(s) for s in sizes]
    peak = max(range(len(totals)), key=totals.__getitem__)
    out: dict[str, Any] = {"peak_gib": totals[peak] / GIB, "peak_make_up": make_up(sizes[peak], names),
                           "start_gib": totals[0] / GIB, "start_make_up": make_up(sizes[0], names)}
    phases = {}
    windows = phase_windows(prof)
    for phase, ranges in windows.items():
        inside = [i for i, t in enumerate(times) if any(a <= t <= b for a, b in ranges)]
        if inside:
            top = max(inside, key=totals.__getitem__)
            phases[phase] = {"peak_gib": totals[top] / GIB, "make_up": make_up(sizes[top], names)}
    out["phases"] = phases
    # the phase whose ranges hold the step's peak (None: outside every marked phase, e.g. TRL's update)
    out["peak_phase"] = next((phase for phase, ranges in windows.items()
                              if any(a <= times[peak] <= b for a, b in ranges)), None)
    return out


def profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)


def mark_phases(obj_methods: dict[str, tuple[Any, str]]) -> None:
    """Wrap each ``(owner, method)`` in a ``phase:<name>`` profiler range."""
    from torch.profiler import record_function

    for phase, (owner, name) in obj_methods.items():
        inner = getattr(owner, name)

        def marked(*a, _inner=inner, _phase=phase, **k):
            with record_function(PHASE_PREFIX + _phase):
                return _inner(*a, **k)

        setattr(owner, name, marked)


def run_meshrl(model_dir: Path, args, tmp: Path) -> dict[str, Any]:
    trainer = meshrl_trainer(model_dir, args, torch.device("cpu"), tmp / "meshrl", mei=False,
                             extra=(*GPU_LAYOUT, *args.set))
    try:
        mark_phases({phase: (trainer if owner is None else getattr(trainer, owner), name)
                     for phase, (owner, name) in PhaseProbe.PHASES.items()})
        for _ in range(args.warmup):
            trainer.step()
        with profiler() as prof:
            t0 = time.perf_counter()
            trainer.step()
            seconds = time.perf_counter() - t0
        speed = trainer.speed.name
    finally:
        trainer.close()
    return {**summarise_profile(prof), "profiled_step_s": seconds, "speed_path": speed}


def run_trl(model_dir: Path, args, tmp: Path) -> dict[str, Any]:
    from transformers import TrainerCallback

    from meshrl.models import load_model
    from meshrl.tasks import load_task

    model, tok = load_model(str(model_dir), dtype="float32")
    state: dict[str, Any] = {"prof": None}

    class Profile(TrainerCallback):  # the step after the warm-up ones, rollout and update together
        def on_step_begin(self, a, s, control, **kw):
            if s.global_step == args.warmup:
                state["prof"], state["t0"] = profiler(), time.perf_counter()
                state["prof"].__enter__()

        def on_step_end(self, a, s, control, **kw):
            if state["prof"] is not None and "seconds" not in state:
                state["prof"].__exit__(None, None, None)
                state["seconds"] = time.perf_counter() - state["t0"]

    trainer = trl_trainer(model, copy.deepcopy(tok), load_task(TASK, seed=0), args.prompts, args.group,
                          args.max_new_tokens, args.lr, args.warmup + 1, tmp / "trl", Side("trl"), [Profile()],
                          use_cpu=True, bf16=args.bf16)
    mark_phases({"rollout": (trainer, "_generate_and_score_completions")})
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    finally:
        if state["prof"] is not None and "seconds" not in state:  # the step failed or never ended: stop profiling
            state["prof"].__exit__(None, None, None)
    del trainer, model
    if "seconds" not in state:
        raise RuntimeError("TRL finished no profiled step (it ran fewer steps than --warmup + 1)")
    return {**summarise_profile(state["prof"]), "profiled_step_s": state["seconds"]}


def shape_with_layers(shape: str, layers: int | None) -> str:
    """``shape`` itself, or a registered copy with ``layers`` layers (``qwen2.5-0.5b-L4``)."""
    if layers is None or layers == SHAPES[shape]["num_hidden_layers"]:
        return shape
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    name = f"{shape}-L{layers}"
    SHAPES[name] = {**SHAPES[shape], "num_hidden_layers": layers}
    return name


def report(name: str, r: dict[str, Any]) -> None:
    if r.get("peak_gib") is None:
        print(f"{name:<7} {r}")
        return

    def parts(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))

    print(f"{name:<7} peak {r['peak_gib']:.2f} GiB in {r['peak_phase'] or 'no marked phase'} "
          f"({parts(r['peak_make_up'])}); at the step's start {r['start_gib']:.2f}")
    for phase, p in r.get("phases", {}).items():
        print(f"        {phase:<13} peak {p['peak_gib']:.2f} GiB ({parts(p['make_up'])})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=[s for s in SHAPES if "-L" not in s])
    ap.add_argument("--layers", type=int, default=None, help="build the shape with this many layers")
    ap.add_argument("--dry-run", action="store_true", help="the tiny-qwen shape, a small batch: checks the script")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1, help="unprofiled steps per side first")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 (default: bf16 autocast)")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--no-meshrl", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further meshrl setting, after the GPU layout's (train.speed=plain: the layout of the "
                         "GPU run on record, made before the CUDA speed path existed)")
    ap.add_argument("--json", type=Path, default=Path("runs/memory_twin.json"))
    args = ap.parse_args(argv)
    if args.dry_run:
        args.shape, args.prompts, args.group, args.max_new_tokens = "tiny-qwen", 2, 4, 8
    shape = shape_with_layers(args.shape, args.layers)
    logging.getLogger("meshrl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    env = {"torch": torch.__version__, "shape": shape, "base_shape": args.shape, **SHAPES[shape],
           "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
           "warmup": args.warmup, "bf16_autocast": args.bf16, "meshrl_settings": [*GPU_LAYOUT, *args.set],
           "cpu": cpu_info()}
    for package in ("transformers", "trl"):
        with contextlib.suppress(ImportError):
            env[package] = __import__(package).__version__
    print(describe(env["cpu"]))
    tmp = Path(tempfile.mkdtemp(prefix="meshrl-memory-twin-"))
    try:
        return _run_sides(args, shape, env, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the model directory: a GB or more at these shapes


def _run_sides(args, shape: str, env: dict[str, Any], tmp: Path) -> int:
    model_dir = build_model_dir(shape, tmp / "model")
    result: dict[str, Any] = {"env": env}
    for name, run in (("meshrl", run_meshrl), ("trl", run_trl)):
        if (name == "trl" and args.no_trl) or (name == "meshrl" and args.no_meshrl):
            continue
        missing = [m for m in ("trl", "datasets") if name == "trl" and importlib.util.find_spec(m) is None]
        if missing:  # say so, keep meshrl's figures
            result[name] = {"skipped": f"not installed: {', '.join(missing)}"}
        else:
            result[name] = run(model_dir, args, tmp)
        report(name, result[name])
    if result.get("meshrl", {}).get("peak_gib") and result.get("trl", {}).get("peak_gib"):
        result["ratio_peak"] = result["meshrl"]["peak_gib"] / result["trl"]["peak_gib"]
        print(f"meshrl / TRL peak live tensor bytes: {result['ratio_peak']:.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
