"""Argument checks the experiments' commands share: each raises one ``ValueError`` naming the option, before any
work starts (the commands print it as one line and exit with status 2)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path


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


def named_dirs(values: Sequence[str], example: str = "W2=runs/persist_W2") -> dict[str, Path]:
    """``WARM=DIR`` arguments as ``{WARM: DIR}``: each well formed, each name once, each directory an experiment's
    (it has ``runs/``)."""
    dirs: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not (sep and name and path):
            raise ValueError(f"give each directory as WARM=DIR, e.g. {example}; got {value!r}")
        if name in dirs:
            raise ValueError(f"{name} names two directories")
        dirs[name] = Path(path)
    missing = [d for d in dirs.values() if not (d / "runs").is_dir()]
    if missing:
        raise ValueError(f"no runs in {missing[0]}")
    return dirs
