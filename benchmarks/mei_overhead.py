"""MEI overhead in the training loop: step time with MEI against the same run without it.

``--engine meshrl`` (default): meshrl's trainer with ``diag.mei.every=1`` against ``0``. Both runs use the same
seed, so they sample the same rollouts and do the same update; the only difference is MEI: its bias features,
summed by the sampler while it samples (``native``/``hf``: ``time/rollout_s``) or, where it has none, computed
from the update's logits with the update's first epoch in one process (``time/train_s``), and the metrics.
``time/step_s`` holds both.

``--engine trl``: TRL's ``GRPOTrainer`` built exactly as ``throughput_vs_trl.py`` builds it (its
``trl_trainer``), in five arms: plain; plain + ``MEICallback``; plain + ``MEICallback`` forced onto its
fallback (its own no-grad forward, as it ran before it read TRL's forwards); ``MeshGRPOTrainer``
(``MeshOptions(m=2, template="plain", subtract_ref=False)``: no reference model, which an in-memory model has no
path to load from; its defaults otherwise); ``MeshGRPOTrainer`` + ``MEICallback``. Every arm starts from the
same weights and seed. Arms alternate run by run (``--rounds`` rounds of the five, in alternating order),
each run's first step untimed, so that load drift on a shared machine spreads over all arms. Besides the
wall-clock medians (noisy on a loaded machine), the seconds spent inside the callback's code (its features,
gathers, metrics; the fallback's forward when used) are timed in the same step, which the load hits alike:
``MEI code / step`` is the load-insensitive figure.

    python benchmarks/mei_overhead.py [--model tiny:small] [--steps 6] [--group-size 16] [--tokens 32]
    python benchmarks/mei_overhead.py --engine trl [--model smollm2-135m | --model tiny] [--steps 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from meshrl.cpu import cpu_info, describe
from meshrl.trainer import load_config, train

TRL_ARMS = ("trl", "trl+mei", "trl+mei_fwd", "mesh", "mesh+mei")


def timed_run(model: str, task: str, steps: int, group: int, tokens: int, mei: bool,
              extra: tuple[str, ...] = ()) -> list[dict]:
    cfg = load_config(overrides=[
        f"model={model}", f"task={task}", f"steps={steps}", "seed=0", "log.progress=false",
        "rollout.prompts_per_step=4", f"rollout.group_size={group}", f"rollout.max_new_tokens={tokens}",
        "train.micro_batch_size=16", "checkpoint.every=1000", f"diag.mei.every={1 if mei else 0}", *extra,
    ])
    with tempfile.TemporaryDirectory() as d:
        return list(train(cfg, Path(d) / "run"))  # read the records before the directory goes


def meshrl_engine(args) -> None:
    timed_run(args.model, args.task, 1, args.group_size, args.tokens, True, tuple(args.set))  # warm-up
    rows = {}
    for mei in (False, True, False, True):  # interleaved to spread machine-load drift over both arms
        hist = timed_run(args.model, args.task, args.steps, args.group_size, args.tokens, mei, tuple(args.set))[1:]
        rows.setdefault(mei, []).extend(hist)
    for key in ("time/rollout_s", "time/train_s", "time/step_s"):
        base = statistics.median(r[key] for r in rows[False])
        with_mei = statistics.median(r[key] for r in rows[True])
        overhead = 100 * (with_mei / base - 1)
        print(f"{key:14s} without MEI {base:.4f}s  with MEI {with_mei:.4f}s  overhead {overhead:+.2f}%")
    print(f"mei/query last step: {rows[True][-1]['mei/query']:.3f} (G={args.group_size}, model {args.model})")


# ---------------------------------------------------------------------------------------------- TRL
def _timed(owner, name: str, clock: dict[str, float]) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``clock["s"]``."""
    inner = getattr(owner, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            clock["s"] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def _step_clock(record: dict[str, list[float]], clock: dict[str, float]):
    """A callback recording each step's wall seconds (end of the previous step to this one's end) and the MEI
    seconds spent within it."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.mark, clock["s"] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            record["step_s"].append(now - self.mark)
            record["mei_s"].append(clock["s"])
            self.mark, clock["s"] = now, 0.0

    return StepClock()


def trl_run(arm: str, world: dict, args, out_dir: Path) -> dict[str, list[float]]:
    """One training run of ``args.steps + 1`` steps of one arm; per-step seconds, the first step dropped."""
    from throughput_vs_trl import Side, trl_trainer

    from meshrl.integrations.trl import MEICallback, MeshGRPOTrainer, MeshOptions
    from meshrl.integrations.trl import mei as mei_module
    from meshrl.integrations.trl.head_capture import HeadUnsupported

    record: dict[str, list[float]] = {"step_s": [], "mei_s": []}
    clock = {"s": 0.0}
    build = (world["model"], world["tok"], world["task"], args.prompts, args.group_size, args.tokens, 1e-5,
             args.steps + 1, out_dir, Side(arm), [_step_clock(record, clock)])
    trainer = trl_trainer(copy.deepcopy(build[0]), copy.deepcopy(build[1]), *build[2:])
    if arm.startswith("mesh"):  # the same GRPOConfig, reward and callbacks; the rows carry their problem text
        data = trainer.train_dataset.map(lambda r: {"problem": r["prompt"][-1]["content"]})
        trainer = MeshGRPOTrainer(copy.deepcopy(build[0]), trainer.reward_funcs[0], args=trainer.args,
                                  train_dataset=data, processing_class=copy.deepcopy(build[1]),
                                  callbacks=[_step_clock(record, clock)], prefixes=world["prefixes"],
                                  mesh=MeshOptions(m=2, template="plain", subtract_ref=False))
    if "+mei" in arm:
        cb = MEICallback()
        if arm.endswith("_fwd"):  # the fallback forced: the callback's own no-grad forward (MEI before the hook)
            with mock.patch.object(mei_module, "HiddenCapture", side_effect=HeadUnsupported("forced")):
                cb.attach(trainer)
        else:
            cb.attach(trainer)
        for owner, name in ((cb, "features"), (cb, "_publish")):
            _timed(owner, name, clock)
        if cb.capture is not None:
            _timed(cb.capture, "features", clock)
        record["hooked"] = [float(cb.capture is not None)]
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):  # TRL prints its end-of-training summary dict
        trainer.train()
    record["step_s"], record["mei_s"] = record["step_s"][1:], record["mei_s"][1:]
    return record


def trl_world(spec: str, tmp: Path) -> dict:
    from meshrl.mesh import RuleCoach, generate_prefixes
    from meshrl.models import load_model
    from meshrl.tasks import load_task

    task = load_task("tiny:repeat", seed=0)  # throughput_vs_trl's task
    model, tok = load_model(spec, seed=0)
    problems = task.problems("train")
    queries = [{"id": q.id, "problem": task.format_prompt(q), "answer": q.answer} for q in problems]
    generate_prefixes(queries, RuleCoach(lambda q: task.coach_strategies(problems[0]), name="rule:tiny:repeat"),
                      m=2, out_path=tmp / "prefixes.jsonl")
    return {"model": model, "tok": tok, "task": task, "prefixes": tmp / "prefixes.jsonl"}


def trl_engine(args) -> None:
    import logging
    import warnings

    import datasets
    import transformers

    datasets.disable_progress_bars()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    transformers.logging.set_verbosity_error()
    logging.getLogger("meshrl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    tmp = Path(tempfile.mkdtemp(prefix="meshrl-mei-trl-"))
    world = trl_world(args.model, tmp)
    rows: dict[str, dict[str, list[float]]] = {arm: {"step_s": [], "mei_s": []} for arm in TRL_ARMS}
    loads = []
    for r in range(args.rounds):
        for arm in TRL_ARMS if r % 2 == 0 else reversed(TRL_ARMS):  # ABCD DCBA: drift hits every arm alike
            loads.append(os.getloadavg()[0])
            got = trl_run(arm, world, args, tmp / f"{arm}-{r}")
            for key in ("step_s", "mei_s"):
                rows[arm][key].extend(got[key])
            rows[arm]["hooked"] = got.get("hooked", [])
    print(f"TRL {args.model}: P={args.prompts} G={args.group_size} {args.tokens} new tokens, {args.rounds} rounds "
          f"x {args.steps} timed steps per arm, torch threads {torch.get_num_threads()}, 1-min load at run starts "
          f"{min(loads):.2f}..{max(loads):.2f}")
    med = {arm: statistics.median(rows[arm]["step_s"]) for arm in TRL_ARMS}
    for arm, base in zip(TRL_ARMS, ("trl", "trl", "trl", "trl", "mesh"), strict=True):
        mei = rows[arm]["mei_s"]
        share = 100 * statistics.median(m / s for m, s in zip(mei, rows[arm]["step_s"], strict=True))
        how = {(): "", (1.0,): "  (MEI hooked)", (0.0,): "  (MEI fallback: own forward)"}[tuple(rows[arm]["hooked"])]
        print(f"{arm:11s} median step {med[arm]:.3f}s  vs {base}: {100 * (med[arm] / med[base] - 1):+6.2f}%  "
              f"MEI code {statistics.median(mei):.4f}s/step = {share:.2f}% of a step{how}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engine", choices=("meshrl", "trl"), default="meshrl")
    ap.add_argument("--model", default=None, help="meshrl: tiny:small (default); trl: smollm2-135m (default), tiny")
    ap.add_argument("--task", default="tiny:add", help="meshrl engine only (trl: throughput_vs_trl's tiny:repeat)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (meshrl 6, trl 3)")
    ap.add_argument("--rounds", type=int, default=2, help="trl: rounds of the five arms")
    ap.add_argument("--prompts", type=int, default=2, help="trl: prompts per step (P)")
    ap.add_argument("--group-size", type=int, default=None, help="meshrl 16, trl 4")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="meshrl engine: extra config overrides, e.g. "
                    "train.skip_zero_advantage=false (where MEI comes from the update's forward, its first epoch runs "
                    "every row serially, and without MEI the default skips zero-advantage rows)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    trl = args.engine == "trl"
    args.model = args.model or ("smollm2-135m" if trl else "tiny:small")
    args.steps = args.steps or (3 if trl else 6)
    args.group_size = args.group_size or (4 if trl else 16)
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; cpus {os.cpu_count()}")
    print(describe(cpu_info()))
    trl_engine(args) if trl else meshrl_engine(args)
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
