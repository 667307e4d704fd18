"""Peak memory of meshrl's trainer against TRL's ``GRPOTrainer``, summed over every process of each side.

meshrl forks worker processes (the native decoder: one per torch thread; the update, for small models: one per
torch thread), which share the parent's pages copy-on-write and the weights through shared memory. The honest
figure is the proportional set size (PSS) summed over the process tree: a page shared by ``k`` processes counts
``1/k`` in each, so the sum counts it once. The driver runs each side in a subprocess of its own (``--side
meshrl|trl``), one after the other, never together, and a sampler thread in the driver reads ``Pss`` (with its
``Pss_Anon`` / ``Pss_File`` / ``Pss_Shmem`` split) from ``/proc/<pid>/smaps_rollup`` of the child and all its
descendants every ``--interval`` seconds (0.25). The child prints a marker line when a step or a phase starts,
so that each sample is attributed to a step and, for meshrl, to a phase:

=============  ====================================================================================
phase          meshrl                                  TRL
=============  ====================================================================================
``setup``      model, optimiser, workers built          model, trainer built
``rollout``    ``plugins.sample`` (generate, rewards)   ``_generate_and_score_completions``
``logps``      old-policy / reference / top-p log-probs (nothing with ``beta=0``, ``num_iterations=1``)
``update``     the engine's forward + backward, clip    ``compute_loss`` + backward
``optimizer``  ``optimizer.step``                       from ``on_pre_optimizer_step``
``sync``       the rollout backend's weight sync        --
``idle``       after ``Trainer.step()`` returns         from ``on_step_end`` (the loop between steps)
=============  ====================================================================================

The protocol defaults are SmolLM2-135M, GRPO with 4 prompts x 8 completions, 48 new tokens, bf16 autocast over
fp32 weights (TRL's ``bf16=True``; meshrl's ``train.autocast_bf16`` and ``rollout.autocast_bf16``), lr 1e-5, 20
steps, and otherwise throughput_vs_trl.py's table of matched settings (its helpers build TRL's side). Both sides
draw the same problems at every step (TRL reads meshrl's order unshuffled; each child checks its draws and fails
otherwise; ``--no-same-problems``: TRL shuffles), since TRL's activations grow with its answers' lengths. Printed:
peak GB per side, the ratio meshrl / TRL, the growth of the per-step peak from step 3 to the last step, the
per-phase peak for meshrl, the load average before and after each side; ``--json`` writes all of it with the
per-step series.

    python benchmarks/memory_vs_trl.py --steps 3                 # quick mode
    python benchmarks/memory_vs_trl.py                           # the protocol, 20 steps per side
    python benchmarks/memory_vs_trl.py --sides meshrl --set train.micro_batch_size=8
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from meshrl.cpu import cpu_info, describe
from meshrl.kernel_caches import CACHE_VARIABLES, bound_kernel_caches

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MARK = "MEMMARK"  # child -> driver: "MEMMARK <step> <phase>"
RESULT = "MEMRESULT"  # child -> driver: "MEMRESULT <json>" once, at the end
PSS_FIELDS = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")
GB = 1e9


# ---------------------------------------------------------------------------------------------- sampling
def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (children of children included), from ``/proc/<pid>/task/*/children``."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue  # ended meanwhile
        for t in tasks:
            with contextlib.suppress(OSError), open(f"/proc/{p}/task/{t}/children") as f:
                todo.extend(int(c) for c in f.read().split())
    return out


def smaps_pss(pid: int) -> dict[str, int] | None:
    """Bytes of each :data:`PSS_FIELDS` entry of ``/proc/<pid>/smaps_rollup`` (None when the process is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    out = dict.fromkeys(PSS_FIELDS, 0)
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in out:
            out[key] = int(rest.split()[0]) * 1024  # the kernel reports kB
    return out


def tree_pss(pid: int) -> tuple[dict[str, int], dict[int, int]]:
    """PSS of ``pid``'s process tree: the fields summed over processes, and ``{pid: Pss bytes}``."""
    total = dict.fromkeys(PSS_FIELDS, 0)
    per_pid: dict[int, int] = {}
    for p in process_tree(pid):
        fields = smaps_pss(p)
        if fields is None:
            continue
        per_pid[p] = fields["Pss"]
        for k, v in fields.items():
            total[k] += v
    return total, per_pid


@dataclass
class Sample:
    t: float
    step: int
    phase: str
    pss: dict[str, int]
    per_pid: dict[int, int]


@dataclass
class TreeSampler:
    """A thread that samples :func:`tree_pss` of ``pid`` every ``interval`` s, tagging each sample with the
    current ``(step, phase)`` (set by whoever reads the child's markers); ``on_sample`` (if set) sees each sample
    as it is taken (a memory limit's check)."""

    pid: int
    interval: float = 0.25
    step: int = 0
    phase: str = "setup"
    samples: list[Sample] = field(default_factory=list)
    on_sample: Callable[[Sample], None] | None = None

    def __post_init__(self) -> None:
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def take(self) -> None:
        """One sample now, tagged with the current step and phase. Called by the timer thread every ``interval``
        and by the marker reader at every marker, so that a step or phase shorter than the interval (or one during
        which a loaded machine starved the timer thread) still has a sample."""
        step, phase = self.step, self.phase  # read before sampling: the sample belongs to this phase
        pss, per_pid = tree_pss(self.pid)
        if per_pid:
            sample = Sample(time.monotonic() - self._t0, step, phase, pss, per_pid)
            with self._lock:
                self.samples.append(sample)
            if self.on_sample is not None:
                self.on_sample(sample)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.take()
            self._stop.wait(self.interval)


def summarise(samples: list[Sample], steps: int) -> dict:
    """Peak GB over the training steps (samples of steps ``1..steps``; ``peak_whole_gb`` adds setup and exit), per
    step and per phase; growth of the per-step peak from step 3 (or the last, if fewer) to the last step."""
    training = [s for s in samples if 1 <= s.step <= steps]
    if not training:
        raise RuntimeError("no memory sample fell inside a training step: lower --interval")
    peak = max(training, key=lambda s: s.pss["Pss"])
    per_step: dict[int, float | None] = {}
    for k in range(1, steps + 1):
        in_step = [s.pss["Pss"] for s in training if s.step == k]
        per_step[k] = max(in_step) / GB if in_step else None  # a step shorter than the interval has no sample
    phases: dict[str, float] = {}
    for s in samples:
        phases[s.phase] = max(phases.get(s.phase, 0.0), s.pss["Pss"] / GB)
    first = min(3, steps)
    a, b = per_step[first], per_step[steps]
    return {
        "peak_gb": peak.pss["Pss"] / GB,
        "peak_whole_gb": max(s.pss["Pss"] for s in samples) / GB,
        "peak_split_gb": {k: v / GB for k, v in peak.pss.items()},
        "peak_at": {"step": peak.step, "phase": peak.phase, "t": peak.t},
        "peak_processes_gb": sorted((v / GB for v in peak.per_pid.values()), reverse=True),
        "per_step_peak_gb": per_step,
        "per_phase_peak_gb": phases,
        "growth_gb": None if a is None or b is None else b - a,
        "growth_from_step": first,
        "samples": len(samples),
        "max_processes": max(len(s.per_pid) for s in samples),
    }


# ---------------------------------------------------------------------------------------------- driver
@dataclass
class SideRun:
    """One child's run: its command, exit code, final report, the sampler (its samples), each marker as
    ``(time.monotonic() when read, step, phase)``, and why it ended early: ``interrupted`` (Ctrl-C / SIGTERM to the
    driver) or ``killed`` (the reason the driver killed its process tree: ``timeout`` or ``memory``)."""

    cmd: list[str]
    rc: int
    report: dict
    sampler: TreeSampler
    marks: list[tuple[float, int, str]]
    interrupted: bool = False
    killed: str | None = None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (it was started in a session of its own, so forked workers that
    outlive their parent go too)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def launch_side(side: str, args: argparse.Namespace, *, timeout_s: float | None = None,
                limit_bytes: int | None = None, stderr: IO | None = None, echo: bool = True) -> SideRun:
    """Run ``--side side`` in a subprocess and sample its tree until it ends; never raises for the child's failure.
    ``timeout_s`` / ``limit_bytes`` (tree PSS): past either, the child's process group is killed and ``killed``
    says which. ``stderr``: where the child's stderr goes (default: this process's)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, *child_args(args)]
    guarded = timeout_s is not None or limit_bytes is not None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1,
                            start_new_session=guarded, env=side_env(side, args))
    run = SideRun(cmd, 0, {}, TreeSampler(proc.pid, args.interval), [])

    def kill(reason: str) -> None:
        if run.killed is None:
            run.killed = reason
            kill_group(proc)

    if limit_bytes is not None:
        run.sampler.on_sample = lambda s: kill("memory") if s.pss["Pss"] > limit_bytes else None
    timer = threading.Timer(timeout_s, kill, ("timeout",)) if timeout_s is not None else None
    run.sampler.start()
    if timer is not None:
        timer.start()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith(MARK):
                _, step, phase = line.split()
                run.sampler.step, run.sampler.phase = int(step), phase
                run.marks.append((time.monotonic(), int(step), phase))
                run.sampler.take()
                if phase == "step" and echo:
                    print(f"[{side}] step {step} at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
            elif line.startswith(RESULT):
                run.report = json.loads(line[len(RESULT) :])
            elif args.verbose:
                print(f"[{side}] {line}", end="")
        run.rc = proc.wait()
    except KeyboardInterrupt:
        run.interrupted = True
        if guarded:
            kill_group(proc)
        else:
            proc.terminate()
        run.rc = proc.wait()
    finally:  # also on any other exception: a child in a session of its own would otherwise outlive the driver
        if timer is not None:
            timer.cancel()
        if guarded:
            kill_group(proc)  # forked workers left behind by a child that died
        run.sampler.stop()
    return run


def run_side(side: str, args: argparse.Namespace) -> dict:
    """Run ``--side side`` in a subprocess, sample its tree until it ends; the summary plus the child's report.
    Interrupted (Ctrl-C, SIGTERM to the driver), the child is stopped and the steps it finished are summarised
    (``complete`` False)."""
    load0 = os.getloadavg()
    run = launch_side(side, args)
    if not run.interrupted and (run.rc != 0 or not run.report):
        raise RuntimeError(f"--side {side} failed (exit {run.rc}); rerun it alone to see its error: "
                           f"{' '.join(run.cmd)}")
    sampler = run.sampler
    done = args.steps if not run.interrupted else sampler.step - 1  # the step under way when stopped is not whole
    out = summarise([s for s in sampler.samples if s.step <= done or s.step > args.steps], max(done, 1))
    out.update(run.report)
    out["complete"], out["steps_done"] = not run.interrupted, done
    out["load_before"], out["load_after"] = list(load0), list(os.getloadavg())
    out["series"] = [(round(s.t, 2), s.step, s.phase, s.pss["Pss"]) for s in sampler.samples]
    return out


TORCH_KERNEL_CACHE_ENTRIES = "1024"  # ideep's and oneDNN's own capacity, what a TRL user runs with


def side_env(side: str, args: argparse.Namespace) -> dict[str, str]:
    """A child's environment. The driver bounds oneDNN's kernel caches as meshrl's command line does
    (meshrl.kernel_caches; :func:`main`), so TRL's child is given PyTorch's own capacities back, as its users run it,
    unless ``--trl-kernel-caches meshrl``. meshrl's child inherits this process's (meshrl's bound, or the caller's)."""
    env = dict(os.environ)
    if side == "trl" and getattr(args, "trl_kernel_caches", "torch") == "torch":
        env.update({name: TORCH_KERNEL_CACHE_ENTRIES for name in CACHE_VARIABLES})
    return env


def child_args(args: argparse.Namespace) -> list[str]:
    out = ["--model", args.model, "--steps", str(args.steps), "--prompts", str(args.prompts), "--group",
           str(args.group), "--tokens", str(args.tokens), "--lr", str(args.lr)]
    out += ["--bf16"] if args.bf16 else ["--no-bf16"]
    out += ["--same-problems"] if getattr(args, "same_problems", True) else ["--no-same-problems"]
    for s in args.overrides or []:
        out += ["--set", s]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


def fmt(value: float | None, spec: str) -> str:
    text = format(value, spec) if value is not None else "n/a"
    return text.rjust(int(spec.lstrip("+").split(".")[0] or 0))


def print_table(results: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\n{args.model}: {args.prompts} prompts x {args.group} completions, {args.tokens} new tokens, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}, lr {args.lr}, {args.steps} steps; PSS summed over each "
          f"side's process tree every {args.interval} s")
    print(f"{'side':<8}{'peak GB':>9}{'whole run':>10}{'at step/phase':>18}{'procs':>7}{'anon':>7}{'file':>7}"
          f"{'shmem':>7}{'growth':>9}{'load 1m before/after':>23}")
    for name, r in results.items():
        split = r["peak_split_gb"]
        at = f"{r['peak_at']['step']}/{r['peak_at']['phase']}"
        print(f"{name:<8}{r['peak_gb']:>9.2f}{r['peak_whole_gb']:>10.2f}{at:>18}{r['max_processes']:>7}"
              f"{split['Pss_Anon']:>7.2f}{split['Pss_File']:>7.2f}{split['Pss_Shmem']:>7.2f}"
              f"{fmt(r['growth_gb'], '+9.2f')}"
              f"{r['load_before'][0]:>12.2f}/{r['load_after'][0]:.2f}")
    if "meshrl" in results and "trl" in results:
        print(f"ratio meshrl / TRL peak: {results['meshrl']['peak_gb'] / results['trl']['peak_gb']:.2f}x")
    for name, r in results.items():
        if not r["complete"]:
            print(f"{name}: INTERRUPTED after {r['steps_done']} of {args.steps} steps (figures over those)")
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["per_phase_peak_gb"].items())
        print(f"{name} per-phase peak GB: {phases}")
        steps = " ".join(fmt(v, ".2f") for v in r["per_step_peak_gb"].values())
        print(f"{name} per-step peak GB: {steps}")


# ---------------------------------------------------------------------------------------------- children
def mark(step: int, phase: str) -> None:
    # sys.__stdout__: TRL's train() runs under redirect_stdout, which must not swallow the markers.
    print(f"{MARK} {step} {phase}", file=sys.__stdout__, flush=True)


class Marker:
    """The child's current step; :meth:`wrap` makes a callable announce a phase when called."""

    def __init__(self) -> None:
        self.step = 0

    def wrap(self, fn, phase: str):
        def marked(*a, **kw):
            mark(self.step, phase)
            return fn(*a, **kw)

        return marked


def meshrl_overrides(args: argparse.Namespace) -> list[str]:
    n = args.prompts * args.group
    return [
        f"model={args.model}", "task=tiny:repeat", "recipe=grpo", "seed=0", "steps=1000000",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"rollout.batch_size={n}", f"optim.lr={args.lr}", "optim.warmup_steps=0", "optim.weight_decay=0.0",
        "optim.max_grad_norm=1.0", "train.ppo_epochs=1", "train.mini_batches=1", f"train.micro_batch_size={n}",
        "train.dtype=float32", f"train.autocast_bf16={str(args.bf16).lower()}",
        f"rollout.autocast_bf16={str(args.bf16).lower()}", "log.progress=false", *(args.overrides or []),
    ]


def child_meshrl(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput_vs_trl import distinct_in_order

    from meshrl.trainer import Trainer, load_config

    marker = Marker()
    cfg = load_config(overrides=meshrl_overrides(args))
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="meshrl-mem-")))
    trainer.plugins.sample = marker.wrap(trainer.plugins.sample, "rollout")
    for name in ("logps", "ref_logps", "log_kept_mass"):
        setattr(trainer.forward, name, marker.wrap(getattr(trainer.forward, name), "logps"))
    trainer.engine.backward = marker.wrap(trainer.engine.backward, "update")
    trainer.optimizer.step = marker.wrap(trainer.optimizer.step, "optimizer")
    trainer.backend.sync_weights = marker.wrap(trainer.backend.sync_weights, "sync")
    lengths, update_s, drawn = [], [], []
    for k in range(1, args.steps + 1):
        marker.step = k
        mark(k, "step")
        metrics = trainer.step()
        mark(k, "idle")  # the step is over: what follows until the next marker is the loop around it
        drawn.append(distinct_in_order(q.id for q in trainer.last_data.problems))
        lengths.append(sum(len(r) for r in trainer.last_data.response_ids) / max(len(trainer.last_data), 1))
        update_s.append(metrics["time/train_s"])
    mark(args.steps + 1, "end")
    check_problem_order(drawn, trainer.task, args)
    out = {"engine": type(trainer.engine).__name__, "reference_model": trainer.ref_model is not None,
           "response_len_mean": sum(lengths) / len(lengths), "update_s": update_s}
    trainer.close()
    return out


def child_trl(args: argparse.Namespace) -> dict:
    import transformers
    import trl
    from transformers import TrainerCallback

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput_vs_trl import TASK, Side, meshrl_problem_order, trl_trainer

    from meshrl.models import load_model
    from meshrl.tasks import load_task

    transformers.logging.set_verbosity_error()
    marker = Marker()

    class Phases(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            marker.step = state.global_step + 1
            mark(marker.step, "step")

        def on_pre_optimizer_step(self, a, state, control, **kw):
            mark(marker.step, "optimizer")

        def on_step_end(self, a, state, control, **kw):
            mark(marker.step, "idle")

    model, tok = load_model(args.model, seed=0)
    side = Side("trl")
    task = load_task(TASK, seed=0)
    order = meshrl_problem_order(task, args.steps * args.prompts) if args.same_problems else None
    trainer = trl_trainer(model, tok, task, args.prompts, args.group, args.tokens, args.lr, args.steps,
                          Path(tempfile.mkdtemp(prefix="trl-mem-")), side, [Phases()], bf16=args.bf16, order=order)
    trainer._generate_and_score_completions = marker.wrap(trainer._generate_and_score_completions, "rollout")
    trainer.compute_loss = marker.wrap(trainer.compute_loss, "update")
    with contextlib.redirect_stdout(io.StringIO()):  # TRL prints its end-of-training summary dict
        trainer.train()
    mark(args.steps + 1, "end")
    check_problem_order(side.problems, task, args)
    lengths = side.extra.get("len/response_mean", [0.0])
    return {"trl_version": trl.__version__, "response_len_mean": sum(lengths) / len(lengths)}


def check_problem_order(drawn: list[list[str]], task, args: argparse.Namespace) -> None:
    """With ``--same-problems`` both sides must draw meshrl's order (``meshrl_problem_order``), ``prompts`` per
    step: else their activations and response lengths would not compare. Raises when a step's problems differ."""
    if not args.same_problems:
        return
    from throughput_vs_trl import meshrl_problem_order

    ids = [q.id for q in meshrl_problem_order(task, len(drawn) * args.prompts)]
    expected = [ids[k * args.prompts : (k + 1) * args.prompts] for k in range(len(drawn))]
    if drawn != expected:
        raise AssertionError(f"{args.side}: drew {drawn}, meshrl's order is {expected}")


# ---------------------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny | tiny:small | tiny:medium")
    parser.add_argument("--steps", type=int, default=20, help="steps per side (3: quick mode)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48, help="max new tokens")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bf16 autocast over fp32 weights on both sides (--no-bf16: fp32)")
    parser.add_argument("--same-problems", action=argparse.BooleanOptionalAction, default=True,
                        help="TRL reads meshrl's problem order unshuffled (default); --no-same-problems: TRL shuffles")
    parser.add_argument("--set", dest="overrides", action="append", help="meshrl config override (repeatable)")
    parser.add_argument("--sides", default="meshrl,trl", help="comma list, run in this order")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in the children")
    parser.add_argument("--trl-kernel-caches", choices=("torch", "meshrl"), default="torch",
                        help="TRL's oneDNN kernel-cache capacity: PyTorch's own (1,024 entries) or meshrl's bound")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true", help="pass the children's other output through")
    parser.add_argument("--side", choices=("meshrl", "trl"), help=argparse.SUPPRESS)  # a child's role
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main() -> None:
    # first, in the driver and in each child: meshrl's side runs with the bound its command line sets, which
    # importing meshrl does not; the driver hands TRL's child PyTorch's sizes back (side_env)
    bound_kernel_caches()
    args = parse_args()
    if args.side:
        import logging
        import warnings

        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        logging.getLogger("meshrl").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        report = child_meshrl(args) if args.side == "meshrl" else child_trl(args)
        report["cpu"] = cpu_info()  # here, not in the driver: torch's pages mapped there would lower the child's PSS
        print(f"{RESULT} {json.dumps(report)}", file=sys.__stdout__, flush=True)
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the side under way, as Ctrl-C does
    results: dict[str, dict] = {}
    cpu: dict | None = None  # the children's cpu_info (the same machine and --threads for every side)
    for side in (s for s in args.sides.split(",") if s):
        results[side] = run_side(side, args)
        cpu = results[side].pop("cpu", None) or cpu
        if args.json:  # after each side: an interrupted run keeps what it measured
            meta = {k: v for k, v in vars(args).items() if k not in ("json", "side")}
            args.json.write_text(json.dumps({"args": meta, "cpus": os.cpu_count(), "cpu": cpu, "sides": results},
                                            indent=1, default=str))
        if not results[side]["complete"]:
            break
    if cpu:
        print(f"\n{describe(cpu)}", end="")
    print_table(results, args)


if __name__ == "__main__":
    main()
