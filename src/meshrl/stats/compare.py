"""Per-benchmark comparison of two models with every test a reader may ask for, Holm-corrected.

Used by ``meshrl compare``; rows are plain data so a CLI, a report or a notebook can render them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from meshrl.stats._checks import check_choice, check_int, check_level, check_paired
from meshrl.stats.resampling import paired_bootstrap, paired_permutation_test
from meshrl.stats.significance import holm_correction, two_proportion_z

__all__ = ["CORRECTION_TESTS", "CompareRow", "compare_table", "format_compare_table"]

CORRECTION_TESTS = ("bootstrap", "permutation", "z")


@dataclass(frozen=True)
class CompareRow:
    """One benchmark: A vs B. ``diff = mean_a - mean_b``; ``[ci_low, ci_high]`` is the paired bootstrap CI of
    ``diff``; ``p_adjusted`` is the Holm-adjusted p-value of the test named by ``corrected``; ``significant``
    says whether it is ``<= alpha`` (survives the correction)."""

    benchmark: str
    n_problems: int
    mean_a: float
    mean_b: float
    diff: float
    ci_low: float
    ci_high: float
    z: float
    p_z: float
    p_bootstrap: float
    p_permutation: float
    p_adjusted: float
    significant: bool
    corrected: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def compare_table(
    scores_a: Mapping[str, Sequence[float] | np.ndarray],
    scores_b: Mapping[str, Sequence[float] | np.ndarray],
    *,
    samples_per_problem: int | Mapping[str, int] = 1,
    n_boot: int = 10000,
    n_perm: int = 10000,
    seed: int = 0,
    ci: float = 0.95,
    alpha: float = 0.05,
    correct: str = "bootstrap",
) -> list[CompareRow]:
    """Compare models A and B on several benchmarks from per-problem scores.

    Args:
        scores_a, scores_b: ``{benchmark: [P] per-problem scores in [0, 1]}`` (accuracy, mean@k or
            pass@k of each problem), the same benchmarks and, per benchmark, the same problems in the same
            order for both models. Rows follow ``scores_a``'s order.
        samples_per_problem: ``k`` samples behind each per-problem score (one int, or one per benchmark).
            Only the z-test uses it: as the readers of the paper computed it, it pools per-sample accuracies,
            ``successes = k * sum(scores)`` out of ``n = k * P`` trials, as if all samples were independent.
        n_boot, n_perm, seed, ci: passed to :func:`paired_bootstrap` and :func:`paired_permutation_test`
            (the same seed for every benchmark).
        alpha: family-wise error rate of the Holm correction across the benchmarks.
        correct: which p-value is Holm-corrected: ``"bootstrap"`` (default), ``"permutation"`` or ``"z"``.
    Returns:
        One :class:`CompareRow` per benchmark.
    """
    if not isinstance(scores_a, Mapping) or not isinstance(scores_b, Mapping):
        raise ValueError("scores_a and scores_b must be mappings {benchmark: per-problem scores}")
    if not scores_a:
        raise ValueError("scores_a must hold at least one benchmark")
    if set(scores_a) != set(scores_b):
        missing = sorted(set(scores_a) ^ set(scores_b))
        raise ValueError(f"scores_a and scores_b must cover the same benchmarks; unmatched: {missing}")
    check_choice("correct", correct, CORRECTION_TESTS)
    alpha = check_level("alpha", alpha)
    ci = check_level("ci", ci)
    partial = []
    for name in scores_a:
        a, b = check_paired(f"scores_a[{name!r}]", scores_a[name], f"scores_b[{name!r}]", scores_b[name], min_len=2)
        if ((a < 0) | (a > 1) | (b < 0) | (b > 1)).any():
            raise ValueError(f"scores for benchmark {name!r} must lie in [0, 1]")
        if isinstance(samples_per_problem, Mapping):
            if name not in samples_per_problem:
                raise ValueError(f"samples_per_problem has no entry for benchmark {name!r}")
            k = check_int(f"samples_per_problem[{name!r}]", samples_per_problem[name], minimum=1)
        else:
            k = check_int("samples_per_problem", samples_per_problem, minimum=1)
        n = k * a.shape[0]
        z, p_z = two_proportion_z(k * float(a.sum()), n, k * float(b.sum()), n)
        boot = paired_bootstrap(a, b, n_boot=n_boot, seed=seed, ci=ci)
        p_perm = paired_permutation_test(a, b, n_perm=n_perm, seed=seed)
        partial.append((name, boot, z, p_z, p_perm))
    chosen = {"bootstrap": [r[1].p_value for r in partial], "permutation": [r[4] for r in partial],
              "z": [r[3] for r in partial]}[correct]
    adjusted, reject = holm_correction(chosen, alpha=alpha)
    return [
        CompareRow(
            benchmark=str(name),
            n_problems=boot.n_problems,
            mean_a=boot.mean_a,
            mean_b=boot.mean_b,
            diff=boot.diff,
            ci_low=boot.ci_low,
            ci_high=boot.ci_high,
            z=z,
            p_z=p_z,
            p_bootstrap=boot.p_value,
            p_permutation=p_perm,
            p_adjusted=float(adj),
            significant=bool(rej),
            corrected=correct,
        )
        for (name, boot, z, p_z, p_perm), adj, rej in zip(partial, adjusted, reject, strict=True)
    ]


def format_compare_table(rows: Sequence[CompareRow], *, ci: float | None = None) -> str:
    """Plain-text table of :func:`compare_table` rows (fixed width, one line per benchmark)."""
    label = f"{round(100 * ci)}% CI" if ci is not None else "CI"
    head = ["benchmark", "P", "mean A", "mean B", "diff", label, "z", "p(z)", "p(boot)", "p(perm)",
            "p(holm)", "sig"]
    body = [
        [r.benchmark, str(r.n_problems), f"{r.mean_a:.4f}", f"{r.mean_b:.4f}", f"{r.diff:+.4f}",
         f"[{r.ci_low:+.4f}, {r.ci_high:+.4f}]", f"{r.z:+.2f}", f"{r.p_z:.3g}", f"{r.p_bootstrap:.3g}",
         f"{r.p_permutation:.3g}", f"{r.p_adjusted:.3g}", "yes" if r.significant else "no"]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
