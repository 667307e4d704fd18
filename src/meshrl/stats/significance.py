"""Closed-form tests and intervals for proportions, and Holm's multiple-comparison correction."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from meshrl.stats._checks import check_1d, check_level, check_real

__all__ = [
    "Interval",
    "holm_correction",
    "normal_quantile",
    "normal_two_sided_p",
    "two_proportion_z",
    "wilson_interval",
]


class Interval(NamedTuple):
    """A confidence interval; unpacks as ``low, high``."""

    low: float
    high: float


def normal_two_sided_p(z: float) -> float:
    """Two-sided standard-normal tail ``P(|Z| >= |z|) = erfc(|z| / sqrt(2))`` (accurate far in the tail,
    where ``1 - cdf`` would round to 0)."""
    return math.erfc(abs(z) / math.sqrt(2.0))


def normal_quantile(q: float) -> float:
    """Inverse standard-normal cdf (Wichura's AS 241 via :class:`statistics.NormalDist`), ``0 < q < 1``."""
    return NormalDist().inv_cdf(check_level("q", q))


def _check_count(name: str, successes: object, n_name: str, n: object) -> tuple[float, float]:
    s, m = check_real(name, successes), check_real(n_name, n)
    if m <= 0:
        raise ValueError(f"{n_name} must be > 0, got {m}")
    if not 0 <= s <= m:
        raise ValueError(f"{name} must be in [0, {n_name}={m}], got {s}")
    return s, m


def two_proportion_z(successes_a: float, n_a: float, successes_b: float, n_b: float) -> tuple[float, float]:
    """Pooled two-proportion z-test of ``H0: p_a == p_b``; returns ``(z, p_two_sided)``.

    Formula (e.g. Agresti, "Categorical Data Analysis", 3rd ed., §3.1.1 with the pooled null SE)::

        p_a = s_a / n_a,  p_b = s_b / n_b,  p = (s_a + s_b) / (n_a + n_b)
        z = (p_a - p_b) / sqrt(p (1 - p) (1 / n_a + 1 / n_b)),   p_two_sided = erfc(|z| / sqrt(2))

    ``z > 0`` means A is better. When both samples are all-success or all-failure the SE is 0 and the
    result is ``(0.0, 1.0)``.

    Caveat: the test treats every sample as independent. Applied to per-sample accuracies (k samples of
    each of P problems pooled as ``n = P * k`` trials) it ignores that samples of one problem are
    correlated and so overstates significance; it is provided because readers computed it that way. Use
    :func:`paired_bootstrap` / :func:`paired_permutation_test` over problems for a trustworthy answer.
    Counts may be non-integer (e.g. ``sum`` of per-problem accuracies).
    """
    s_a, m_a = _check_count("successes_a", successes_a, "n_a", n_a)
    s_b, m_b = _check_count("successes_b", successes_b, "n_b", n_b)
    pooled = (s_a + s_b) / (m_a + m_b)
    var = pooled * (1.0 - pooled) * (1.0 / m_a + 1.0 / m_b)
    if var <= 0.0:
        return 0.0, 1.0
    z = (s_a / m_a - s_b / m_b) / math.sqrt(var)
    return z, normal_two_sided_p(z)


def wilson_interval(successes: float, n: float, confidence: float = 0.95) -> Interval:
    """Wilson score interval for a binomial proportion (Wilson 1927; Newcombe 1998, method 3)::

        z = Phi^-1(1 - (1 - confidence) / 2),  p = s / n
        centre = (p + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))

    Unlike the Wald interval it stays inside [0, 1] and does not collapse to a point at 0 or n successes.
    """
    s, m = _check_count("successes", successes, "n", n)
    z = NormalDist().inv_cdf(1.0 - (1.0 - check_level("confidence", confidence)) / 2.0)
    p = s / m
    denom = 1.0 + z * z / m
    centre = (p + z * z / (2.0 * m)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / m + z * z / (4.0 * m * m))
    low = 0.0 if s == 0 else max(0.0, centre - half)  # exact ends: rounding must not exclude p = 0 or 1
    high = 1.0 if s == m else min(1.0, centre + half)
    return Interval(low, high)


def holm_correction(p_values: object, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Holm-Bonferroni step-down correction (Holm 1979) of ``m`` p-values; returns ``(adjusted, reject)``.

    With the p-values sorted ascending ``p_(1) <= ... <= p_(m)``, the adjusted values are::

        p~_(i) = min(1, max_{j <= i} (m - j + 1) * p_(j))

    (the running max keeps them monotone in the sorted order), reported in the input order;
    ``reject = adjusted <= alpha``, which is the same as rejecting ``H_(1..i)`` while
    ``p_(i) <= alpha / (m - i + 1)``. Controls the family-wise error rate at ``alpha`` under any dependence.
    """
    p = check_1d("p_values", p_values, min_len=0)
    if ((p < 0) | (p > 1)).any():
        raise ValueError("p_values must lie in [0, 1]")
    alpha = check_level("alpha", alpha)
    m = p.shape[0]
    order = np.argsort(p, kind="stable")
    scaled = (m - np.arange(m)) * p[order]
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(scaled)) if m else scaled
    return adjusted, adjusted <= alpha
