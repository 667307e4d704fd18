"""meshrl's vLLM backend on vLLM's CPU build: the engine samples, and after each optimiser step it holds the new
policy (run in .venv-vllm by scripts/vllm_env.sh; skipped where vLLM is not installed).

"Holds the policy" is checked on log-probs of fixed tokens: the engine's prompt log-probs of a fixed sequence
against ``log_softmax(model(sequence))`` of the trainer's model, both in float32 on the CPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_probe import MATCH_TOL, MOVED_MIN, SEQUENCE, engine_logprobs, optimiser_step, policy_logprobs  # noqa: E402

from meshrl.models import build_tiny  # noqa: E402
from meshrl.models.lora import apply_lora  # noqa: E402
from meshrl.rollout import make_backend  # noqa: E402
from meshrl.rollout.base import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    model, tok = build_tiny("tiny:small", seed=0)
    backend = make_backend("vllm", model, tok, batch_size=64, enforce_eager=True)
    yield model, tok, backend
    backend.close()


def test_samples_with_engine_logprobs(engine):
    model, _, backend = engine
    out = backend.generate([[1, 40, 41], [1, 50]], SamplingParams(n=3, temperature=1.0, top_p=1.0,
                                                                 max_new_tokens=6), seed=0)
    assert out.prompt_index == [0, 0, 0, 1, 1, 1]
    assert all(0 < len(r) <= 6 for r in out.response_ids)
    assert [len(lp) for lp in out.engine_logprobs] == [len(r) for r in out.response_ids]
    # Each sampled token's engine log-prob is the policy's (temperature 1: raw log-probs are the sampled ones).
    for prompt, response, logps in zip(out.prompt_ids, out.response_ids, out.engine_logprobs, strict=True):
        ours = policy_logprobs(model, prompt + response)[len(prompt) - 1:]
        assert torch.allclose(torch.tensor(logps), ours, atol=MATCH_TOL)
    # ignore_eos (throughput benchmarks): every row runs the full length, eos or not, log-probs aligned.
    full = backend.generate([[1, 40, 41]], SamplingParams(n=8, max_new_tokens=20, ignore_eos=True), seed=0)
    assert all(len(r) == 20 for r in full.response_ids) and all(full.truncated)
    assert [len(lp) for lp in full.engine_logprobs] == [20] * 8


def test_engine_follows_the_optimiser_step(engine):
    model, _, backend = engine
    before = policy_logprobs(model, SEQUENCE)
    assert torch.allclose(engine_logprobs(backend, SEQUENCE), before, atol=MATCH_TOL)
    optimiser_step(model)
    after = policy_logprobs(model, SEQUENCE)
    assert (after - before).abs().max() > MOVED_MIN
    assert (engine_logprobs(backend, SEQUENCE) - before).abs().max() < MATCH_TOL  # not synced yet: old policy
    backend.sync_weights(model)
    synced = engine_logprobs(backend, SEQUENCE)
    assert torch.allclose(synced, after, atol=MATCH_TOL)
    assert (synced - before).abs().max() > MOVED_MIN


def test_lora_policy_syncs_merged_weights():
    model, tok = build_tiny("tiny:small", seed=1)
    model = apply_lora(model, r=4, alpha=8)
    backend = make_backend("vllm", model, tok, enforce_eager=True)
    try:
        before = policy_logprobs(model, SEQUENCE)
        optimiser_step(model, lr=5e-2)  # only the adapters train: B starts at 0, so one step moves the policy
        after = policy_logprobs(model, SEQUENCE)
        assert (after - before).abs().max() > MOVED_MIN
        backend.sync_weights(model)
        assert torch.allclose(engine_logprobs(backend, SEQUENCE), after, atol=MATCH_TOL)
    finally:
        backend.close()


def test_tiny_head_size_is_refused_with_a_clear_message():
    model, tok = build_tiny("tiny", seed=0)
    with pytest.raises(ValueError, match="head size 16"):
        make_backend("vllm", model, tok)


def test_no_process_is_forked_beside_the_engine(engine):
    """A native decoder asked for two worker processes after vLLM came up decodes in this one instead of forking
    beside vLLM's threads (a fork there hung in futex_wait), and still returns its rows."""
    from meshrl.forkpool import fork_available

    model, tok, _ = engine
    assert not fork_available()
    native = make_backend("native", model, tok, workers=2)
    out = native.generate([[1, 40, 41]] * 2, SamplingParams(n=16, temperature=1.0, max_new_tokens=4), seed=0)
    assert len(out.response_ids) == 32 and native.workers == 1
    native.close()
