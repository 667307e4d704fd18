"""How one training step's time and peak memory grow, meshrl's trainer against TRL's ``GRPOTrainer``, along three axes.

=========  ===========================================================  =====================================
axis       values (``--points AXIS=v1,v2,..`` to change)                 fixed
=========  ===========================================================  =====================================
group      G = 4, 8, 16, 32, 64 completions per prompt                   model, P prompts, L new tokens
length     L = 32, 64, 128, 256, 512, 1024 max new tokens                model, P, G
model      tiny, smollm2-135m (the pretrained SmolLM2-135M-Instruct),    P, G, L
           random:smollm2-135m, random:smollm2-360m, random:qwen2.5-0.5b
=========  ===========================================================  =====================================

``random:<shape>`` is a model of that shape with random weights, built once from its config (benchmarks/gpu_check.py's
``SHAPES`` and ``build_model_dir``) into ``--model-cache``: SmolLM2-360M (hidden 960, 32 layers, 15 heads, 5 kv
heads, intermediate 2560, vocabulary 49,152) and -135M with SmolLM2's own tokenizer, Qwen2.5-0.5B (hidden 896, 24
layers, 14 / 2 heads, intermediate 4864, vocabulary 151,936, tied embeddings) with gpu_check's character tokenizer
padded to the vocabulary. The group and length axes default to ``random:smollm2-135m``: a pretrained model stops
when it has answered, so past the length of its answers the length axis would measure the same work; a random model
of 49k tokens almost never samples EOS, so every completion runs to L on both sides and the sides do the same work.
Each record keeps the mean completion length it saw.

Every grid point runs once per side, in a child process of its own (benchmarks/memory_vs_trl.py's children and its
sampler: PSS summed over the child's process tree every ``--interval`` s, step and phase markers; TRL built with
throughput_vs_trl.py's matched settings; bf16 autocast over fp32 weights unless ``--no-bf16``): ``--warmup`` (1)
untimed step, then ``--steps`` timed ones. Recorded per point: the median step time (from the child's step-start
marker to its step-end marker), the peak PSS in GB over the timed steps and the phase it fell in, the median time of
each phase, the mean completion length. A random model earns no reward, so every advantage is 0; TRL computes its
loss and runs the backward over every row regardless, while meshrl by default runs rows of advantage 0 forward only
(their gradient is exactly 0). The sweep sets ``train.skip_zero_advantage=false`` for meshrl on every point (also
tiny and the pretrained model, so that the axes do not switch work half-way): both sides then do the full backward
over all P x G rows. ``--meshrl-skip-zero`` keeps meshrl's default instead.

A point past ``--point-timeout`` seconds, or whose process tree passes ``--mem-limit-gb`` (default 90% of the memory
available at start; the child is killed before the kernel's OOM killer picks a victim), or that dies of an allocation
failure, is recorded as ``timeout`` / ``oom`` and the sweep goes on. One JSON line is appended to ``--out`` per point
as it finishes; a rerun skips the points already there (same settings), ``--retry-failed`` reruns those that did not
finish. Then, per axis, side and metric, growth_fit.py's linear and quadratic least-squares fits, which term
dominates at each x, and the x at which the memory fit reaches ``--max-gb`` (24); ``--markdown`` prints the tables,
``--svg`` writes the figure, ``--no-run`` only reports what ``--out`` holds.

    python benchmarks/cost_growth.py --threads 2                                  # the full grid
    python benchmarks/cost_growth.py --axes group --sides meshrl --points group=4,16 --steps 1
    python benchmarks/cost_growth.py --no-run --markdown --svg growth.svg         # report only
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from growth_fit import Measured, Series, analyse, markdown, svg  # noqa: E402
from memory_vs_trl import GB, SideRun, launch_side  # noqa: E402

from meshrl.cpu import cpu_info, describe  # noqa: E402
from meshrl.kernel_caches import bound_kernel_caches  # noqa: E402

AXIS_VALUES: dict[str, tuple] = {
    "group": (4, 8, 16, 32, 64),
    "length": (32, 64, 128, 256, 512, 1024),
    "model": ("tiny", "smollm2-135m", "random:smollm2-135m", "random:smollm2-360m", "random:qwen2.5-0.5b"),
}
AXIS_TITLES = {"group": "group size G", "length": "max new tokens L", "model": "parameters (M)"}
RANDOM = "random:"
BUILT_MARKER = "meshrl-random-model.json"  # written last: a directory without it is incomplete
OOM_SIGNS = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "out of memory")


@dataclass(frozen=True)
class Point:
    side: str
    model: str
    prompts: int
    group: int
    tokens: int

    @property
    def key(self) -> str:
        return f"{self.side} {self.model} P{self.prompts} G{self.group} L{self.tokens}"


# ---------------------------------------------------------------------------------------------- grid
def axis_values(args: argparse.Namespace) -> dict[str, tuple]:
    """The values of each axis in ``--axes``: the defaults, or those given with ``--points AXIS=v1,v2``."""
    values = {axis: AXIS_VALUES[axis] for axis in args.axes}
    for item in args.points or []:
        axis, sep, text = item.partition("=")
        if not sep or axis not in AXIS_VALUES or not text:
            raise SystemExit(f"--points {item!r}: expected AXIS=v1,v2,.. with AXIS one of {list(AXIS_VALUES)}")
        if axis not in values:
            raise SystemExit(f"--points {item!r}: axis {axis} is not in --axes {','.join(args.axes)}")
        parts = [v.strip() for v in text.split(",") if v.strip()]
        try:
            values[axis] = tuple(parts if axis == "model" else (int(v) for v in parts))
        except ValueError:
            raise SystemExit(f"--points {item!r}: {axis} values must be integers") from None
    return values


def on_axis(axis: str, model: str, prompts: int, group: int, tokens: int, args: argparse.Namespace,
            values: dict[str, tuple]) -> bool:
    """Whether the configuration lies on ``axis``: its value there is one of the axis's, the others at the base."""
    base = (args.model, args.prompts, args.group, args.tokens)
    if axis == "group":
        return (model, prompts, tokens) == (base[0], base[1], base[3]) and group in values[axis]
    if axis == "length":
        return (model, prompts, group) == base[:3] and tokens in values[axis]
    return (prompts, group, tokens) == base[1:] and model in values[axis]


def grid(args: argparse.Namespace) -> list[Point]:
    """Every point of the axes, each configuration once (the base point lies on all three), sides in
    ``--sides`` order next to each other so that both meet the same machine load."""
    values = axis_values(args)
    configs: list[tuple[str, int, int, int]] = []
    for axis, vals in values.items():
        for v in vals:
            model, g, tokens = args.model, args.group, args.tokens
            if axis == "group":
                g = v
            elif axis == "length":
                tokens = v
            else:
                model = v
            if (model, args.prompts, g, tokens) not in configs:
                configs.append((model, args.prompts, g, tokens))
    return [Point(side, *c) for c in configs for side in args.sides]


# ---------------------------------------------------------------------------------------------- models
def model_path(spec: str, cache: Path) -> str:
    """What the children load: ``spec`` itself, or for ``random:<shape>`` a directory built once into ``cache``."""
    if not spec.startswith(RANDOM):
        return spec
    import gpu_check

    shape = spec[len(RANDOM) :]
    if shape not in gpu_check.SHAPES:
        raise SystemExit(f"model {spec!r}: unknown shape {shape!r}; known: {sorted(gpu_check.SHAPES)}")
    target = cache / f"random-{shape}"
    if (target / BUILT_MARKER).is_file():
        return str(target)
    tokenizer = None
    if shape.startswith("smollm2"):  # SmolLM2's own tokenizer: the same prompts as the pretrained 135M model
        from transformers import AutoTokenizer

        from meshrl.models.smollm import ensure_smollm2

        tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2()), local_files_only=True)
    print(f"building {spec} (random weights, seed 0) into {target}", file=sys.stderr, flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".random-{shape}-", dir=cache))
    gpu_check.build_model_dir(shape, tmp, seed=0, tokenizer=tokenizer)
    (tmp / BUILT_MARKER).write_text(json.dumps({"shape": shape, "fields": gpu_check.SHAPES[shape], "seed": 0}))
    if target.exists():
        import shutil

        shutil.rmtree(target)  # an incomplete earlier build (no marker)
    tmp.rename(target)
    return str(target)


def count_params(spec: str, path: str) -> int:
    """Parameters of the model (a tied head counted once), from its config on the meta device: nothing allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrl.models.smollm import CACHE_NAME, ensure_smollm2
    from meshrl.models.tiny import TINY_PRESETS, build_char_tokenizer, tiny_config

    if spec in TINY_PRESETS:
        config = tiny_config(spec, build_char_tokenizer())
    else:
        config = AutoConfig.from_pretrained(str(ensure_smollm2()) if spec == CACHE_NAME else path,
                                            local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- one point
def settings(args: argparse.Namespace) -> dict:
    """What must match for a stored point to count as done."""
    return {"warmup": args.warmup, "steps": args.steps, "bf16": args.bf16, "lr": args.lr, "threads": args.threads,
            "meshrl_skip_zero": args.meshrl_skip_zero, "overrides": list(args.overrides or []),
            "same_problems": True}


def child_namespace(point: Point, path: str, args: argparse.Namespace) -> argparse.Namespace:
    """The arguments memory_vs_trl.py's children take (``child_args``), for this point."""
    overrides = ([] if args.meshrl_skip_zero else ["train.skip_zero_advantage=false"]) + list(args.overrides or [])
    return argparse.Namespace(model=path, steps=args.warmup + args.steps, prompts=point.prompts, group=point.group,
                              tokens=point.tokens, lr=args.lr, bf16=args.bf16, overrides=overrides,
                              threads=args.threads, interval=args.interval, verbose=False, same_problems=True)


def step_phases(marks: list[tuple[float, int, str]]) -> dict[int, dict[str, float]]:
    """Seconds per phase of each finished step (one whose ``idle`` marker came), from the driver's marker times:
    each interval between two markers belongs to the first one's phase; ``other`` is the time from the step's start
    to its first phase (TRL: fetching the batch)."""
    out: dict[int, dict[str, float]] = {}
    for (t, step, phase), (t_next, _, _) in zip(marks, marks[1:], strict=False):
        if phase in ("idle", "end", "setup") or step < 1:
            continue
        name = "other" if phase == "step" else phase
        phases = out.setdefault(step, {})
        phases[name] = phases.get(name, 0.0) + t_next - t
    finished = {step for _, step, phase in marks if phase == "idle"}
    return {k: v for k, v in out.items() if k in finished}


def classify(run: SideRun, stderr_tail: str, args: argparse.Namespace) -> tuple[str, str]:
    """``ok`` / ``timeout`` / ``oom`` / ``error`` and why."""
    last = " | ".join(stderr_tail.strip().splitlines()[-3:])
    if run.killed == "timeout":
        return "timeout", f"past --point-timeout {args.point_timeout:g} s"
    if run.killed == "memory":
        return "oom", f"process tree PSS past --mem-limit-gb {args.mem_limit_gb:.1f}"
    if run.rc == -signal.SIGKILL:
        return "oom", "SIGKILL from outside the sweep (the kernel's OOM killer?)"
    if run.rc != 0 and any(sign in stderr_tail for sign in OOM_SIGNS):
        return "oom", last
    if run.rc != 0 or not run.report:
        return "error", f"exit {run.rc}: {last}"
    return "ok", ""


def run_point(point: Point, path: str, params: int, args: argparse.Namespace) -> dict:
    """Run one side of one point; the JSON record (raises KeyboardInterrupt when the sweep was interrupted)."""
    load0, t0 = os.getloadavg(), time.monotonic()
    limit = int(args.mem_limit_gb * GB) if args.mem_limit_gb > 0 else None
    with tempfile.TemporaryFile("w+") as err:
        run = launch_side(point.side, child_namespace(point, path, args), timeout_s=args.point_timeout or None,
                          limit_bytes=limit, stderr=err, echo=False)
        err.seek(0)
        tail = err.read()[-4000:]
    if run.interrupted:
        raise KeyboardInterrupt
    status, reason = classify(run, tail, args)
    cpu = run.report.pop("cpu", None) or cpu_info()  # the child's (its --threads); this process's if it sent none
    timed = range(args.warmup + 1, args.warmup + args.steps + 1)
    phases = step_phases(run.marks)
    step_s = [sum(phases[k].values()) for k in timed if k in phases]
    in_timed = [s for s in run.sampler.samples if s.step in timed]
    peak = max(in_timed, key=lambda s: s.pss["Pss"]) if in_timed else None
    seen = max((s.pss["Pss"] for s in run.sampler.samples), default=0)
    names = sorted({n for k in timed if k in phases for n in phases[k]})
    if status == "ok" and len(step_s) < args.steps:
        status, reason = "error", f"{len(step_s)} of {args.steps} timed steps finished"
    return {
        "key": point.key, "side": point.side, "model": point.model, "prompts": point.prompts, "group": point.group,
        "tokens": point.tokens, "params": params, "settings": settings(args), "status": status, "reason": reason,
        "step_s": step_s, "time_s": statistics.median(step_s) if step_s else None,
        "peak_gb": peak.pss["Pss"] / GB if peak else None, "peak_phase": peak.phase if peak else None,
        "peak_seen_gb": seen / GB,
        "phase_s": {n: statistics.median(phases[k].get(n, 0.0) for k in timed if k in phases) for n in names},
        "response_len": run.report.get("response_len_mean"), "steps_done": len(phases),
        "wall_s": time.monotonic() - t0, "load_before": list(load0), "load_after": list(os.getloadavg()),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "child": run.report, "cpu": cpu,
    }


# ---------------------------------------------------------------------------------------------- store
def load_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not a JSON line ({e.msg}); remove the line or use another --out") from None
        if not isinstance(rec, dict) or "key" not in rec or "status" not in rec:
            raise SystemExit(f"{path}:{n}: a record needs the fields 'key' and 'status'")
        out.append(rec)
    return out


def current(records: list[dict], args: argparse.Namespace) -> dict[str, dict]:
    """The last record of each point run with this sweep's settings."""
    wanted = settings(args)
    return {r["key"]: r for r in records if r.get("settings") == wanted}


def append_record(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------------------------- sweep
def sweep(args: argparse.Namespace) -> None:
    points = grid(args)
    done = current(load_records(args.out), args)
    todo = [p for p in points if p.key not in done or (args.retry_failed and done[p.key]["status"] != "ok")]
    print(f"{len(points)} points ({len(points) - len(todo)} already in {args.out}), {len(todo)} to run; "
          f"memory limit {args.mem_limit_gb:.1f} GB, timeout {args.point_timeout or 'none'} s", file=sys.stderr)
    print(describe(cpu_info()), file=sys.stderr)
    paths: dict[str, str] = {}
    params: dict[str, int] = {}
    start = time.monotonic()
    for i, point in enumerate(todo, 1):
        if point.model not in paths:
            paths[point.model] = model_path(point.model, args.model_cache)
            params[point.model] = count_params(point.model, paths[point.model])
        print(f"[{i}/{len(todo)} {time.strftime('%H:%M:%S')}] {point.key} ...", file=sys.stderr, flush=True)
        rec = run_point(point, paths[point.model], params[point.model], args)
        append_record(args.out, rec)
        spent = time.monotonic() - start
        what = (f"{rec['time_s']:.3g} s/step, peak {rec['peak_gb'] or 0:.2f} GB" if rec["status"] == "ok"
                else f"{rec['status'].upper()}: {rec['reason']}")
        print(f"    {what} ({rec['wall_s']:.0f} s; {spent / 60:.1f} min so far, ~{spent / i * (len(todo) - i) / 60:.0f}"
              f" min to go)", file=sys.stderr, flush=True)


def series(records: dict[str, dict], args: argparse.Namespace) -> Series:
    """axis -> side -> its measured points, sorted by x (G, L, or parameters in millions)."""
    values = axis_values(args)
    out: Series = {}
    for axis in values:
        for side in args.sides:
            pts = []
            for r in records.values():
                if r["side"] != side or not on_axis(axis, r["model"], r["prompts"], r["group"], r["tokens"], args,
                                                     values):
                    continue
                x = {"group": r["group"], "length": r["tokens"], "model": r["params"] / 1e6}[axis]
                label = r["model"] if axis == "model" else str(x)
                pts.append(Measured(float(x), label, r["status"], r["time_s"], r["peak_gb"], r["response_len"]))
            out.setdefault(axis, {})[side] = sorted(pts, key=lambda p: p.x)
    return out


def report(args: argparse.Namespace) -> None:
    records = current(load_records(args.out), args)
    data = series(records, args)
    fits = analyse(data, args.max_gb)
    summary = {axis: {side: {m: (f.as_dict() if f else None) for m, f in metrics.items()}
                      for side, metrics in sides.items()} for axis, sides in fits.items()}
    print(json.dumps({"points": len(records), "fits": summary}))
    if args.markdown:
        print(markdown(data, fits, {**AXIS_TITLES, **base_titles(args)}, args.max_gb))
    if args.svg:
        args.svg.write_text(svg(data, fits, {**AXIS_TITLES, **base_titles(args)}, args.max_gb))
        print(f"wrote {args.svg}", file=sys.stderr)


def base_titles(args: argparse.Namespace) -> dict[str, str]:
    return {"group": f"G ({args.model}, P={args.prompts}, L={args.tokens})",
            "length": f"L ({args.model}, P={args.prompts}, G={args.group})",
            "model": f"parameters, M (P={args.prompts}, G={args.group}, L={args.tokens})"}


# ---------------------------------------------------------------------------------------------- main
def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from meshrl.models.smollm import default_cache_root

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--axes", default="group,length,model", help="comma list of group, length, model")
    ap.add_argument("--sides", default="meshrl,trl", help="comma list of meshrl, trl")
    ap.add_argument("--points", action="append", metavar="AXIS=v1,v2", help="an axis's values (repeatable)")
    ap.add_argument("--model", default="random:smollm2-135m", help="the model of the group and length axes")
    ap.add_argument("--prompts", type=int, default=4, help="P, fixed on every axis")
    ap.add_argument("--group", type=int, default=8, help="G on the length and model axes")
    ap.add_argument("--tokens", type=int, default=48, help="L on the group and model axes")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per point")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast over fp32 weights on both sides (--no-bf16: fp32)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in the children (default torch's)")
    ap.add_argument("--set", dest="overrides", action="append", help="meshrl config override (repeatable)")
    ap.add_argument("--meshrl-skip-zero", action="store_true",
                    help="keep meshrl's forward-only rows of advantage 0 (default: full backward, as TRL)")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between memory samples")
    ap.add_argument("--point-timeout", type=float, default=1800.0, help="seconds per point and side (0: none)")
    ap.add_argument("--mem-limit-gb", type=float, default=None,
                    help="kill a point whose process tree passes this (default 90%% of MemAvailable; 0: none)")
    ap.add_argument("--max-gb", type=float, default=24.0, help="where the memory fits are solved for x")
    ap.add_argument("--out", type=Path, default=Path("cost_growth.jsonl"), help="JSON lines, one per point")
    ap.add_argument("--model-cache", type=Path, default=default_cache_root(), help="where random:<shape> is built")
    ap.add_argument("--retry-failed", action="store_true", help="rerun stored points that did not finish")
    ap.add_argument("--no-run", action="store_true", help="only report what --out holds")
    ap.add_argument("--markdown", action="store_true", help="print tables for benchmarks/JOURNAL.md")
    ap.add_argument("--svg", type=Path, default=None, help="write the figure here")
    args = ap.parse_args(argv)
    args.axes = [a for a in args.axes.split(",") if a]
    args.sides = [s for s in args.sides.split(",") if s]
    if bad := [a for a in args.axes if a not in AXIS_VALUES]:
        ap.error(f"--axes: unknown {bad}; use {list(AXIS_VALUES)}")
    if bad := [s for s in args.sides if s not in ("meshrl", "trl")]:
        ap.error(f"--sides: unknown {bad}; use meshrl, trl")
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.mem_limit_gb is None:
        args.mem_limit_gb = 0.9 * mem_available_gb()
    return args


def main(argv: list[str] | None = None) -> int:
    bound_kernel_caches()  # the children inherit it: meshrl's side as its command line runs (memory_vs_trl.py)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the point under way, as Ctrl-C does
    if not args.no_run:
        try:
            sweep(args)
        except KeyboardInterrupt:
            print(f"interrupted: the finished points are in {args.out}; rerun to go on", file=sys.stderr)
            return 130
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
