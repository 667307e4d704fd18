"""Loss aggregation over tokens and sequences (the choice that separates GRPO, DAPO and Dr. GRPO)."""

from __future__ import annotations

import torch

from meshrl.algos._checks import check_choice, check_mask, check_tensor

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    norm_len: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix ``[B, T]`` to a scalar.

    Modes (names and semantics as verl's ``agg_loss``; sources in brackets), ``m`` the mask, ``L_i`` the
    number of masked tokens of row ``i``, ``B'`` the number of rows with ``L_i > 0``::

        token-mean               sum_{i,t} m l / sum_{i,t} m                      [DAPO eq. 12]
        token-sum                sum_{i,t} m l
        seq-mean-token-mean      (1/B') sum_i (1/L_i) sum_t m l                   [GRPO, DeepSeekMath eq. 3]
        seq-mean-token-sum       (1/B') sum_i sum_t m l
        seq-mean-token-sum-norm  (1/B) sum_i (1/norm_len) sum_t m l              [Dr. GRPO, Liu et al. 2025]

    ``norm_len`` is the explicit constant normaliser of Dr. GRPO (the generation budget, which does not
    depend on the sampled lengths); it defaults to ``T = loss_mat.shape[1]``. Rows without masked tokens
    are left out of the sequence means (padding rows), but an all-zero mask is an error: it would give a
    silent zero or NaN loss.
    """
    check_choice("aggregation mode", mode, AGG_MODES)
    check_tensor("loss_mat", loss_mat, ndim=2)
    m = check_mask("mask", mask, loss_mat, "loss_mat")
    if m.sum() == 0:
        raise ValueError("mask selects no tokens: nothing to aggregate")
    masked = loss_mat * m
    if mode == "token-mean":
        return masked.sum() / m.sum()
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-sum-norm":
        denom = float(loss_mat.shape[1]) if norm_len is None else float(norm_len)
        if denom <= 0:
            raise ValueError(f"norm_len must be > 0, got {norm_len}")
        return masked.sum() / (loss_mat.shape[0] * denom)
    lengths = m.sum(-1)
    has_tok = lengths > 0
    seq = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / lengths.clamp(min=1)
    return seq[has_tok].mean()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)``; 0 when the mask is empty (for metrics, not losses)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)
