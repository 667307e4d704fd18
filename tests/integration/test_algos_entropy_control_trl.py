"""The forking-token mask against TRL's ``get_high_entropy_mask`` on the same inputs (TRL itself imported)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshrl.algos import (
    high_entropy_mask,
)


def test_forking_mask_equals_trl_get_high_entropy_mask() -> None:
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    identity = SimpleNamespace(pad_across_processes=lambda x, dim, pad_index: x, gather=lambda x: x)
    fake_trainer = SimpleNamespace(accelerator=identity)
    gen = torch.Generator().manual_seed(3)
    for rho in (0.2, 0.5, 1.0):
        entropy = torch.rand(6, 9, generator=gen) * 3
        mask = (torch.rand(6, 9, generator=gen) > 0.3).to(torch.long)
        mask[4] = 0  # an empty row
        theirs = grpo.GRPOTrainer.get_high_entropy_mask(fake_trainer, entropy, mask, 1 - rho)
        ours = high_entropy_mask(entropy, mask, top_frac=rho)
        assert torch.equal(ours, theirs)
