"""Exact per-rollout Fisher scores of a tiny HF Llama (meshrl.diagnostics.fisher_scores)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from meshrl.diagnostics import count_sketch, coupling_kernel, fisher_scores

V = 50


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    B, L = 5, 11
    ids = torch.randint(0, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    am[0, :2] = 0  # left padding
    am[3, :1] = 0
    rm = torch.zeros(B, L)
    rm[:, 5:] = 1
    rm[1, 9:] = 0  # shorter response
    rm[4] = 0  # no response token: U = 0
    return ids, am, rm


def _reference(model, ids, am, rm, T=1.0):
    """Per-sample autograd on ONE batched forward (retain_graph), independent of the per-row forward."""
    params = [p for _, p in model.named_parameters()]
    logits = model(input_ids=ids, attention_mask=am).logits
    logp = torch.log_softmax(logits[:, :-1] / T, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    seq = (logp * rm[:, 1:]).sum(dim=1)
    rows = []
    for i in range(ids.shape[0]):
        grads = torch.autograd.grad(seq[i], params, retain_graph=True, allow_unused=True)
        flat = [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params, strict=True)]
        rows.append(torch.cat(flat))
    return torch.stack(rows)


def test_loop_equals_per_sample_autograd(model, batch):
    ids, am, rm = batch
    model.eval()
    ref = _reference(model, ids, am, rm, T=0.8)
    U = fisher_scores(model, ids, am, rm, temperature=0.8)
    n_params = sum(p.numel() for p in model.parameters())
    assert U.shape == (5, n_params)
    assert torch.allclose(U, ref, atol=2e-5, rtol=1e-4)
    assert U[4].abs().max() == 0


def test_vmap_equals_loop(model, batch):
    ids, am, rm = batch
    loop = fisher_scores(model, ids, am, rm)
    for chunk in (None, 2):
        vm = fisher_scores(model, ids, am, rm, method="vmap", vmap_chunk=chunk)
        assert torch.allclose(vm, loop, atol=2e-5, rtol=1e-4)


def test_params_subset_is_a_slice_and_mode_restored(model, batch):
    ids, am, rm = batch
    model.train()
    full = fisher_scores(model, ids, am, rm)
    assert model.training
    names = [n for n, _ in model.named_parameters()]
    pick = ["lm_head.weight", "model.layers.1.mlp.up_proj.weight"]
    sub = fisher_scores(model, ids, am, rm, params=list(reversed(pick)))
    offsets, cols = 0, []
    for n, p in model.named_parameters():
        if n in pick:
            cols.append(full[:, offsets : offsets + p.numel()])
        offsets += p.numel()
    assert names.index(pick[0]) > names.index(pick[1])  # output follows named_parameters() order
    assert torch.allclose(sub, torch.cat(cols, dim=1))


def test_sketch_error_bounded(model, batch):
    # Measured on this case at k=4096: relative Frobenius error of K about 0.02-0.03.
    ids, am, rm = batch
    U = fisher_scores(model, ids, am, rm)
    assert torch.equal(fisher_scores(model, ids, am, rm, sketch_dim=4096, seed=0), count_sketch(U, 4096, 0))
    K = coupling_kernel(U)[0]
    n = K.diagonal().sqrt()
    live = n > 0
    for seed in range(5):
        Ks = coupling_kernel(count_sketch(U, 4096, seed))[0]
        assert (Ks - K).norm() / K.norm() <= 0.1
        cos_err = (Ks - K)[live][:, live] / (n[live][:, None] * n[live][None])
        assert cos_err.abs().max() <= 0.1  # std bound sqrt(2/k) = 0.022


def test_count_sketch_unbiased_inner_products():
    g = torch.Generator().manual_seed(3)
    U = torch.randn(4, 3000, generator=g, dtype=torch.float64)
    K = U @ U.T
    mean = torch.stack([(z := count_sketch(U, 64, s)) @ z.T for s in range(400)]).mean(0)
    assert ((mean - K).abs() / K.diagonal().max()).max() < 0.03


def test_fisher_bad_inputs(model, batch):
    ids, am, rm = batch
    bad_rm = rm.clone()
    bad_rm[0, 0] = 1
    with pytest.raises(ValueError, match="response_mask"):
        fisher_scores(model, ids, am, bad_rm)
    bad_rm = rm.clone()
    bad_rm[0, 5] = 1
    bad_am = am.clone()
    bad_am[0, 5] = 0
    with pytest.raises(ValueError, match="response_mask"):
        fisher_scores(model, ids, bad_am, bad_rm)
    with pytest.raises(ValueError, match="attention_mask"):
        fisher_scores(model, ids, am[:, :-1], rm)
    with pytest.raises(ValueError, match="params"):
        fisher_scores(model, ids, am, rm, params=["nope"])
    with pytest.raises(ValueError, match="method"):
        fisher_scores(model, ids, am, rm, method="fast")
    with pytest.raises(ValueError, match="sketch_dim"):
        fisher_scores(model, ids, am, rm, sketch_dim=0)
    with pytest.raises(ValueError, match="model"):
        fisher_scores(lambda **_: None, ids, am, rm)
