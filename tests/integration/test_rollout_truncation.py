"""meshrl.rollout.truncation: log-probs under a top-k / top-p truncated distribution (vLLM's rule)."""

from __future__ import annotations

import pytest
import torch

from meshrl.rollout.truncation import kept_mask, truncated_logprobs


def _logits(seed: int = 0, shape=(3, 5, 50)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_without_truncation_it_is_the_tempered_log_softmax():
    logits = _logits()
    tokens = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(1))
    logp, log_kept = truncated_logprobs(logits, tokens, temperature=0.7)
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(logp, want, atol=1e-6) and torch.all(log_kept == 0)


def test_top_p_keeps_the_smallest_nucleus_with_mass_over_p():
    logits = _logits()
    probs = torch.softmax(logits / 0.8, -1)
    keep = kept_mask(logits, temperature=0.8, top_p=0.9)
    kept_mass = (probs * keep).sum(-1)
    assert torch.all(kept_mass >= 0.9 - 1e-6)
    # Minimal: dropping the least likely kept token leaves at most p.
    least = probs.masked_fill(~keep, float("inf")).min(-1).values
    assert torch.all(kept_mass - least <= 0.9 + 1e-6)
    # The renormalised distribution sums to one, and the gap to the full one is log(kept mass) on every token.
    tokens = probs.argmax(-1)
    logp, log_kept = truncated_logprobs(logits, tokens, temperature=0.8, top_p=0.9)
    full = torch.log(probs.gather(-1, tokens[..., None])[..., 0])
    assert torch.allclose(logp, full - log_kept, atol=1e-5)
    assert torch.allclose(log_kept.exp(), kept_mass, atol=1e-5)


def test_top_k_and_tokens_outside_the_kept_set():
    logits = _logits()
    keep = kept_mask(logits, top_k=3)
    assert torch.all(keep.sum(-1) == 3)
    worst = logits.argmin(-1)
    logp, _ = truncated_logprobs(logits, worst, top_k=3)
    assert torch.all(torch.isneginf(logp))
    best, _ = truncated_logprobs(logits, logits.argmax(-1), top_k=1)
    assert torch.all(best == 0)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="top_p"):
        kept_mask(_logits(), top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        kept_mask(_logits(), temperature=0.0)
