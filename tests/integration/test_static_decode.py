"""meshrl.rollout.static_decode, the GPU decode path run eagerly on a CPU (its twin): the same logits as the
dynamic decoder to float rounding, the same samples, log-probs and MEI features, compaction by row buckets, buffers
kept between batches with the weights refreshed in place, and the backend's choice of decoder."""

from __future__ import annotations

import pytest
import torch

from meshrl.models import apply_lora, encode_prompt, load_model
from meshrl.rollout import SamplingParams
from meshrl.rollout.native import NativeDecodeBackend
from meshrl.rollout.static_decode import StaticDecoder, padded_length, row_buckets
from meshrl.testing import family_model


@pytest.fixture(scope="module")
def small():
    return load_model("tiny:small", seed=0)


def _prompts(tok) -> list[list[int]]:
    return [encode_prompt(tok, t) for t in ["1+2=", "Repeat: hello there", "x", "abc abc"]]


def test_row_buckets_and_padded_length():
    assert row_buckets(64) == [64, 32, 16, 8, 4, 2, 1]
    assert row_buckets(36) == [36, 32, 16, 8, 4, 2, 1]
    assert row_buckets(1) == [1]
    assert padded_length(65, 64) == 128 and padded_length(64, 64) == 64 and padded_length(1, 64) == 64


@pytest.mark.parametrize("kind", ["tiny:small", "qwen2", "qwen3", "llama+bias", "llama-untied"])
def test_static_logits_equal_the_dynamic_decoders(kind, small):
    model, tok = small if kind == "tiny:small" else family_model(kind)
    prompts = _prompts(tok)
    dynamic = NativeDecodeBackend(model, tok, workers=1, decoder="dynamic", prepack=False)
    static = NativeDecodeBackend(model, tok, workers=1, decoder="static")
    assert static.static and not dynamic.static
    params = SamplingParams(max_new_tokens=70, temperature=0.0)  # past one length bucket (64 columns)
    with torch.inference_mode():
        a, _, logits_a, _ = dynamic._decode_batch(prompts, params, record_logits=True, stop_at_eos=False)
        b, _, logits_b, _ = static._decode_batch(prompts, params, record_logits=True, stop_at_eos=False)
    assert torch.equal(a, b)
    diff = (torch.stack(logits_a) - torch.stack(logits_b)).abs().max()
    assert diff < 1e-4, diff
    assert static.verify(prompts, new_tokens=6) < 1e-3


def test_static_samples_logprobs_and_features_equal_the_dynamic_decoders(small):
    model, tok = small
    prompts = _prompts(tok)
    params = SamplingParams(max_new_tokens=40, n=8, temperature=1.0)
    outs = [NativeDecodeBackend(model, tok, workers=1, decoder=mode, prepack=False).generate(
        prompts, params, seed=5, features=True) for mode in ("dynamic", "static")]
    dyn, sta = outs
    assert sta.response_ids == dyn.response_ids and sta.truncated == dyn.truncated
    # rows end at different steps, so the static decoder compacted by row buckets along the way
    assert len({len(r) for r in dyn.response_ids}) > 3
    for x, y in zip(dyn.engine_logprobs, sta.engine_logprobs, strict=True):
        assert torch.allclose(torch.as_tensor(x), torch.as_tensor(y), atol=1e-4)
    assert torch.allclose(torch.as_tensor(dyn.engine_features), torch.as_tensor(sta.engine_features), atol=1e-3)


def test_compaction_by_row_buckets_keeps_running_rows_and_moves_few(small):
    model, _ = small
    dec = StaticDecoder(model, 8, 20, torch.device("cpu"), capture=False)
    running = torch.tensor([True, False, True, False, False, False, True, False])
    keep = dec.keep_slots(running, 3)  # 3 running: the 4-slot bucket, padded with the first finished slot
    assert keep is not None and int(keep.sum()) == 4 and keep[running].all() and bool(keep[1])
    assert dec.keep_slots(torch.tensor([True] * 5 + [False] * 3), 5) is None  # 5 running: still the 8 bucket
    assert dec.keep_slots(torch.zeros(8, dtype=torch.bool), 0).sum() == 1  # none running: the smallest bucket


def test_buffers_are_kept_between_batches_and_see_the_new_weights(small):
    model, tok = small
    model = load_model("tiny:small", seed=0)[0]  # a copy this test may change
    prompts = _prompts(tok)
    params = SamplingParams(max_new_tokens=12, n=2, temperature=1.0)
    static = NativeDecodeBackend(model, tok, workers=1, decoder="static")
    static.generate(prompts, params, seed=1)
    kept = static._static
    assert kept is not None
    with torch.no_grad():  # an optimiser step, in place
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    after = static.generate(prompts, params, seed=1)
    assert static._static is kept  # the same buffers (a GPU's graphs read their addresses)
    dynamic = NativeDecodeBackend(model, tok, workers=1, decoder="dynamic", prepack=False)
    fresh = dynamic.generate(prompts, params, seed=1)
    assert after.response_ids == fresh.response_ids
    static.generate(prompts[:3], params, seed=1)  # another row count: a new decoder
    assert static._static is not kept


def test_bf16_autocast_casts_every_sampler_weight_once(small):
    model, tok = small
    prompts = _prompts(tok)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        dec = StaticDecoder(model, 4, 30, torch.device("cpu"), capture=False)
    assert dec.head_weight.dtype == torch.bfloat16
    assert all(g.weight.dtype == torch.bfloat16 for pk in dec.packed for g in (pk.qkv, pk.o, pk.gate_up, pk.down))
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    outs = [NativeDecodeBackend(model, tok, workers=1, decoder=mode, prepack=False, autocast="bfloat16").generate(
        prompts, params, seed=0) for mode in ("dynamic", "static")]
    assert outs[0].response_ids == outs[1].response_ids


def test_lora_layers_run_through_their_modules(small):
    model, tok = load_model("tiny:small", seed=0)
    model = apply_lora(model, r=4)
    prompts = _prompts(tok)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    outs = [NativeDecodeBackend(model, tok, workers=1, decoder=mode, prepack=False).generate(prompts, params, seed=0)
            for mode in ("dynamic", "static")]
    assert outs[0].response_ids == outs[1].response_ids


def test_bad_settings_are_refused(small):
    model, tok = small
    with pytest.raises(ValueError, match="decoder must be one of"):
        NativeDecodeBackend(model, tok, decoder="yes")
    with pytest.raises(ValueError, match="CUDA graph capture needs a CUDA device"):
        StaticDecoder(model, 2, 10, torch.device("cpu"), capture=True)
