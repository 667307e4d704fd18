"""meshrl.rollout: SamplingParams, HF generate backend (padding, eos, n, determinism), registry, vLLM."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from meshrl.models import apply_lora, build_tiny, encode_prompt, load_model
from meshrl.models.loading import load_local
from meshrl.rollout import (
    HFGenerateBackend,
    Rollouts,
    SamplingParams,
    cut_at_eos,
    left_pad,
    make_backend,
    save_policy,
)
from meshrl.rollout.hf import generation_config


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def _prompts(tok, texts: list[str]) -> list[list[int]]:
    return [encode_prompt(tok, t) for t in texts]


def script(model, tok, table: dict[str, str], default: str) -> list[int]:
    """Make ``model`` deterministic: the next token is ``table[last char]`` (else ``default``).

    A forward hook overwrites the logits, so generation behaves like a tiny state machine; "</s>"
    in the table means eos. Returns the recorded input lengths of every forward call.
    """

    def tid(s: str) -> int:
        return tok.eos_token_id if s == "</s>" else tok.convert_tokens_to_ids(s)

    nxt = torch.full((len(tok),), tid(default), dtype=torch.long)
    for src, dst in table.items():
        nxt[tid(src)] = tid(dst)
    seen: list[int] = []

    def hook(module, args, kwargs, output):
        ids = kwargs["input_ids"]
        seen.append(ids.shape[1])
        logits = torch.full_like(output.logits, -1e4)
        want = nxt[ids[:, -logits.shape[1] :]]
        output.logits = logits.scatter(-1, want.unsqueeze(-1), 0.0)
        return output

    model.register_forward_hook(hook, with_kwargs=True)
    return seen


def test_sampling_params_validation():
    assert SamplingParams(8, temperature=0).greedy
    for bad in ({"max_new_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"n": 0}):
        kw = {"max_new_tokens": 4, **bad}
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 2, 2, 2], [2]) == ([5, 6, 2], False)
    assert cut_at_eos([5, 6, 7], [2]) == ([5, 6, 7], True)
    assert cut_at_eos([5, 9, 6, 2], [2, 9]) == ([5, 9], False)


def test_registry(tiny):
    model, tok = tiny
    assert isinstance(make_backend("hf", model, tok), HFGenerateBackend)
    with pytest.raises(ValueError, match="hf"):
        make_backend("nope", model, tok)


def test_same_seed_same_samples_and_rng_untouched(tiny):
    model, tok = tiny
    backend = make_backend("hf", model, tok)
    prompts = _prompts(tok, ["1+1?", "a longer question here?"])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2)
    state = torch.random.get_rng_state()
    a = backend.generate(prompts, params, seed=7)
    assert torch.equal(state, torch.random.get_rng_state())
    b = backend.generate(prompts, params, seed=7)
    c = backend.generate(prompts, params, seed=8)
    assert a.response_ids == b.response_ids and a.texts == b.texts
    assert a.response_ids != c.response_ids
    assert a.engine_logprobs == b.engine_logprobs  # the sampler's log-probs (test_rollout_mismatch.py)
    assert [len(x) for x in a.engine_logprobs] == [len(x) for x in a.response_ids]


def test_n_samples_prompt_major(tiny):
    model, tok = tiny
    prompts = _prompts(tok, ["x", "yy", "zzz"])
    out = make_backend("hf", model, tok).generate(prompts, SamplingParams(6, n=3), seed=0)
    assert isinstance(out, Rollouts) and len(out) == 9
    assert out.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert out.prompt_ids == [prompts[i] for i in out.prompt_index]
    assert all(len(r) == 6 for r, t in zip(out.response_ids, out.truncated, strict=True) if t)
    assert len({tuple(r) for r in out.response_ids[:3]}) > 1, "the n copies of a prompt must differ"


def test_left_padding_matches_unpadded(tiny):
    model, tok = tiny
    short, long = _prompts(tok, ["hi", "a much longer prompt that forces left padding"])
    config = generation_config(SamplingParams(8, temperature=0), [tok.eos_token_id], tok.pad_token_id)

    def run(prompts):
        ids, mask = left_pad(prompts, tok.pad_token_id, torch.device("cpu"))
        assert ids[0, -1].item() == prompts[0][-1] and mask.sum(1).tolist() == [len(p) for p in prompts]
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                output_logits=True,
                return_dict_in_generate=True,
            )
        return out.sequences[0, ids.shape[1] :], torch.stack(out.logits, 1)[0]

    alone_tokens, alone_logits = run([short])
    batch_tokens, batch_logits = run([short, long])
    assert torch.equal(alone_tokens, batch_tokens)
    assert torch.allclose(alone_logits, batch_logits, atol=1e-4)
    backend = make_backend("hf", model, tok)
    greedy = SamplingParams(8, temperature=0)
    assert (
        backend.generate([short], greedy, seed=0).response_ids[0]
        == (backend.generate([long, short], greedy, seed=0).response_ids[1])
    )


def test_micro_batches_do_not_change_greedy_output(tiny):
    model, tok = tiny
    prompts = _prompts(tok, ["a", "bb", "ccc", "dddd", "eeeee"])
    greedy = SamplingParams(6, temperature=0, n=2)
    whole = make_backend("hf", model, tok).generate(prompts, greedy, seed=0)
    split = make_backend("hf", model, tok, batch_size=3).generate(prompts, greedy, seed=0)
    assert whole.response_ids == split.response_ids and whole.prompt_index == split.prompt_index


def test_sampling_uses_temperature_and_top_p_only(tiny):
    """Processed scores are exactly log_softmax(logits / T): no hidden top_k=50 or penalties."""
    model, tok = tiny
    prompt = _prompts(tok, ["q"])
    config = generation_config(SamplingParams(4, temperature=0.7), [tok.eos_token_id], tok.pad_token_id)
    ids, mask = left_pad(prompt, tok.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
        )
    for raw, processed in zip(out.logits, out.scores, strict=True):
        assert torch.isfinite(processed).all(), "some tokens were masked out"
        assert torch.allclose(processed.log_softmax(-1), (raw / 0.7).log_softmax(-1), atol=1e-5)


def test_eos_truncation_and_truncated_flag():
    model, tok = build_tiny("tiny", seed=0)
    seen = script(model, tok, {"\n": "a", "a": "b", "b": "</s>", "x": "x"}, default="x")
    backend = make_backend("hf", model, tok)
    stops = encode_prompt(tok, "go")  # ends with "assistant\n" -> a, b, </s>
    loops = tok.encode("x", add_special_tokens=False)  # x -> x -> x ...
    out = backend.generate([stops, loops], SamplingParams(5, temperature=0), seed=0)
    eos = tok.eos_token_id
    assert out.response_ids[0] == [*tok.encode("ab", add_special_tokens=False), eos]
    assert out.truncated == [False, True]
    assert out.response_ids[1] == tok.encode("xxxxx", add_special_tokens=False)
    assert out.texts == ["ab", "xxxxx"]
    # KV cache: one prefill over the padded prompts, then single-token decode steps.
    assert seen[0] > 1 and set(seen[1:]) == {1}
    tight = backend.generate([stops], SamplingParams(2, temperature=0), seed=0)
    assert tight.truncated == [True] and tight.texts == ["ab"]


def test_pad_equal_to_eos_stops_at_first_eos():
    model, tok = build_tiny("tiny", seed=0, pad_is_eos=True)
    assert tok.pad_token_id == tok.eos_token_id == model.generation_config.pad_token_id
    script(model, tok, {"\n": "</s>", "k": "m", "m": "n", "n": "</s>", "x": "x"}, default="x")
    quick, slower, never = encode_prompt(tok, "q"), tok.encode("k"), tok.encode("x")
    out = make_backend("hf", model, tok).generate([quick, slower, never], SamplingParams(6, temperature=0), seed=0)
    eos = tok.eos_token_id
    assert out.response_ids[0] == [eos], "rows padded with eos after finishing must be cut at the first one"
    assert out.response_ids[1] == [*tok.encode("mn"), eos]
    assert out.truncated == [False, False, True] and out.texts == ["", "mn", "xxxxxx"]


def test_eval_mode_restored_and_sync_weights(tiny):
    model, tok = tiny
    backend = make_backend("hf", model, tok)
    model.train()
    try:
        backend.generate(_prompts(tok, ["a"]), SamplingParams(2), seed=0)
        assert model.training
    finally:
        model.eval()
    other, _ = load_model("tiny", seed=1)
    backend.sync_weights(other)
    assert backend.model is other
    assert len(backend.generate([], SamplingParams(2), seed=0)) == 0
    with pytest.raises(ValueError):
        backend.generate([[]], SamplingParams(2), seed=0)


def test_lora_model_generates():
    pytest.importorskip("peft")
    model, tok = load_model("tiny", seed=0)
    greedy = SamplingParams(5, temperature=0)
    prompts = _prompts(tok, ["a"])
    base = make_backend("hf", model, tok).generate(prompts, greedy, seed=0)
    peft_model = apply_lora(model, r=2)
    out = make_backend("hf", peft_model, tok, autocast="bfloat16").generate(prompts, greedy, seed=0)
    assert len(out.response_ids[0]) == len(base.response_ids[0])


def test_save_policy_merges_lora(tmp_path):
    """The directory handed to vLLM holds the adapted policy as a plain checkpoint."""
    pytest.importorskip("peft")
    model, tok = load_model("tiny", seed=0)
    model = apply_lora(model, r=2)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    save_policy(model, tok, tmp_path)
    loaded, tok2 = load_local(tmp_path, torch.float32)
    ids = torch.tensor([encode_prompt(tok, "abc")])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-4)
    assert tok2.eos_token_id == tok.eos_token_id


def test_vllm_backend_on_gpu(tmp_path):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a GPU")
    model, tok = load_model("tiny:medium", seed=0)
    backend = make_backend("vllm", model, tok, work_dir=tmp_path, enforce_eager=True, max_model_len=512)
    prompts = _prompts(tok, ["1+1?", "2+2?"])
    params = SamplingParams(16, temperature=1.0, n=3)
    out = backend.generate(prompts, params, seed=3)
    assert out.prompt_index == [0, 0, 0, 1, 1, 1]
    assert out.engine_logprobs is not None
    assert [len(lp) for lp in out.engine_logprobs] == [len(r) for r in out.response_ids]
    assert out.response_ids == backend.generate(prompts, params, seed=3).response_ids
    backend.sync_weights(model)
    backend.close()


class _FakeVLLM:
    """Stand-in for the ``vllm`` module: records what the backend asks, answers in vLLM's shapes.

    It checks our glue (request layout, eos cut, truncation, log-prob alignment, weight sync), not
    vLLM itself; the real engine is covered by ``test_vllm_backend_on_gpu`` where a GPU exists.
    """

    def __init__(self, eos: int, *, reloads: bool = True):
        self.eos, self.loaded, self.engines = eos, [], []
        fake = self

        class SamplingParams:
            def __init__(self, **kw):
                self.__dict__.update(kw)

        class LLM:
            def __init__(self, model, tokenizer, **kw):
                self.kw, self.model_dir, self.resets = kw, model, 0
                fake.engines.append(self)

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                if method != "reload_weights" or not reloads:  # what an older vLLM's worker says
                    raise AttributeError(f"'Worker' object has no attribute '{method}'")
                fake.loaded.append(dict(kwargs["weights_iterator"]))
                return [None]

            def reset_prefix_cache(self):
                self.resets += 1

            def generate(self, requests, sampling, use_tqdm=True):
                return [fake.answer(r["prompt_token_ids"], sp) for r, sp in zip(requests, sampling, strict=True)]

        self.LLM, self.SamplingParams = LLM, SamplingParams

    def answer(self, prompt, sp):
        outs = []
        for j in range(sp.n):
            # Sample j of each prompt: j+1 tokens then eos (vLLM keeps the eos), or a full-length run.
            body = [10 + j] * (j + 1)
            tokens = [*body, self.eos] if len(body) < sp.max_tokens else [10 + j] * sp.max_tokens
            finish = "stop" if tokens[-1] == self.eos else "length"
            logprobs = [{t: SimpleNamespace(logprob=-0.1 * (k + 1))} for k, t in enumerate(tokens)]
            outs.append(SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason=finish))
        return SimpleNamespace(outputs=outs)


@pytest.fixture()
def fork_flag(monkeypatch):
    """Building even a stand-in engine turns forking off for the process (forkpool.forbid_fork): keep that to
    the test, so that later tests in this process still get their worker processes."""
    from meshrl import forkpool

    monkeypatch.setattr(forkpool, "_FORK_UNSAFE", [])
    return forkpool


def test_vllm_glue_with_fake_engine(tmp_path, monkeypatch, fork_flag):
    model, tok = load_model("tiny", seed=0)
    fake = _FakeVLLM(tok.eos_token_id)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", SimpleNamespace(current_platform=SimpleNamespace(
        is_cpu=lambda: False)))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    backend = make_backend("vllm", model, tok, work_dir=tmp_path, max_model_len=256)
    assert not fork_flag.fork_available()  # nothing is forked beside an engine's threads
    engine = fake.engines[0]
    assert engine.kw == {"dtype": "bfloat16", "logprobs_mode": "processed_logprobs", "max_model_len": 256,
                         "gpu_memory_utilization": 0.3}
    reloaded, _ = load_local(engine.model_dir, torch.float32)  # the engine reads the current policy
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    out = backend.generate([[1, 2], [3]], SamplingParams(2, temperature=1.0, n=3), seed=5)
    eos = tok.eos_token_id
    assert out.prompt_index == [0, 0, 0, 1, 1, 1] and out.prompt_ids[3] == [3]
    assert out.response_ids[:3] == [[10, eos], [11, 11], [12, 12]]
    assert out.truncated[:3] == [False, True, True]
    assert out.engine_logprobs[0] == pytest.approx([-0.1, -0.2])
    assert [len(lp) for lp in out.engine_logprobs] == [len(r) for r in out.response_ids]
    backend.sync_weights(model)
    assert set(fake.loaded[0]) == set(model.state_dict()) and engine.resets == 1
    backend = make_backend("vllm", model, tok, work_dir=tmp_path, weight_sync="reload")
    backend.sync_weights(model)
    assert len(fake.engines) == 3
    backend.close()


def test_vllm_without_worker_reload_falls_back_to_rebuilding(tmp_path, monkeypatch, fork_flag):
    model, tok = load_model("tiny", seed=0)
    fake = _FakeVLLM(tok.eos_token_id, reloads=False)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", SimpleNamespace(current_platform=SimpleNamespace(
        is_cpu=lambda: False)))
    backend = make_backend("vllm", model, tok, work_dir=tmp_path, batch_size=64)  # batch_size: not vLLM's
    assert "batch_size" not in fake.engines[0].kw
    backend.sync_weights(model)
    backend.sync_weights(model)
    assert len(fake.engines) == 3 and not fake.loaded and backend.weight_sync == "reload"
    backend.close()
