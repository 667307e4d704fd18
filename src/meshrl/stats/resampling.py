"""Resampling inference over problems: paired bootstrap, paired sign-flip permutation test, bootstrap CI.

Samples of one problem are correlated, so the unit of resampling is the *problem*: every function takes
per-problem scores (accuracy, mean@k or pass@k of each problem) and, for the paired ones, model A's and
model B's scores on the same problems in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from meshrl.stats._checks import check_1d, check_int, check_level, check_paired
from meshrl.stats.significance import Interval

__all__ = ["BootstrapResult", "bootstrap_ci", "paired_bootstrap", "paired_permutation_test"]

_CHUNK_ELEMS = 1 << 22  # resampled values held in memory at once (32 MiB of float64)


@dataclass(frozen=True)
class BootstrapResult:
    """Outcome of :func:`paired_bootstrap`; ``diff = mean_a - mean_b`` over problems."""

    mean_a: float
    mean_b: float
    diff: float
    ci_low: float
    ci_high: float
    p_value: float
    ci: float
    n_boot: int
    n_problems: int


def _chunks(total: int, width: int) -> Iterator[int]:
    rows = max(1, _CHUNK_ELEMS // max(1, width))
    done = 0
    while done < total:
        size = min(rows, total - done)
        yield size
        done += size


def _resampled_means(values: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``[n_boot]`` means of ``values`` resampled with replacement (same length as ``values``)."""
    p = values.shape[0]
    out = [values[rng.integers(0, p, size=(rows, p))].mean(axis=1) for rows in _chunks(n_boot, p)]
    return np.concatenate(out)


def _tolerance(d: np.ndarray) -> float:
    """Ties within rounding: resampled statistics are sums of the same values in another order."""
    return 1e-9 * float(np.abs(d).sum()) / d.shape[0]


def paired_bootstrap(
    scores_a: object, scores_b: object, n_boot: int = 10000, seed: int = 0, ci: float = 0.95
) -> BootstrapResult:
    """Paired bootstrap over problems of the mean difference ``mean(a) - mean(b)``.

    Method (Efron & Tibshirani 1993, "An Introduction to the Bootstrap": §13.3 percentile interval and
    §16.4 the shift method for a test of a mean):

    1. ``d_p = a_p - b_p`` per problem, observed ``D = mean(d)``.
    2. ``n_boot`` times, draw ``P`` problems with replacement (the same draw for A and B, which keeps
       the pairing) and record ``D*_b = mean(d[idx])``.
    3. CI: the ``(1-ci)/2`` and ``(1+ci)/2`` quantiles of ``D*`` (percentile interval, linear
       interpolation).
    4. p-value: centre the bootstrap distribution on the null (``D*_b - D``, the distribution of the mean
       of ``d - D``, whose mean is 0) and count how often it is at least as extreme as the observation::

           p = (1 + #{b : |D*_b - D| >= |D|}) / (n_boot + 1)

       (the +1 counts the observed data as one resample, so ``p > 0``; Davison & Hinkley 1997 eq. 4.11).
       Identical models give ``D = 0`` and ``p = 1``.

    Args:
        scores_a, scores_b: ``[P]`` per-problem scores of the two models on the same problems, ``P >= 2``.
        n_boot: bootstrap resamples, ``>= 1``.
        seed: seed of ``numpy.random.default_rng``; the result is deterministic given the inputs.
        ci: two-sided confidence level in (0, 1).
    """
    a, b = check_paired("scores_a", scores_a, "scores_b", scores_b, min_len=2)
    n_boot = check_int("n_boot", n_boot, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    ci = check_level("ci", ci)
    d = a - b
    observed = float(d.mean())
    boot = _resampled_means(d, n_boot, np.random.default_rng(seed))
    low, high = np.quantile(boot, [(1.0 - ci) / 2.0, (1.0 + ci) / 2.0])
    extreme = np.abs(boot - observed) >= abs(observed) - _tolerance(d)
    p_value = (1.0 + float(extreme.sum())) / (n_boot + 1.0)
    return BootstrapResult(
        mean_a=float(a.mean()),
        mean_b=float(b.mean()),
        diff=observed,
        ci_low=float(low),
        ci_high=float(high),
        p_value=min(1.0, p_value),
        ci=ci,
        n_boot=n_boot,
        n_problems=int(d.shape[0]),
    )


def paired_permutation_test(
    scores_a: object, scores_b: object, n_perm: int = 10000, seed: int = 0, exact_max_problems: int = 16
) -> float:
    """Two-sided paired permutation (sign-flip) test of ``H0``: A and B are exchangeable on each problem.

    Under ``H0`` the sign of each per-problem difference ``d_p = a_p - b_p`` is a fair coin, so the
    statistic ``T(s) = |sum_p s_p d_p|`` (equivalently ``|mean|``) over sign vectors ``s in {-1, +1}^P``
    is the null distribution of the observed ``T(1)`` (Fisher 1935; Good, "Permutation Tests", §3.1).

    - ``P <= exact_max_problems``: exact, over all ``2^P`` sign vectors, ``p = #{s : T(s) >= T(1)} / 2^P``.
    - otherwise Monte Carlo with ``n_perm`` random sign vectors: ``p = (1 + #{T(s) >= T(1)}) / (n_perm + 1)``
      (Phipson & Smyth 2010: never 0, valid for a finite number of permutations).

    Ties are counted as extreme (within a rounding tolerance), so identical models give ``p = 1``.
    """
    a, b = check_paired("scores_a", scores_a, "scores_b", scores_b)
    n_perm = check_int("n_perm", n_perm, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    exact_max_problems = check_int("exact_max_problems", exact_max_problems, minimum=0)
    if exact_max_problems > 24:
        raise ValueError(f"exact_max_problems must be <= 24 (2^P sign vectors), got {exact_max_problems}")
    d = a - b
    p = d.shape[0]
    threshold = abs(float(d.sum())) - _tolerance(d) * p
    if p <= exact_max_problems:
        count = 0
        codes = np.arange(1 << p, dtype=np.int64)
        step = max(1, _CHUNK_ELEMS // p)
        for start in range(0, codes.shape[0], step):
            bits = (codes[start : start + step, None] >> np.arange(p)) & 1
            count += int((np.abs((1 - 2 * bits) @ d) >= threshold).sum())
        return count / float(1 << p)
    rng = np.random.default_rng(seed)
    count = 0
    for rows in _chunks(n_perm, p):
        signs = 1 - 2 * rng.integers(0, 2, size=(rows, p))
        count += int((np.abs(signs @ d) >= threshold).sum())
    return min(1.0, (1.0 + count) / (n_perm + 1.0))


def bootstrap_ci(
    values: object,
    stat: Callable[[np.ndarray], float] = np.mean,
    n_boot: int = 10000,
    seed: int = 0,
    ci: float = 0.95,
) -> Interval:
    """Percentile bootstrap CI of ``stat(values)`` (Efron & Tibshirani 1993, §13.3).

    ``values`` are i.i.d. units (e.g. per-problem scores); each of ``n_boot`` resamples draws
    ``len(values)`` of them with replacement and the interval is the ``(1-ci)/2`` and ``(1+ci)/2``
    quantiles of ``stat`` over the resamples. ``np.mean`` and ``np.median`` are evaluated vectorised;
    any other ``stat`` is called once per resample with a 1-D array and must return a finite number.
    """
    x = check_1d("values", values)
    n_boot = check_int("n_boot", n_boot, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    ci = check_level("ci", ci)
    if not callable(stat):
        raise ValueError(f"stat must be callable, got {stat!r}")
    rng = np.random.default_rng(seed)
    n = x.shape[0]
    parts = []
    for rows in _chunks(n_boot, n):
        sample = x[rng.integers(0, n, size=(rows, n))]
        if stat is np.mean or stat is np.median:
            parts.append(stat(sample, axis=1))
        else:
            parts.append(np.array([float(stat(row)) for row in sample]))
    boot = np.concatenate(parts)
    if not np.isfinite(boot).all():
        raise ValueError("stat returned a non-finite value on a bootstrap resample")
    low, high = np.quantile(boot, [(1.0 - ci) / 2.0, (1.0 + ci) / 2.0])
    return Interval(float(low), float(high))
