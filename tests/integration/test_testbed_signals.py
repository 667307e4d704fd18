"""meshrl.testbed.signals: the partition agreement (ARI), signal crossings and calibrated thresholds."""

from __future__ import annotations

import pytest

from meshrl.testbed.signals import adjusted_rand_index, calibrated_threshold, first_crossing


def test_adjusted_rand_index_hand_values():
    assert adjusted_rand_index([0, 0, 1, 1], ["a", "a", "b", "b"]) == 1.0  # same partition, other names
    assert adjusted_rand_index([0, 0, 0, 0], [1, 1, 1, 1]) == 1.0  # one cluster each: identical
    # Contingency [[2,1],[0,1]] (a = 0,0,0,1; b = x,x,y,y): sum_ij C = 1, sum_a C = 3, sum_b C = 2,
    # E = 3*2/6 = 1, max = 2.5 -> ARI = (1 - 1) / (2.5 - 1) = 0.
    assert adjusted_rand_index([0, 0, 0, 1], ["x", "x", "y", "y"]) == pytest.approx(0.0)
    # a = 0,0,1,1,2,2 vs b = 0,0,0,1,1,1: sum_ij = 1+0+0+1 = 2 (cells (0,0)=2,(1,0)=1,(1,1)=1,(2,1)=2 -> 1+0+0+1),
    # sum_a = 3, sum_b = 6, E = 18/15 = 1.2, max = 4.5 -> (2 - 1.2) / (4.5 - 1.2) = 0.2424...
    assert adjusted_rand_index([0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1]) == pytest.approx(0.8 / 3.3)
    with pytest.raises(ValueError, match="length"):
        adjusted_rand_index([0], [0, 1])


def test_crossings_and_thresholds():
    steps = [0, 4, 8, 12, 16]
    assert first_crossing(steps, [1, 2, 5, 6, 7], 4.0, "up") == 8
    assert first_crossing(steps, [1, 5, 2, 6, 7], 4.0, "up", patience=2) == 12
    assert first_crossing(steps, [9, 8, 7, 6, 5], 4.0, "down") is None
    assert first_crossing(steps, [9, float("nan"), 3, 6, 5], 4.0, "down") == 8
    with pytest.raises(ValueError, match="direction"):
        first_crossing(steps, [1] * 5, 0.0, "sideways")
    assert calibrated_threshold([1.0, 2.0, 3.0], "up") == pytest.approx(2 + 3 * 1.0)
    assert calibrated_threshold([1.0, 2.0, 3.0], "down", k_sd=2) == pytest.approx(0.0)
    assert calibrated_threshold([5.0, 5.0], "up", min_sd=0.5) == pytest.approx(6.5)
    with pytest.raises(ValueError, match="baseline"):
        calibrated_threshold([1.0], "up")


def test_distinct_rows_keeps_each_responses_first_copy():
    from meshrl.testbed.signals import distinct_rows

    assert distinct_rows([[1, 2], [3], [1, 2], [3], [4]]) == [0, 1, 4]
    assert distinct_rows([]) == []


def test_probe_reports_mei_over_distinct_rollouts(monkeypatch):
    """``mei_distinct/*`` is MEI of the Gram matrix restricted to one row per distinct response: copies of one
    response raise plain MEI (identical rows) and leave the distinct one alone."""
    import torch

    import meshrl.testbed  # noqa: F401  (registers the testbed tasks)
    from meshrl.diagnostics import mei_from_gram
    from meshrl.models import load_model
    from meshrl.tasks import load_task
    from meshrl.testbed import signals

    model, tok = load_model("tiny:small", seed=0)
    task = load_task("testbed:add", seed=0)
    seen = []
    real = signals._grams

    def grams(*args, **kwargs):
        out, ent = real(*args, **kwargs)
        seen.append((args[3], out["bias"]))
        return out, ent

    monkeypatch.setattr(signals, "_grams", grams)
    res = signals.probe_signals(model, tok, task, task.problems("eval")[:2], group_size=6, seed=0,
                                features=("bias",), epsilons=(0.1,))
    for rec, (responses, gram) in zip(res["per_problem"], seen, strict=True):
        keep = signals.distinct_rows(responses)
        assert rec["mei_distinct/bias"] == mei_from_gram(gram[keep][:, keep])
        assert rec["distinct_frac"] == len(keep) / len(responses)
    # a copy of a row raises plain MEI by its couplings and leaves the distinct version unchanged
    g = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
    dup = torch.tensor([[2.0, 2.0, 1.0], [2.0, 2.0, 1.0], [1.0, 1.0, 3.0]])
    assert mei_from_gram(dup) > mei_from_gram(g) == mei_from_gram(dup[[0, 2]][:, [0, 2]])
