"""LUFFY shaping, M2PO masking, rollout importance weights / rejection and mismatch statistics against
hand-computed and independently computed cases (holes in masks, empty rows)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import (
    OFF_POLICY_SHAPES,
    importance_weight_stats,
    logprob_mismatch_stats,
    luffy_off_policy_loss,
    m2po_mask,
    rollout_is_weights,
    rollout_rejection_mask,
)


def test_luffy_value_and_gradient_hand_case() -> None:
    p = torch.tensor([[0.5, 0.1, 0.9]], dtype=torch.float64)
    logp = p.log().requires_grad_()
    adv = torch.tensor([2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = luffy_off_policy_loss(logp, adv, mask, gamma=0.1)
    expected = [-2 * 0.5 / 0.6, -2 * 0.1 / 0.2, -2 * 0.9 / 1.0]
    torch.testing.assert_close(loss.detach(), torch.tensor([expected], dtype=torch.float64))
    (g,) = torch.autograd.grad((loss * mask).sum(), logp)
    # d/dlogp [-A p/(p+g)] = -A g p / (p+g)^2: the rarer token gets the larger push
    want = [-2 * 0.1 * 0.5 / 0.36, -2 * 0.1 * 0.1 / 0.04, 0.0]
    torch.testing.assert_close(g, torch.tensor([want], dtype=torch.float64))
    assert metrics["offpolicy/prob_mean"] == pytest.approx(0.3)
    plain, _ = luffy_off_policy_loss(logp, adv, mask, shape="none")
    torch.testing.assert_close(plain.detach(), -2 * p)
    as_sampled, _ = luffy_off_policy_loss(logp, adv, mask, shape="log")
    torch.testing.assert_close(as_sampled.detach(), -2 * p.log())
    (g,) = torch.autograd.grad((as_sampled * mask).sum(), logp)
    torch.testing.assert_close(g, torch.tensor([[-2.0, -2.0, 0.0]], dtype=torch.float64))  # weight 1 at any p
    assert set(OFF_POLICY_SHAPES) == {"p_div_p", "none", "log"}
    with pytest.raises(ValueError, match="gamma"):
        luffy_off_policy_loss(logp, adv, mask, gamma=0.0)


def m2po_by_loop(log_r: list[list[float]], adv: list[float], mask: list[list[int]], tau: float) -> set:
    """Algorithm 1 literally: remove the argmax of (log r)^2 from S while S's mean exceeds tau."""
    s = {(i, t) for i, row in enumerate(log_r) for t, x in enumerate(row)
         if mask[i][t] and ((adv[i] > 0 and x > 0) or (adv[i] < 0 and x < 0))}
    masked = set()
    while s and sum(log_r[i][t] ** 2 for i, t in s) / len(s) > tau:
        worst = max(s, key=lambda k: log_r[k[0]][k[1]] ** 2)
        s.remove(worst)
        masked.add(worst)
    return masked


def test_m2po_hand_case() -> None:
    log_r = [[0.5, -0.5, 0.1, 0.3], [-0.4, 0.2, 0.0, 9.0], [0.0, 0.0, 0.0, 0.0]]
    adv = [1.0, -1.0, 0.0]
    mask = [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]]
    behaviour = torch.full((3, 4), -2.0, dtype=torch.float64)
    logp = behaviour + torch.tensor(log_r, dtype=torch.float64)
    keep, metrics = m2po_mask(logp, behaviour, torch.tensor(adv), torch.tensor(mask), threshold=0.04)
    # S = {(0,0) .25, (0,2) .01, (0,3) .09, (1,0) .16}; mean .1275 > .04 -> drop .25 (.0867), drop .16 (.05),
    # drop .09 (.01 <= .04): three masked; (0,1) and (1,1) push inward and stay; (1,3) is padding
    masked = {(i, t) for i in range(3) for t in range(4) if mask[i][t] and keep[i, t] == 0}
    assert masked == {(0, 0), (1, 0), (0, 3)} == m2po_by_loop(log_r, adv, mask, 0.04)
    assert metrics["m2po/masked_frac"] == pytest.approx(3 / 7)
    valid_sq = [x**2 for i, row in enumerate(log_r) for t, x in enumerate(row) if mask[i][t]]
    assert metrics["m2po/m2"] == pytest.approx(sum(valid_sq) / 7)
    assert keep[1, 3] == 0 and keep[2].sum() == 0  # padding stays masked


def test_m2po_matches_the_literal_algorithm_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        log_r = (torch.randn(5, 7, generator=gen, dtype=torch.float64) * 0.3)
        adv = torch.randn(5, generator=gen, dtype=torch.float64)
        mask = (torch.rand(5, 7, generator=gen) > 0.25).long()
        keep, _ = m2po_mask(log_r, torch.zeros_like(log_r), adv, mask, threshold=0.04)
        ours = {(i, t) for i in range(5) for t in range(7) if mask[i, t] and keep[i, t] == 0}
        assert ours == m2po_by_loop(log_r.tolist(), adv.tolist(), mask.tolist(), 0.04)


def test_m2po_nothing_to_mask_and_bad_threshold() -> None:
    z = torch.zeros(2, 3)
    keep, metrics = m2po_mask(z, z, torch.ones(2), torch.ones(2, 3))
    assert keep.sum() == 6 and metrics["m2po/masked_frac"] == 0.0
    with pytest.raises(ValueError, match="m2po threshold"):
        m2po_mask(z, z, torch.ones(2), torch.ones(2, 3), threshold=0.0)


LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
ROLL = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.2, -9.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])


def test_token_truncated_and_masked_weights() -> None:
    w, metrics = rollout_is_weights(LOGP, ROLL, MASK, level="token", mode="truncate", upper=1.5)
    d = [[0.5, -1.0, 0.0], [-1.0, 0.2, 8.0]]
    want = [[min(math.exp(d[0][0]), 1.5), math.exp(-1), 1.0], [math.exp(-1), math.exp(0.2), 0.0], [0, 0, 0]]
    torch.testing.assert_close(w, torch.tensor(want, dtype=torch.float64))
    assert metrics["rollout_is/clipped_frac"] == pytest.approx(1 / 5)  # exp(.5) = 1.65 > 1.5
    w2, m2 = rollout_is_weights(LOGP, ROLL, MASK, mode="mask", lower=0.5, upper=1.5)
    want2 = [[0.0, 0.0, 1.0], [0.0, math.exp(0.2), 0.0], [0, 0, 0]]
    torch.testing.assert_close(w2, torch.tensor(want2, dtype=torch.float64))
    assert m2["rollout_is/clipped_frac"] == pytest.approx(3 / 5)
    assert not w.requires_grad


def test_sequence_weight_is_the_product_over_valid_tokens() -> None:
    w, _ = rollout_is_weights(LOGP, ROLL, MASK, level="sequence", upper=10.0)
    # row 0: exp(.5 - 1 + 0) on every position; row 1: exp(-1 + .2), the hole's 8.0 left out; empty row 0
    assert w[0].tolist() == pytest.approx([math.exp(-0.5)] * 3)
    assert w[1, :2].tolist() == pytest.approx([math.exp(-0.8)] * 2) and w[1, 2] == 0
    assert w[2].sum() == 0
    with pytest.raises(ValueError, match="needs a lower bound"):
        rollout_is_weights(LOGP, ROLL, MASK, mode="mask")
    with pytest.raises(ValueError, match="rollout_is level"):
        rollout_is_weights(LOGP, ROLL, MASK, level="row")


def test_rejection_k1_k2_k3_token_and_sequence() -> None:
    log_w = (LOGP - ROLL)
    k3 = log_w.exp() - 1 - log_w
    keep, m = rollout_rejection_mask(LOGP, ROLL, MASK, stat="token_k3", upper=0.2)
    want = ((k3 <= 0.2) & (MASK > 0)).to(torch.float64)
    torch.testing.assert_close(keep, want)  # k3(.5) = .149 kept, k3(-1) = .368 rejected
    assert m["rollout_rs/masked_frac"] == pytest.approx(2 / 5)
    assert m["rollout_rs/seq_masked_frac"] == pytest.approx(1.0)  # both non-empty rows lose a token
    # k1 = -log w, bounds as ratios pi_rollout / pi_train in [1/1.5, 2]: e^-.5 = .61 and e^1 = 2.7 out,
    # e^0 and e^-.2 = .82 in
    keep1, _ = rollout_rejection_mask(LOGP, ROLL, MASK, stat="token_k1", lower=1 / 1.5, upper=2.0)
    assert keep1.tolist() == [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    # seq_mean_k2: row 0 (.125 + .5 + 0)/3 = .208; row 1 (.5 + .02)/2 = .26 -> threshold .25 keeps row 0
    keep_s, ms = rollout_rejection_mask(LOGP, ROLL, MASK, stat="seq_mean_k2", upper=0.25)
    assert keep_s.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert ms["rollout_rs/seq_masked_frac"] == pytest.approx(1 / 2)
    keep_max, _ = rollout_rejection_mask(LOGP, ROLL, MASK, stat="seq_max_k2", upper=0.4)
    assert keep_max.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="token_k1 needs"):
        rollout_rejection_mask(LOGP, ROLL, MASK, stat="token_k1", upper=2.0)
    with pytest.raises(ValueError, match="rollout rejection statistic"):
        rollout_rejection_mask(LOGP, ROLL, MASK, stat="seq_max_k1", upper=2.0)


def test_mismatch_stats_hand_case_and_empty() -> None:
    s = logprob_mismatch_stats(LOGP, ROLL, MASK)
    d = torch.tensor([0.5, -1.0, 0.0, -1.0, 0.2], dtype=torch.float64)
    assert s["mismatch/logp_absdiff_mean"] == pytest.approx(2.7 / 5)
    assert s["mismatch/logp_absdiff_max"] == pytest.approx(1.0)
    assert s["mismatch/logp_diff_mean"] == pytest.approx(-1.3 / 5)
    assert s["mismatch/logp_absdiff_p50"] == pytest.approx(0.5)
    # sorted |d| = 0, .2, .5, 1, 1: p90 at position 3.6 -> 1.0; p99 -> 1.0
    assert s["mismatch/logp_absdiff_p90"] == pytest.approx(1.0)
    assert s["mismatch/logp_absdiff_p99"] == pytest.approx(1.0)
    assert s["mismatch/kl_k3"] == pytest.approx(float((d.exp() - 1 - d).mean()))
    assert logprob_mismatch_stats(LOGP, ROLL, torch.zeros_like(MASK)) == {}


def test_importance_weight_stats_by_hand():
    # weights 1, 1, 2 on the valid tokens, a masked 50 ignored: sum 4, sum of squares 6, n 3 -> ESS 16 / 18
    log_ratio = torch.log(torch.tensor([[1.0, 1.0], [2.0, 50.0]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = importance_weight_stats(log_ratio, mask)
    assert out["max"] == pytest.approx(2.0) and out["ess"] == pytest.approx(16 / 18)
    assert importance_weight_stats(torch.zeros(2, 3), torch.ones(2, 3)) == {"max": 1.0, "ess": 1.0}
    assert importance_weight_stats(torch.zeros(1, 2), torch.zeros(1, 2)) == {"max": 1.0, "ess": 1.0}
