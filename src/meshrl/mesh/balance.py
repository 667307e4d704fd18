"""Strategy-Balancing Regularisation of Mesh Learning (docs/method.md §1.3, §1.4).

For one query Q with strategies (coach prefixes) i = 1..M and the correct rollouts C_i of strategy i
(the Mesh Learning paper, "Strategy-Balancing Regularization"; docs/method.md §1.3)::

    z_i     = (1/|C_i|) sum_{tau in C_i} log pi_theta(tau | Q, prefix_i)   (sum over response tokens)
    z_i^ref = the same mean under the frozen reference policy (no gradient)
    r_i     = z_i - z_i^ref            (subtract_ref=True; r_i = z_i when subtract_ref=False)
    p       = softmax(r)               over the m strategies with C_i non-empty
    J_Q     = mu * KL(uniform_m || p) = mu * sum_i (1/m) (log(1/m) - log p_i)
            = mu * (logsumexp(r) - mean(r) - log m)                          (closed form used here)
    dJ_Q/dr_i = mu * (p_i - 1/m)

J_Q is 0 when m < 2 (nothing to balance). J_Q(r + c) = J_Q(r): the term only redistributes pressure
between strategies; it never opposes all of them improving together.

Differences from the authors' release (verl fork ``Ayanami-0123/Open-Mesh-Learning``; docs/method.md §1.4),
on purpose:

- groups are keyed by explicit ``query_ids`` and ``strategy_ids``; the release takes softmaxes over
  blocks of 4 adjacent batch rows and silently relies on batch order;
- a strategy with no correct rollout drops out of the softmax; the release enters it as z = -1e9,
  which makes the loss value huge and meaningless;
- the batch loss is a **mean over queries** (``reduction="mean"``), the release sums over groups
  (``reduction="sum"`` reproduces that). See :func:`strategy_balance_loss` for why.
- one release version does not subtract the reference log-probability: ``subtract_ref=False``. The
  variant is written into the metrics (``mesh/balance_subtract_ref``) so every run records it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from meshrl.algos import check_choice, check_tensor

IdsLike = Sequence[Hashable] | torch.Tensor
REDUCTIONS = ("mean", "mean_active", "sum")


def _labels(name: str, ids: IdsLike, n: int) -> list[Hashable]:
    """Return ``ids`` as a list of ``n`` hashable labels; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.is_floating_point():
            raise ValueError(f"{name} must hold integer ids, got dtype {ids.dtype}")
        labels = ids.tolist()
    elif isinstance(ids, str | bytes):
        raise ValueError(f"{name} must be a sequence of ids, not a single {type(ids).__name__}")
    else:
        try:
            labels = list(ids)
        except TypeError as e:
            raise ValueError(f"{name} must be a sequence of hashable ids or a 1-D tensor") from e
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} entries but seq_logp has {n}")
    for lab in labels:
        try:
            hash(lab)
        except TypeError as e:
            raise ValueError(f"{name} holds an unhashable id of type {type(lab).__name__}") from e
    return labels


def _correct_mask(correct: object, n: int) -> torch.Tensor:
    if not isinstance(correct, torch.Tensor):
        raise ValueError(f"correct must be a torch.Tensor, got {type(correct).__name__}")
    if correct.dim() != 1 or correct.shape[0] != n:
        raise ValueError(f"correct must have shape [{n}] like seq_logp, got {tuple(correct.shape)}")
    if correct.dtype != torch.bool:
        if ((correct != 0) & (correct != 1)).any():
            raise ValueError("correct must be bool or hold only 0/1 values")
        correct = correct != 0
    return correct


def _segment_sum(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, index, values)


def strategy_balance_loss(
    seq_logp: torch.Tensor,
    ref_seq_logp: torch.Tensor | None,
    correct: torch.Tensor,
    query_ids: IdsLike,
    strategy_ids: IdsLike,
    mu: float = 1e-5,
    *,
    subtract_ref: bool = True,
    reduction: str = "mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Strategy-balancing loss ``mu * KL(uniform || softmax(r))`` per query, reduced over the batch.

    Args:
        seq_logp: ``[N]`` sum of response-token log-probs of each rollout under the policy, with grad.
            Coach tokens (an assistant-turn prefix) must already be excluded by the caller.
        ref_seq_logp: ``[N]`` the same sums under the frozen reference policy; detached here. May be
            ``None`` only when ``subtract_ref=False``.
        correct: ``[N]`` bool (or 0/1) — the rollout is correct. Only correct rollouts enter ``z``.
        query_ids: ``N`` hashable ids (or a 1-D integer tensor): which query each row answers.
        strategy_ids: ``N`` hashable ids (or a 1-D integer tensor): which strategy (prefix) conditioned
            each row. Strategy ids are scoped by query: ``(query, strategy)`` identifies a cell. Rows
            are grouped by these ids, never by their position in the batch.
        mu: coefficient ``>= 0`` (paper: 1e-5; the release's launch scripts use 5e-5 and 1e-4).
        subtract_ref: ``r = z - z_ref`` (paper, default) or ``r = z`` (one release version).
        reduction: how the per-query terms J_Q are combined:

            - ``"mean"`` (default): mean over **all** distinct queries in the batch, those with fewer
              than two qualifying strategies counting as 0. Each query then carries the fixed weight
              ``mu / Q`` however many other queries qualify this step, so the effective coefficient
              does not jump when only a few queries qualify, and it does not grow with the batch
              size as a sum does (the policy loss is a mean too, so ``mu`` keeps one meaning).
            - ``"mean_active"``: mean over the queries with ``m >= 2`` only.
            - ``"sum"``: sum over queries, as the release does (scales with the number of queries).

    Returns:
        ``(loss, metrics)``: a 0-dim tensor in ``seq_logp.dtype`` whose gradient flows into
        ``seq_logp`` (rows of correct rollouts only), and float metrics:

        - ``mesh/balance_loss``: the loss value;
        - ``mesh/active_strategies``: mean over all queries of m (strategies with >= 1 correct rollout);
        - ``mesh/balance_queries``: number of queries with m >= 2 (where the term acts);
        - ``mesh/balance_p_entropy``: mean entropy of p (nats) over those queries;
        - ``mesh/balance_p_entropy_norm``: the same divided by log m (1 = perfectly balanced);
        - ``mesh/balance_p_max``: mean over those queries of max_i p_i;
        - ``mesh/balance_r_spread``: mean over those queries of max_i r_i - min_i r_i;
        - ``mesh/balance_mu`` and ``mesh/balance_subtract_ref`` (1.0 / 0.0): the variant run.

        The three ``p`` / ``r`` means are NaN when no query has m >= 2 (``mesh/balance_queries`` = 0
        says why); metrics are for one call per training step, not for summing over micro-batches.

    All rollouts of a query (across all its prefix groups) must be in the same call: ``z`` is a mean
    over them. See :func:`strategy_balance_row_weights` for gradient accumulation over micro-batches.
    """
    check_tensor("seq_logp", seq_logp, ndim=1)
    n = seq_logp.shape[0]
    if subtract_ref:
        if ref_seq_logp is None:
            raise ValueError("ref_seq_logp is required when subtract_ref=True")
        check_tensor("ref_seq_logp", ref_seq_logp, ndim=1)
        if ref_seq_logp.shape[0] != n:
            raise ValueError(f"ref_seq_logp has {ref_seq_logp.shape[0]} rows but seq_logp has {n}")
    elif ref_seq_logp is not None:
        check_tensor("ref_seq_logp", ref_seq_logp, ndim=1)
    ok = _correct_mask(correct, n)
    qs = _labels("query_ids", query_ids, n)
    ss = _labels("strategy_ids", strategy_ids, n)
    if isinstance(mu, bool) or not isinstance(mu, int | float) or not math.isfinite(mu) or mu < 0:
        raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")
    check_choice("reduction", reduction, REDUCTIONS)

    # Dense ids: every query present in the batch (for the mean), cells = (query, strategy) among
    # correct rows only, so a strategy without a correct rollout never enters the softmax.
    query_index: dict[Hashable, int] = {}
    for q in qs:
        query_index.setdefault(q, len(query_index))
    n_queries = len(query_index)
    cell_index: dict[tuple[Hashable, Hashable], int] = {}
    cell_query: list[int] = []
    rows: list[int] = []
    row_cell: list[int] = []
    for j, (q, s, good) in enumerate(zip(qs, ss, ok.tolist(), strict=True)):
        if not good:
            continue
        c = cell_index.get((q, s))
        if c is None:
            c = cell_index[(q, s)] = len(cell_index)
            cell_query.append(query_index[q])
        rows.append(j)
        row_cell.append(c)
    n_cells = len(cell_index)
    dev = seq_logp.device
    wdtype = torch.float64

    if n_cells == 0:
        loss = seq_logp.sum() * 0.0
        return loss, _metrics(mu, subtract_ref, loss, n_queries, torch.zeros(n_queries), None, None, None)

    row_idx = torch.tensor(rows, dtype=torch.long, device=dev)
    cell_of_row = torch.tensor(row_cell, dtype=torch.long, device=dev)
    q_of_cell = torch.tensor(cell_query, dtype=torch.long, device=dev)
    count = _segment_sum(torch.ones(len(rows), dtype=wdtype, device=dev), cell_of_row, n_cells)
    z = _segment_sum(seq_logp[row_idx].to(wdtype), cell_of_row, n_cells) / count
    r = z
    if subtract_ref:
        ref = ref_seq_logp.detach()[row_idx].to(wdtype)  # type: ignore[union-attr]
        r = z - _segment_sum(ref, cell_of_row, n_cells) / count

    # Per-query softmax over its cells, stabilised by the (detached) per-query max.
    m_q = _segment_sum(torch.ones(n_cells, dtype=wdtype, device=dev), q_of_cell, n_queries)
    r_max = torch.full((n_queries,), -math.inf, dtype=wdtype, device=dev).scatter_reduce(
        0, q_of_cell, r.detach(), "amax"
    )
    r_min = torch.full((n_queries,), math.inf, dtype=wdtype, device=dev).scatter_reduce(
        0, q_of_cell, r.detach(), "amin"
    )
    shift = torch.where(torch.isfinite(r_max), r_max, torch.zeros_like(r_max))
    sum_exp = _segment_sum((r - shift[q_of_cell]).exp(), q_of_cell, n_queries)
    active = m_q >= 2
    safe_sum = torch.where(active, sum_exp, torch.ones_like(sum_exp))
    lse = shift + safe_sum.log()
    mean_r = _segment_sum(r, q_of_cell, n_queries) / m_q.clamp(min=1)
    kl = lse - mean_r - m_q.clamp(min=1).log()  # KL(uniform || p), exact 0 for m = 1
    j_q = torch.where(active, kl, torch.zeros_like(kl)) * mu

    if reduction == "sum":
        total = j_q.sum()
    elif reduction == "mean":
        total = j_q.sum() / n_queries
    else:
        total = j_q.sum() / active.sum().clamp(min=1)
    loss = total.to(seq_logp.dtype)

    logp = (r - lse[q_of_cell]).detach()
    p = logp.exp()
    ent = _segment_sum(-(p * logp), q_of_cell, n_queries)
    p_max = torch.zeros(n_queries, dtype=wdtype, device=dev).scatter_reduce(0, q_of_cell, p, "amax")
    stats = (ent, p_max, r_max - r_min)
    return loss, _metrics(mu, subtract_ref, loss, n_queries, m_q, active, m_q, stats)


def _metrics(
    mu: float,
    subtract_ref: bool,
    loss: torch.Tensor,
    n_queries: int,
    m_q: torch.Tensor,
    active: torch.Tensor | None,
    m_active: torch.Tensor | None,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> dict[str, float]:
    nan = float("nan")
    n_active = int(active.sum()) if active is not None else 0
    out = {
        "mesh/balance_loss": float(loss.detach()),
        "mesh/active_strategies": float(m_q.sum()) / n_queries if n_queries else 0.0,
        "mesh/balance_queries": float(n_active),
        "mesh/balance_p_entropy": nan,
        "mesh/balance_p_entropy_norm": nan,
        "mesh/balance_p_max": nan,
        "mesh/balance_r_spread": nan,
        "mesh/balance_mu": float(mu),
        "mesh/balance_subtract_ref": 1.0 if subtract_ref else 0.0,
    }
    if n_active and stats is not None and active is not None and m_active is not None:
        ent, p_max, spread = (s[active] for s in stats)
        out["mesh/balance_p_entropy"] = float(ent.mean())
        out["mesh/balance_p_entropy_norm"] = float((ent / m_active[active].log()).mean())
        out["mesh/balance_p_max"] = float(p_max.mean())
        out["mesh/balance_r_spread"] = float(spread.mean())
    return out


def strategy_balance_row_weights(
    seq_logp: torch.Tensor,
    ref_seq_logp: torch.Tensor | None,
    correct: torch.Tensor,
    query_ids: IdsLike,
    strategy_ids: IdsLike,
    mu: float = 1e-5,
    *,
    subtract_ref: bool = True,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-rollout gradient coefficients of :func:`strategy_balance_loss`, for gradient accumulation.

    The balancing term needs every rollout of a query at once (``z`` is a mean over them), while the
    trainer's backward runs over micro-batches. Since the loss depends on ``seq_logp`` only, its
    gradient is ``sum_j w_j * grad(seq_logp_j)`` with::

        w_j = dJ/d seq_logp_j = (scale * mu) * (p_i - 1/m) / |C_i|   for a correct rollout j of strategy i
        w_j = 0                                                         otherwise (and when m < 2)

    (``scale`` = 1/Q for ``"mean"``, 1/Q_active for ``"mean_active"``, 1 for ``"sum"``). Compute the
    weights once from detached full-batch log-probs, then add ``(w[rows] * seq_logp_micro).sum()`` to
    each micro-batch loss: the accumulated gradient equals the full-batch gradient exactly (at the
    parameters where the weights were computed).

    Returns:
        ``(weights [N] float detached, loss 0-dim detached, metrics)``, arguments as
        :func:`strategy_balance_loss`.
    """
    check_tensor("seq_logp", seq_logp, ndim=1)
    x = seq_logp.detach().clone().requires_grad_(True)
    loss, metrics = strategy_balance_loss(
        x, ref_seq_logp, correct, query_ids, strategy_ids, mu, subtract_ref=subtract_ref, reduction=reduction
    )
    if loss.requires_grad:
        (w,) = torch.autograd.grad(loss, x, allow_unused=True)
        w = torch.zeros_like(x) if w is None else w
    else:
        w = torch.zeros_like(x)
    return w.detach(), loss.detach(), metrics
