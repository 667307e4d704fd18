"""``plugins.sft_mix`` (ReLIFT's SFT on the hardest problems, MIFO's high-entropy tokens): the SFT loss, and bounds
refused by key (the buffer, the term in the trainer and training on the tiny model:
tests/integration/test_plugin_sft_mix_train.py)."""

from __future__ import annotations

import pytest
import torch

from meshrl.trainer import load_config
from meshrl.trainer.plugins.sft_mix import sft_loss


def test_sft_loss_is_the_token_mean_nll_over_the_kept_tokens():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]])
    keep = torch.tensor([[True, False, True], [False, True, False]])
    assert float(sft_loss(logp, keep)) == pytest.approx((1.0 + 3.0 + 4.0) / 3)
    assert float(sft_loss(logp, torch.zeros_like(keep))) == 0.0


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.sft_mix.hard_max_acc=1", "plugins.sft_mix.hard_max_acc"),
    ("plugins.sft_mix.hard_max_acc=-0.1", "plugins.sft_mix.hard_max_acc"),
    ("plugins.sft_mix.batch_size=0", "plugins.sft_mix.batch_size"),
    ("plugins.sft_mix.coef=0", "plugins.sft_mix.coef"),
    ("plugins.sft_mix.top_entropy_frac=0", "plugins.sft_mix.top_entropy_frac"),
    ("plugins.sft_mix.top_entropy_frac=1.5", "plugins.sft_mix.top_entropy_frac"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_missing_demonstrations_file_is_refused():
    with pytest.raises(ValueError, match=r"plugins\.sft_mix\.traces: no such file"):
        load_config(overrides=["plugins.sft_mix.enabled=true", "plugins.sft_mix.traces=/nonexistent.jsonl"])
