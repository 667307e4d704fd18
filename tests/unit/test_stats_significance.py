"""z-test, Wilson interval and Holm correction against hand computations and published values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.stats import holm_correction, normal_quantile, normal_two_sided_p, two_proportion_z, wilson_interval


def test_z_hand_computation():
    # A: 60/100, B: 45/100. pooled p = 105/200 = 0.525; SE = sqrt(0.525*0.475*(1/100+1/100)) = sqrt(0.0049875)
    z, p = two_proportion_z(60, 100, 45, 100)
    assert z == pytest.approx(0.15 / math.sqrt(0.0049875), rel=1e-12)
    assert z == pytest.approx(2.12398, abs=1e-5)
    assert p == pytest.approx(0.033672, abs=1e-6)
    z2, p2 = two_proportion_z(45, 100, 60, 100)
    assert z2 == pytest.approx(-z) and p2 == pytest.approx(p)


def test_z_unequal_sizes_and_degenerate():
    z, _ = two_proportion_z(30, 50, 90, 200)
    pooled = 120 / 250
    assert z == pytest.approx((0.6 - 0.45) / math.sqrt(pooled * (1 - pooled) * (1 / 50 + 1 / 200)), rel=1e-12)
    assert two_proportion_z(0, 10, 0, 20) == (0.0, 1.0)
    assert two_proportion_z(10, 10, 20, 20) == (0.0, 1.0)
    assert two_proportion_z(12.5, 20, 7.25, 20)[0] > 0  # fractional (pooled accuracy) counts are allowed


def test_normal_tail_known_values():
    assert normal_two_sided_p(1.959963984540054) == pytest.approx(0.05, rel=1e-12)
    assert normal_two_sided_p(0.0) == 1.0
    assert normal_two_sided_p(10.0) == pytest.approx(1.5239706e-23, rel=1e-6)  # 1 - cdf would be 0
    assert normal_quantile(0.975) == pytest.approx(1.959963984540054, rel=1e-12)


def test_cross_check_with_scipy():
    sp = pytest.importorskip("scipy.stats")
    for args in [(60, 100, 45, 100), (3, 40, 11, 40), (500, 1000, 530, 1000)]:
        z, p = two_proportion_z(*args)
        assert p == pytest.approx(2 * sp.norm.sf(abs(z)), rel=1e-10)
    for s, n in [(81, 263), (0, 20), (1, 29), (29, 29), (7, 12)]:
        lo, hi = wilson_interval(s, n, 0.9)
        ref = sp.binomtest(s, n).proportion_ci(confidence_level=0.9, method="wilson")
        assert (lo, hi) == pytest.approx((ref.low, ref.high), abs=1e-12)


@pytest.mark.parametrize(
    "s,n,lo,hi",
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Stat. Med. 17:857, Table II
    # method 3 (score interval without continuity correction), 95%.
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_textbook_values(s, n, lo, hi):
    got = wilson_interval(s, n)
    assert got.low == pytest.approx(lo, abs=5e-5)
    assert got.high == pytest.approx(hi, abs=5e-5)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 500).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_contains_the_estimate(sn):
    s, n = sn
    lo, hi = wilson_interval(s, n)
    assert 0.0 <= lo <= s / n <= hi <= 1.0
    lo99, hi99 = wilson_interval(s, n, 0.99)
    assert lo99 <= lo + 1e-15 and hi99 >= hi - 1e-15


def test_holm_worked_example():
    # Wikipedia, "Holm-Bonferroni method", example: four hypotheses, alpha = 0.05.
    # sorted: 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06, 0.04*1 = 0.04 -> max(0.06, 0.04) = 0.06
    adjusted, reject = holm_correction([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    np.testing.assert_allclose(adjusted, [0.03, 0.06, 0.06, 0.02], rtol=1e-12)
    assert reject.tolist() == [True, False, False, True]


def test_holm_matches_r_p_adjust():
    # R: p.adjust(c(0.01, 0.02, 0.03, 0.04, 0.05), "holm") -> 0.05 0.08 0.09 0.09 0.09
    adjusted, reject = holm_correction([0.01, 0.02, 0.03, 0.04, 0.05])
    np.testing.assert_allclose(adjusted, [0.05, 0.08, 0.09, 0.09, 0.09], rtol=1e-12)
    assert reject.tolist() == [True, False, False, False, False]
    adjusted, _ = holm_correction([0.5, 0.9])
    np.testing.assert_allclose(adjusted, [1.0, 1.0])  # capped at 1
    assert holm_correction([])[0].shape == (0,)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=30))
def test_holm_properties(ps):
    p = np.array(ps)
    adjusted, reject = holm_correction(p, alpha=0.05)
    m = len(ps)
    assert (adjusted >= p - 1e-15).all() and (adjusted <= np.minimum(1, m * p) + 1e-15).all()
    order = np.argsort(p, kind="stable")
    assert (np.diff(adjusted[order]) >= -1e-15).all()  # monotone in the sorted order
    # the step-down rule itself
    want = np.zeros(m, dtype=bool)
    for i, j in enumerate(order):
        if p[j] <= 0.05 / (m - i):
            want[j] = True
        else:
            break
    assert (reject == want).all()


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: two_proportion_z(5, 0, 1, 10), "n_a"),
        (lambda: two_proportion_z(11, 10, 1, 10), "successes_a"),
        (lambda: two_proportion_z(1, 10, -1, 10), "successes_b"),
        (lambda: two_proportion_z(1, 10, 1, float("nan")), "n_b"),
        (lambda: wilson_interval(3, 10, confidence=1.0), "confidence"),
        (lambda: wilson_interval(11, 10), "successes"),
        (lambda: holm_correction([0.1, 1.2]), "p_values"),
        (lambda: holm_correction([[0.1]]), "p_values"),
        (lambda: holm_correction([0.1], alpha=0), "alpha"),
        (lambda: normal_quantile(1.5), "q"),
    ],
)
def test_bad_inputs_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call()
