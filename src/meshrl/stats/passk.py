"""Sample-based accuracy metrics per benchmark: unbiased pass@k and mean@k.

Notation: a problem has ``n`` sampled completions of which ``c`` are correct; ``k <= n`` is the budget
the metric pretends to have drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshrl.stats._checks import check_choice, check_int

__all__ = [
    "MEAN_AT_K_ESTIMATORS",
    "mean_at_k",
    "mean_at_k_per_problem",
    "mean_pass_at_k",
    "pass_at_k",
    "pass_at_k_per_problem",
]

MEAN_AT_K_ESTIMATORS = ("first", "all")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples with ``c`` correct.

    Formula (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1 and the
    numerically stable form of their Figure 3)::

        pass@k = 1 - C(n - c, k) / C(n, k)
               = 1 - prod_{i = n-c+1}^{n} (1 - k / i)       (= 1 exactly when n - c < k)

    i.e. the probability that at least one of ``k`` samples drawn without replacement from the ``n`` is
    correct. The product has ``c`` factors in (0, 1), so it neither overflows nor cancels for ``k = 128``
    and ``n`` in the thousands (binomials such as C(1000, 128) are ~1e174).

    Args:
        n: samples drawn for the problem, ``>= 1``.
        c: correct samples, ``0 <= c <= n``.
        k: ``1 <= k <= n``; ``k > n`` raises (there is no unbiased estimate from fewer samples than k).
    """
    n = check_int("n", n, minimum=1)
    c = check_int("c", c, minimum=0)
    k = check_int("k", k, minimum=1)
    if c > n:
        raise ValueError(f"c must be <= n={n}, got {c}")
    if k > n:
        raise ValueError(f"k must be <= n={n} (pass@k needs at least k samples per problem), got {k}")
    return _pass_at_k(n, c, k)


def _pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    if c == 0:
        return 0.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def _counts(n: int | Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate per-problem ``(n, c)`` arrays; a scalar ``n`` is shared by every problem."""
    c_arr = np.asarray(c)
    if c_arr.ndim != 1 or c_arr.shape[0] == 0:
        raise ValueError(f"c must be a non-empty 1-D array of per-problem correct counts, got shape {c_arr.shape}")
    n_arr = np.broadcast_to(np.asarray(n), c_arr.shape) if np.ndim(n) == 0 else np.asarray(n)
    if n_arr.shape != c_arr.shape:
        raise ValueError(f"n has shape {n_arr.shape} but c has shape {c_arr.shape}")
    for name, arr in (("n", n_arr), ("c", c_arr)):
        if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and np.all(arr == np.round(arr))):
            raise ValueError(f"{name} must hold integer counts, got dtype {arr.dtype}")
    n_arr, c_arr = n_arr.astype(np.int64), c_arr.astype(np.int64)
    if (n_arr < 1).any():
        raise ValueError(f"n must be >= 1 for every problem, got min {int(n_arr.min())}")
    if (c_arr < 0).any() or (c_arr > n_arr).any():
        raise ValueError("c must satisfy 0 <= c <= n for every problem")
    return n_arr, c_arr


def pass_at_k_per_problem(
    n: int | Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray, k: int
) -> np.ndarray:
    """:func:`pass_at_k` for each problem: ``[P]`` float64 from per-problem counts ``c`` (``[P]``) and ``n``
    (``[P]``, or one int shared by all problems). ``k`` larger than any problem's ``n`` raises."""
    n_arr, c_arr = _counts(n, c)
    k = check_int("k", k, minimum=1)
    if k > int(n_arr.min()):
        raise ValueError(f"k must be <= n for every problem (min n = {int(n_arr.min())}), got {k}")
    return np.array([_pass_at_k(int(ni), int(ci), k) for ni, ci in zip(n_arr, c_arr, strict=True)])


def mean_pass_at_k(n: int | Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray, k: int) -> float:
    """Benchmark pass@k: the mean over problems of :func:`pass_at_k_per_problem` (Chen et al. 2021 §2.1)."""
    return float(pass_at_k_per_problem(n, c, k).mean())


def _correct_matrix(correct: object) -> np.ndarray:
    arr = np.asarray(correct, dtype=np.float64)
    if arr.ndim != 2 or 0 in arr.shape:
        raise ValueError(f"correct must be a non-empty 2-D [problems, samples] array, got shape {arr.shape}")
    if not np.isfinite(arr).all() or (arr < 0).any() or (arr > 1).any():
        raise ValueError("correct must hold scores in [0, 1] (1 = correct sample)")
    return arr


def mean_at_k_per_problem(correct: object, k: int, *, estimator: str = "first") -> np.ndarray:
    """Per-problem mean@k (a.k.a. avg@k): the average correctness of ``k`` samples of each problem.

    Two estimators from a ``[P, n]`` matrix of per-sample scores in [0, 1] (1 = correct), ``k <= n``:

    - ``"first"`` (default): ``mean(correct[p, :k])``, literally "sample k completions and average", as
      reported by papers that draw exactly k samples (e.g. "mean@16"). Samples must be in drawing order.
    - ``"all"``: ``mean(correct[p, :])`` = ``c / n``, the unbiased (and lower-variance) estimate of the
      *expected* mean@k from all ``n >= k`` samples; the expectation of a k-sample average does not depend
      on ``k``, so ``k`` only has to be ``<= n``.

    The two agree when ``n == k``.
    """
    arr = _correct_matrix(correct)
    k = check_int("k", k, minimum=1)
    check_choice("estimator", estimator, MEAN_AT_K_ESTIMATORS)
    if k > arr.shape[1]:
        raise ValueError(f"k must be <= the number of samples per problem ({arr.shape[1]}), got {k}")
    return arr[:, :k].mean(axis=1) if estimator == "first" else arr.mean(axis=1)


def mean_at_k(correct: object, k: int, *, estimator: str = "first") -> float:
    """Benchmark mean@k: the mean over problems of :func:`mean_at_k_per_problem` (same estimators)."""
    return float(mean_at_k_per_problem(correct, k, estimator=estimator).mean())
