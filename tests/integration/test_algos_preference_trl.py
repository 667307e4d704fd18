"""DPO equal to TRL's DPOTrainer loss on the same per-token log-probs (TRL itself imported)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from meshrl.algos import dpo_loss


def _trl_dpo_loss(loss_type: str, beta: float, smoothing: float, chosen_tok, rejected_tok, ref_c, ref_r, mask):
    """TRL 1.16's ``DPOTrainer._compute_loss`` on given per-token log-probs: a stand-in model returns them."""
    dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    per_token = torch.cat([chosen_tok, rejected_tok])
    n, t = per_token.shape
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros(n, t), mean_logits=torch.zeros(n, t),
                              is_top1=torch.zeros(n, t, dtype=torch.bool))
    identity = SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x)
    fake = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=identity, aux_loss_enabled=False,
                           ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                           loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=smoothing,
                           use_weighting=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
                           _tp_size=1)
    completion = torch.cat([torch.zeros(n, 1), mask.float()], dim=1)  # TRL shifts the mask by one position
    inputs = {"input_ids": torch.zeros(n, t + 1, dtype=torch.long), "attention_mask": torch.ones(n, t + 1),
              "completion_mask": completion, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    return dpo.DPOTrainer._compute_loss(fake, lambda **kw: outputs, inputs, return_outputs=False)


# TRL 1.16's "sigmoid" ignores its label_smoothing (only "robust", "aot*" read it): compared at 0.
@pytest.mark.parametrize(("loss_type", "smoothing"), [("sigmoid", 0.0), ("hinge", 0.0)])
def test_dpo_equals_trl(loss_type: str, smoothing: float) -> None:
    gen = torch.Generator().manual_seed(1)
    b, t = 4, 6
    mask = torch.ones(2 * b, t)
    tok = -torch.rand(2 * b, t, generator=gen, dtype=torch.float32) * 2  # TRL sums these over all positions
    ref_c, ref_r = -torch.rand(b, generator=gen) * 12, -torch.rand(b, generator=gen) * 12
    theirs = _trl_dpo_loss(loss_type, 0.1, smoothing, tok[:b], tok[b:], ref_c, ref_r, mask)
    ours, _ = dpo_loss(tok[:b].sum(1), tok[b:].sum(1), ref_c, ref_r, beta=0.1, loss_type=loss_type,
                       label_smoothing=smoothing)
    torch.testing.assert_close(ours.mean(), theirs)
