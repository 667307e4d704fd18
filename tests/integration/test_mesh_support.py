"""meshrl's support-balancing variant: hand-computed weights, properties, and the trainer's gradient."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.mesh import support_balance_row_weights


def test_hand_computed_weights_and_metrics():
    # One query, three strategies: A has two correct rollouts (l_A = mean(-1, -3) = -2), B one (l_B = -2),
    # C one (l_C = -2 + ln 4), one wrong rollout of C (ignored). p = (1, 1, 4) / 6, uniform 1/3:
    # d = (1/3 - 1/6, 1/3 - 1/6, 0) = (1/6, 1/6, 0); TV = 1/3.
    seq = torch.tensor([-1.0, -3.0, -2.0, -2.0 + math.log(4), -0.5])
    correct = torch.tensor([1, 1, 1, 1, 0])
    w, m = support_balance_row_weights(seq, correct, [0] * 5, ["A", "A", "B", "C", "C"], mu=0.6)
    expected = torch.tensor([-0.6 / 6 / 2, -0.6 / 6 / 2, -0.6 / 6, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert m["mesh/support_tv"] == pytest.approx(1 / 3)
    assert m["mesh/support_queries"] == 1.0
    assert m["mesh/support_loss"] == pytest.approx(-0.6 * (1 / 6 * -2 + 1 / 6 * -2))


def test_reductions_and_inactive_queries():
    seq = torch.tensor([-1.0, -5.0, -2.0, -2.0])
    q, s = [0, 0, 1, 1], [0, 1, 0, 0]  # query 1 has one strategy only: no term
    correct = torch.ones(4)
    w_mean, m = support_balance_row_weights(seq, correct, q, s, mu=1.0)
    w_sum, _ = support_balance_row_weights(seq, correct, q, s, mu=1.0, reduction="sum")
    w_act, _ = support_balance_row_weights(seq, correct, q, s, mu=1.0, reduction="mean_active")
    torch.testing.assert_close(w_sum, 2 * w_mean)
    torch.testing.assert_close(w_act, w_sum)
    assert w_sum[0] == 0 and w_sum[1] < 0 and (w_sum[2:] == 0).all()
    p_rare = 1 / (1 + math.exp(4))
    assert float(w_sum[1]) == pytest.approx(-(0.5 - p_rare))
    assert m["mesh/support_queries"] == 1.0
    _, none = support_balance_row_weights(seq, torch.zeros(4), q, s, mu=1.0)
    assert math.isnan(none["mesh/support_tv"]) and none["mesh/support_loss"] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.floats(-30, 0), st.booleans()),
                min_size=1, max_size=24), st.floats(-50, 50))
def test_never_pushes_down_and_ignores_a_shift(rows, shift):
    q = [r[0] for r in rows]
    s = [r[1] for r in rows]
    seq = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    ok = torch.tensor([r[3] for r in rows])
    w, _ = support_balance_row_weights(seq, ok, q, s, mu=0.1)
    assert (w <= 0).all() and (w[~ok] == 0).all()
    assert float(w.sum()) >= -0.1 * (1 - 1 / 4) - 1e-12  # at most mu * TV per query, mean over queries
    w2, _ = support_balance_row_weights(seq + shift, ok, q, s, mu=0.1)
    torch.testing.assert_close(w, w2)


def test_bad_inputs_are_named():
    seq = torch.zeros(3)
    with pytest.raises(ValueError, match="mu"):
        support_balance_row_weights(seq, torch.ones(3), [0] * 3, [0, 1, 2], mu=-1.0)
    with pytest.raises(ValueError, match="strategy_ids"):
        support_balance_row_weights(seq, torch.ones(3), [0] * 3, [0, 1], mu=1.0)
    with pytest.raises(ValueError, match="reduction"):
        support_balance_row_weights(seq, torch.ones(3), [0] * 3, [0, 1, 2], mu=1.0, reduction="max")


def test_trainer_support_gradient_equals_autograd_of_the_objective(tmp_path):
    """The trainer's accumulated support gradient == autograd of J = -mu/Q sum_q sum_i sg[d_i] l_i, where
    l_i is computed here independently, one rollout at a time, under the bare query."""
    from meshrl.models import encode_prompt
    from meshrl.trainer import Trainer, load_config
    from meshrl.trainer.batch import response_logits, token_logprobs

    cfg = load_config(overrides=[
        "model=tiny", "task=tiny:repeat", "recipe=mesh", "mesh.balance=support", "mesh.mu=0.5",
        "rollout.prompts_per_step=2", "rollout.group_size=8", "rollout.max_new_tokens=4",
        "train.micro_batch_size=3", "log.progress=false", "mesh.m=4"])
    tr = Trainer(cfg, tmp_path / "run")
    data, _ = tr.sampler.run(0, 0)
    data.scores = [1.0 if j % 3 else 0.0 for j in range(len(data))]  # a fixed mix of correct and wrong
    metrics = tr.balance.begin_update(data, None, None)
    assert metrics["mesh/support_queries"] >= 1 and (tr.balance.support_weights < 0).any()
    params = [p for p in tr.model.parameters() if p.requires_grad]
    grads = tr.balance.support_grads(list(range(len(data))), data, params, None)

    ell: dict[tuple[int, int], list[torch.Tensor]] = {}
    for j in range(len(data)):
        if data.scores[j] >= 1:
            prompt = encode_prompt(tr.tokenizer, tr.task.format_prompt(data.problems[j]))
            mb = tr.forward.collate([prompt], [data.response_ids[j]])
            lp = token_logprobs(response_logits(tr.model, mb), mb.response_ids, cfg.rollout.temperature)
            ell.setdefault((data.query_ids[j], data.strategy_ids[j]), []).append((lp * mb.response_mask).sum())
    queries = sorted(set(data.query_ids))
    total = torch.zeros(())
    for q in queries:
        cells = [torch.stack(v).mean() for (qq, _), v in sorted(ell.items()) if qq == q]
        if len(cells) < 2:
            continue
        lq = torch.stack(cells)
        d = (1 / len(cells) - torch.softmax(lq.detach(), 0)).clamp(min=0)
        total = total - 0.5 / len(queries) * (d * lq).sum()
    expected = torch.autograd.grad(total, params, allow_unused=True)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(g) if e is None else e, atol=1e-6, rtol=1e-4)


def test_support_arm_trains_and_logs_its_metrics(tmp_path):
    from meshrl.trainer import load_config, train

    cfg = load_config(overrides=[
        "model=tiny", "task=tiny:repeat", "recipe=mesh", "mesh.balance=support", "mesh.mu=0.1", "steps=2",
        "rollout.prompts_per_step=2", "rollout.group_size=8", "rollout.max_new_tokens=4", "log.progress=false",
        "optim.lr=1e-2"])
    hist = train(cfg, tmp_path / "run")
    assert len(hist) == 2 and all("mesh/support_queries" in h for h in hist)
    assert all("mesh/balance_loss" not in h for h in hist)  # the paper form is off
    with pytest.raises(ValueError, match="mesh.balance"):
        load_config(overrides=["recipe=mesh", "mesh.balance=both"])
