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
