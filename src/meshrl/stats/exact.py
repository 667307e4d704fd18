"""Exact tests on 2 x 2 tables of counts (per-seed outcomes: niche kept or lost, per arm).

With a handful of seeds per arm a normal approximation is meaningless; the hypergeometric distribution of
the table given its margins is exact. Pure stdlib (``math.comb``), layer 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALTERNATIVES = ("two-sided", "less", "greater")
_REL_TOL = 1 + 1e-7  # tables "as extreme" as the observed one, up to float rounding (as R and scipy do)


@dataclass(frozen=True)
class FisherResult:
    """Sample odds ratio ``(a d) / (b c)`` (inf or nan when a zero makes it undefined) and the p-value."""

    odds_ratio: float
    p_value: float


def _check_table(table) -> tuple[int, int, int, int]:
    try:
        (a, b), (c, d) = table
    except (TypeError, ValueError):
        raise ValueError(f"fisher_exact needs a 2x2 table [[a, b], [c, d]], got {table!r}") from None
    cells = (a, b, c, d)
    for x in cells:
        if isinstance(x, bool) or int(x) != x or x < 0:
            raise ValueError(f"fisher_exact needs non-negative integer counts, got {table!r}")
    return tuple(int(x) for x in cells)  # type: ignore[return-value]


def hypergeom_pmf(x: int, row1: int, col1: int, n: int) -> float:
    """P(top-left cell = x) for a 2x2 table with first-row total ``row1``, first-column total ``col1`` and
    grand total ``n`` (hypergeometric: C(col1, x) C(n - col1, row1 - x) / C(n, row1))."""
    if x < max(0, row1 + col1 - n) or x > min(row1, col1):
        return 0.0
    return math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1)


def fisher_exact(table, alternative: str = "two-sided") -> FisherResult:
    """Fisher's exact test of independence on ``[[a, b], [c, d]]`` (Fisher 1935; rows = arms, columns =
    kept / lost).

    Conditioning on the margins, the top-left count ``X`` is hypergeometric; with ``p(x)`` its pmf:

    - ``two-sided``: ``sum of p(x) over x with p(x) <= p(a)`` (the tables at most as likely as the observed);
    - ``less``: ``P(X <= a)`` (odds ratio < 1); ``greater``: ``P(X >= a)``.

    Returns the sample odds ratio and the p-value (the conventions of ``scipy.stats.fisher_exact``).
    """
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    a, b, c, d = _check_table(table)
    row1, col1, n = a + b, a + c, a + b + c + d
    odds = (math.nan if a * d == 0 else math.inf) if b * c == 0 else a * d / (b * c)
    if row1 == 0 or col1 == 0 or row1 == n or col1 == n:
        return FisherResult(odds, 1.0)  # a zero margin: only one table is possible
    lo, hi = max(0, row1 + col1 - n), min(row1, col1)
    pmf = {x: hypergeom_pmf(x, row1, col1, n) for x in range(lo, hi + 1)}
    if alternative == "less":
        p = sum(v for x, v in pmf.items() if x <= a)
    elif alternative == "greater":
        p = sum(v for x, v in pmf.items() if x >= a)
    else:
        p = sum(v for v in pmf.values() if v <= pmf[a] * _REL_TOL)
    return FisherResult(odds, min(1.0, p))
