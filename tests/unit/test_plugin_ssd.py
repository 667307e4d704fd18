"""plugins.ssd: the sampler's top-k, and bad settings named by key (the NLL term in the trainer:
tests/integration/test_plugin_ssd_train.py)."""

from __future__ import annotations

import pytest
import torch

from meshrl.rollout import SamplingParams
from meshrl.rollout.hf import generation_config
from meshrl.rollout.native import sample_tokens
from meshrl.trainer import load_config


def test_sampler_top_k_keeps_the_k_most_likely_and_off_changes_nothing():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 12, generator=gen)
    noise = torch.empty(500, 12).exponential_(generator=gen)
    top3 = logits.topk(3, dim=-1).indices
    drawn = sample_tokens(logits, SamplingParams(1, temperature=5.0, top_k=3), noise)
    assert bool((drawn[:, None] == top3).any(-1).all())
    assert len(set(drawn.tolist())) > 3  # still a draw, not an argmax
    # top_k and top_p together: vLLM's rule, top-p over the top-k's renormalised mass (p = 0.5 of two equal
    # tokens keeps one; p = 0.5 of the whole vocabulary would keep them both)
    flat = torch.tensor([[2.0, 2.0, 0.0, 0.0, 0.0, 0.0]]).expand(200, 6)
    pair = sample_tokens(flat, SamplingParams(1, top_p=0.5, top_k=2), torch.ones(200, 6) + torch.rand(200, 6))
    assert set(pair.tolist()) <= {0, 1} and len(set(pair.tolist())) == 1
    for params in (SamplingParams(1, temperature=0.8), SamplingParams(1, temperature=0.8, top_p=0.6)):
        off = SamplingParams(1, temperature=params.temperature, top_p=params.top_p, top_k=0)
        assert torch.equal(sample_tokens(logits, params, noise), sample_tokens(logits, off, noise))
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        SamplingParams(1, top_k=-1)
    assert generation_config(SamplingParams(4, top_k=20), [0], 0).top_k == 20
    assert generation_config(SamplingParams(4), [0], 0).top_k == 0


@pytest.mark.parametrize(("override", "key"), [
    ("plugins.ssd.coef=0", "plugins.ssd.coef"),
    ("plugins.ssd.temperature=0", "plugins.ssd.temperature"),
    ("plugins.ssd.top_k=-1", "plugins.ssd.top_k"),
    ("plugins.ssd.top_p=0", "plugins.ssd.top_p"),
    ("plugins.ssd.top_p=1.5", "plugins.ssd.top_p"),
    ("plugins.ssd.samples=filtered", "plugins.ssd.samples"),
])
def test_bad_settings_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])
