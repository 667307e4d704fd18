"""Input validation shared by the algorithm functions: every failure names the argument."""

from __future__ import annotations

import torch


def check_tensor(name: str, x: object, *, ndim: int | None = None, finite: bool = True) -> torch.Tensor:
    """Raise ``ValueError`` naming ``name`` unless ``x`` is a tensor of ``ndim`` dims with finite values."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if finite and x.is_floating_point() and x.numel() and not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} has {bad} non-finite value(s) (NaN or inf)")
    return x


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` listing every shape unless all named tensors share one shape."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k}={s}" for k, s in shapes.items())
        raise ValueError(f"shape mismatch: {listed}")


def check_mask(name: str, mask: torch.Tensor, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """Validate a 0/1 (or bool) mask of the same shape as ``like``; return it as ``like``'s dtype."""
    check_tensor(name, mask)
    if tuple(mask.shape) != tuple(like.shape):
        raise ValueError(f"{name} shape {tuple(mask.shape)} != {like_name} shape {tuple(like.shape)}")
    m = mask.to(like.dtype)
    if ((m != 0) & (m != 1)).any():
        raise ValueError(f"{name} must contain only 0/1 values")
    return m


def check_choice(name: str, value: str, choices: dict | list | tuple) -> None:
    """Raise ``ValueError`` listing the known names when ``value`` is not one of ``choices``."""
    if value not in choices:
        known = ", ".join(sorted(choices))
        raise ValueError(f"unknown {name} {value!r}; known: {known}")
