"""The shared training and evaluation configuration of testbed runs (``meshrl demo`` and the experiments in
``experiments/collapse_testbed/``): one matched-budget base that every arm adds its own keys to.

``sizes`` is any object with ``steps``, ``prompts_per_step``, ``group_size``, ``lr``, ``ppo_epochs`` and
``mini_batches`` (and, optionally, ``task`` and ``extra``: more overrides for every arm); the evaluation reads
``eval_n``, ``ks`` and ``eval_problems``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_TASK = "testbed:add"


def base_overrides(sizes: Any, model_path: Path, max_new_tokens: int) -> list[str]:
    """``meshrl train`` keys shared by every testbed arm (matched budget: every arm samples P x G)."""
    return [
        f"model={model_path}", f"task={getattr(sizes, 'task', DEFAULT_TASK)}", f"steps={sizes.steps}",
        f"rollout.prompts_per_step={sizes.prompts_per_step}", f"rollout.group_size={sizes.group_size}",
        f"rollout.max_new_tokens={max_new_tokens}", "rollout.temperature=1.0", f"optim.lr={sizes.lr}",
        "optim.warmup_steps=3", f"train.ppo_epochs={sizes.ppo_epochs}", f"train.mini_batches={sizes.mini_batches}",
        "train.micro_batch_size=96", "mesh.m=3", "mesh.template=plain", "diag.mei.every=1",
        "log.progress=false", "log.samples_per_step=-1",
        # The experiments' documented results (experiments/collapse_testbed/results.md) were sampled with
        # transformers' generate and scored in one pass in one process; pinned so that they reproduce sample for
        # sample (the demo overrides these with meshrl's default engines: meshrl.testbed.demo.DEMO_ENGINE).
        "rollout.backend=hf", "train.share_prompts=false", "train.update_workers=1",
        "train.skip_zero_advantage=false", *getattr(sizes, "extra", ()),
    ]


def eval_config(model: str, sizes: Any, seed: int, max_new: int, limit: int | None = None):
    """The held-out evaluation of the testbed (``generate`` sampling pinned, as in :func:`base_overrides`);
    ``limit`` problems instead of ``sizes.eval_problems`` when given."""
    from meshrl.evaluation import EvalConfig

    return EvalConfig(model=model, data=getattr(sizes, "task", DEFAULT_TASK), split="eval", n=sizes.eval_n,
                      ks=list(sizes.ks), limit=limit or sizes.eval_problems, max_new_tokens=max_new,
                      temperature=1.0, seed=seed, by="type", backend="hf")
