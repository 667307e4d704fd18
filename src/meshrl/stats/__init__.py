"""Evaluation statistics: unbiased pass@k, mean@k, significance tests and intervals over problems.

Layer 1 (pure numpy + stdlib math). Samples of one problem are correlated, so the trustworthy
comparisons resample *problems*: :func:`paired_bootstrap` and :func:`paired_permutation_test`; the
pooled :func:`two_proportion_z` is kept because readers of the paper computed it. :func:`compare_table`
runs all of them per benchmark and applies :func:`holm_correction` across benchmarks.
"""

from meshrl.stats.compare import CORRECTION_TESTS, CompareRow, compare_table, format_compare_table
from meshrl.stats.exact import FisherResult, fisher_exact
from meshrl.stats.passk import (
    MEAN_AT_K_ESTIMATORS,
    mean_at_k,
    mean_at_k_per_problem,
    mean_pass_at_k,
    pass_at_k,
    pass_at_k_per_problem,
)
from meshrl.stats.resampling import BootstrapResult, bootstrap_ci, paired_bootstrap, paired_permutation_test
from meshrl.stats.significance import (
    Interval,
    holm_correction,
    normal_quantile,
    normal_two_sided_p,
    two_proportion_z,
    wilson_interval,
)

__all__ = [
    "CORRECTION_TESTS",
    "MEAN_AT_K_ESTIMATORS",
    "BootstrapResult",
    "CompareRow",
    "FisherResult",
    "Interval",
    "bootstrap_ci",
    "compare_table",
    "fisher_exact",
    "format_compare_table",
    "holm_correction",
    "mean_at_k",
    "mean_at_k_per_problem",
    "mean_pass_at_k",
    "normal_quantile",
    "normal_two_sided_p",
    "paired_bootstrap",
    "paired_permutation_test",
    "pass_at_k",
    "pass_at_k_per_problem",
    "two_proportion_z",
    "wilson_interval",
]
