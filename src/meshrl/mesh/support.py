"""Support balancing: a meshrl extension of Strategy-Balancing Regularisation (not in the paper).

Why a variant. The paper's term (:func:`meshrl.mesh.strategy_balance_loss`) balances ``z_i``, the
log-likelihood of strategy i's correct rollouts **under the coach prefix that produced them**. Two
things follow, both measured on the testbed (experiments/collapse_testbed/results.md):

1. The quantity it balances is not the one that collapses. At evaluation the policy runs without a
   prefix, and which strategy it picks there is ``pi(tau | Q)``, not ``pi(tau | Q, prefix_i)``; a
   conditional likelihood can be perfectly balanced while the unconditioned choice has collapsed.
2. Its gradient ``mu (p_i - 1/m)`` is two-sided: it lowers the log-probability of the *most likely
   correct* completions, so any ``mu`` large enough to matter fights the reward.

Support balancing changes both: it scores strategies by the **unconditioned** likelihood of their
correct rollouts and only ever **raises** the under-represented ones. For one query Q with strategies
i (coach prefixes) and correct rollouts C_i (strategies with no correct rollout drop out)::

    l_i  = (1/|C_i|) sum_{tau in C_i} log pi_theta(tau | Q)      (no prefix; sum over response tokens)
    p    = softmax(l)                                             over the m active strategies
    d_i  = max(0, 1/m - p_i)                                      (sum_i d_i = TV(uniform_m, p))
    J_Q  = -mu * sum_i sg[d_i] * l_i                              (sg = stop-gradient)
    dJ_Q / d log pi(tau|Q) = -mu * d_i / |C_i|                    for tau in C_i, else 0

so a strategy the unconditioned policy already favours (``p_i >= 1/m``) gets no pressure at all, and a
rare but successful one gets a bounded push up (at most ``mu/m`` per query). The loss is minimised, so
negative weights raise log-probabilities. ``J_Q = 0`` when m < 2. Reductions as the paper form
(``"mean"`` over all queries, ``"mean_active"``, ``"sum"``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from meshrl.algos import check_choice, check_tensor
from meshrl.mesh.balance import REDUCTIONS, IdsLike, _correct_mask, _labels


def support_balance_row_weights(
    uncond_seq_logp: torch.Tensor,
    correct: torch.Tensor,
    query_ids: IdsLike,
    strategy_ids: IdsLike,
    mu: float,
    *,
    reduction: str = "mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-rollout weights ``w`` of support balancing: ``grad J = sum_j w_j grad log pi(tau_j | Q)``.

    Args:
        uncond_seq_logp: ``[N]`` log-probability of each response given the query **without** its coach
            prefix (sum over response tokens); detached here.
        correct: ``[N]`` bool or 0/1; only correct rollouts enter ``l`` and receive weight.
        query_ids, strategy_ids: ``N`` hashable ids each (or 1-D integer tensors); cells are
            ``(query, strategy)`` pairs, grouped by id, never by batch position.
        mu: coefficient ``>= 0``.
        reduction: ``"mean"`` (over all queries in the batch), ``"mean_active"`` or ``"sum"``.

    Returns:
        ``(w [N] float64, metrics)`` with ``w <= 0`` everywhere (it only raises log-probabilities).
        Metrics: ``mesh/support_tv`` (mean over queries with m >= 2 of TV(uniform, p); NaN if none),
        ``mesh/support_queries`` (that count), ``mesh/support_loss`` (the value of J, reduced).
    """
    check_tensor("uncond_seq_logp", uncond_seq_logp, ndim=1)
    n = uncond_seq_logp.shape[0]
    ok = _correct_mask(correct, n).tolist()
    qs, ss = _labels("query_ids", query_ids, n), _labels("strategy_ids", strategy_ids, n)
    if isinstance(mu, bool) or not isinstance(mu, int | float) or not math.isfinite(mu) or mu < 0:
        raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")
    check_choice("reduction", reduction, REDUCTIONS)
    values = uncond_seq_logp.detach().double().tolist()

    cells: dict[Hashable, dict[Hashable, list[int]]] = {}
    for j, (q, s) in enumerate(zip(qs, ss, strict=True)):
        cells.setdefault(q, {})
        if ok[j]:
            cells[q].setdefault(s, []).append(j)
    w = torch.zeros(n, dtype=torch.float64)
    tvs, losses = [], []
    for by_strategy in cells.values():
        if len(by_strategy) < 2:
            continue
        rows = list(by_strategy.values())
        ell = torch.tensor([sum(values[j] for j in r) / len(r) for r in rows], dtype=torch.float64)
        p = torch.softmax(ell, dim=0)
        deficit = (1.0 / len(rows) - p).clamp(min=0.0)
        tvs.append(float(deficit.sum()))
        losses.append(-float((deficit * ell).sum()))
        for d, r in zip(deficit.tolist(), rows, strict=True):
            for j in r:
                w[j] = -d / len(r)
    scale = {"sum": 1.0, "mean": 1.0 / max(len(cells), 1), "mean_active": 1.0 / max(len(tvs), 1)}[reduction]
    w *= mu * scale
    metrics = {"mesh/support_tv": sum(tvs) / len(tvs) if tvs else float("nan"),
               "mesh/support_queries": float(len(tvs)),
               "mesh/support_loss": mu * scale * sum(losses)}
    return w, metrics
