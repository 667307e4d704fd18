"""Argument checks the experiments' commands share: each raises one ``ValueError`` naming the option, before any
work starts (the commands print it as one line and exit with status 2)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def check_at_least(options: Iterable[tuple[str, int | None, int]]) -> None:
    """Each ``(flag, value, low)``: a given value must be ``>= low``."""
    for flag, value, low in options:
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")


def check_seeds(seeds: Sequence[int] | None) -> None:
    """``--seeds``: none negative, none twice."""
    if seeds is None:
        return
    if min(seeds) < 0:
        raise ValueError(f"--seeds must be >= 0, got {min(seeds)}")
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds names a seed twice: {' '.join(map(str, seeds))}")
