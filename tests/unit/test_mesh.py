"""Strategy-balancing loss: value, gradient, invariances, id keying, drop-out and input errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.mesh import strategy_balance_loss, strategy_balance_row_weights

D = torch.float64


def _one_query(r: torch.Tensor, mu: float = 1.0, **kw):
    """One correct rollout per strategy, reference 0, so seq_logp == r."""
    k = r.shape[0]
    return strategy_balance_loss(
        r, torch.zeros(k, dtype=D), torch.ones(k, dtype=torch.bool), ["q"] * k, list(range(k)), mu, **kw
    )


def test_hand_computed_three_strategies():
    # q: strategy "a" two correct rollouts (z=-4, z_ref=-4 -> r=0); "b" one correct (r=log 2);
    # "c" one correct + one wrong (r=log 3); "d" only wrong rollouts -> drops out.
    seq = torch.tensor([-3.0, -5.0, -2.0, -1.0, -7.0, -9.0], dtype=D, requires_grad=True)
    ref = torch.tensor([-4.0, -4.0, -2.0 - math.log(2), -1.0 - math.log(3), 99.0, 5.0], dtype=D)
    ok = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)
    strat = ["a", "a", "b", "c", "c", "d"]
    mu = 1e-2
    loss, met = strategy_balance_loss(seq, ref, ok, ["q"] * 6, strat, mu)
    # p = (1/6, 2/6, 3/6); KL(u || p) = (1/3) (log 2 + log 1 + log(2/3)) = (1/3) log(4/3)
    assert loss.item() == pytest.approx(mu * math.log(4 / 3) / 3, rel=1e-12)
    loss.backward()
    p = torch.tensor([1 / 6, 2 / 6, 3 / 6], dtype=D)
    g = mu * (p - 1 / 3)
    expected = torch.tensor([g[0] / 2, g[0] / 2, g[1], g[2], 0.0, 0.0], dtype=D)
    torch.testing.assert_close(seq.grad, expected)
    assert met["mesh/active_strategies"] == 3.0
    assert met["mesh/balance_queries"] == 1.0
    assert met["mesh/balance_p_max"] == pytest.approx(0.5)
    ent = -sum(x * math.log(x) for x in (1 / 6, 2 / 6, 3 / 6))
    assert met["mesh/balance_p_entropy"] == pytest.approx(ent)
    assert met["mesh/balance_p_entropy_norm"] == pytest.approx(ent / math.log(3))
    assert met["mesh/balance_r_spread"] == pytest.approx(math.log(3))
    assert met["mesh/balance_loss"] == pytest.approx(loss.item())
    assert met["mesh/balance_mu"] == mu and met["mesh/balance_subtract_ref"] == 1.0


@settings(max_examples=60, deadline=None)
@given(
    r=st.lists(st.floats(-30, 30, allow_nan=False), min_size=2, max_size=7),
    mu=st.floats(1e-6, 10.0),
)
def test_gradient_wrt_r_is_mu_p_minus_uniform(r, mu):
    rt = torch.tensor(r, dtype=D, requires_grad=True)
    loss, _ = _one_query(rt, mu)
    (g,) = torch.autograd.grad(loss, rt)
    p = torch.softmax(rt.detach(), 0)
    torch.testing.assert_close(g, mu * (p - 1 / len(r)), rtol=1e-9, atol=1e-12)
    assert loss.item() >= -1e-12


@settings(max_examples=60, deadline=None)
@given(
    r=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=7),
    c=st.floats(-1e3, 1e3, allow_nan=False),
)
def test_shift_invariance(r, c):
    rt = torch.tensor(r, dtype=D)
    a, _ = _one_query(rt)
    b, _ = _one_query(rt + c)
    assert b.item() == pytest.approx(a.item(), rel=1e-9, abs=1e-9)


def _random_batch(gen: torch.Generator, n_q: int = 4, m: int = 4, n: int = 3):
    rows = [(f"q{q}", s) for q in range(n_q) for s in range(m) for _ in range(n)]
    seq = -torch.rand(len(rows), generator=gen, dtype=D) * 20
    ref = -torch.rand(len(rows), generator=gen, dtype=D) * 20
    ok = torch.rand(len(rows), generator=gen) < 0.6
    return seq, ref, ok, [q for q, _ in rows], [s for _, s in rows]


def test_permuting_rows_does_not_change_loss_or_gradient(gen):
    seq, ref, ok, qs, ss = _random_batch(gen)
    x = seq.clone().requires_grad_(True)
    loss, met = strategy_balance_loss(x, ref, ok, qs, ss, 0.5)
    loss.backward()
    perm = torch.randperm(len(qs), generator=gen)
    y = seq[perm].clone().requires_grad_(True)
    loss2, met2 = strategy_balance_loss(y, ref[perm], ok[perm], [qs[i] for i in perm], [ss[i] for i in perm], 0.5)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(y.grad, x.grad[perm])
    for k in met:
        assert met2[k] == pytest.approx(met[k], nan_ok=True)


def test_tensor_ids_match_list_ids_and_strategy_ids_are_scoped_by_query(gen):
    seq, ref, ok, qs, ss = _random_batch(gen, n_q=3, m=3, n=2)
    a, _ = strategy_balance_loss(seq, ref, ok, qs, ss, 1.0)
    q_t = torch.tensor([int(q[1:]) for q in qs])
    b, _ = strategy_balance_loss(seq, ref, ok, q_t, torch.tensor(ss), 1.0)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    # the same strategy label under two queries is two different cells
    seq2 = torch.tensor([0.0, 1.0, 5.0, 5.0], dtype=D)
    loss, met = strategy_balance_loss(
        seq2, torch.zeros(4, dtype=D), torch.ones(4, dtype=torch.bool), [1, 1, 2, 2], [0, 1, 0, 1], 1.0, reduction="sum"
    )
    expected = math.log((1 + math.e) / 2) - 0.5  # query 1: r=(0,1); query 2: r equal -> 0
    assert loss.item() == pytest.approx(expected)
    assert met["mesh/balance_queries"] == 2.0


def test_strategies_without_correct_rollout_drop_out():
    # q1: strategies 0,1 qualify, 2 has only wrong rollouts -> same as a batch without strategy 2.
    # q2: only strategy 0 qualifies -> contributes 0 and gets no gradient. q3: nothing correct.
    seq = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0], dtype=D, requires_grad=True)
    ref = torch.zeros(7, dtype=D)
    ok = torch.tensor([1, 1, 0, 1, 0, 0, 0], dtype=torch.bool)
    qs = ["q1", "q1", "q1", "q2", "q2", "q3", "q3"]
    ss = [0, 1, 2, 0, 1, 0, 1]
    loss, met = strategy_balance_loss(seq, ref, ok, qs, ss, 1.0, reduction="sum")
    loss.backward()
    r = torch.tensor([-1.0, -2.0], dtype=D)
    only, _ = _one_query(r, reduction="sum")
    assert loss.item() == pytest.approx(only.item(), rel=1e-12)
    assert torch.isfinite(loss) and loss.item() < 1.0  # no -1e9 placeholder anywhere
    assert seq.grad[2:].abs().max().item() == 0.0
    assert met["mesh/active_strategies"] == pytest.approx((2 + 1 + 0) / 3)
    assert met["mesh/balance_queries"] == 1.0


def test_reductions():
    seq = torch.tensor([0.0, 2.0, 0.0, 1.0, -3.0], dtype=D)
    args = (
        seq,
        torch.zeros(5, dtype=D),
        torch.ones(5, dtype=torch.bool),
        ["a", "a", "b", "b", "c"],
        [0, 1, 0, 1, 0],
        1.0,
    )
    s, _ = strategy_balance_loss(*args, reduction="sum")
    mean, _ = strategy_balance_loss(*args)
    act, _ = strategy_balance_loss(*args, reduction="mean_active")
    assert mean.item() == pytest.approx(s.item() / 3)  # all three queries count in the mean
    assert act.item() == pytest.approx(s.item() / 2)  # only the two with m >= 2


def test_subtract_ref_false_uses_raw_z():
    seq = torch.tensor([-1.0, -3.0], dtype=D)
    ref = torch.tensor([-5.0, 0.0], dtype=D)
    kw = dict(correct=torch.ones(2, dtype=torch.bool), query_ids=[0, 0], strategy_ids=[0, 1], mu=1.0)
    raw, met = strategy_balance_loss(seq, None, subtract_ref=False, **kw)
    also_raw, _ = strategy_balance_loss(seq, ref, subtract_ref=False, **kw)
    with_ref, _ = strategy_balance_loss(seq, ref, **kw)
    assert raw.item() == pytest.approx(_one_query(seq)[0].item())
    assert also_raw.item() == raw.item()
    assert with_ref.item() == pytest.approx(_one_query(seq - ref)[0].item())
    assert met["mesh/balance_subtract_ref"] == 0.0


def test_no_active_query_gives_zero_loss_with_graph_and_nan_p_metrics():
    seq = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, met = strategy_balance_loss(seq, torch.zeros(2), torch.tensor([True, False]), [0, 0], [0, 1], 1.0)
    loss.backward()
    assert loss.item() == 0.0 and seq.grad.abs().sum().item() == 0.0
    assert met["mesh/balance_queries"] == 0.0 and met["mesh/active_strategies"] == 1.0
    assert math.isnan(met["mesh/balance_p_entropy"]) and math.isnan(met["mesh/balance_p_max"])
    empty, met0 = strategy_balance_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), [], [], 1.0)
    assert empty.item() == 0.0 and met0["mesh/active_strategies"] == 0.0


def test_float32_input_keeps_dtype():
    seq = torch.tensor([-10.0, -11.0, -12.0], requires_grad=True)
    loss, _ = strategy_balance_loss(seq, torch.zeros(3), torch.ones(3, dtype=torch.bool), [0] * 3, [0, 1, 2], 1e-5)
    assert loss.dtype == torch.float32
    loss.backward()
    assert seq.grad.dtype == torch.float32


def test_row_weights_equal_autograd_gradient_and_accumulate_over_micro_batches(gen):
    seq, ref, ok, qs, ss = _random_batch(gen)
    x = seq.clone().requires_grad_(True)
    loss, _ = strategy_balance_loss(x, ref, ok, qs, ss, 0.3)
    loss.backward()
    w, val, _ = strategy_balance_row_weights(seq, ref, ok, qs, ss, 0.3)
    torch.testing.assert_close(w, x.grad)
    assert val.item() == pytest.approx(loss.item())
    # surrogate over two micro-batches: the same gradient wrt parameters feeding seq_logp
    theta = torch.randn(seq.shape[0], dtype=D, generator=gen, requires_grad=True)
    full, _ = strategy_balance_loss(seq + theta, ref, ok, qs, ss, 0.3)
    (g_full,) = torch.autograd.grad(full, theta)
    w, _, _ = strategy_balance_row_weights((seq + theta).detach(), ref, ok, qs, ss, 0.3)
    half = seq.shape[0] // 2
    acc = sum((w[sl] * (seq + theta)[sl]).sum() for sl in (slice(0, half), slice(half, None)))
    (g_acc,) = torch.autograd.grad(acc, theta)
    torch.testing.assert_close(g_acc, g_full)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(seq_logp=torch.zeros(2, 2)), "seq_logp"),
        (dict(seq_logp=torch.tensor([0.0, float("nan")])), "seq_logp"),
        (dict(seq_logp=[0.0, 1.0]), "seq_logp"),
        (dict(ref_seq_logp=torch.zeros(3)), "ref_seq_logp"),
        (dict(ref_seq_logp=None), "ref_seq_logp"),
        (dict(correct=torch.ones(3, dtype=torch.bool)), "correct"),
        (dict(correct=torch.tensor([0.0, 0.5])), "correct"),
        (dict(correct=[True, False]), "correct"),
        (dict(query_ids=[0]), "query_ids"),
        (dict(query_ids="ab"), "query_ids"),
        (dict(query_ids=[[0], [1]]), "query_ids"),
        (dict(strategy_ids=torch.tensor([0.0, 1.0])), "strategy_ids"),
        (dict(strategy_ids=torch.zeros(2, 1, dtype=torch.long)), "strategy_ids"),
        (dict(mu=-1.0), "mu"),
        (dict(mu=float("inf")), "mu"),
        (dict(reduction="max"), "reduction"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, name):
    args = dict(
        seq_logp=torch.zeros(2),
        ref_seq_logp=torch.zeros(2),
        correct=torch.ones(2, dtype=torch.bool),
        query_ids=[0, 0],
        strategy_ids=[0, 1],
        mu=1.0,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        strategy_balance_loss(**args)
