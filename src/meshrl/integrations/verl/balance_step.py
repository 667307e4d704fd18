"""The trainer-side half of strategy balancing in verl: per-rollout weights from a step's batch (no Ray needed).

Input is what the v1 trainer holds after the old-log-prob pass: one ``extra_info`` dict per row (the dataset row's,
carried by verl into every rollout), the token-level scores, the response mask and the old / reference
log-probs. Output is the per-row fields the loss wrapper reads (:mod:`meshrl.integrations.verl.loss_fn`) and the
step's ``mesh/*`` metrics, with the same names as meshrl's own trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from meshrl.integrations.verl.settings import (
    BALANCE_WEIGHT,
    CORRECT,
    CORRECT_AT,
    EXTRA_QUERY_ID,
    EXTRA_STRATEGY_ID,
    QUERY_ID,
    STRATEGY_ID,
    MeshSettings,
)
from meshrl.mesh import strategy_balance_row_weights

log = logging.getLogger(__name__)


def as_row_list(value: Any, n: int, name: str) -> list:
    """A per-row non-tensor field (list, numpy array, tensordict ``NonTensorStack``) as a list of ``n`` items."""
    rows = value.tolist() if hasattr(value, "tolist") else list(value)
    if len(rows) != n:
        raise ValueError(f"verl batch field {name!r} has {len(rows)} rows, expected {n}")
    return rows


def row_ids(extra_infos: Sequence[Any], padding: Sequence[bool]) -> tuple[list[Hashable], list[Hashable]]:
    """``(query_ids, strategy_ids)`` from each row's ``extra_info``; padding rows get ``None``.

    A real row without a dict ``extra_info``, or without ``query_id`` / ``strategy_id`` in it, raises ``ValueError``
    naming the row and the field (export the data with ``meshrl export verl``, which writes both).
    """
    queries: list[Hashable] = []
    strategies: list[Hashable] = []
    for j, (info, pad) in enumerate(zip(extra_infos, padding, strict=True)):
        if pad:
            queries.append(None)
            strategies.append(None)
            continue
        if not isinstance(info, dict):
            raise ValueError(f"verl batch row {j}: field 'extra_info' must be a dict with {EXTRA_QUERY_ID!r} and "
                             f"{EXTRA_STRATEGY_ID!r} (write the data with `meshrl export verl`), got "
                             f"{type(info).__name__}")
        for key in (EXTRA_QUERY_ID, EXTRA_STRATEGY_ID):
            if info.get(key) is None:
                raise ValueError(f"verl batch row {j}: extra_info has no {key!r} (needed for strategy balancing; "
                                 "write the data with `meshrl export verl`)")
        queries.append(_hashable(info[EXTRA_QUERY_ID], j, EXTRA_QUERY_ID))
        strategies.append(_hashable(info[EXTRA_STRATEGY_ID], j, EXTRA_STRATEGY_ID))
    return queries, strategies


def _hashable(value: Any, row: int, key: str) -> Hashable:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if not isinstance(value, str | int):
        raise ValueError(f"verl batch row {row}: extra_info[{key!r}] must be a string or an integer, "
                         f"got {type(value).__name__}")
    return value


def _dense(labels: Sequence[Hashable]) -> torch.Tensor:
    index: dict[Hashable, int] = {}
    return torch.tensor([-1 if lab is None else index.setdefault(lab, len(index)) for lab in labels],
                        dtype=torch.long)


def balance_fields(
    extra_infos: Sequence[Any],
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    mesh: MeshSettings,
    padding: Sequence[bool] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per-row fields and ``mesh/*`` metrics of strategy balancing for one verl step.

    Args:
        extra_infos: ``B`` dicts, each with ``query_id`` and ``strategy_id``.
        scores: ``[B, T]`` token-level scores (verl's ``rm_scores``: the score on the last response token) or
            ``[B]`` sequence scores. A rollout is correct when its score reaches 1.
        response_mask: ``[B, T]`` 0/1 response mask (padded).
        old_log_probs / ref_log_probs: ``[B, T]`` log-probs under the sampling policy and the reference; the
            reference may be ``None`` only when ``mesh.subtract_ref`` is false.
        mesh: the run's :class:`MeshSettings`.
        padding: ``B`` flags of rows verl added only to fill a batch (weight 0, not a query's rollout).
    Returns:
        ``({meshrl_balance_weight [B] float32, meshrl_correct [B] bool, meshrl_query_id [B] long,
        meshrl_strategy_id [B] long}, metrics)``; ids are dense per step (-1 on padding rows).
    """
    n = response_mask.shape[0]
    pad = [False] * n if padding is None else list(padding)
    if len(pad) != n:
        raise ValueError(f"padding has {len(pad)} flags for {n} rows")
    infos = as_row_list(extra_infos, n, "extra_info")
    queries, strategies = row_ids(infos, pad)
    mask = response_mask.to(torch.float64)
    seq_scores = scores.to(torch.float64) if scores.dim() == 1 else (scores.to(torch.float64) * mask).sum(-1)
    real = torch.tensor([not p for p in pad])
    # A row of the bare group (strategy -1, no prefix) is not a strategy cell, as in meshrl's own trainer.
    prefixed = torch.tensor([not (isinstance(s, int) and s < 0) for s in strategies])
    correct = (seq_scores >= CORRECT_AT) & real & prefixed
    seq_logp = (old_log_probs.to(torch.float64) * mask).sum(-1)
    ref_seq = None
    if mesh.subtract_ref:
        if ref_log_probs is None:
            raise ValueError("meshrl.subtract_ref=true needs verl's reference log-probs (field 'ref_log_prob'): set "
                             "actor_rollout_ref.actor.use_kl_loss=true (kl_loss_coef=0 adds no KL term)")
        ref_seq = (ref_log_probs.to(torch.float64) * mask).sum(-1)
    keep = real.nonzero(as_tuple=True)[0]
    weights = torch.zeros(n, dtype=torch.float64)
    w, _loss, metrics = strategy_balance_row_weights(
        seq_logp[keep], None if ref_seq is None else ref_seq[keep], correct[keep],
        [queries[j] for j in keep.tolist()], [strategies[j] for j in keep.tolist()], mesh.mu,
        subtract_ref=mesh.subtract_ref, reduction=mesh.reduction,
    )
    weights[keep] = w
    metrics["mesh/split_queries"] = float(split_queries(infos, queries, strategies, pad))
    fields = {
        BALANCE_WEIGHT: weights.to(torch.float32),
        CORRECT: correct,
        QUERY_ID: _dense(queries),
        STRATEGY_ID: _dense(strategies),
    }
    return fields, {k: v for k, v in metrics.items() if v == v}


def split_queries(extra_infos: Sequence[Any], queries: Sequence[Hashable], strategies: Sequence[Hashable],
                  padding: Sequence[bool]) -> int:
    """Queries of the step that hold fewer distinct strategies than their ``num_strategies`` (the export's m):
    their balancing sees only part of their prefix groups (rows split across steps, e.g. ``data.shuffle=true``)."""
    seen: dict[Hashable, set] = {}
    wanted: dict[Hashable, int] = {}
    for info, q, s, pad in zip(extra_infos, queries, strategies, padding, strict=True):
        if pad:
            continue
        seen.setdefault(q, set()).add(s)
        m = info.get("num_strategies") if isinstance(info, dict) else None
        if isinstance(m, int) and m > 0:
            wanted[q] = m
    split = sum(1 for q, m in wanted.items() if len(seen[q]) < m)
    if split:
        log.warning("meshrl: %d querie(s) of this step hold fewer than their m prefix rows; keep data.shuffle=false "
                    "and data.train_batch_size a multiple of m", split)
    return split
