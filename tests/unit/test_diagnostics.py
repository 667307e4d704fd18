"""MEI, the bias/head feature maps, the coupling kernel and epsilon-strategies (meshrl.diagnostics)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.diagnostics import (
    bias_features,
    coupling_kernel,
    epsilon_partition,
    group_mei,
    head_gram,
    kernel_distance,
    mean_pairwise_cosine,
    mei_from_gram,
    mei_key,
    mei_metrics,
    normalise_kernel,
    strategy_masses,
)
from meshrl.diagnostics.mei import gram_matrix


def orthonormal(n: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(dim, n, generator=gen, dtype=torch.float64))
    return q.T  # [n, dim], orthonormal rows


# ---------------------------------------------------------------- MEI


def test_mei_orthogonal_identical_and_clusters(gen):
    G = 16
    assert mei_from_gram(gram_matrix(orthonormal(G, 32, gen) * 3.0)) == pytest.approx(1.0)
    same = torch.randn(1, 20, generator=gen).repeat(G, 1)
    assert mei_from_gram(gram_matrix(same)) == pytest.approx(G)
    for c in (1, 2, 4, 8, 16):
        feats = orthonormal(c, 32, gen).repeat_interleave(G // c, dim=0)
        r = group_mei(feats, [0] * G)
        assert r["mei"][0].item() == pytest.approx(G / c)
        assert r["g_over_mei"][0].item() == pytest.approx(c)
        assert r["directions"][0].item() == pytest.approx(c)
        assert r["mean_cos"][0].item() == pytest.approx((G // c - 1) / (G - 1), abs=1e-12)
        # equal norms: the approximation (MEI-1)/(G-1) is the exact mean cosine
        assert r["approx_cos"][0].item() == pytest.approx(r["mean_cos"][0].item(), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    G=st.integers(1, 10),
    F=st.integers(1, 6),
    data=st.data(),
)
def test_mei_in_range_property(G, F, data):
    vals = data.draw(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=G * F, max_size=G * F))
    feats = torch.tensor(vals, dtype=torch.float64).reshape(G, F)
    mei = mei_from_gram(gram_matrix(feats))
    if float((feats**2).sum()) == 0:
        assert math.isnan(mei)
    else:
        assert -1e-9 <= mei <= G * (1 + 1e-9)


def test_mean_pairwise_cosine_matches_explicit(gen):
    f = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    f[3] = 0  # zero feature: excluded from the cosine
    keep = [i for i in range(7) if i != 3]
    cos = torch.nn.functional.cosine_similarity(f[keep][:, None], f[keep][None], dim=-1)
    expect = (cos.sum() - cos.trace()) / (6 * 5)
    assert mean_pairwise_cosine(gram_matrix(f)) == pytest.approx(float(expect))


def test_undefined_cases_are_nan():
    assert math.isnan(mei_from_gram(torch.zeros(3, 3)))
    r = group_mei(torch.ones(1, 4), ["q"])
    assert r["mei"][0].item() == 1.0 and math.isnan(r["approx_cos"][0].item()) and math.isnan(r["mean_cos_mean"])


def test_group_mei_any_grouping_and_gram_input(gen):
    f = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    ids = ["b", "a", "b", "c", "a", "b", "c", "a", "c"]  # not contiguous
    r = group_mei(f, ids)
    assert r["labels"] == ["b", "a", "c"] and r["size"].tolist() == [3, 3, 3]
    for g, lab in enumerate(r["labels"]):
        rows = [i for i, x in enumerate(ids) if x == lab]
        assert r["mei"][g].item() == pytest.approx(mei_from_gram(gram_matrix(f[rows])))
    rg = group_mei(gram_matrix(f), ids, is_gram=True)
    assert torch.allclose(rg["mei"], r["mei"]) and rg["mei_mean"] == pytest.approx(r["mei"].mean().item())


def test_mei_metrics_scales_mesh_layout(gen):
    # 2 queries x 4 prefixes x 4 rollouts; query 0 fully collapsed, query 1 collapsed inside each prefix
    # group with orthogonal groups. Prefix ids repeat across queries and must be paired with the query.
    G, m = 16, 4
    q = torch.arange(2).repeat_interleave(G)
    p = torch.arange(m).repeat_interleave(G // m).repeat(2)
    feats = torch.cat([torch.randn(1, 32, generator=gen).repeat(G, 1), orthonormal(m, 32, gen).repeat_interleave(4, 0)])
    out = mei_metrics(feats, q, p, feature="bias")
    assert out[mei_key("bias", "query")] == pytest.approx((16 + 4) / 2)
    assert out["mei/bias/query_max"] == pytest.approx(16)
    assert out["mei/bias/query_g_over_mei"] == pytest.approx((1 + 4) / 2)
    assert out["mei/bias/query_directions"] == pytest.approx((1 + 4) / 2)
    assert out["mei/bias/query_group_size"] == 16 and out["mei/bias/query_n_groups"] == 2
    assert out["mei/bias/prefix_group"] == pytest.approx(4) and out["mei/bias/prefix_group_n_groups"] == 8
    assert out["mei/bias/prefix_group_g_over_mei"] == pytest.approx(1)
    assert out["mei/bias/prefix_group_directions"] == pytest.approx(1)
    assert all(k.startswith("mei/bias/") for k in out) and all(isinstance(v, float) for v in out.values())
    gram_out = mei_metrics(gram_matrix(feats), q.tolist(), p.tolist(), feature="head", is_gram=True)
    assert gram_out["mei/head/query"] == pytest.approx(out["mei/bias/query"])
    assert set(mei_metrics(feats, q)) == {k for k in out if "/query" in k}


def test_mei_bad_inputs():
    with pytest.raises(ValueError, match="gram"):
        mei_from_gram(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="gram"):
        mei_from_gram(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="group_ids"):
        group_mei(torch.ones(3, 2), [0, 1])
    with pytest.raises(ValueError, match="prefix_ids"):
        mei_metrics(torch.ones(4, 2), [0, 0, 1, 1], [0, 1])
    with pytest.raises(ValueError, match="query_ids"):
        mei_metrics(torch.ones(4, 2), [0, 0, 1])
    with pytest.raises(ValueError, match="feature"):
        mei_metrics(torch.ones(4, 2), [0, 0, 1, 1], feature="a/b")
    with pytest.raises(ValueError, match="phi"):
        mei_metrics(torch.ones(4, 3), [0, 0, 1, 1], is_gram=True)


# ---------------------------------------------------------------- bias / head feature maps


def _batch(gen: torch.Generator, B=5, T=9, V=23, D=7):
    hidden = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    W = torch.randn(V, D, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.3).long()
    mask[2] = 0  # a rollout with no response token: phi = 0
    tokens = torch.where(mask.bool(), tokens, torch.full_like(tokens, -100))  # padding ids are ignored
    return hidden, W, tokens, mask


def test_bias_features_is_gradient_wrt_logit_bias(gen):
    hidden, W, tokens, mask = _batch(gen)
    logits, T = hidden @ W.T, 0.7
    expect = []
    for i in range(logits.shape[0]):
        b = torch.zeros(logits.shape[-1], dtype=torch.float64, requires_grad=True)
        lp = torch.log_softmax(logits[i] / T + b, dim=-1).gather(-1, tokens[i].clamp(min=0)[:, None]).squeeze(-1)
        (g,) = torch.autograd.grad((lp * mask[i]).sum(), b)
        expect.append(g)
    expect = torch.stack(expect)
    for chunk in (1, 4, 100):
        assert torch.allclose(bias_features(logits, tokens, mask, temperature=T, chunk_size=chunk), expect, atol=1e-12)
    out16 = bias_features(logits.to(torch.bfloat16), tokens, mask, temperature=T)
    assert out16.dtype == torch.float32 and torch.allclose(out16.double(), expect, atol=0.05)


def _explicit_head_gram(hidden, W, tokens, mask, T):
    phis = []
    for i in range(hidden.shape[0]):
        Wr = W.clone().requires_grad_(True)
        lp = torch.log_softmax(hidden[i] @ Wr.T / T, dim=-1).gather(-1, tokens[i].clamp(min=0)[:, None]).squeeze(-1)
        (g,) = torch.autograd.grad((lp * mask[i]).sum(), Wr)
        phis.append((g * T).reshape(-1))  # phi_head = T * dlogpi/dW
    return gram_matrix(torch.stack(phis))


def test_head_gram_exact_equals_explicit_unembedding_gradient(gen):
    hidden, W, tokens, mask = _batch(gen)
    T = 0.7
    expect = _explicit_head_gram(hidden, W, tokens, mask, T)
    for chunk in (1, 5, 1000):
        got = head_gram(hidden @ W.T, tokens, hidden, mask, temperature=T, chunk_size=chunk)
        assert got.dtype == torch.float64 and torch.allclose(got, expect, rtol=1e-10, atol=1e-10)
    assert expect[2].abs().max() == 0  # the empty rollout


def test_head_gram_sketch_error_bounded(gen):
    # Measured (B=6, T=12, V=50, D=16, k=2048, 30 seeds): relative Frobenius error mean 0.056 / max 0.080,
    # max cosine-scale error mean 0.061 / max 0.111; per-entry variance * k / (Phi_ii Phi_jj) <= 2.9.
    hidden, W, tokens, mask = _batch(gen, B=6, T=12, V=50, D=16)
    logits = hidden @ W.T
    exact = head_gram(logits, tokens, hidden, mask)
    norms = exact.diagonal().sqrt()
    sketches = [head_gram(logits, tokens, hidden, mask, proj_dim=2048, seed=s) for s in range(4)]
    for sk in sketches:
        assert (sk - exact).norm() / exact.norm() <= 0.2
        live = norms > 0
        cos_err = (sk - exact)[live][:, live] / (norms[live][:, None] * norms[live][None, :])
        assert cos_err.abs().max() <= 0.2
    assert torch.equal(sketches[0], head_gram(logits, tokens, hidden, mask, proj_dim=2048, seed=0))
    assert not torch.equal(sketches[0], sketches[1])
    mean_err = (torch.stack(sketches).mean(0) - exact).norm() / exact.norm()
    assert mean_err <= 0.1  # unbiased: averaging seeds shrinks the error


def test_feature_bad_inputs(gen):
    hidden, W, tokens, mask = _batch(gen)
    logits = hidden @ W.T
    with pytest.raises(ValueError, match="mask"):
        bias_features(logits, tokens, mask[:, :-1])
    with pytest.raises(ValueError, match="tokens"):
        bias_features(logits, tokens[:, :-1], mask)
    with pytest.raises(ValueError, match="tokens"):
        bias_features(logits, torch.where(mask.bool(), 999, tokens), mask)
    with pytest.raises(ValueError, match="logits"):
        bias_features(torch.full_like(logits, float("nan")), tokens, mask)
    with pytest.raises(ValueError, match="temperature"):
        bias_features(logits, tokens, mask, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        bias_features(logits, tokens, mask, chunk_size=0)
    with pytest.raises(ValueError, match="hidden"):
        head_gram(logits, tokens, hidden[:, :-1], mask)
    with pytest.raises(ValueError, match="proj_dim"):
        head_gram(logits, tokens, hidden, mask, proj_dim=0)


# ---------------------------------------------------------------- coupling kernel and strategies


def test_coupling_kernel_and_zero_rows(gen):
    U = torch.randn(5, 40, generator=gen)
    U[4] = 0
    K, Kt = coupling_kernel(U)
    u = U.double()
    assert torch.allclose(K, u @ u.T)
    n = u[:4].norm(dim=1)
    assert torch.allclose(Kt[:4, :4], (u[:4] @ u[:4].T) / (n[:, None] * n[None]))
    assert Kt[4].abs().sum() == 0 and Kt[:, 4].abs().sum() == 0
    assert torch.allclose(Kt.diagonal()[:4], torch.ones(4, dtype=torch.float64))
    d = kernel_distance(Kt)
    assert torch.allclose(d, d.T) and d.diagonal().abs().max() == 0 and (d[4, :4] >= 1 - 1e-12).all()
    assert torch.equal(normalise_kernel(K), Kt)  # the Gram-matrix route gives the same K~
    with pytest.raises(ValueError, match="square"):
        normalise_kernel(K[:3])


def test_partition_two_clusters_and_identical_rows(gen):
    base = orthonormal(2, 200, gen)
    U = torch.cat([base[0] + 0.003 * torch.randn(4, 200, generator=gen, dtype=torch.float64),
                   base[1] + 0.003 * torch.randn(3, 200, generator=gen, dtype=torch.float64)])
    perm = torch.tensor([3, 5, 0, 6, 1, 2, 4])  # interleave the clusters
    labels = epsilon_partition(coupling_kernel(U[perm])[1], eps=0.05)
    truth = (perm >= 4).long()
    assert labels.unique().numel() == 2
    assert all((labels == labels[i]).equal(truth == truth[i]) for i in range(7))
    same = torch.randn(1, 10, generator=gen).repeat(6, 1)
    assert epsilon_partition(coupling_kernel(same)[1]).tolist() == [0] * 6


def _line(xs: list[float]) -> torch.Tensor:
    """A matrix whose rows differ only in column 0, so d(i, j) = |x_i - x_j|."""
    k = torch.zeros(len(xs), len(xs), dtype=torch.float64)
    k[:, 0] = torch.tensor(xs, dtype=torch.float64)
    return k


def test_partition_non_transitive_chain_as_documented():
    # a~b~c with a !~ c: the middle one is the centre and takes all three
    assert epsilon_partition(_line([0.08, 0.0, 0.04]), eps=0.05).tolist() == [0, 0, 0]
    # a~b~c~d: b and c tie (3 each), b (lower index) wins -> {a,b,c}, then {d}
    assert epsilon_partition(_line([0.0, 0.04, 0.08, 0.12]), eps=0.05).tolist() == [0, 0, 0, 1]
    # two disjoint pairs of equal size: the lowest index is the first centre, labels in creation order
    assert epsilon_partition(_line([0.5, 0.0, 0.51, 0.01]), eps=0.05).tolist() == [0, 1, 0, 1]
    assert epsilon_partition(_line([0.0, 0.5, 0.2, 0.51, 0.52]), eps=0.05).tolist() == [1, 0, 2, 0, 0]


def test_partition_eps_zero_separates_distinct_rows(gen):
    Kt = coupling_kernel(torch.randn(5, 30, generator=gen))[1]
    assert epsilon_partition(Kt, eps=0.0).tolist() == [0, 1, 2, 3, 4]
    U = torch.randn(3, 30, generator=gen)
    assert epsilon_partition(coupling_kernel(U[[0, 1, 0, 2, 1]])[1], eps=0.0).tolist() == [0, 1, 0, 2, 1]


def test_strategy_masses():
    labels = torch.tensor([0, 0, 1, 2, 0, 1])
    r = strategy_masses(labels)
    assert r["n_strategies"] == 3 and r["count_mass"].tolist() == pytest.approx([3 / 6, 2 / 6, 1 / 6])
    assert r["max_count_mass"] == pytest.approx(0.5) and r["prob_mass"] is None
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -4.0])
    r = strategy_masses(labels, logp)
    w = torch.softmax(logp.double(), 0)
    assert r["prob_mass"].tolist() == pytest.approx([float(w[[0, 1, 4]].sum()), float(w[[2, 5]].sum()), float(w[3])])
    assert r["prob_mass"].sum().item() == pytest.approx(1.0) and r["count_mass"].sum().item() == pytest.approx(1.0)
    flat = strategy_masses(labels, torch.full((6,), -7.0))
    assert torch.allclose(flat["prob_mass"], flat["count_mass"])


def test_kernel_bad_inputs():
    with pytest.raises(ValueError, match="U"):
        coupling_kernel(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="K_tilde"):
        kernel_distance(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="eps"):
        epsilon_partition(torch.eye(2), eps=-0.1)
    with pytest.raises(ValueError, match="seq_logp"):
        strategy_masses(torch.tensor([0, 1]), torch.zeros(3))
    with pytest.raises(ValueError, match="labels"):
        strategy_masses(torch.tensor([0.0, 1.0]))
