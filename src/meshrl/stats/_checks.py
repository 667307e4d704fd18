"""Input validation shared by the statistics functions: every failure names the argument."""

from __future__ import annotations

import math
import numbers

import numpy as np


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` as ``int``; ``ValueError`` naming ``name`` unless it is an integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    out = int(value)
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_real(name: str, value: object) -> float:
    """Return ``value`` as a finite ``float``; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


def check_level(name: str, value: object) -> float:
    """A probability level strictly inside (0, 1): a confidence, a CI width or a test level ``alpha``."""
    out = check_real(name, value)
    if not 0.0 < out < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {out}")
    return out


def check_1d(name: str, values: object, *, min_len: int = 1) -> np.ndarray:
    """Return ``values`` as a 1-D finite float64 array of at least ``min_len`` entries, or raise."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a 1-D array of numbers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.shape[0] < min_len:
        raise ValueError(f"{name} must have at least {min_len} value(s), got {arr.shape[0]}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} has {int((~np.isfinite(arr)).sum())} non-finite value(s) (NaN or inf)")
    return arr


def check_paired(name_a: str, a: object, name_b: str, b: object, *, min_len: int = 1) -> tuple[np.ndarray, ...]:
    """Two 1-D arrays of per-problem scores over the same problems (same length)."""
    x = check_1d(name_a, a, min_len=min_len)
    y = check_1d(name_b, b, min_len=min_len)
    if x.shape != y.shape:
        raise ValueError(f"{name_a} has {x.shape[0]} problems but {name_b} has {y.shape[0]}; pair them")
    return x, y


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` listing the known names when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; known: {', '.join(choices)}")
