"""pass@k and mean@k against closed forms, exact rational arithmetic and hand computations."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.stats import (
    mean_at_k,
    mean_at_k_per_problem,
    mean_pass_at_k,
    pass_at_k,
    pass_at_k_per_problem,
)


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The definition, 1 - C(n-c, k) / C(n, k), in exact rational arithmetic (math.comb is 0 for k > n-c)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_hand_computed_n5_c2_k2():
    # 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)


@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (200, 128), (3000, 128)])
def test_closed_forms(n, k):
    assert pass_at_k(n, 0, k) == 0.0
    assert pass_at_k(n, n, k) == 1.0
    for c in (0, 1, n // 3, n):
        assert pass_at_k(n, c, 1) == pytest.approx(c / n, rel=1e-12, abs=1e-15)


def test_all_draws_correct_when_fewer_wrong_than_k():
    assert pass_at_k(10, 8, 3) == 1.0  # only 2 wrong samples: any 3 draws contain a correct one
    assert pass_at_k(10, 7, 3) == pytest.approx(1 - 1 / math.comb(10, 3), rel=1e-13)


@pytest.mark.parametrize("c", [1, 2, 5, 17, 100, 500, 871, 872, 999])
def test_large_n_k128_matches_exact_fractions(c):
    n, k = 1000, 128
    got = pass_at_k(n, c, k)
    want = float(exact_pass_at_k(n, c, k))
    assert math.isfinite(got)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_n_in_the_thousands_does_not_overflow():
    with pytest.raises(OverflowError):
        float(math.comb(20000, 128))  # ~1e334: naive float binomials overflow
    for n, c in [(5000, 3), (20000, 7), (20000, 150)]:
        got = pass_at_k(n, c, 128)
        assert got == pytest.approx(float(exact_pass_at_k(n, c, 128)), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_matches_definition_everywhere(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 80).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n - 1))))
def test_monotone_in_k(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k + 1) >= pass_at_k(n, c, k) - 1e-15


def test_vectorised_mean_over_problems():
    c = np.array([0, 1, 3, 5, 5])
    per = pass_at_k_per_problem(5, c, 2)
    want = [float(exact_pass_at_k(5, int(ci), 2)) for ci in c]
    np.testing.assert_allclose(per, want, rtol=1e-13, atol=1e-15)
    assert mean_pass_at_k(5, c, 2) == pytest.approx(np.mean(want), rel=1e-13)
    # per-problem n
    n = np.array([4, 10, 1000])
    c = np.array([1, 0, 3])
    want = [float(exact_pass_at_k(int(a), int(b), 4)) for a, b in zip(n, c, strict=True)]
    np.testing.assert_allclose(pass_at_k_per_problem(n, c, 4), want, rtol=1e-12, atol=1e-15)


def test_k1_mean_is_plain_accuracy():
    c = np.array([3, 0, 16, 8])
    assert mean_pass_at_k(16, c, 1) == pytest.approx(c.sum() / 64)


@pytest.mark.parametrize(
    "args,name",
    [((5, 2, 6), "k"), ((5, 2, 0), "k"), ((5, 6, 2), "c"), ((5, -1, 2), "c"), ((0, 0, 1), "n"),
     ((5.0, 2, 2), "n"), ((5, 2, 2.5), "k"), ((5, True, 1), "c")],
)
def test_bad_inputs_name_the_argument(args, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        pass_at_k(*args)


def test_vectorised_bad_inputs():
    with pytest.raises(ValueError, match=r"^k"):
        pass_at_k_per_problem([4, 10], [1, 1], 5)
    with pytest.raises(ValueError, match=r"^c"):
        pass_at_k_per_problem(5, [1, 6], 2)
    with pytest.raises(ValueError, match=r"^c"):
        pass_at_k_per_problem(5, [], 2)
    with pytest.raises(ValueError, match=r"^n"):
        pass_at_k_per_problem([5, 5, 5], [1, 2], 2)
    with pytest.raises(ValueError, match=r"^c"):
        pass_at_k_per_problem(5, [1.5, 2], 2)


def test_mean_at_k_estimators():
    correct = np.array([[1, 0, 0, 1], [1, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(mean_at_k_per_problem(correct, 2), [0.5, 1.0, 0.0])
    np.testing.assert_allclose(mean_at_k_per_problem(correct, 2, estimator="all"), [0.5, 0.75, 0.0])
    assert mean_at_k(correct, 2) == pytest.approx(0.5)
    assert mean_at_k(correct, 2, estimator="all") == pytest.approx(1.25 / 3)
    assert mean_at_k(correct, 4) == mean_at_k(correct, 4, estimator="all")  # agree when k == n
    # mean@1 with all samples equals pass@1
    assert mean_at_k(correct, 1, estimator="all") == pytest.approx(mean_pass_at_k(4, correct.sum(1), 1))


def test_mean_at_k_bad_inputs():
    with pytest.raises(ValueError, match=r"^k"):
        mean_at_k(np.ones((2, 3)), 4)
    with pytest.raises(ValueError, match=r"^correct"):
        mean_at_k(np.ones(3), 1)
    with pytest.raises(ValueError, match=r"^correct"):
        mean_at_k(np.full((2, 2), 2.0), 1)
    with pytest.raises(ValueError, match=r"estimator"):
        mean_at_k(np.ones((2, 2)), 1, estimator="best")
