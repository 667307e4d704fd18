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


def test_the_trainer_adds_the_kept_mass_back_to_a_truncating_samplers_logprobs():
    """A sampler that reports log-probs under its top-p distribution (vLLM's processed log-probs): the log kept
    mass the update computes (PolicyForward.log_kept_mass) turns them into the whole-vocabulary log-probs the
    trainer computes, so the mismatch diagnostic and the rollout correction compare like with like."""
    from meshrl.testing import tiny_config
    from meshrl.trainer.batch import token_logprobs
    from meshrl.trainer.forward import PolicyForward
    from meshrl.trainer.mismatch import sampler_logps
    from meshrl.trainer.step_data import StepData

    cfg = tiny_config("rollout.temperature=0.8", "rollout.top_p=0.7")
    torch.manual_seed(0)
    table = torch.randn(40, 32) * 3

    model = torch.nn.Identity()  # stands for the policy: position t's logits are row t of a fixed random table
    forward = PolicyForward(cfg, model, None, pad_id=0, bare_prompt=lambda p: [])
    forward.logits = lambda m, mb: table[: mb.response_ids.shape[1]].expand(mb.response_ids.shape[0], -1, -1)
    best = table.argmax(-1).tolist()  # the most likely token is always inside the nucleus
    data = StepData(prompt_ids=[[1, 2], [3]], response_ids=[best[:3], best[:2]], texts=["a", "b"],
                    origin=["", ""], unsampled=[0, 0])
    mb = forward.collate(data.prompt_ids, data.response_ids)
    logits = forward.logits(model, mb)
    sampled, _ = truncated_logprobs(logits, mb.response_ids, temperature=0.8, top_p=0.7)
    whole = token_logprobs(logits, mb.response_ids, 0.8)
    lengths = [3, 2]
    data.rollout_logps = [sampled[i, :n].tolist() for i, n in enumerate(lengths)]
    as_reported = sampler_logps(data, [0, 1])
    gap = max(abs(a - b) for i, n in enumerate(lengths)
              for a, b in zip(as_reported[i], whole[i, :n].tolist(), strict=True))
    assert gap > 0.05  # the truncation alone: what the diagnostic would call mismatch
    data.rollout_log_kept = forward.log_kept_mass(model, data, 0.7)
    corrected = sampler_logps(data, [0, 1])
    for i, n in enumerate(lengths):
        assert torch.allclose(torch.tensor(corrected[i], dtype=torch.float64), whole[i, :n].double(), atol=1e-5)
