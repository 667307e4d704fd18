"""Training throughput of meshrl's trainer against TRL's ``GRPOTrainer`` on an identical configuration.

Both trainers run in ONE process, with the same threads, on the same model (meshrl's ``Trainer`` loads
``MODEL`` with seed 0; TRL gets a deep copy of the same weights, checked equal, and its tokenizer), the
same ``tiny:repeat`` prompts rendered with the same chat template (token ids checked equal), the same
reward (``task.score``) and the same GRPO setup:

=====================================  ======================================================
meshrl (``--set``)                      TRL (``GRPOConfig``)
=====================================  ======================================================
recipe ``grpo`` (kl_coef 0)             ``beta=0.0``, ``loss_type="grpo"``, ``epsilon=0.2``
adv_scale ``std`` (per group)           ``scale_rewards="group"``
rollout.prompts_per_step = P            ``per_device_train_batch_size = P*G`` (one prompt group
rollout.group_size = G                  per G rows), ``num_generations=G``,
                                        ``generation_batch_size = P*G`` (steps_per_generation 1)
rollout.max_new_tokens = L              ``max_completion_length=L``
rollout.temperature 1, top_p 1          ``temperature=1.0, top_p=1.0, top_k=0``
ppo_epochs 1, mini_batches 1            ``num_iterations=1``, ``gradient_accumulation_steps=1``
train.micro_batch_size = P*G            TRL scores the whole per-device batch in one forward
rollout.batch_size = P*G                one ``generate`` call for the P*G rows
optim lr, AdamW(0.9, 0.999, 1e-8),      ``learning_rate``, ``optim="adamw_torch"`` (TRL's default,
  wd 0, max_grad_norm 1, no warm-up      the fused AdamW, is not what meshrl runs), constant
                                        schedule, ``weight_decay=0``, ``max_grad_norm=1``
fp32 weights, no autocast               ``bf16=False, fp16=False`` (TRL defaults bf16 to True);
  (``--bf16``: train/rollout autocast)    (``--bf16``: ``bf16=True``, autocast over fp32 weights)
no gradient checkpointing               ``gradient_checkpointing=False`` (TRL defaults to True)
``Trainer.step()`` (no run-dir I/O)     ``report_to="none"``, ``logging_strategy="no"``,
                                        ``save_strategy="no"``, ``eval_strategy="no"``,
                                        ``use_cpu=True``, ``use_vllm=False``,
                                        ``dataloader_num_workers=0``, ``disable_tqdm=True``
=====================================  ======================================================

meshrl keeps its defaults for *how* it computes (native decoder with one forked process per torch thread,
shared-prompt update with the responses of a prompt packed into rows, the update's micro-batches split over one
forked process per torch thread, no backward for rows whose advantage is 0, whose gradient is exactly zero);
what is computed is the same as TRL's.

A step is one generation of P*G completions, their rewards and advantages, one forward/backward over
them and one optimiser step. The first ``--warmup`` steps of each side are not timed; then ``--steps``
steps are. ``tokens/s`` counts prompt + completion tokens of the step (meshrl's
``throughput/tokens_per_s`` definition), ``gen tok/s`` completion tokens only. Both trainers see the same
problems at every step (``--same-problems``, the default): TRL's dataset is laid out in the order meshrl's
sampler draws (:func:`meshrl_problem_order`) and read unshuffled (``shuffle_dataset=False``), and the run checks
that each step's problems agree; ``--no-same-problems`` lets TRL shuffle with its own seed. Sampled completion
lengths still differ (different RNG streams), so ``tokens/s`` is the fairer figure; mean lengths are printed.
With ``--schedule interleaved`` (default) the two trainers alternate step by step, so that load
from other processes on a shared machine hits both alike; ``sequential`` runs meshrl, then TRL.

    python benchmarks/throughput_vs_trl.py                                # tiny:small, 5 timed steps
    python benchmarks/throughput_vs_trl.py --model tiny:small --model smollm2-135m
    python benchmarks/throughput_vs_trl.py --model smollm2-135m --prompts 2 --group 4 --max-new-tokens 32

Needs ``pip install trl accelerate datasets`` (tested with trl 1.16.0, transformers 5.24).
``--model smollm2-135m`` uses ``--smol-prompts/--smol-group/--smol-max-new-tokens`` (smaller defaults,
so that the whole benchmark stays within minutes on 2 cores) unless given explicitly.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Both sides share this process, so one oneDNN kernel-cache size serves both: PyTorch's own (1,024 entries), as TRL's
# users run it and as the published figures were measured, not the bound meshrl's command line sets (it measured no
# difference in meshrl's step time; benchmarks/JOURNAL.md, "Memory: bounded kernel caches, the defaults at 0.46x").
for _name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_name, "1024")

import torch  # noqa: E402

from meshrl.cpu import cpu_info, describe  # noqa: E402
from meshrl.models import encode_prompt, load_model  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402
from meshrl.trainer import Trainer, load_config  # noqa: E402

TASK = "tiny:repeat"


@dataclass
class Side:
    """Per-step timings and token counts of one trainer (index 0 = first step, warm-up included)."""

    name: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prompt + completion tokens of the step
    gen_tokens: list[int] = field(default_factory=list)  # completion tokens of the step
    extra: dict[str, list[float]] = field(default_factory=dict)
    problems: list[list[str]] = field(default_factory=list)  # each step's problem ids, in draw order

    def summary(self, warmup: int) -> dict[str, float]:
        secs, toks, gen = self.seconds[warmup:], self.tokens[warmup:], self.gen_tokens[warmup:]
        total = sum(secs)
        out = {
            "steps": len(secs),
            "seconds": total,
            "steps_per_s": len(secs) / total,
            "tokens_per_s": sum(toks) / total,
            "gen_tokens_per_s": sum(gen) / total,
            "step_s_median": statistics.median(secs),
            "step_s_min": min(secs),
            "step_s_max": max(secs),
            "tokens_per_step": sum(toks) / len(toks),
            "gen_tokens_per_step": sum(gen) / len(gen),
        }
        for k, v in self.extra.items():
            out[k] = statistics.mean(v[warmup:]) if v[warmup:] else float("nan")
        return out


# ---------------------------------------------------------------------------------------------- meshrl
def meshrl_trainer(spec: str, p: int, g: int, max_new: int, lr: float, micro: int, run_dir: Path,
                   bf16: bool = False) -> Trainer:
    overrides = [
        f"model={spec}",
        f"task={TASK}",
        "recipe=grpo",
        "seed=0",
        "steps=1000000",
        f"rollout.prompts_per_step={p}",
        f"rollout.group_size={g}",
        f"rollout.max_new_tokens={max_new}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        f"rollout.batch_size={p * g}",
        f"optim.lr={lr}",
        "optim.warmup_steps=0",
        "optim.weight_decay=0.0",
        "optim.max_grad_norm=1.0",
        "train.ppo_epochs=1",
        "train.mini_batches=1",
        f"train.micro_batch_size={micro}",
        "train.dtype=float32",
        f"train.autocast_bf16={str(bf16).lower()}",
        f"rollout.autocast_bf16={str(bf16).lower()}",
        "log.progress=false",
    ]
    cfg = load_config(overrides=overrides)
    assert cfg.resolved_recipe().kl_coef == 0.0 and cfg.resolved_recipe().js_coef == 0.0
    return Trainer(cfg, run_dir)


def meshrl_step(trainer: Trainer, side: Side) -> None:
    t0 = time.perf_counter()
    m = trainer.step()
    side.seconds.append(time.perf_counter() - t0)
    data = trainer.last_data
    side.problems.append(distinct_in_order(q.id for q in data.problems))
    side.tokens.append(sum(len(a) + len(b) for a, b in zip(data.prompt_ids, data.response_ids, strict=True)))
    side.gen_tokens.append(sum(len(b) for b in data.response_ids))
    for k in ("time/rollout_s", "time/train_s", "len/response_mean"):
        side.extra.setdefault(k, []).append(float(m.get(k, float("nan"))))


def meshrl_problem_order(task, n: int, seed: int = 0) -> list:
    """The first ``n`` problems meshrl's trainer draws with ``seed`` (its ``ProblemStream``, cursor 0..n-1).

    The trainer skips a problem whose prompt is too long for the model; the benchmark's task has none, and
    :func:`run_pair` checks every step's problems on both sides anyway."""
    from meshrl.trainer.rollout_step import ProblemStream

    problems = task.problems("train")
    sampler = ProblemStream(len(problems), seed)
    return [problems[sampler.index(i)] for i in range(n)]


def distinct_in_order(ids) -> list[str]:
    """Each id once, in first-seen order (a step's rows hold each problem G times)."""
    return list(dict.fromkeys(ids))


# ---------------------------------------------------------------------------------------------- TRL
def trl_trainer(
    model,
    tokenizer,
    task,
    p: int,
    g: int,
    max_new: int,
    lr: float,
    max_steps: int,
    out_dir: Path,
    side: Side,
    callbacks: list,
    trl_defaults: bool = False,
    use_cpu: bool = True,
    bf16: bool = False,
    order: list | None = None,
):
    """TRL's ``GRPOTrainer`` on the matched settings (module docstring). ``order``: the problems laid out in
    this order and read unshuffled, one step per ``p`` of them (:func:`meshrl_problem_order`); None: the task's
    training problems, shuffled by TRL with seed 0."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    problems = task.problems("train")
    by_id = {q.id: q for q in problems}
    prompt_len = {q.id: len(encode_prompt(tokenizer, task.format_prompt(q))) for q in problems}
    rows = [{"prompt": [{"role": "user", "content": task.format_prompt(q)}], "problem_id": q.id}
            for q in (problems if order is None else order)]
    dataset = Dataset.from_list(rows)

    def repeat_reward(prompts, completions, completion_ids, problem_id, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        side.problems.append(distinct_in_order(problem_id))
        side.tokens.append(sum(prompt_len[q] + len(c) for q, c in zip(problem_id, completion_ids, strict=True)))
        side.gen_tokens.append(sum(len(c) for c in completion_ids))
        side.extra.setdefault("len/response_mean", []).append(
            sum(len(c) for c in completion_ids) / max(len(completion_ids), 1)
        )
        return [task.score(t, by_id[q]) for t, q in zip(texts, problem_id, strict=True)]

    args = GRPOConfig(
        output_dir=str(out_dir),
        seed=0,
        use_cpu=use_cpu,
        use_vllm=False,
        **(
            {}
            if trl_defaults
            else {"bf16": bf16, "fp16": False, "gradient_checkpointing": False, "optim": "adamw_torch"}
        ),
        torch_compile=False,
        per_device_train_batch_size=p * g,
        gradient_accumulation_steps=1,
        generation_batch_size=p * g,
        num_generations=g,
        num_iterations=1,
        max_completion_length=max_new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        max_steps=max_steps,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        shuffle_dataset=order is None,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=repeat_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def make_timer_callback(side: Side, between=None):
    """A TrainerCallback that records TRL's step times; ``between()`` (meshrl's step) runs after each
    TRL step and is excluded from TRL's time: a TRL step is timed from the end of the previous one (or
    of ``between``) to its ``on_step_end``, so it includes the trainer loop, dataloader and callbacks."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.mark = None

        def on_train_begin(self, args, state, control, **kw):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            side.seconds.append(time.perf_counter() - self.mark)
            if between is not None:
                between()
            self.mark = time.perf_counter()

    return Timer()


def _time_trl_rollout(trainer, side: Side) -> None:
    """Time TRL's generate + reward + advantage phase (``_generate_and_score_completions``, which
    ``_prepare_inputs`` looks up on the instance) so that its step splits like meshrl's."""
    inner = trainer._generate_and_score_completions

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        side.extra.setdefault("time/rollout_s", []).append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed


# ---------------------------------------------------------------------------------------------- checks
def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def check_prompts(tokenizer, task) -> int:
    """meshrl's encode_prompt and TRL's apply_chat_template(tokenize=True) give the same ids; returns len."""
    lens = set()
    for q in task.problems("train"):
        ours = encode_prompt(tokenizer, task.format_prompt(q))
        theirs = tokenizer.apply_chat_template(
            [{"role": "user", "content": task.format_prompt(q)}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        theirs = list(theirs["input_ids"])
        if theirs and isinstance(theirs[0], list):
            theirs = theirs[0]
        if ours != theirs:
            raise AssertionError(f"prompt ids differ for {q.id}: meshrl {ours[:12]}... TRL {theirs[:12]}...")
        lens.add(len(ours))
    return max(lens)


# ---------------------------------------------------------------------------------------------- driver
def run_pair(spec: str, p: int, g: int, max_new: int, args) -> dict:
    import transformers
    import trl

    transformers.logging.set_verbosity_error()
    task = load_task(TASK, seed=0)
    base, tok = load_model(spec, seed=0)
    prompt_len = check_prompts(tok, task)
    micro = args.micro_batch or p * g
    tmp = Path(tempfile.mkdtemp(prefix="meshrl-vs-trl-"))
    ours = meshrl_trainer(spec, p, g, max_new, args.lr, micro, tmp / "meshrl", bf16=args.bf16)
    if not same_weights(ours.model, base):
        raise AssertionError("meshrl's trainer did not load the same initial weights")
    trl_model = copy.deepcopy(base)
    del base
    total = args.warmup + args.steps
    m_side, t_side = Side("meshrl"), Side("trl")
    interleaved = args.schedule == "interleaved"
    if not interleaved:
        for _ in range(total):
            meshrl_step(ours, m_side)
    cb = make_timer_callback(t_side, (lambda: meshrl_step(ours, m_side)) if interleaved else None)
    theirs = trl_trainer(
        trl_model,
        copy.deepcopy(tok),
        task,
        p,
        g,
        max_new,
        args.lr,
        total,
        tmp / "trl",
        t_side,
        [cb],
        trl_defaults=args.trl_defaults,
        bf16=args.bf16,
        order=meshrl_problem_order(task, total * p) if args.same_problems else None,
    )
    _time_trl_rollout(theirs, t_side)
    threads_before = torch.get_num_threads()
    with contextlib.redirect_stdout(io.StringIO()):  # TRL prints its end-of-training summary dict
        theirs.train()
    if torch.get_num_threads() != threads_before:
        print(f"warning: TRL changed torch threads {threads_before} -> {torch.get_num_threads()}")
    if len(t_side.seconds) != total or len(m_side.seconds) != total:
        raise AssertionError(f"expected {total} steps, got meshrl {len(m_side.seconds)} TRL {len(t_side.seconds)}")
    if args.same_problems and m_side.problems != t_side.problems:
        raise AssertionError(f"the trainers drew different problems: meshrl {m_side.problems} TRL {t_side.problems}")
    ms, ts = m_side.summary(args.warmup), t_side.summary(args.warmup)
    return {
        "model": spec,
        "params": sum(x.numel() for x in ours.model.parameters()),
        "prompts_per_step": p,
        "group_size": g,
        "max_new_tokens": max_new,
        "prompt_tokens": prompt_len,
        "micro_batch": micro,
        "lr": args.lr,
        "warmup": args.warmup,
        "timed_steps": args.steps,
        "schedule": args.schedule,
        "threads": torch.get_num_threads(),
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "meshrl": ms,
        "trl": ts,
        "ratio_steps_per_s": ms["steps_per_s"] / ts["steps_per_s"],
        "ratio_tokens_per_s": ms["tokens_per_s"] / ts["tokens_per_s"],
        "ratio_gen_tokens_per_s": ms["gen_tokens_per_s"] / ts["gen_tokens_per_s"],
        # Interleaved: step i of each side ran back to back, so per-pair ratios see the same load.
        "ratio_tokens_per_s_pair_median": statistics.median(
            (mt / msec) / (tt / tsec)
            for mt, msec, tt, tsec in zip(
                m_side.tokens[args.warmup :],
                m_side.seconds[args.warmup :],
                t_side.tokens[args.warmup :],
                t_side.seconds[args.warmup :],
                strict=True,
            )
        ),
        "trl_defaults": args.trl_defaults,
        "bf16": args.bf16,
        "same_problems": args.same_problems,
    }


def report(r: dict) -> None:
    print(
        f"\n== {r['model']} ({r['params'] / 1e6:.2f}M params): P={r['prompts_per_step']} prompts x "
        f"G={r['group_size']} = {r['prompts_per_step'] * r['group_size']} completions/step, max "
        f"{r['max_new_tokens']} new tokens, prompt {r['prompt_tokens']} tokens, lr {r['lr']}, "
        f"{r['timed_steps']} timed steps after {r['warmup']} warm-up, {r['schedule']}, "
        f"threads {r['threads']}, trl {r['trl_version']}"
        + (", bf16 autocast over fp32 weights on both sides" if r.get("bf16") else ", fp32")
        + (", the same problems at every step" if r.get("same_problems") else ", each trainer's own problem order")
    )
    print(
        f"{'trainer':<8}{'steps/s':>9}{'tokens/s':>10}{'gen tok/s':>11}{'step s (med)':>14}"
        f"{'min..max':>16}{'resp len':>10}"
    )
    for name in ("meshrl", "trl"):
        s = r[name]
        print(
            f"{name:<8}{s['steps_per_s']:>9.3f}{s['tokens_per_s']:>10.0f}{s['gen_tokens_per_s']:>11.0f}"
            f"{s['step_s_median']:>14.3f}{s['step_s_min']:>8.3f}..{s['step_s_max']:<6.3f}"
            f"{s['len/response_mean']:>10.1f}"
        )
    for name in ("meshrl", "trl"):
        s = r[name]
        roll = s["time/rollout_s"]
        rest = s["seconds"] / s["steps"] - roll
        print(
            f"{name} phases (mean s/step): rollout (generate+reward+advantages) {roll:.3f}, "
            f"update and the rest {rest:.3f}"
        )
    print(
        f"ratio meshrl/TRL: steps/s {r['ratio_steps_per_s']:.2f}x, tokens/s {r['ratio_tokens_per_s']:.2f}x, "
        f"gen tokens/s {r['ratio_gen_tokens_per_s']:.2f}x (median per-step-pair tokens/s ratio "
        f"{r['ratio_tokens_per_s_pair_median']:.2f}x)"
    )
    if r["trl_defaults"]:
        print(
            "NOTE: --trl-defaults: TRL ran with its own defaults for gradient checkpointing (on), bf16 "
            "(on, autocast on CPU) and optim (adamw_torch_fused): NOT the identical configuration"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        help="tiny | tiny:small | tiny:medium | smollm2-135m (repeatable; default tiny:small)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trainer")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per trainer first")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--smol-prompts", type=int, default=2, help="P for smollm2-135m")
    parser.add_argument("--smol-group", type=int, default=4, help="G for smollm2-135m")
    parser.add_argument("--smol-max-new-tokens", type=int, default=32, help="max new tokens for smollm2-135m")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="meshrl train.micro_batch_size (0: P*G, the whole batch in one forward like TRL)",
    )
    parser.add_argument("--same-problems", action=argparse.BooleanOptionalAction, default=True,
                        help="TRL reads meshrl's problem order unshuffled (default); --no-same-problems: TRL shuffles")
    parser.add_argument("--schedule", choices=("interleaved", "sequential"), default="interleaved")
    parser.add_argument(
        "--trl-defaults",
        action="store_true",
        help="leave TRL's own defaults for gradient_checkpointing (True), bf16 (True) and optim "
        "(adamw_torch_fused): what TRL does out of the box, not identical",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 autocast over fp32 weights on both sides (meshrl train/rollout.autocast_bf16, TRL bf16=True)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("meshrl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    load0 = os.getloadavg()
    print(
        f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; cpus {os.cpu_count()}; "
        f"torch threads {torch.get_num_threads()}"
    )
    cpu = cpu_info()
    print(describe(cpu))
    results = []
    for spec in args.model or ["tiny:small"]:
        smol = spec.startswith("smollm")
        p = args.smol_prompts if smol else args.prompts
        g = args.smol_group if smol else args.group
        n = args.smol_max_new_tokens if smol else args.max_new_tokens
        r = run_pair(spec, p, g, n, args)
        r["load_avg_1m_end"] = os.getloadavg()[0]
        r["cpu"] = cpu
        report(r)
        results.append(r)
    load1 = os.getloadavg()
    print(f"\nload average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
