"""Rollout budget of Coach Prompting: how many rollouts each strategy prefix gets (docs/method.md §1.3).

The paper says "16 rollouts per query" (§5.1) and "each prefix conditions a separate rollout group"
(§4.1) without saying whether 16 is the total or the size of each group; the two readings lead to
different conclusions (docs/method.md §1.3). meshrl makes the choice explicit:

- ``matched``: the query's G rollouts are split into m prefix groups of G/m. Mesh and the baseline
  draw the same number of samples per query (the reading of the authors' release: 4 prefixes x
  ``ROLLOUT_N=4`` = 16). Each strategy sees only G/m samples, so per-strategy statistics are noisier.
- ``per_prefix``: each of the m prefixes gets its own group of G rollouts: m*G samples per query, m
  times the baseline's. A fair comparison then needs a baseline with the same total samples per query
  (group size m*G): :func:`baseline_group_size` returns it.
"""

from __future__ import annotations

BUDGET_MODES = ("matched", "per_prefix")


def _check_counts(group_size: int, m: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be an integer >= 1, got {m!r}")


def budget_groups(group_size: int, m: int, mode: str = "matched") -> list[int]:
    """Rollouts per prefix group for one query: a list of m group sizes.

    Budget parity: under ``matched`` the total over the m prefixes is ``group_size`` (G), the same as
    a baseline with group size G, so Mesh and the baseline spend the same sampling budget; under
    ``per_prefix`` the total is ``m * G`` and the baseline must be run with group size ``m * G``
    (:func:`baseline_group_size`) to be compared at equal budget.

    Args:
        group_size: G, the baseline's rollouts per query.
        m: number of strategy prefixes per query.
        mode: ``"matched"`` (m groups of G/m; G must be divisible by m) or ``"per_prefix"``
            (m groups of G).
    Returns:
        ``[n_1, ..., n_m]`` rollouts for prefix 1..m.
    """
    _check_counts(group_size, m)
    if mode == "matched":
        if group_size % m != 0:
            raise ValueError(f"budget mode 'matched' needs group_size divisible by m: group_size={group_size}, m={m}")
        return [group_size // m] * m
    if mode == "per_prefix":
        return [group_size] * m
    raise ValueError(f"unknown budget mode {mode!r}; known: {', '.join(BUDGET_MODES)}")


def baseline_group_size(group_size: int, m: int, mode: str = "matched") -> int:
    """Group size a prefix-free baseline needs to draw as many samples per query as Mesh does."""
    return sum(budget_groups(group_size, m, mode))
