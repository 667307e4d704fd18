"""Paired bootstrap, permutation test, bootstrap CI and the comparison table."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from meshrl.stats import (
    BootstrapResult,
    bootstrap_ci,
    compare_table,
    format_compare_table,
    paired_bootstrap,
    paired_permutation_test,
)


@pytest.fixture
def scores() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    a = rng.uniform(0.2, 0.8, size=300)
    return a, np.clip(a - 0.1 + 0.05 * rng.standard_normal(300), 0, 1)


def test_bootstrap_identical_models(scores):
    a, _ = scores
    res = paired_bootstrap(a, a.copy(), n_boot=2000)
    assert isinstance(res, BootstrapResult)
    assert res.diff == 0.0 and res.ci_low <= 0.0 <= res.ci_high
    assert res.p_value == pytest.approx(1.0)


def test_bootstrap_noisy_equal_models_contains_zero():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2, size=200).astype(float)
    b = rng.permutation(a)  # same accuracy, unrelated per-problem outcomes
    res = paired_bootstrap(a, b, n_boot=4000)
    assert res.ci_low <= 0.0 <= res.ci_high
    assert res.p_value > 0.2


def test_bootstrap_clear_difference(scores):
    a, b = scores
    res = paired_bootstrap(a, b)
    assert res.diff == pytest.approx(a.mean() - b.mean())
    assert res.mean_a == pytest.approx(a.mean()) and res.mean_b == pytest.approx(b.mean())
    assert 0 < res.ci_low < res.diff < res.ci_high
    assert res.p_value < 0.01
    assert res.p_value == pytest.approx(1 / (res.n_boot + 1))  # no centred resample reaches the observation
    swapped = paired_bootstrap(b, a)
    assert swapped.diff == pytest.approx(-res.diff) and swapped.ci_high < 0


def test_bootstrap_ci_matches_normal_theory(scores):
    # for a mean of 300 i.i.d. differences the percentile CI is close to mean +- 1.96 * sd / sqrt(P)
    a, b = scores
    d = a - b
    res = paired_bootstrap(a, b, n_boot=20000, seed=1)
    half = 1.959964 * d.std() / np.sqrt(d.size)
    assert res.ci_low == pytest.approx(d.mean() - half, abs=0.1 * half)
    assert res.ci_high == pytest.approx(d.mean() + half, abs=0.1 * half)


def test_bootstrap_seeds_are_deterministic(scores):
    a, b = scores
    b = b + 0.1  # difference near 0, so the p-value depends on the draws
    assert paired_bootstrap(a, b, n_boot=500, seed=5) == paired_bootstrap(a, b, n_boot=500, seed=5)
    assert paired_bootstrap(a, b, n_boot=500, seed=5) != paired_bootstrap(a, b, n_boot=500, seed=6)


def test_bootstrap_cross_check_scipy(scores):
    sp = pytest.importorskip("scipy.stats")
    a, b = scores
    ref = sp.bootstrap((a - b,), np.mean, n_resamples=20000, method="percentile", random_state=0)
    res = paired_bootstrap(a, b, n_boot=20000)
    width = ref.confidence_interval.high - ref.confidence_interval.low
    assert res.ci_low == pytest.approx(ref.confidence_interval.low, abs=0.05 * width)
    assert res.ci_high == pytest.approx(ref.confidence_interval.high, abs=0.05 * width)


def brute_force_sign_flip_p(d: np.ndarray) -> float:
    observed = abs(sum(d))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d, strict=True))) >= observed - 1e-12
               for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


@pytest.mark.parametrize("seed", range(4))
def test_permutation_exact_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    p = 5 + 2 * seed
    a = rng.integers(0, 5, size=p) / 4  # quarter steps: many exact ties
    b = rng.integers(0, 5, size=p) / 4
    assert paired_permutation_test(a, b) == pytest.approx(brute_force_sign_flip_p(a - b), abs=1e-15)


def test_permutation_exact_known_values():
    # every problem better by the same amount: only s = +1 and s = -1 reach |sum| -> p = 2 / 2^P
    a, b = np.ones(10), np.zeros(10)
    assert paired_permutation_test(a, b) == pytest.approx(2 / 2**10)
    assert paired_permutation_test(a, a) == 1.0
    assert paired_permutation_test([0.3], [0.1]) == 1.0  # one problem: both signs give the same |d|
    # 0.1 + 0.2 vs 0.3 in floating point: ties within rounding still count
    assert paired_permutation_test([0.1, 0.2, 0.3], [0.0, 0.0, 0.0]) == pytest.approx(brute_force_sign_flip_p(
        np.array([0.1, 0.2, 0.3])))


def test_permutation_monte_carlo(scores):
    a, b = scores
    assert paired_permutation_test(a, b) == pytest.approx(1 / 10001)
    assert paired_permutation_test(a, a) == 1.0
    rng = np.random.default_rng(11)
    x = rng.normal(size=40)
    y = x + rng.normal(scale=1.0, size=40) * 0.5 + 0.05
    p1 = paired_permutation_test(x, y, n_perm=5000, seed=3)
    assert p1 == paired_permutation_test(x, y, n_perm=5000, seed=3)
    exact = paired_permutation_test(x[:18], y[:18], exact_max_problems=18)
    mc = paired_permutation_test(x[:18], y[:18], n_perm=40000, exact_max_problems=0)
    assert mc == pytest.approx(exact, abs=0.01)


def test_bootstrap_ci_values():
    rng = np.random.default_rng(2)
    x = rng.normal(1.0, 2.0, size=400)
    lo, hi = bootstrap_ci(x, n_boot=20000)
    half = 1.959964 * x.std() / np.sqrt(x.size)
    assert lo == pytest.approx(x.mean() - half, abs=0.1 * half)
    assert hi == pytest.approx(x.mean() + half, abs=0.1 * half)
    med = bootstrap_ci(x, stat=np.median, n_boot=2000)
    assert med.low < np.median(x) < med.high
    custom = bootstrap_ci(x, stat=lambda v: float(np.mean(v)), n_boot=2000, seed=4)
    assert custom == pytest.approx(bootstrap_ci(x, n_boot=2000, seed=4), abs=1e-12)  # same draws
    assert bootstrap_ci(x, seed=9, n_boot=300) == bootstrap_ci(x, seed=9, n_boot=300)


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: paired_bootstrap([0.1, 0.2], [0.1, 0.2, 0.3]), "scores_a"),
        (lambda: paired_bootstrap([0.1], [0.1]), "scores_a"),
        (lambda: paired_bootstrap([0.1, 0.2], [0.1, np.nan]), "scores_b"),
        (lambda: paired_bootstrap([0.1, 0.2], [0.1, 0.3], n_boot=0), "n_boot"),
        (lambda: paired_bootstrap([0.1, 0.2], [0.1, 0.3], ci=95), "ci"),
        (lambda: paired_bootstrap([0.1, 0.2], [0.1, 0.3], seed=-1), "seed"),
        (lambda: paired_permutation_test([[0.1]], [[0.2]]), "scores_a"),
        (lambda: paired_permutation_test([0.1], [0.2], n_perm=0), "n_perm"),
        (lambda: paired_permutation_test([0.1], [0.2], exact_max_problems=30), "exact_max_problems"),
        (lambda: bootstrap_ci([]), "values"),
        (lambda: bootstrap_ci([1.0, 2.0], stat=3), "stat"),
        (lambda: bootstrap_ci([1.0, "x"]), "values"),
    ],
)
def test_bad_inputs_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call()


def test_compare_table(scores):
    a, b = scores
    rng = np.random.default_rng(0)
    same = rng.uniform(size=50)
    rows = compare_table(
        {"math": a, "code": same, "small": a[:8]},
        {"math": b, "code": same, "small": b[:8]},
        samples_per_problem={"math": 4, "code": 1, "small": 2},
        n_boot=2000,
        n_perm=2000,
    )
    assert [r.benchmark for r in rows] == ["math", "code", "small"]
    math_row, code_row, small_row = rows
    assert math_row.significant and not code_row.significant
    assert code_row.diff == 0.0 and code_row.p_adjusted == 1.0 and code_row.z == 0.0
    assert math_row.p_adjusted == pytest.approx(min(1.0, 3 * math_row.p_bootstrap))  # smallest p: times m
    assert small_row.p_permutation == pytest.approx(paired_permutation_test(a[:8], b[:8]))
    from meshrl.stats import two_proportion_z

    assert math_row.z == pytest.approx(two_proportion_z(4 * a.sum(), 1200, 4 * b.sum(), 1200)[0])
    assert math_row.ci_low <= math_row.diff <= math_row.ci_high
    text = format_compare_table(rows, ci=0.95)
    assert "95% CI" in text and "math" in text and text.count("\n") == 4
    assert rows[0].as_dict()["benchmark"] == "math"
    by_perm = compare_table({"m": a}, {"m": b}, correct="permutation", n_boot=100, n_perm=100)
    assert by_perm[0].p_adjusted == by_perm[0].p_permutation and by_perm[0].corrected == "permutation"


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"scores_a": {"m": [0.1, 0.2]}, "scores_b": {"n": [0.1, 0.2]}}, "scores_a"),
        ({"scores_a": {}, "scores_b": {}}, "scores_a"),
        ({"scores_a": {"m": [0.1, 1.2]}, "scores_b": {"m": [0.1, 0.2]}}, "scores"),
        ({"scores_a": {"m": [0.1, 0.2]}, "scores_b": {"m": [0.1, 0.2]}, "correct": "bonferroni"}, "correct"),
        ({"scores_a": {"m": [0.1, 0.2]}, "scores_b": {"m": [0.1, 0.2]}, "samples_per_problem": 0},
         "samples_per_problem"),
        ({"scores_a": {"m": [0.1, 0.2]}, "scores_b": {"m": [0.1, 0.2]}, "samples_per_problem": {"x": 1}},
         "samples_per_problem"),
    ],
)
def test_compare_table_bad_inputs(kwargs, name):
    with pytest.raises(ValueError, match=name):
        compare_table(**kwargs)
