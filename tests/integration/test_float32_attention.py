"""meshrl.trainer.float32_attention: under bf16 autocast on a CPU the update's attention runs in float32. It must
change only forwards that build a graph under autocast, agree with the bf16 path to bf16 rounding, be no further
from a float32 model than the bf16 path is, and leave transformers' attention registry as it found it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config
from meshrl.trainer.float32_attention import float32_attention


def _model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))


def _run(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, *, autocast: bool, fp32_attention: bool):
    """log-softmax of the logits and the gradients of a fixed loss of them."""
    model.zero_grad(set_to_none=True)
    with float32_attention(fp32_attention), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=mask).logits
    logp = logits.float().log_softmax(-1)
    weights = torch.linspace(-1.0, 1.0, logp.shape[-1])
    (logp * weights * mask[..., None]).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_float32_attention_is_as_exact_as_the_bf16_path(kind: str) -> None:
    model = _model(kind)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: a real mask reaches the kernel
    exact_lp, exact_grads = _run(model, ids, mask, autocast=False, fp32_attention=False)
    bf16_lp, bf16_grads = _run(model, ids, mask, autocast=True, fp32_attention=False)
    f32_lp, f32_grads = _run(model, ids, mask, autocast=True, fp32_attention=True)
    keep = mask.bool()
    assert not torch.equal(f32_lp, bf16_lp)  # it did run something else
    torch.testing.assert_close(f32_lp[keep], bf16_lp[keep], atol=0.05, rtol=0.05)  # bf16 rounding apart

    def err(lp: torch.Tensor) -> float:
        return float((lp - exact_lp)[keep].abs().mean())

    # No further from the float32 model than the bf16 path (seen 2-4% closer in log-probs): the projections' bf16
    # matmuls, unchanged here, make most of both paths' distance, so the margin is small either way.
    assert err(f32_lp) <= 1.02 * err(bf16_lp)

    def grad_err(grads: dict[str, torch.Tensor]) -> float:
        return sum(float((grads[n] - g).norm() / g.norm()) for n, g in exact_grads.items())

    assert grad_err(f32_grads) <= 1.05 * grad_err(bf16_grads)


def test_float32_attention_leaves_other_forwards_and_the_registry_alone() -> None:
    model = _model("llama")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    plain = ALL_ATTENTION_FUNCTIONS["sdpa"]
    had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    for autocast in (False, True):  # no graph: bit for bit the plain forward, with or without autocast
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            want = model(input_ids=ids).logits
            with float32_attention():
                got = model(input_ids=ids).logits
        assert torch.equal(got, want)
    with torch.autocast("cpu", enabled=False):  # a graph but no autocast: unchanged too
        want = model(input_ids=ids).logits
        with float32_attention():
            got = model(input_ids=ids).logits
    assert torch.equal(got, want)
    with float32_attention(enabled=False):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is plain
    with pytest.raises(RuntimeError, match="boom"), float32_attention():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not plain
        raise RuntimeError("boom")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is plain  # restored after an error
    assert ("sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping) == had_local


def test_a_training_step_with_float32_attention_matches_the_bf16_one(tmp_path) -> None:
    """train.float32_attention on and off under bf16 autocast: the same rollouts give updates that agree to
    bf16 rounding (the weights move by ~lr either way)."""
    base = [*TINY_RUN, "rollout.max_new_tokens=8", "optim.lr=1e-4", "train.autocast_bf16=true",
            "train.update_workers=1"]
    on = Trainer(load_config(overrides=[*base, "train.float32_attention=true"]), tmp_path / "on")
    off = Trainer(load_config(overrides=[*base, "train.float32_attention=false"]), tmp_path / "off")
    try:
        data, _ = off.sampler.run(0, 0)
        data.advantages = torch.randn(len(data), generator=torch.Generator().manual_seed(0))
        m_off, m_on = off.update(data), on.update(data)
        assert m_on["loss/total"] == pytest.approx(m_off["loss/total"], rel=0.02, abs=1e-4)
        assert m_on["grad/norm"] == pytest.approx(m_off["grad/norm"], rel=0.05)
        lr = off.cfg.optim.lr
        for p, q in zip(off.model.parameters(), on.model.parameters(), strict=True):
            torch.testing.assert_close(q, p, atol=2 * lr, rtol=0)
    finally:
        on.close()
        off.close()


def test_float32_attention_is_deterministic_and_bounded(monkeypatch) -> None:
    """The same forward and backward twice give the same bits (float32 flash attention's backward did not, inside
    the update), and a layer whose scores pass MAX_SCORE_BYTES runs the plain bf16 path, bit for bit."""
    from meshrl.trainer import float32_attention as mod

    model = _model("llama")
    ids = torch.randint(0, 97, (4, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[2, :7] = 0
    first = _run(model, ids, mask, autocast=True, fp32_attention=True)
    second = _run(model, ids, mask, autocast=True, fp32_attention=True)
    assert torch.equal(first[0], second[0]) and all(torch.equal(first[1][n], second[1][n]) for n in first[1])
    monkeypatch.setattr(mod, "MAX_SCORE_BYTES", 4 * 4 * 30 * 30 * 4 - 1)  # rows x heads x 30 x 30 float32, less 1
    bounded = _run(model, ids, mask, autocast=True, fp32_attention=True)
    plain = _run(model, ids, mask, autocast=True, fp32_attention=False)
    assert torch.equal(bounded[0], plain[0]) and all(torch.equal(bounded[1][n], plain[1][n]) for n in plain[1])
    assert not torch.equal(first[0], plain[0])


def _attention_inputs(b: int, heads: int, kv_heads: int, t: int, s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, t, 16, generator=g)
    k = torch.randn(b, kv_heads, s, 16, generator=g)
    v = torch.randn(b, kv_heads, s, 16, generator=g).bfloat16()  # the value projection's autocast output
    return [x.requires_grad_() for x in (q, k, v)]


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _reference(q, k, v, allowed):
    """The float32 math kernel on repeated keys and values, as transformers' sdpa function runs it."""
    group = q.shape[1] // k.shape[1]
    kr, vr = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), kr, vr, attn_mask=allowed,
                                                               is_causal=allowed is None, scale=0.25)
    return out.transpose(1, 2).bfloat16()


@pytest.mark.parametrize("case", ["causal", "mask", "mask-broadcast"])
def test_grouped_float32_attention_matches_the_math_kernel(case: str) -> None:
    """The update's own float32 attention (heads grouped over shared keys, only the inputs and the softmax kept)
    gives the math kernel's outputs and gradients to float32 rounding, including a query row with no key allowed
    (zeros, not NaN) and a mask shared by every row."""
    from meshrl.trainer.float32_attention import _grouped_attention

    b, t, s = 3, 7, (7 if case == "causal" else 11)
    allowed = None
    if case != "causal":
        allowed = torch.rand(b if case == "mask" else 1, 1, t, s, generator=torch.Generator().manual_seed(4)) > 0.3
        allowed[0, 0, 2] = False  # a row with nothing to attend to
    got_in = _attention_inputs(b, 6, 2, t, s, 3)
    want_in = [x.detach().clone().requires_grad_() for x in got_in]
    got = _grouped_attention(_Layer(3), *got_in, allowed, 0.25, torch.bfloat16)
    want = _reference(*want_in, allowed)
    assert got.shape == want.shape == (b, t, 6, 16) and got.dtype == torch.bfloat16
    assert not got.float().isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)  # outputs rounded to bf16 alike
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))
    (got.float() * weights).sum().backward()
    (want.float() * weights).sum().backward()
    for mine, theirs in zip(got_in, want_in, strict=True):
        assert mine.grad.dtype == mine.dtype and not mine.grad.float().isnan().any()
        tol = 1e-5 if mine.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(mine.grad, theirs.grad, atol=tol, rtol=tol)


def test_grouped_float32_attention_keeps_its_inputs_and_the_softmax_only() -> None:
    """What the backward keeps: the inputs as given and one float32 softmax, never the math kernel's float32
    copies of repeated keys and values (the memory the update's peak would otherwise carry per layer)."""
    from meshrl.trainer.float32_attention import _grouped_attention

    def saved_bytes(fn) -> int:
        seen: dict[int, int] = {}

        def pack(x: torch.Tensor) -> torch.Tensor:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn()
        return sum(seen.values())

    b, heads, kv_heads, t, s = 4, 8, 2, 24, 40
    q, k, v = _attention_inputs(b, heads, kv_heads, t, s, 6)
    allowed = torch.ones(b, 1, t, s, dtype=torch.bool)
    mine = saved_bytes(lambda: _grouped_attention(_Layer(heads // kv_heads), q, k, v, allowed, 0.25, torch.bfloat16))
    math = saved_bytes(lambda: _reference(q, k, v, allowed))
    inputs = sum(x.numel() * x.element_size() for x in (q, k, v))
    assert mine == inputs + b * heads * t * s * 4
    assert mine < 0.75 * math


def test_grouped_float32_attention_runs_in_the_model_and_declines_what_it_does_not_reproduce(monkeypatch) -> None:
    """A Llama forward under autocast with a graph takes the grouped path in every layer, padded or not; an
    additive (float) mask, or keys longer than queries without a mask, go to the math kernel instead."""
    from meshrl.trainer import float32_attention as mod

    calls: list[bool] = []
    real = mod._grouped_attention

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(mod, "_grouped_attention", spy)
    model = _model("llama")
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    _run(model, ids, mask, autocast=True, fp32_attention=True)
    mask[1, :4] = 0
    _run(model, ids, mask, autocast=True, fp32_attention=True)
    assert calls == [True] * 4  # two layers, two forwards
    q, k, v = _attention_inputs(1, 4, 2, 5, 9, 8)
    assert real(_Layer(2), q, k, v, None, 0.25, torch.bfloat16) is None
    assert real(_Layer(2), q, k, v, torch.zeros(1, 1, 5, 9), 0.25, torch.bfloat16) is None
