"""Small, fast runs for tests: the built-in tiny model on ``tiny:repeat`` (seconds per step on a CPU).

For meshrl's own tests and for anyone testing a plug-in of their own (docs/plugins.md, "Writing a plug-in")::

    from meshrl.testing import tiny_config
    from meshrl.trainer import train

    history = train(tiny_config("plugins.fork.enabled=true", steps=2), tmp_path / "run")

Later overrides win, so a test states only what it changes.
"""

from __future__ import annotations

from typing import Any

# 4 problems x 4 rollouts of up to 6 tokens, one micro-batch, no progress bar; checkpoints every 100 steps and
# after the last one (a short run writes one checkpoint, at its end).
TINY_RUN = ("model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "train.micro_batch_size=16", "log.progress=false", "checkpoint.every=100",
            "optim.lr=1e-3")


def tiny_config(*overrides: str, steps: int = 2) -> Any:
    """A validated :class:`meshrl.trainer.RunConfig` of the tiny run with ``overrides`` (``key=value``) applied
    after ``steps`` (so ``"steps=5"`` among the overrides wins over the keyword)."""
    from meshrl.trainer import load_config

    return load_config(overrides=[*TINY_RUN, f"steps={steps}", *overrides])
