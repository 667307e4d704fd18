"""What a run is built from: the task, the policy (model, frozen reference, optimiser) and the sampler."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrl import cpu
from meshrl.trainer.balance import prepare_prefixes
from meshrl.trainer.periodic_eval import PeriodicEval
from meshrl.trainer.plugins import plugins_need_reference
from meshrl.trainer.rollout_step import RolloutStep

log = logging.getLogger("meshrl")


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: Any
    ref_model: torch.nn.Module | None  # a frozen copy; None when not needed or with LoRA (adapter off instead)
    optimizer: torch.optim.Optimizer
    pad_id: int


def build_task(cfg: Any) -> tuple[Any, list[Any]]:
    from meshrl.tasks import load_task

    task = load_task(cfg.task, seed=cfg.seed, **cfg.task_options)
    return task, task.problems("train")


def build_policy(cfg: Any, recipe: Any) -> Policy:
    """The model to train (LoRA-wrapped when ``train.lora_r > 0``), its reference and AdamW."""
    from meshrl.models import apply_lora, load_model, resolve_device

    model, tokenizer = load_model(cfg.model, dtype=cfg.train.dtype, seed=cfg.seed)
    model = model.to(resolve_device(cfg.train.device))  # before the reference copy and the optimiser
    paper_balance = cfg.mesh_enabled and cfg.balance_mu > 0 and cfg.mesh.balance == "paper"
    needs_ref = (recipe.needs_reference or (paper_balance and cfg.mesh.subtract_ref)
                 or plugins_need_reference(cfg.plugins))
    ref_model = None
    if cfg.train.lora_r > 0:  # the reference is the adapter-disabled base model
        model = apply_lora(model, r=cfg.train.lora_r, alpha=cfg.train.lora_alpha)
    elif needs_ref:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    model.eval()  # dropout off: RL log-probs must match the sampling distribution
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"model {cfg.model!r}: tokenizer has neither a pad nor an eos token")
    o = cfg.optim
    # fused=True: on CPU the default per-tensor loop was 8x slower per step on 135M parameters (benchmarks/).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                                  betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True)
    return Policy(model, tokenizer, ref_model, optimizer, int(pad))


def bf16_settings(cfg: Any, device_type: str) -> dict[str, bool]:
    """The run's bf16 settings (``key=value`` -> in force) that run on this process's CPU: none on a GPU, and the
    sampler's autocast only for the in-process samplers (vLLM picks its own precision)."""
    if device_type != "cpu":
        return {}
    return {"train.dtype=bfloat16": cfg.train.dtype == "bfloat16",
            "train.autocast_bf16=true": bool(cfg.train.autocast_bf16),
            "rollout.autocast_bf16=true": bool(cfg.rollout.autocast_bf16) and cfg.rollout.backend != "vllm"}


def emulated_bf16_event(cfg: Any, model: torch.nn.Module, step: int) -> dict[str, Any] | None:
    """Warn (once per process start) when the run asks for bf16 that this CPU emulates, and return the event
    for events.jsonl that ``meshrl doctor`` reads (``bf16_emulated``: the settings and the CPU, at ``step``, the
    first step this process runs); None otherwise."""
    device = next(model.parameters()).device.type
    names = cpu.warn_emulated_bf16(bf16_settings(cfg, device))
    if not names:
        return None
    return {"step": step, "event": "bf16_emulated", "settings": names, "cpu": cpu.cpu_info()}


def _check_code_sandbox(cfg: Any, task: Any) -> None:
    """A code task refuses, before any rollout, to run model-written code under a weak sandbox unless
    ``reward.sandbox_allow_weak`` accepts the risk (one line naming the setting)."""
    from meshrl.rewards.sandbox import allow_weak_sandbox, check_sandbox
    from meshrl.tasks import CodeTask

    allow_weak_sandbox(cfg.reward.sandbox_allow_weak)
    if isinstance(task, CodeTask):
        log.info("code sandbox: %s", check_sandbox())


def build_sampler(cfg: Any, recipe: Any, task: Any, problems: list[Any], policy: Policy, run_dir: Path
                  ) -> tuple[Any, RolloutStep, PeriodicEval | None]:
    """The rollout backend, the step's sampler (problems, rollouts, rewards, advantages) and the held-out
    evaluation (``eval.every``)."""
    from meshrl.models import encode_prompt
    from meshrl.rewards import RewardRunner, scorer_time_limit
    from meshrl.rollout import backend_for_run
    from meshrl.rollout.choice import StepShape

    # each backend reads its own settings (RolloutBackend.from_config); auto picks by the step's shape
    shape = StepShape(cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.rollout.max_new_tokens)
    backend = backend_for_run(cfg.rollout, policy.model, policy.tokenizer, shape=shape)
    log.info("rollout backend: %s (rollout.backend=%s)", backend.name, cfg.rollout.backend)
    _check_code_sandbox(cfg, task)
    runner = RewardRunner(task.score, timeout_s=scorer_time_limit(cfg.reward.timeout_s, task), strict=cfg.reward.strict)
    if getattr(task, "episodic", False):  # tool-using episodes: the prompt shows the tools
        from meshrl.trainer.episodes import check_episodic_config

        check_episodic_config(cfg)
        encode_prompt = task.encode_prompt
    prefixes = prepare_prefixes(cfg, task, problems, run_dir) if cfg.mesh_enabled else None
    sampler = RolloutStep(task=task, problems=problems, backend=backend, tokenizer=policy.tokenizer,
                          reward_runner=runner, recipe=recipe, cfg=cfg, encode_prompt=encode_prompt, prefixes=prefixes)
    evaluator = (PeriodicEval(cfg, task, policy.tokenizer, backend, runner, encode_prompt)
                 if cfg.eval.every > 0 else None)
    return backend, sampler, evaluator
