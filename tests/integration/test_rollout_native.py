"""meshrl.rollout.native: the decode loop against transformers (logits, greedy output), sampling law,
row-keyed noise, eos/compaction (and ignore_eos), worker processes, supported-model detection and the auto choice
(native / vllm by the measured rule, hf fallback)."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.generation.logits_process import TopPLogitsWarper

from meshrl.models import apply_lora, base_model, build_tiny, encode_prompt, llama_fast, load_model
from meshrl.rollout import SamplingParams, VLLMBackend, make_backend, unsupported_reason
from meshrl.rollout import auto as auto_mod
from meshrl.rollout import choice as choice_mod
from meshrl.rollout import native as native_mod
from meshrl.rollout.choice import StepShape
from meshrl.rollout.native import NativeDecodeBackend, RowNoise, distinct_prompts, sample_tokens
from meshrl.testing import family_model


@pytest.fixture(scope="module")
def small():
    return load_model("tiny:small", seed=0)


def _prompts(tok, texts: list[str]) -> list[list[int]]:
    return [encode_prompt(tok, t) for t in texts]


@pytest.mark.parametrize("kind", ["tiny:small", "qwen2", "qwen3", "llama-untied", "llama+bias-"])
def test_decode_logits_equal_the_models_forward_and_greedy_equals_generate(kind, small):
    model, tok = small if kind == "tiny:small" else family_model(kind.split("-")[0])
    prompts = _prompts(tok, ["1+2=", "Repeat: hello there", "x"])
    backend = make_backend("native", model, tok, workers=1)
    assert backend.verify(prompts + prompts[:1], new_tokens=6) < 1e-4
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    ours = backend.generate(prompts, greedy, seed=0)
    theirs = make_backend("hf", model, tok).generate(prompts, greedy, seed=0)
    assert ours.response_ids == theirs.response_ids and ours.truncated == theirs.truncated


def test_lora_model_runs_through_its_modules(small):
    model, tok = load_model("tiny", seed=0)
    peft = apply_lora(model, r=4, alpha=8)
    for name, p in peft.named_parameters():  # a non-zero adapter, so that skipping it would change logits
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    backend = make_backend("native", peft, tok, workers=1)
    assert backend.verify(_prompts(tok, ["1+2=", "abc"]), new_tokens=5) < 1e-4
    assert not llama_fast.packable(base_model(peft))
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = _prompts(tok, ["hello", "7*8="])
    assert (backend.generate(prompts, greedy, seed=0).response_ids
            == make_backend("hf", peft, tok).generate(prompts, greedy, seed=0).response_ids)


def test_verify_catches_a_decoder_that_disagrees(small, monkeypatch):
    model, tok = small
    backend = NativeDecodeBackend(model, tok, workers=1)
    monkeypatch.setattr(llama_fast, "rotate", lambda x, cos, sin: x)  # "forget" RoPE
    with pytest.raises(RuntimeError, match="disagrees with the model's forward"):
        backend.verify(_prompts(tok, ["1+2=", "abc"]), new_tokens=4)


def test_unsupported_models_are_refused_and_auto_falls_back_to_hf():
    _, tok = build_tiny("tiny")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "gpt2" in unsupported_reason(gpt2)
    assert make_backend("auto", gpt2, tok).name == "hf"
    with pytest.raises(ValueError, match="cannot run this model: model_type 'gpt2'"):
        make_backend("native", gpt2, tok)
    windowed = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            use_sliding_window=True, sliding_window=16, max_window_layers=0))
    assert "sliding" in unsupported_reason(windowed) or "layer types" in unsupported_reason(windowed)
    tiny, tok = build_tiny("tiny")
    assert unsupported_reason(tiny) is None and make_backend("auto", tiny, tok, workers=1).name == "native"


def test_sampling_law_matches_softmax_and_nucleus():
    """The exponential race picks token v with probability p_v (chi-square over 40k draws), and top-p
    keeps exactly the set transformers' TopPLogitsWarper keeps."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(40_000, 4)
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(40_000, 4).exponential_(generator=gen)
    counts = torch.bincount(sample_tokens(logits, SamplingParams(1), noise), minlength=4).float()
    expected = probs * 40_000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 99.9% quantile of chi-square with 3 degrees of freedom
    # Temperature: T=2 flattens to softmax(log p / 2).
    hot = torch.bincount(sample_tokens(logits, SamplingParams(1, temperature=2.0), noise), minlength=4).float()
    hot_p = torch.softmax(probs.log() / 2, -1)
    assert float(((hot - hot_p * 40_000) ** 2 / (hot_p * 40_000)).sum()) < 16.3
    # Nucleus: the kept set equals transformers' on random logits, for several top_p.
    rand = torch.randn(200, 30, generator=gen)
    for top_p in (0.3, 0.7, 0.95):
        ref_kept = torch.isfinite(TopPLogitsWarper(top_p)(None, rand.clone()))
        draws = torch.stack([sample_tokens(rand, SamplingParams(1, top_p=top_p),
                                           torch.empty_like(rand).exponential_(generator=gen)) for _ in range(200)])
        kept_seen = torch.zeros_like(ref_kept)
        kept_seen.scatter_(1, draws.t(), True)
        assert not (kept_seen & ~ref_kept).any(), "sampled a token outside the nucleus"
        assert (kept_seen.sum(1) >= 1).all()
    assert torch.equal(sample_tokens(rand, SamplingParams(1, temperature=0.0)), rand.argmax(-1))


def test_row_noise_depends_only_on_seed_row_and_step():
    a, b = RowNoise(3, 10, torch.device("cpu")), RowNoise(3, 10, torch.device("cpu"))
    full = a(torch.arange(40), step=5)
    assert torch.equal(b(torch.tensor([37, 2, 16]), step=5), full[[37, 2, 16]])
    two = torch.tensor([2])
    assert not torch.equal(a(two, step=6), full[[2]]) and not torch.equal(RowNoise(4, 10, a.device)(two, 5), full[[2]])
    assert (full > 0).all()


def test_samples_do_not_depend_on_batching_or_workers(small):
    model, tok = small
    prompts = _prompts(tok, ["1+2=", "Repeat: 7", "abc", "x"])
    params = SamplingParams(max_new_tokens=24, n=9, temperature=1.0)
    outs = []
    for workers, batch in [(1, None), (1, 10), (2, None), (3, 16)]:
        backend = NativeDecodeBackend(model, tok, workers=workers, batch_size=batch)
        outs.append(backend.generate(prompts, params, seed=11))
        backend.close()
    assert all(o.response_ids == outs[0].response_ids for o in outs[1:])
    assert outs[0].prompt_index == [i for i in range(4) for _ in range(9)]
    again = NativeDecodeBackend(model, tok, workers=1).generate(prompts, params, seed=12)
    assert again.response_ids != outs[0].response_ids
    # Same seed, same samples; the caller's RNG stream is not consumed.
    state = torch.random.get_rng_state()
    rerun = NativeDecodeBackend(model, tok, workers=1).generate(prompts, params, seed=11)
    assert rerun.response_ids == outs[0].response_ids and torch.equal(torch.random.get_rng_state(), state)


def test_workers_read_the_updated_weights_and_report_errors(small):
    model, tok = load_model("tiny:small", seed=1)
    prompts = _prompts(tok, ["1+2=", "Repeat: 7", "abc"])
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, n=8)
    pooled, single = NativeDecodeBackend(model, tok, workers=2), NativeDecodeBackend(model, tok, workers=1)
    before = pooled.generate(prompts, greedy, seed=0)
    assert pooled._pool is not None and all(p.is_shared() for p in model.parameters())
    with torch.no_grad():  # an in-place update, as the optimiser makes
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    after = pooled.generate(prompts, greedy, seed=0)
    assert after.response_ids == single.generate(prompts, greedy, seed=0).response_ids
    assert after.response_ids != before.response_ids
    # A failure inside a worker comes back as an error with the worker's traceback.
    bad = [*prompts[:2], [len(tok) + 50]]  # an out-of-vocabulary id: the 3rd prompt's rows go to the worker
    with pytest.raises(RuntimeError, match="decode worker failed"):
        pooled.generate(bad, greedy, seed=0)
    pooled.close()
    assert pooled._pool is None


def _scripted(monkeypatch, sequences: list[list[int]]):
    """Replace the sampler: row r emits ``sequences[r]`` then repeats its last token, under a uniform
    distribution (for the MEI features)."""
    counter = itertools.count()
    state = {"step": -1, "rows": None}

    def fake(logits, params, noise=None, *, full_probs=True):
        state["step"] = next(counter)
        tokens = torch.tensor([seq[min(state["step"], len(seq) - 1)] for seq in state["rows"]])
        uniform = torch.full(logits.shape, 1 / logits.shape[-1]) if full_probs else None
        return tokens, torch.zeros(len(tokens)), uniform

    original = native_mod.NativeDecodeBackend._decode_batch

    def run(self, prompts, params, **kw):
        state["rows"] = list(sequences)
        # Compaction moves and drops rows: follow them by wrapping it.
        compact = native_mod._Decoder.compact

        def follow(dec, running):
            order = compact(dec, running)
            state["rows"] = [state["rows"][i] for i in order.tolist()]
            return order

        monkeypatch.setattr(native_mod._Decoder, "compact", follow)
        try:
            return original(self, prompts, params, **kw)
        finally:
            monkeypatch.setattr(native_mod._Decoder, "compact", compact)

    monkeypatch.setattr(native_mod, "sample_with_probs", fake)
    monkeypatch.setattr(native_mod.NativeDecodeBackend, "_decode_batch", run)


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_eos_truncation_and_finished_rows_dropped(monkeypatch, pad_is_eos):
    model, tok = build_tiny("tiny", seed=0, pad_is_eos=pad_is_eos)
    eos = tok.eos_token_id
    a, b, x = (tok.convert_tokens_to_ids(c) for c in "abx")
    # 8 rows: row 0 stops after 1 token, rows 1-3 after "ab", rows 4-7 never stop (truncated).
    seqs = [[eos], [a, b, eos], [a, b, eos], [a, b, eos], [x], [x], [x], [x]]
    _scripted(monkeypatch, seqs)
    backend = NativeDecodeBackend(model, tok, workers=1, verify=False)
    out = backend.generate(_prompts(tok, ["q"] * 8), SamplingParams(5, temperature=1.0), seed=0, features=True)
    assert out.response_ids[0] == [eos] and out.response_ids[1] == [a, b, eos]
    assert out.response_ids[4] == [x] * 5
    assert out.truncated == [False] * 4 + [True] * 4
    assert out.texts[:2] == ["", "ab"] and out.texts[4] == "xxxxx"
    # MEI features: each row's own tokens up to its eos (not the pad/eos written after it, not another row's
    # after compaction), minus the uniform distribution once per token
    for r, response in enumerate(out.response_ids):
        vocab = out.engine_features[r].shape[0]
        want = -torch.full((vocab,), len(response) / vocab)
        want.index_add_(0, torch.tensor(response), torch.ones(len(response)))
        assert torch.allclose(torch.from_numpy(out.engine_features[r]), want, atol=1e-6), r


def test_distinct_prompts_and_compaction_keep_rows_in_order(small):
    assert distinct_prompts([[1, 2], [3], [1, 2], [3], [4]]) == ([[1, 2], [3], [4]], [0, 1, 0, 1, 2])
    model, tok = small
    # Greedy rows of the same prompt are identical; prompt-major order survives compaction.
    prompts = _prompts(tok, ["1+2=", "Repeat: hello", "abc"])
    out = NativeDecodeBackend(model, tok, workers=1).generate(prompts, SamplingParams(16, temperature=0, n=3), seed=0)
    for i in range(3):
        assert len({tuple(r) for r in out.response_ids[3 * i : 3 * i + 3]}) == 1


def test_trainer_picks_native_for_llama_models_and_hf_when_asked(tmp_path):
    from meshrl.trainer import Trainer, load_config

    base = ["model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=2", "rollout.group_size=4",
            "rollout.max_new_tokens=4", "log.progress=false"]
    auto = Trainer(load_config(overrides=base), tmp_path / "a")
    assert auto.backend.name == "native" and auto.backend.workers == min(torch.get_num_threads(), 8)
    one = Trainer(load_config(overrides=[*base, "rollout.decode_workers=1"]), tmp_path / "c")
    assert one.backend.workers == 1
    hf = Trainer(load_config(overrides=[*base, "rollout.backend=hf"]), tmp_path / "b")
    assert hf.backend.name == "hf"
    with pytest.raises(ValueError, match="rollout.decode_workers"):
        load_config(overrides=[*base, "rollout.decode_workers=-1"])


def test_a_dead_worker_is_reported_the_batch_decoded_here_then_replaced(small, caplog):
    model, tok = load_model("tiny:small", seed=2)
    prompts = _prompts(tok, ["1+2=", "Repeat: 7"])
    params = SamplingParams(max_new_tokens=8, n=16)
    backend = NativeDecodeBackend(model, tok, workers=2)
    first = backend.generate(prompts, params, seed=0)
    dead = backend._pool
    dead.procs[0].kill()
    dead.procs[0].join()
    with caplog.at_level("WARNING", logger="meshrl"):
        recovered = backend.generate(prompts, params, seed=0)  # this batch: every shard decoded here
    assert "decode worker process died" in caplog.text and dead.closed
    assert recovered.response_ids == first.response_ids
    again = backend.generate(prompts, params, seed=0)  # a fresh pool
    assert backend._pool is not dead and not backend._pool.closed
    assert again.response_ids == first.response_ids
    backend.close()


def test_no_room_in_shared_memory_means_one_decoder(monkeypatch, caplog):
    from collections import namedtuple

    from meshrl import forkpool

    model, tok = load_model("tiny", seed=4)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(forkpool.shutil, "disk_usage", lambda path: usage(64 << 20, 64 << 20, 1 << 10))
    backend = NativeDecodeBackend(model, tok, workers=2)
    prompts = _prompts(tok, ["a", "b"])
    with caplog.at_level("WARNING", logger="meshrl"):
        out = backend.generate(prompts, SamplingParams(max_new_tokens=6, n=16), seed=1)
    assert backend.workers == 1 and backend._pool is None and "shared memory" in caplog.text
    assert not any(p.is_shared() for p in model.parameters())
    assert out.response_ids == NativeDecodeBackend(model, tok, workers=1).generate(
        prompts, SamplingParams(max_new_tokens=6, n=16), seed=1).response_ids


def test_native_and_generate_sample_the_same_sequence_law():
    """Whole sequences, not just one step: the mean log-probability of 3000 sampled 4-token responses under
    the model agrees between the two backends (within 4 standard errors), and so do first-token counts."""
    from meshrl.trainer.batch import collate, response_logits, token_logprobs

    model, tok = load_model("tiny", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked policy, so that a wrong law would show
    prompts = _prompts(tok, ["Repeat: ab", "1+2="])
    params = SamplingParams(max_new_tokens=4, n=1500)
    stats = {}
    for name in ("hf", "native"):
        out = make_backend(name, model, tok).generate(prompts, params, seed=7)
        mb = collate(out.prompt_ids, out.response_ids, tok.pad_token_id)
        with torch.no_grad():
            seq = (token_logprobs(response_logits(model, mb), mb.response_ids) * mb.response_mask).sum(-1)
        first = torch.bincount(torch.tensor([r[0] for r in out.response_ids]), minlength=len(tok)).float()
        stats[name] = (seq.mean(), seq.std() / len(seq) ** 0.5, first)
    (m1, s1, f1), (m2, s2, f2) = stats["hf"], stats["native"]
    assert abs(m1 - m2) < 4 * (s1**2 + s2**2) ** 0.5
    seen = (f1 + f2) > 10
    chi2 = float(((f1 - f2) ** 2 / (f1 + f2))[seen].sum())
    assert chi2 < 3 * max(1, int(seen.sum()) - 1) + 10


@pytest.mark.parametrize("mode", ["autocast", "bf16-weights"])
def test_low_precision_decode_passes_its_check(mode, small):
    model, tok = small
    prompts = _prompts(tok, ["1+2=", "Repeat: hello there"])
    if mode == "autocast":
        backend = NativeDecodeBackend(model, tok, workers=1, autocast="bfloat16")
    else:
        model, tok = load_model("tiny:small", seed=0, dtype="bfloat16")
        backend = NativeDecodeBackend(model, tok, workers=1)
    diff = backend.verify(prompts, new_tokens=6)
    assert 0 < diff < 0.5
    out = backend.generate(prompts, SamplingParams(max_new_tokens=8, n=3), seed=0)
    assert len(out) == 6 and all(len(r) >= 1 for r in out.response_ids)


def test_length_dependent_rope_is_refused():
    _, tok = build_tiny("tiny")
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [8.0] * 8,
            "original_max_position_embeddings": 32}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, rope_parameters=rope))
    assert "longrope" in unsupported_reason(model)
    assert make_backend("auto", model, tok).name == "hf"


def test_auto_falls_back_to_generate_when_the_check_fails(small, monkeypatch, caplog):
    model, tok = small
    monkeypatch.setattr(llama_fast, "rotate", lambda x, cos, sin: x)
    with caplog.at_level("WARNING", logger="meshrl"):
        backend = make_backend("auto", model, tok, workers=2, batch_size=8)
    assert backend.name == "hf" and backend.batch_size == 8 and "disagrees" in caplog.text
    monkeypatch.undo()
    assert make_backend("auto", model, tok, workers=1).name == "native"


def test_zero_uniform_draws_give_finite_noise(monkeypatch):
    monkeypatch.setattr(native_mod.torch, "rand", lambda *a, **k: torch.zeros(*a[:2]))
    noise = RowNoise(0, 5, torch.device("cpu"))(torch.arange(3), 0)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    logits = torch.tensor([[0.0, -1e4, -1e4, -1e4, 5.0]]).expand(3, 5)
    assert sample_tokens(logits, SamplingParams(1, top_p=0.5), noise).tolist() == [4, 4, 4]


def _tagged(tag):
    if tag == "fail":
        raise ValueError("worker-side failure")
    return f"done {tag}"


def test_pool_errors_keep_or_close_it_as_the_pipes_require():
    from meshrl.forkpool import ForkPool, WorkerError

    model, _ = load_model("tiny", seed=5)
    pool = ForkPool(model, _tagged, workers=2)
    assert pool.map(_tagged, [("a",), ("b",)]) == ["done a", "done b"]
    with pytest.raises(WorkerError, match="worker-side failure"):
        pool.map(_tagged, [("a",), ("fail",)])
    assert not pool.closed and pool.map(_tagged, [("c",), ("d",)]) == ["done c", "done d"]

    def interrupted(tag):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pool.map(interrupted, [("e",), ("f",)])
    assert pool.closed  # a late reply must not be read by the next call as its own


def test_pool_has_as_many_processes_as_shards_and_grows_on_demand(small):
    model, tok = load_model("tiny:small", seed=6)
    backend = NativeDecodeBackend(model, tok, workers=3)
    prompts = _prompts(tok, ["1+2=", "Repeat: 7"])
    backend.generate(prompts, SamplingParams(max_new_tokens=4, n=16), seed=0)  # 32 rows: 2 shards of 16
    assert backend._pool.size == 2
    backend.generate(prompts, SamplingParams(max_new_tokens=4, n=24), seed=0)  # 48 rows: 3 shards
    assert backend._pool.size == 3
    backend.close()


@pytest.mark.parametrize("kind", ["tiny:small", "qwen2", "llama+bias"])
def test_fused_weights_in_autocast_dtype_change_no_sample(kind, small, monkeypatch):
    """Under autocast the decoder keeps its fused q|k|v and gate|up copies in bf16 (what autocast cast them to
    at every call): the same samples and log-probs, bit for bit, as fused fp32 copies cast per call."""
    model, tok = small if kind == "tiny:small" else family_model(kind)
    prompts = _prompts(tok, ["1+2=", "Repeat: hello there", "x"])
    params = SamplingParams(max_new_tokens=10, n=3, temperature=0.8)

    def run():
        backend = NativeDecodeBackend(model, tok, workers=1, autocast="bfloat16", verify=False, prepack=False)
        return backend.generate(prompts, params, seed=5)

    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        runner = llama_fast.LlamaRunner(model, 16, torch.device("cpu"))
    pk = runner.packed[0]
    assert pk.qkv.weight.dtype == torch.bfloat16 and pk.gate_up.weight.dtype == torch.bfloat16
    assert llama_fast.LlamaRunner(model, 16, torch.device("cpu")).packed[0].qkv.weight.dtype == torch.float32
    low = run()
    monkeypatch.setattr(llama_fast, "autocast_dtype", lambda device, dtype: None)  # the fp32 copies
    full = run()
    assert low.response_ids == full.response_ids
    assert low.engine_logprobs == full.engine_logprobs


def test_ignore_eos_runs_every_row_to_the_end_with_the_same_draws(small):
    """``ignore_eos``: every row is max_new_tokens long, and up to where it used to end a row has the same tokens
    (the draws are keyed by row and step); hf masks eos instead and fills every row too."""
    model, tok = small
    prompts = _prompts(tok, ["1+2=", "Repeat: hello", "abc"])
    params = SamplingParams(max_new_tokens=40, n=8)
    backend = NativeDecodeBackend(model, tok, workers=2)
    stopped = backend.generate(prompts, params, seed=3)
    full = backend.generate(prompts, dataclasses.replace(params, ignore_eos=True), seed=3)
    backend.close()
    assert any(not t for t in stopped.truncated)  # some rows do end at eos, so the comparison means something
    assert all(len(r) == 40 for r in full.response_ids) and all(full.truncated)
    assert all(b[: len(a)] == a for a, b in zip(stopped.response_ids, full.response_ids, strict=True))
    assert all(len(lp) == 40 for lp in full.engine_logprobs)
    eos = set(backend.eos)
    assert any(eos & set(r[:-1]) for r in full.response_ids)  # an eos inside a row did not end it
    hf = make_backend("hf", model, tok).generate(prompts, dataclasses.replace(params, ignore_eos=True), seed=3)
    assert all(len(r) == 40 for r in hf.response_ids)


def test_auto_picks_by_the_rule_and_says_why(small, monkeypatch, caplog):
    """With vLLM 'installed' on a CPU and a measured table where vLLM wins the long shape (the shipped one, since
    prepacked GEMMs, keeps native everywhere): at 64x64, where native measured faster, auto keeps native and logs
    why; at 16x512, where vLLM measured faster, it builds vLLM, and when that engine cannot start (here vLLM is
    absent) it warns and falls back to native."""
    model, tok = small
    monkeypatch.setattr(choice_mod, "_logged", set())
    monkeypatch.setattr(auto_mod, "vllm_installed", lambda: True)
    split = {StepShape(64, 64): (262.0, 204.0), StepShape(16, 512): (107.0, 150.0)}  # measured before prepacking
    monkeypatch.setattr(choice_mod, "CPU_MEASURED", split)
    with caplog.at_level(logging.INFO, logger="meshrl"):
        backend = make_backend("auto", model, tok, workers=1, shape=StepShape(64, 64))
    assert backend.name == "native"
    assert "auto -> native: vllm installed, but at 64x64" in caplog.text and "262 vs 204" in caplog.text
    built = []

    def no_engine(self, *args, **kwargs):
        built.append(True)
        raise ImportError("no vllm")

    monkeypatch.setattr(VLLMBackend, "__init__", no_engine)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="meshrl"):
        assert make_backend("auto", model, tok, workers=1, shape=StepShape(16, 512)).name == "native"
    assert built and "vLLM's CPU build measured faster" in caplog.text
    assert "but vllm failed to start (no vllm); trying native" in caplog.text
    monkeypatch.setattr(VLLMBackend, "__init__", lambda self, *args, **kwargs: None)  # an engine that "starts"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="meshrl"):
        assert make_backend("auto", model, tok, workers=1, shape=StepShape(8, 1024)).name == "vllm"
    assert "auto -> vllm: at 16x512, the measured shape nearest the step's 8x1024" in caplog.text


def test_trainer_passes_the_step_shape_to_auto(tmp_path, monkeypatch):
    from meshrl.trainer import Trainer, load_config

    seen = []
    monkeypatch.setattr(auto_mod, "choose_sampler", lambda **kw: seen.append(kw) or ("native", "test"))
    Trainer(load_config(overrides=["model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=3",
                                   "rollout.group_size=4", "rollout.max_new_tokens=5", "log.progress=false"]),
            tmp_path / "a")
    assert seen[0]["shape"] == StepShape(12, 5) and seen[0]["device"] == "cpu"
