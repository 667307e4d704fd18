"""Clip-Cov, KL-Cov, entropy-based advantage and forking-token masks against hand-computed cases (against TRL's
``get_high_entropy_mask``: tests/integration/test_algos_entropy_control_trl.py)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algos import (
    ADVANTAGE_SHAPERS,
    COVARIANCE_LOSSES,
    TOKEN_MASKS,
    aggregate,
    clip_cov_loss,
    clip_cov_selection,
    entropy_advantage,
    high_entropy_mask,
    kl_cov_loss,
    kl_cov_selection,
    ppo_clip_loss,
    shape_advantages,
    token_covariance,
    token_mask,
)

# One row with a hole (position 2) and an empty row: the means run over the 4 valid tokens only.
LOGP = [[-0.5, -2.0, -9.0, -4.0], [-1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
ADV = [[2.0, 2.0, 5.0, -1.0], [-3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
MASK = [[1, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]]


def tensors():
    return (torch.tensor(LOGP, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64),
            torch.tensor(MASK, dtype=torch.float64))


def hand_cov() -> dict[tuple[int, int], float]:
    valid = [(i, t) for i in range(3) for t in range(4) if MASK[i][t]]
    a_bar = sum(ADV[i][t] for i, t in valid) / len(valid)
    l_bar = sum(LOGP[i][t] for i, t in valid) / len(valid)
    return {(i, t): (ADV[i][t] - a_bar) * (LOGP[i][t] - l_bar) for i, t in valid}


def test_token_covariance_is_centred_over_valid_tokens_only() -> None:
    logp, adv, mask = tensors()
    cov = token_covariance(logp, adv, mask)
    expected = torch.zeros(3, 4, dtype=torch.float64)
    for (i, t), v in hand_cov().items():
        expected[i, t] = v
    torch.testing.assert_close(cov, expected)
    # a_bar = 0, l_bar = -1.875: (2)(1.375) = 2.75 at (0, 0)
    assert cov[0, 0].item() == pytest.approx(2.75)


def test_clip_cov_selection_keeps_to_candidates_and_counts() -> None:
    logp, adv, mask = tensors()
    cov = hand_cov()
    # candidates with 1 < cov < 5: (0,0) 2.75; (0,1) 2*(-0.125) no; (0,3) (-1)(-2.125)=2.125; (1,0) (-3)(0.875) no
    none_clipped = torch.zeros(3, 4, dtype=torch.bool)
    every = clip_cov_selection(logp, adv, mask, none_clipped, ratio=1.0)
    assert {tuple(x) for x in torch.nonzero(every).tolist()} == {(0, 0), (0, 3)}
    assert all(1 < cov[k] < 5 for k in [(0, 0), (0, 3)])
    # k = max(1, floor(ratio N)) = 1 with the default ratio: exactly one of the two
    one = clip_cov_selection(logp, adv, mask, none_clipped, generator=torch.Generator().manual_seed(0))
    assert int(one.sum()) == 1 and bool((one & ~every).sum() == 0)
    # an already-clipped candidate is never drawn
    clipped = torch.zeros(3, 4, dtype=torch.bool)
    clipped[0, 0] = True
    left = clip_cov_selection(logp, adv, mask, clipped, ratio=1.0)
    assert torch.nonzero(left).tolist() == [[0, 3]]
    # nothing valid: nothing selected, no error
    assert not clip_cov_selection(logp, adv, torch.zeros_like(mask), none_clipped).any()


def test_clip_cov_draw_is_uniform_and_seeded() -> None:
    # 10 candidates (cov = 2 each after centring), k = 3: each drawn with probability 3/10.
    n = 20
    adv = torch.tensor([[1.0] * 10 + [-1.0] * 10], dtype=torch.float64)
    logp = torch.tensor([[0.0] * 10 + [-4.0] * 10], dtype=torch.float64)  # cov = (±1)(±2) = 2
    mask = torch.ones(1, n, dtype=torch.float64)
    clipped = torch.zeros(1, n, dtype=torch.bool)
    clipped[0, 10:] = True  # only the first ten are candidates
    counts = torch.zeros(n)
    draws = 2000
    for s in range(draws):
        sel = clip_cov_selection(logp, adv, mask, clipped, ratio=3 / n, generator=torch.Generator().manual_seed(s))
        assert int(sel.sum()) == 3
        counts += sel[0].float()
    assert counts[10:].sum() == 0
    freq = counts[:10] / draws  # binomial sd sqrt(.3 * .7 / 2000) = 0.010
    assert (freq - 0.3).abs().max() < 0.05
    a = clip_cov_selection(logp, adv, mask, clipped, ratio=0.15, generator=torch.Generator().manual_seed(7))
    b = clip_cov_selection(logp, adv, mask, clipped, ratio=0.15, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_clip_cov_loss_detaches_exactly_the_selected_tokens() -> None:
    logp, adv, mask = tensors()
    old = logp.clone()
    logp = logp.clone().requires_grad_()
    loss, metrics = clip_cov_loss(logp, old, adv, mask, ratio=1.0)
    base, _ = ppo_clip_loss(logp, old, adv, mask)
    (g,) = torch.autograd.grad((loss * mask).sum(), logp)
    (g0,) = torch.autograd.grad((base * mask).sum(), logp)
    # on-policy: gradient -A except at the two selected tokens
    expected = g0.clone()
    expected[0, 0] = expected[0, 3] = 0.0
    torch.testing.assert_close(g, expected)
    assert metrics["clipcov/frac_tokens"] == pytest.approx(2 / 4)
    assert metrics["clipcov/n_tokens"] == 2


def test_kl_cov_selects_top_covariance_and_penalises_abs_log_ratio() -> None:
    logp, adv, mask = tensors()
    sel = kl_cov_selection(logp, adv, mask, ratio=0.5)  # k = floor(4 * 0.5) = 2: (0,0) 2.75, (1,0) -2.625? no
    cov = hand_cov()
    top2 = sorted(cov, key=cov.get, reverse=True)[:2]
    assert {tuple(x) for x in torch.nonzero(sel).tolist()} == set(top2)
    old = logp - torch.tensor([[0.1, -0.2, 0.0, 0.3], [0.4, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    lp = logp.clone().requires_grad_()
    loss, metrics = kl_cov_loss(lp, old, adv, mask, ratio=0.5, coef=1.0)
    log_r = (logp - old)
    expected = -adv * log_r.exp()
    for i, t in top2:
        expected[i, t] += abs(float(log_r[i, t]))
    torch.testing.assert_close(loss.detach() * mask, expected * mask)
    pen = sum(abs(float(log_r[i, t])) for i, t in top2) / 4
    assert metrics["klcov/penalty"] == pytest.approx(pen)
    assert metrics["klcov/frac_tokens"] == pytest.approx(0.5)


def test_kl_cov_on_policy_penalty_is_zero_and_min_one_token() -> None:
    logp, adv, mask = tensors()
    assert int(kl_cov_selection(logp, adv, mask).sum()) == 1  # max(1, floor(4 * 2e-4))
    loss, metrics = kl_cov_loss(logp.clone().requires_grad_(), logp, adv, mask)
    assert metrics["klcov/penalty"] == 0.0
    torch.testing.assert_close(loss.detach(), -adv)
    assert not kl_cov_selection(logp, adv, torch.zeros_like(mask)).any()


def test_selections_take_one_advantage_per_sequence() -> None:
    # The trainer's advantages are [B] (one per rollout): KL-Cov's selection (used on top of every token-level
    # loss but ppo_clip) raised IndexError on them, and the covariance broadcast a [B] vector along T when
    # B == T (silently wrong) instead of along each row's tokens.
    torch.manual_seed(0)
    logp = -torch.rand(4, 4, dtype=torch.float64) * 3
    adv = torch.tensor([1.5, -0.5, 2.0, -3.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float64)
    per_token = adv[:, None].expand(4, 4)
    torch.testing.assert_close(token_covariance(logp, adv, mask), token_covariance(logp, per_token, mask))
    assert token_covariance(logp, adv, mask)[0, 0] != token_covariance(logp, adv[None, :].expand(4, 4), mask)[0, 0]
    assert torch.equal(kl_cov_selection(logp, adv, mask, ratio=0.3), kl_cov_selection(logp, per_token, mask, ratio=0.3))
    none = torch.zeros(4, 4, dtype=torch.bool)
    assert torch.equal(clip_cov_selection(logp, adv, mask, none, ratio=1.0, cov_lb=0.1, cov_ub=5.0),
                       clip_cov_selection(logp, per_token, mask, none, ratio=1.0, cov_lb=0.1, cov_ub=5.0))
    with pytest.raises(ValueError, match="advantages shape"):
        kl_cov_selection(logp, adv[:3], mask)


def test_kl_cov_ignores_only_ppo_clips_keywords() -> None:
    # It drops in for ppo_clip (whose clip settings it ignores), but a misspelt setting was silently ignored too.
    logp, adv, mask = tensors()
    loss, _ = kl_cov_loss(logp, logp, adv, mask, clip_low=0.2, clip_high=0.28, clip_dual=3.0)
    torch.testing.assert_close(loss, kl_cov_loss(logp, logp, adv, mask)[0])
    with pytest.raises(TypeError, match="coeff"):
        kl_cov_loss(logp, logp, adv, mask, coeff=0.5)


def test_entropy_advantage_hand_case() -> None:
    adv = torch.tensor([1.0, -1.0, 0.0])
    entropy = torch.tensor([[0.5, 2.0], [0.5, 2.0], [3.0, 3.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    shaped, metrics = entropy_advantage(adv, mask, entropy=entropy, alpha=0.4, kappa=2.0)
    # psi = min(0.4 H, |A| / 2): row 0: min(.2,.5)=.2, min(.8,.5)=.5; row 1 same; row 2: |A| = 0 -> 0
    torch.testing.assert_close(shaped, torch.tensor([[1.2, 1.5], [-0.8, -0.5], [0.0, 0.0]]))
    assert (shaped[1] < 0).all()  # kappa > 1: a negative advantage stays negative
    assert metrics["entadv/bonus_mean"] == pytest.approx((0.2 + 0.5 + 0.2) / 5)
    # |A|/kappa is the smaller term at (0, 1) and at both tokens of the A = 0 row
    assert metrics["entadv/capped_frac"] == pytest.approx(3 / 5)
    assert shape_advantages("entropy", adv, mask, entropy=entropy)[0].shape == (3, 2)
    assert set(ADVANTAGE_SHAPERS) == {"entropy"}
    with pytest.raises(ValueError, match="kappa"):
        entropy_advantage(adv, mask, entropy=entropy, kappa=1.0)


def test_forking_mask_quantile_ties_holes_and_empty() -> None:
    entropy = torch.tensor([[0.1, 0.9, 5.0, 0.3], [0.7, 0.2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    # valid entropies 0.1 0.9 0.3 0.7 0.2: the 0.6-quantile (linear) is 0.3 + 0.4 * (0.7 - 0.3) = 0.46
    keep = high_entropy_mask(entropy, mask, top_frac=0.4)
    assert keep.tolist() == [[False, True, False, False], [True, False, False, False]]
    assert not high_entropy_mask(entropy, torch.zeros_like(mask)).any()
    ties = high_entropy_mask(torch.ones(2, 3), torch.ones(2, 3), top_frac=0.2)
    assert ties.all()  # every token reaches the quantile of a constant


def test_forking_normalisations_differ_only_in_the_denominator() -> None:
    entropy = torch.tensor([[0.1, 0.9, 5.0, 0.3], [0.7, 0.2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]], dtype=torch.float32)
    loss_mat = torch.tensor([[1.0, 2.0, 100.0, 3.0], [4.0, 5.0, 100.0, 100.0]])
    w_sel, agg_sel, m_sel = token_mask("fork_selected", entropy, mask, top_frac=0.4)
    w_all, agg_all, m_all = token_mask("fork_all", entropy, mask, top_frac=0.4)
    paper = aggregate(loss_mat * w_sel, agg_sel, "token-mean")
    trl = aggregate(loss_mat * w_all, agg_all, "token-mean")
    assert paper.item() == pytest.approx((2.0 + 4.0) / 2)
    assert trl.item() == pytest.approx((2.0 + 4.0) / 5)
    assert m_sel == m_all == {"fork/frac_tokens": pytest.approx(2 / 5)}
    assert set(TOKEN_MASKS) == {"fork_selected", "fork_all"}


def test_registry_and_bad_settings_name_the_setting() -> None:
    assert set(COVARIANCE_LOSSES) == {"clip_cov", "kl_cov"}
    logp, adv, mask = tensors()
    with pytest.raises(ValueError, match="clip_cov ratio"):
        clip_cov_selection(logp, adv, mask, torch.zeros(3, 4, dtype=torch.bool), ratio=0.0)
    with pytest.raises(ValueError, match="cov_lb < cov_ub"):
        clip_cov_selection(logp, adv, mask, torch.zeros(3, 4, dtype=torch.bool), cov_lb=5, cov_ub=1)
    with pytest.raises(ValueError, match="kl_cov ratio"):
        kl_cov_selection(logp, adv, mask, ratio=2.0)
    with pytest.raises(ValueError, match="top_frac"):
        high_entropy_mask(logp.abs(), mask, top_frac=0.0)
    with pytest.raises(ValueError, match="unknown token mask"):
        token_mask("fork", logp.abs(), mask)
    assert math.isfinite(kl_cov_loss(logp, logp, adv, mask)[1]["approx_kl"])
