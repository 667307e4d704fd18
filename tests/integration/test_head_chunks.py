"""train.head_chunk: log-probs and entropies from the output head in chunks (logits recomputed in the backward)
equal the plain path's, whole logits at once: values, gradients, the update's metrics and weights."""

from __future__ import annotations

import pytest
import torch

from meshrl.testing import TINY_RUN
from meshrl.trainer import Trainer, load_config, token_entropy, token_logprobs
from meshrl.trainer.head import chunked_token_terms, head_set_aside, output_head


class WrappedLinear(torch.nn.Linear):
    """A head that is not a plain nn.Linear (as a wrapped one would be): the checkpointed path."""


@pytest.mark.parametrize("head_class", [torch.nn.Linear, WrappedLinear])
@pytest.mark.parametrize("autocast_bf16", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_terms_equal_the_whole_logits(autocast_bf16: bool, temperature: float, head_class: type) -> None:
    from meshrl.trainer.head import fused_head

    g = torch.Generator().manual_seed(0)
    n, t, h, v = 3, 7, 16, 50
    head = head_class(h, v, bias=False)
    assert fused_head(head) == (head_class is torch.nn.Linear)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
    tokens = torch.randint(0, v, (n, t), generator=g)
    hidden = torch.randn(n, t, h, generator=g, requires_grad=True)
    weights = torch.randn(n, t, generator=g)  # a loss that weights every token differently

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        logits = head(hidden)
    logits = logits.float()
    want_lp, want_ent = token_logprobs(logits, tokens, temperature), token_entropy(logits, temperature)
    (want_lp * weights).sum().backward()
    want_dh, want_dw = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    lp, ent = chunked_token_terms(hidden, tokens, head, chunk=5, autocast_bf16=autocast_bf16,
                                  temperature=temperature)  # 21 tokens: chunks of 5, 5, 5, 5, 1
    assert ent is not None and not ent.requires_grad and lp.requires_grad
    (lp * weights).sum().backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hidden.grad, want_dh, atol=1e-6, rtol=1e-5)
    # The head's weight gradient sums over tokens: under autocast the whole path rounds that sum to bf16 once,
    # the chunked path once per chunk (then adds in float32), so the two agree to a few roundings of bf16 (2^-8).
    tol = 2**-6 * float(want_dw.abs().max()) if autocast_bf16 else 1e-6
    torch.testing.assert_close(head.weight.grad, want_dw, atol=tol, rtol=1e-5)
    with torch.no_grad():
        lp2, ent2 = chunked_token_terms(hidden, tokens, head, chunk=4, autocast_bf16=autocast_bf16,
                                        temperature=temperature, entropy=False)
    assert ent2 is None and not lp2.requires_grad
    torch.testing.assert_close(lp2, want_lp.detach(), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="train.head_chunk"):
        chunked_token_terms(hidden, tokens, head, chunk=0, autocast_bf16=False)


def test_the_head_set_aside_comes_back_tied() -> None:
    from meshrl.models import load_model

    model, _ = load_model("tiny", seed=0)
    head, name = output_head(model)
    assert name == "lm_head" and head.weight is model.get_input_embeddings().weight
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with head_set_aside(model) as aside:
            hidden = model(input_ids=ids).logits
            assert aside is head and hidden.shape[-1] == model.config.hidden_size
        assert model.lm_head is head
        torch.testing.assert_close(model(input_ids=ids).logits, want)
        torch.testing.assert_close(head(hidden), want)


TINY = [*TINY_RUN, "rollout.max_new_tokens=8", "optim.lr=1e-4"]


FP32 = 1e-6  # float32 forward: gradients and weights to ~1e-6
BF16 = 2**-6  # bf16 autocast: the head's weight gradient to a few bf16 roundings of its scale (see above)


@pytest.mark.parametrize(("extra", "tol"), [
    (["recipe=grpo", "train.update_workers=1"], FP32),  # serial engine: every row's backward here
    (["recipe=grpo", "train.update_workers=2", "train.micro_batch_size=8"], FP32),  # parts over a forked worker
    # reference and old-policy log-probs (no grad), several micro- and mini-batches, tempered sampling
    (["recipe=grpo_kl", "train.ppo_epochs=2", "train.mini_batches=2", "train.micro_batch_size=3",
      "rollout.temperature=0.8", "train.update_workers=1"], FP32),
    (["recipe=grpo", "train.autocast_bf16=true", "train.update_workers=1"], BF16),
    (["recipe=grpo_js", "algo.js_mode=exact", "train.update_workers=1"], FP32),  # reads the whole logits
    # LoRA: the head sits under peft's wrapper; the reference is the adapter-free base
    (["recipe=grpo_kl", "train.lora_r=4", "train.update_workers=1"], FP32),
])
def test_a_chunked_head_update_equals_the_whole_logits_update(tmp_path, extra: list[str], tol: float) -> None:
    plain = Trainer(load_config(overrides=[*TINY, *extra, "train.head_chunk=0"]), tmp_path / "plain")
    chunked = Trainer(load_config(overrides=[*TINY, *extra, "train.head_chunk=5"]), tmp_path / "chunked")
    try:
        assert chunked.forward.chunks_head(chunked.model) and not plain.forward.chunks_head(plain.model)
        data, _ = plain.sampler.run(0, 0)
        data.advantages = torch.randn(len(data), generator=torch.Generator().manual_seed(0))
        m_plain, m_chunked = plain.update(data), chunked.update(data)
        scale = max(float(p.grad.abs().max()) for p in plain.model.parameters() if p.grad is not None)
        lr = plain.cfg.optim.lr
        for p, q in zip(plain.model.parameters(), chunked.model.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, atol=tol * scale if tol == BF16 else tol, rtol=1e-5)
            # AdamW's first step moves a weight by ~lr * sign(grad): a bf16-rounded gradient near 0 may flip it. In
            # float32, over several steps (the third case: 4), a gradient near AdamW's eps amplifies its rounding:
            # seen 0.012 * lr (the fused head's log-normaliser is summed in another order than log_softmax's).
            torch.testing.assert_close(q, p, atol=2 * lr if tol == BF16 else max(tol, 0.05 * lr), rtol=1e-5)
        assert m_plain.keys() == m_chunked.keys()
        for key, value in m_plain.items():
            # grad/norm sums the gradients above, so it carries their tolerance
            rel = tol if key == "grad/norm" and tol == BF16 else 1e-5
            assert m_chunked[key] == pytest.approx(value, rel=rel, abs=1e-6), key
    finally:
        plain.close()
        chunked.close()


@pytest.mark.parametrize("path", ["fused", "checkpointed"])
def test_a_non_finite_log_prob_from_a_chunk_skips_the_step(tmp_path, monkeypatch, path: str) -> None:
    from meshrl.trainer import head

    if path == "fused":  # the tiny model's head is a plain nn.Linear: LinearTokenTerms
        real_apply = head.LinearTokenTerms.apply

        def poisoned_apply(*args):
            logp, entropy = real_apply(*args)
            return logp * float("nan"), entropy

        monkeypatch.setattr(head.LinearTokenTerms, "apply", poisoned_apply)
    else:  # any other head: checkpointed chunks of its own forward
        real = head._chunk_terms

        def poisoned(*args):
            logp, entropy = real(*args)
            return logp * float("nan"), entropy

        monkeypatch.setattr(head, "_chunk_terms", poisoned)
        monkeypatch.setattr(head, "fused_head", lambda module: False)
    t = Trainer(load_config(overrides=[*TINY, "train.head_chunk=5", "train.update_workers=1"]), tmp_path / "nan")
    try:
        data, _ = t.sampler.run(0, 0)
        data.advantages = torch.randn(len(data), generator=torch.Generator().manual_seed(0))
        before = [p.detach().clone() for p in t.model.parameters()]
        metrics = t.update(data)
        assert metrics["skipped/nonfinite"] == 1.0
        assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))
    finally:
        t.close()


@pytest.mark.parametrize("autocast_bf16", [False, True])
def test_the_fused_head_over_row_blocks_with_a_bias(monkeypatch, autocast_bf16: bool) -> None:
    """Several cache-sized row blocks per chunk and a head with a bias: values and the three gradients equal the
    autograd of the whole logits."""
    from meshrl.trainer import head as head_mod

    monkeypatch.setattr(head_mod, "BLOCK_BYTES", 3 * 4 * 64)  # 3 rows of a 64-token vocabulary per block
    g = torch.Generator().manual_seed(1)
    n, t, h, v = 2, 9, 8, 64
    head = torch.nn.Linear(h, v, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
        head.bias.copy_(torch.randn(v, generator=g))
    tokens = torch.randint(0, v, (n, t), generator=g)
    hidden = torch.randn(n, t, h, generator=g, requires_grad=True)
    weights = torch.randn(n, t, generator=g)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        logits = head(hidden)
    logits = logits.float()
    want_lp, want_ent = token_logprobs(logits, tokens, 0.9), token_entropy(logits, 0.9)
    (want_lp * weights).sum().backward()
    want = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None
    lp, ent = chunked_token_terms(hidden, tokens, head, chunk=7, autocast_bf16=autocast_bf16, temperature=0.9)
    (lp * weights).sum().backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    for got, exp in zip([hidden.grad, head.weight.grad, head.bias.grad], want, strict=True):
        tol = 2**-6 * float(exp.abs().max()) if autocast_bf16 else 1e-5
        torch.testing.assert_close(got, exp, atol=tol, rtol=1e-5)


@pytest.mark.parametrize("autocast_bf16", [False, True])
def test_kept_logits_give_the_recomputed_gradients_bit_for_bit(monkeypatch, autocast_bf16: bool) -> None:
    """train.head_keep_mib: logits kept from the forward, or recomputed in the backward, are the same matmul on the
    same inputs, so the gradients agree exactly; a budget too small for them recomputes; no graph keeps nothing."""
    from meshrl.trainer import head as head_mod

    g = torch.Generator().manual_seed(2)
    n, t, h, v = 2, 11, 8, 40
    head = torch.nn.Linear(h, v, bias=False)
    tokens = torch.randint(0, v, (n, t), generator=g)
    base = torch.randn(n, t, h, generator=g)
    weights = torch.randn(n, t, generator=g)
    matmuls = []
    real_linear = head_mod.F.linear
    monkeypatch.setattr(head_mod.F, "linear", lambda *a: matmuls.append(1) or real_linear(*a))

    def run(keep_mib: float):
        hidden = base.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        matmuls.clear()
        lp, ent = chunked_token_terms(hidden, tokens, head, chunk=6, autocast_bf16=autocast_bf16, temperature=0.8,
                                      keep_mib=keep_mib)
        (lp * weights).sum().backward()
        return lp.detach(), ent, hidden.grad, head.weight.grad, len(matmuls)

    need = n * t * v * (2 if autocast_bf16 else 4) / 2**20  # MiB of the kept logits
    recomputed, kept, too_small = run(0), run(need), run(need * 0.99)
    assert recomputed[-1] == 8 and kept[-1] == 4 and too_small[-1] == 8  # 4 chunks: forward + backward each
    for a, b in zip(recomputed[:4], kept[:4], strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # no graph: nothing to keep for
        lp, _ = chunked_token_terms(base, tokens, head, chunk=6, autocast_bf16=autocast_bf16, temperature=0.8,
                                    keep_mib=1e6)
    torch.testing.assert_close(lp, recomputed[0], atol=0, rtol=0)


@pytest.mark.parametrize("head_class", [torch.nn.Linear, WrappedLinear])
def test_positions_skip_the_padding_and_keep_the_rest(head_class: type) -> None:
    """positions: only a micro-batch's real response tokens go through the head; their log-probs, entropies and
    gradients are those of the full computation, the padding's are 0 (and give no gradient)."""
    g = torch.Generator().manual_seed(3)
    n, t, h, v = 3, 8, 16, 30
    head = head_class(h, v, bias=False)
    tokens = torch.randint(0, v, (n, t), generator=g)
    positions = torch.arange(t)[None, :] < torch.tensor([8, 3, 5])[:, None]  # right padding after each row
    weights = torch.randn(n, t, generator=g) * positions
    base = torch.randn(n, t, h, generator=g)

    def run(pos):
        hidden = base.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        lp, ent = chunked_token_terms(hidden, tokens, head, chunk=4, autocast_bf16=False, positions=pos)
        (lp * weights).sum().backward()
        return lp.detach(), ent, hidden.grad, head.weight.grad

    full, skipped = run(None), run(positions)
    for a, b in zip(full[:2], skipped[:2], strict=True):
        torch.testing.assert_close(b[positions], a[positions], atol=1e-6, rtol=1e-6)
        assert torch.all(b[~positions] == 0)
    torch.testing.assert_close(skipped[2], full[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(skipped[3], full[3], atol=1e-6, rtol=1e-5)


def test_positions_with_no_real_token_fall_back_to_every_position() -> None:
    """A micro-batch whose responses are all empty still gives log-probs with a graph (every position, as before
    positions existed), on both head paths."""
    for head_class in (torch.nn.Linear, WrappedLinear):
        head = head_class(4, 9, bias=False)
        hidden = torch.randn(2, 3, 4, requires_grad=True)
        tokens = torch.zeros(2, 3, dtype=torch.long)
        nothing = torch.zeros(2, 3, dtype=torch.bool)
        lp, _ = chunked_token_terms(hidden, tokens, head, chunk=4, autocast_bf16=False, positions=nothing)
        want, _ = chunked_token_terms(hidden, tokens, head, chunk=4, autocast_bf16=False)
        assert lp.requires_grad and torch.equal(lp, want)
