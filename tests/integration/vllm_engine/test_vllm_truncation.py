"""Like with like under truncated sampling: vLLM's log-prob of a token it drew at top-p 0.9 (and temperature
0.8) against the trainer's, on the same weights (run in .venv-vllm by scripts/vllm_env.sh).

Over the whole vocabulary the trainer's log-probs sit ``log(kept mass)`` below the sampler's on every token,
so the mismatch reads as truncation and the importance ratio ``pi_train / pi_sampler`` is biased by that much;
under the same truncated distribution (meshrl.rollout.truncation) the gap is float noise.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_probe import MATCH_TOL  # noqa: E402

from meshrl.models import build_tiny  # noqa: E402
from meshrl.rollout import make_backend  # noqa: E402
from meshrl.rollout.base import SamplingParams  # noqa: E402
from meshrl.rollout.truncation import truncated_logprobs  # noqa: E402

TEMPERATURE, TOP_P = 0.8, 0.9


@pytest.fixture(scope="module")
def sampled():
    """Rollouts at top-p 0.9 from a tiny:small policy, with the trainer's logits of every response token."""
    model, tok = build_tiny("tiny:small", seed=2)
    backend = make_backend("vllm", model, tok, enforce_eager=True)
    try:
        out = backend.generate([[1, 40, 41], [1, 60, 61, 62]], SamplingParams(
            12, temperature=TEMPERATURE, top_p=TOP_P, n=8), seed=0)
    finally:
        backend.close()
    rows = []
    with torch.no_grad():
        for prompt, response, engine in zip(out.prompt_ids, out.response_ids, out.engine_logprobs, strict=True):
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            rows.append((logits, torch.tensor(response), torch.tensor(engine)))
    return rows


def _gaps(rows, **truncation):
    """Per token: trainer log-prob minus the sampler's, and log(kept mass)."""
    gaps, kept = [], []
    for logits, tokens, engine in rows:
        logp, log_kept = truncated_logprobs(logits, tokens, temperature=TEMPERATURE, **truncation)
        gaps.append(logp - engine)
        kept.append(log_kept)
    return torch.cat(gaps), torch.cat(kept)


def test_under_the_same_truncation_the_mismatch_is_float_noise(sampled):
    gap, _ = _gaps(sampled, top_p=TOP_P)
    assert gap.abs().max() < MATCH_TOL
    assert abs(gap.exp().mean() - 1) < MATCH_TOL  # the importance ratio is unbiased


def test_over_the_whole_vocabulary_the_ratio_is_biased_by_the_kept_mass(sampled):
    gap, _ = _gaps(sampled)  # the trainer's full tempered distribution
    _, log_kept = _gaps(sampled, top_p=TOP_P)
    assert log_kept.mean() < -0.02  # top-p 0.9 drops a real share of this near-uniform policy's mass
    assert torch.allclose(gap, log_kept, atol=MATCH_TOL)  # the gap is exactly log(kept mass), token by token
    assert gap.exp().mean() < 1 - 0.02


def test_top_k_reaches_the_engine_and_one_keeps_only_the_argmax():
    """``SamplingParams.top_k`` (simple self-distillation's sampling): at top-k 1 every drawn token is the
    trainer's argmax on the same weights, at temperature 1.5, where unrestricted sampling leaves it."""
    model, tok = build_tiny("tiny:small", seed=2)
    backend = make_backend("vllm", model, tok, enforce_eager=True)
    try:
        out = backend.generate([[1, 40, 41]], SamplingParams(8, temperature=1.5, top_k=1, n=4), seed=0)
        free = backend.generate([[1, 40, 41]], SamplingParams(8, temperature=1.5, n=4), seed=0)
    finally:
        backend.close()

    def argmax_share(ro) -> float:
        hits = total = 0
        with torch.no_grad():
            for prompt, response in zip(ro.prompt_ids, ro.response_ids, strict=True):
                logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
                hits += int((logits.argmax(-1) == torch.tensor(response)).sum())
                total += len(response)
        return hits / total

    assert argmax_share(out) == 1.0
    assert argmax_share(free) < 1.0
