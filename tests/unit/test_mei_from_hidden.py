"""``bias_features_from_hidden``: the bias map of ``z = h W^T + b`` projected position by position equals
``bias_features`` of the full logits, for any chunking, and names bad inputs."""

from __future__ import annotations

import pytest
import torch

from meshrl.diagnostics import bias_features, bias_features_from_hidden


def case(seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    B, T, D, V = 5, 7, 6, 11
    hidden = torch.randn(B, T, D, generator=gen, dtype=dtype)
    weight = torch.randn(V, D, generator=gen, dtype=dtype)
    bias = torch.randn(V, generator=gen, dtype=dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.rand(B, T, generator=gen) < 0.7).float()
    mask[2] = 0  # a row without model tokens has the zero feature
    tokens[mask == 0] = -100  # ignored under the mask
    return hidden, weight, bias, tokens, mask


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_equals_bias_features_of_the_full_logits(chunk):
    hidden, weight, bias, tokens, mask = case()
    for b in (None, bias):
        logits = hidden @ weight.T + (0 if b is None else b)
        want = bias_features(logits, tokens, mask, temperature=0.7)
        got = bias_features_from_hidden(hidden, weight, tokens, mask, 0.7, bias=b, chunk_size=chunk)
        assert got.dtype == torch.float64 and torch.allclose(got, want, atol=1e-12)
        assert bool((got[2] == 0).all()) and torch.allclose(got.sum(1), torch.zeros(5, dtype=got.dtype), atol=1e-12)


def test_low_precision_hidden_is_computed_in_float32():
    hidden, weight, bias, tokens, mask = case(1, torch.float32)
    want = bias_features(hidden.double() @ weight.double().T + bias.double(), tokens, mask)
    got = bias_features_from_hidden(hidden.bfloat16(), weight.bfloat16(), tokens, mask, bias=bias.bfloat16())
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=0.1)


def test_bad_inputs_are_named():
    hidden, weight, bias, tokens, mask = case()
    with pytest.raises(ValueError, match="weight shape"):
        bias_features_from_hidden(hidden, weight[:, :4], tokens, mask)
    with pytest.raises(ValueError, match="bias shape"):
        bias_features_from_hidden(hidden, weight, tokens, mask, bias=bias[:3])
    with pytest.raises(ValueError, match="tokens shape"):
        bias_features_from_hidden(hidden, weight, tokens[:, :3], mask[:, :3])
    with pytest.raises(ValueError, match="tokens under mask"):
        bias_features_from_hidden(hidden, weight, tokens.clamp(min=0) + 11, mask)
    with pytest.raises(ValueError, match="temperature"):
        bias_features_from_hidden(hidden, weight, tokens, mask, temperature=0.0)
