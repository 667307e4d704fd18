"""The native decoder's prepacked oneDNN GEMMs (meshrl.models.llama_fast.PrepackedGemm): equal to ``F.linear``
(bit for bit in bf16), copies taken at construction, float32 copies where the CPU has no bf16 kernels, the same
samples as the plain decoder, used only where blocks are plain and large enough, and the setting reaching the
backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshrl import cpu
from meshrl.models import apply_lora, encode_prompt, llama_fast, load_model
from meshrl.rollout import SamplingParams
from meshrl.rollout.native import NativeDecodeBackend
from meshrl.testing import family_model


@pytest.fixture(scope="module")
def small():
    return load_model("tiny:small", seed=0)


def _prompts(tok, texts: list[str]) -> list[list[int]]:
    return [encode_prompt(tok, t) for t in texts]


needs_onednn = pytest.mark.skipif(not llama_fast.prepack_available(torch.device("cpu")),
                                  reason="torch built without oneDNN")
# oneDNN's bf16 reorder and GEMMs need AVX-512 BW/VL/DQ or AVX-NE-CONVERT (PyTorch's own check, meshrl.cpu); a CPU
# without them takes the float32 prepack instead, tested on every CPU below.
needs_bf16_gemm = pytest.mark.skipif(not cpu.bf16_gemm_native(),
                                     reason=f"no oneDNN bf16 kernels on this CPU (capability {cpu.capability()})")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_gemm)])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_gemm_equals_f_linear(dtype, bias):
    """oneDNN on a prepacked weight: ``F.linear`` to float32 rounding (bit for bit in bf16), for 2-D and 3-D
    inputs and every row count the decoder feeds it (one row to a prefill); ``add_to`` is the residual sum."""
    torch.manual_seed(0)
    w = (0.05 * torch.randn(96, 40)).to(dtype)
    b = torch.randn(96).to(dtype) if bias else None
    plain, packed = llama_fast.Gemm(w, b), llama_fast.PrepackedGemm(w, b)
    with torch.inference_mode():
        for shape in [(1, 40), (5, 40), (16, 40), (3, 7, 40), (200, 40)]:
            x = torch.randn(shape).to(dtype)
            residual = torch.randn(*shape[:-1], 96).to(dtype)
            if dtype == torch.bfloat16:
                assert torch.equal(packed(x), plain(x))
            else:
                torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
                assert packed(x).dtype == torch.float32
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(packed.add_to(residual, x), residual + plain(x), rtol=tol, atol=tol)


@needs_onednn
def test_prepacked_gemm_takes_a_copy():
    """The packed copy is the weight at construction (a later optimiser step needs a new runner)."""
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    fp = llama_fast.PrepackedGemm(w, None)
    before = fp(x)
    w.add_(1.0)
    assert torch.equal(fp(x), before)


@needs_onednn
@needs_bf16_gemm
def test_prepacked_gemm_casts_its_input():
    """A float32 input meets bf16 weights as autocast would cast it."""
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    packed = llama_fast.PrepackedGemm(w.to(torch.bfloat16), None)
    assert torch.equal(packed(x), F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)))


@needs_onednn
def test_without_bf16_kernels_the_prepack_stays_float32(small, monkeypatch, caplog):
    """Where oneDNN has no bf16 kernels (AVX2 without AVX-512) the decoder under bf16 autocast prepacks float32
    copies instead of crashing in the reorder, says why once, and still agrees with the model's own forward
    (the backend's check) and samples like the unpacked bf16 decoder up to bf16 rounding."""
    monkeypatch.setattr(llama_fast, "PREPACK_MIN_HIDDEN", 0)
    monkeypatch.setattr(llama_fast, "_said_fallback", False)
    monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: False)
    model, tok = small
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), caplog.at_level("INFO", "meshrl"):
        runner = llama_fast.LlamaRunner(model, 16, torch.device("cpu"), prepack=True)
        llama_fast.LlamaRunner(model, 16, torch.device("cpu"), prepack=True)
    assert runner.prepacked and runner.packed[0].qkv.dtype == torch.float32
    assert runner.packed[0].down.dtype == torch.float32 and runner.head_gemm.dtype == torch.float32
    said = [r.getMessage() for r in caplog.records if "prepacked GEMMs in float32" in r.getMessage()]
    assert len(said) == 1 and "bf16" in said[0]
    prompts = _prompts(tok, ["1+2=", "Repeat: hello there", "x"])
    params = SamplingParams(max_new_tokens=12, n=3, temperature=0.8)
    backend = NativeDecodeBackend(model, tok, workers=1, autocast="bfloat16", prepack=True)
    assert backend.verify(prompts) < 0.5
    packed = backend.generate(prompts, params, seed=4)
    plain = NativeDecodeBackend(model, tok, workers=1, autocast="bfloat16", prepack=False).generate(prompts, params,
                                                                                                      seed=4)
    matched = 0
    for ids_a, ids_b, lp_a, lp_b in zip(plain.response_ids, packed.response_ids, plain.engine_logprobs,
                                        packed.engine_logprobs, strict=True):
        n = min(len(ids_a), len(ids_b))
        same = next((i for i in range(n) if ids_a[i] != ids_b[i]), n)
        torch.testing.assert_close(torch.tensor(lp_a[:same]), torch.tensor(lp_b[:same]), atol=0.05, rtol=0)
        matched += same
    assert matched >= sum(map(len, plain.response_ids)) // 2
    monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: True)
    assert llama_fast.prepacked_dtype(torch.bfloat16) is torch.bfloat16
    assert llama_fast.prepacked_dtype(None) is None


@needs_onednn
@pytest.mark.parametrize("kind", ["tiny:small", "qwen2", "llama+bias", "qwen3"])
def test_prepacked_decoder_same_samples(kind, small, monkeypatch):
    """The native backend with and without prepacked weights: under bf16 autocast the same samples and
    log-probs bit for bit; in float32 log-probs to float rounding (and, on these models, the same samples)."""
    monkeypatch.setattr(llama_fast, "PREPACK_MIN_HIDDEN", 0)  # these models are below it
    model, tok = small if kind == "tiny:small" else family_model(kind)
    prompts = _prompts(tok, ["1+2=", "Repeat: hello there", "x"])
    params = SamplingParams(max_new_tokens=12, n=3, temperature=0.8)
    for autocast in ("bfloat16", None) if cpu.bf16_gemm_native() else (None,):  # else: the float32 prepack test
        outs = []
        for prepack in (False, True):
            backend = NativeDecodeBackend(model, tok, workers=1, autocast=autocast, prepack=prepack)
            outs.append(backend.generate(prompts, params, seed=4))
        plain, packed = outs
        assert plain.response_ids == packed.response_ids
        if autocast:
            assert plain.engine_logprobs == packed.engine_logprobs
        else:
            for a, b in zip(plain.engine_logprobs, packed.engine_logprobs, strict=True):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


@needs_onednn
def test_prepack_only_where_blocks_are_plain_and_large_enough(small, monkeypatch):
    """LoRA layers are not plain ``nn.Linear``: no prepacking (the module path runs); a plain model prepacks
    every projection and the head from PREPACK_MIN_HIDDEN on, and not without the flag."""
    model, _ = small
    assert not llama_fast.LlamaRunner(model, 16, torch.device("cpu"), prepack=True).prepacked  # hidden 128
    monkeypatch.setattr(llama_fast, "PREPACK_MIN_HIDDEN", 128)
    with torch.inference_mode():
        runner = llama_fast.LlamaRunner(model, 16, torch.device("cpu"), prepack=True)
        assert runner.prepacked and isinstance(runner.packed[0].down, llama_fast.PrepackedGemm)
        assert runner.head_gemm is not None
        assert not llama_fast.LlamaRunner(model, 16, torch.device("cpu")).prepacked
        lora = apply_lora(load_model("tiny:small", seed=1)[0], r=2, alpha=4)
        lora_runner = llama_fast.LlamaRunner(lora, 16, torch.device("cpu"), prepack=True)
        assert not lora_runner.prepacked and lora_runner.head_gemm is None


@pytest.mark.parametrize("backend", ["native", "auto"])
def test_config_passes_prepack_to_the_native_backend(tmp_path, backend):
    from meshrl.testing import TINY_RUN
    from meshrl.trainer import Trainer, load_config

    for flag in (True, False):
        cfg = load_config(overrides=[*TINY_RUN, f"rollout.backend={backend}",
                                     f"rollout.prepack_weights={str(flag).lower()}"])
        t = Trainer(cfg, tmp_path / f"{backend}{flag}")
        assert t.backend.name == "native" and t.backend.prepack is flag
        t.close()
