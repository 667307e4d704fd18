"""Shared test setup: no network for Hugging Face, and a fixed torch seed per test."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The sandbox tests run attacks under every mechanism on purpose (those of the weak fallbacks explicitly refuse it).
os.environ.setdefault("MESHRL_SANDBOX_ALLOW_WEAK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fixed seed; also reseeds the global RNG so a test is reproducible alone."""
    torch.manual_seed(0)
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def tiny_config():
    """:func:`meshrl.testing.tiny_config`: the shared tiny run's config, ``tiny_config(*overrides, steps=2)``."""
    from meshrl.testing import tiny_config

    return tiny_config


SWEEP_GRID = """
out: {out}
seeds: [0, 1]
base:
  model: tiny
  task: tiny:add
  steps: 2
  log: {{progress: false}}
  rollout: {{prompts_per_step: 2, group_size: 4, max_new_tokens: 3}}
arms:
  - name: grpo
    recipe: grpo
  - name: mesh
    recipe: mesh
    grid: {{mesh.mu: [0.0, 0.1]}}
"""


@pytest.fixture
def sweep_grid(tmp_path):
    """A ``meshrl sweep`` grid: GRPO and Mesh at two mu, seeds 0-1, tiny 2-step runs (tests of meshrl.trainer.sweep)."""
    path = tmp_path / "grid.yaml"
    path.write_text(SWEEP_GRID.format(out=tmp_path / "runs"))
    return path
