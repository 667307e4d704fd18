"""Coupling kernel of one query's rollouts, epsilon-strategies and strategy masses (docs/method.md §1.1).

Formulas (docs/method.md §1.1, the Mesh Learning paper's definition of strategies from update geometry)::

    K_ij  = U_i . U_j                         U_i = grad_theta log pi(tau_i | Q)   (fisher_scores)
    K~_ij = K_ij / sqrt(K_ii K_jj)            cosine normalisation
    d(i, j) = max_k |K~_ik - K~_jk|           two rollouts respond alike to every update
    N(i) = {j : d(i, j) <= eps}               eps = 0.05 by default

A small step on tau_j moves log pi(tau_i) by ``eta A_j K_ij``, so ``d`` compares how two rollouts
respond to every rollout's update. ``d`` is a pseudo-metric on rows (the L-infinity distance between
rows of ``K~``) but "within eps" is not transitive, hence the greedy neighbourhood cover of
:func:`epsilon_partition`.
"""

from __future__ import annotations

import math

import torch

from meshrl.algos import check_tensor

DEFAULT_EPS = 0.05
#: Rounding allowance of the neighbourhood test ``d <= eps + DISTANCE_ATOL``: duplicated rollouts
#: (identical scores) give rows of ``K~`` equal only up to float64 rounding (~1e-16).
DISTANCE_ATOL = 1e-12


def coupling_kernel(U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupling kernel ``K = U U^T`` and its cosine normalisation ``K~``.

    Zero rows (a rollout whose score is exactly zero, e.g. an empty response) have no direction:
    their row and column of ``K~`` are set to 0, diagonal included. Such a rollout responds to no
    update, so all zero-score rollouts are at distance 0 from each other and at distance >= 1 from
    every other rollout (whose diagonal entry is 1): they form one strategy of their own. Values of
    ``K~`` are clamped to [-1, 1] against rounding.

    Args:
        U: ``[G, P]`` per-rollout scores (or any features) of one query.
    Returns:
        ``(K, K_tilde)``, both ``[G, G]`` float64.
    """
    check_tensor("U", U, ndim=2)
    u = U.detach().to(torch.float64)
    K = u @ u.T
    return K, normalise_kernel(K)


def normalise_kernel(K: torch.Tensor) -> torch.Tensor:
    """``K~_ij = K_ij / sqrt(K_ii K_jj)`` of a Gram matrix ``[G, G]`` (float64), with zero-norm rows and
    columns set to 0 and values clamped to [-1, 1] (see :func:`coupling_kernel`). For feature maps known
    only through their Gram matrix (the ``head`` map's kernel trick)."""
    K = _check_square("K", K).detach().to(torch.float64)
    norms = torch.diagonal(K).clamp(min=0).sqrt()
    nz = norms > 0
    safe = torch.where(nz, norms, torch.ones_like(norms))
    Kt = (K / (safe[:, None] * safe[None, :])).clamp(-1.0, 1.0)
    return Kt * (nz[:, None] & nz[None, :])


def _check_square(name: str, x: torch.Tensor) -> torch.Tensor:
    check_tensor(name, x, ndim=2)
    if x.shape[0] != x.shape[1]:
        raise ValueError(f"{name} must be square [G, G], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach().to(torch.float64)


def kernel_distance(K_tilde: torch.Tensor) -> torch.Tensor:
    """``[G, G]`` float64 distances ``d(i, j) = max_k |K~_ik - K~_jk|`` (exactly 0 for identical rows)."""
    kt = _check_square("K_tilde", K_tilde)
    if kt.shape[0] == 0:
        return kt.clone()
    return (kt[:, None, :] - kt[None, :, :]).abs().amax(dim=-1)


def epsilon_partition(K_tilde: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Deterministic greedy neighbourhood cover of the rollouts: one strategy label per rollout.

    Algorithm: ``N(i) = {j : d(i, j) <= eps}`` (``i`` is in its own neighbourhood; the comparison
    allows ``DISTANCE_ATOL = 1e-12`` of rounding). While some rollout
    is unassigned, take the unassigned rollout ``c`` whose neighbourhood holds the most unassigned
    rollouts (ties go to the lowest index) and give every unassigned member of ``N(c)`` the next label
    (labels 0, 1, 2, ... in creation order; ``c`` is the strategy's centre).

    Consequences: every member of a strategy is within ``eps`` of its centre, so two members are within
    ``2 eps`` of each other (triangle inequality for ``d``); a rollout never changes label once assigned.
    Non-transitive chains are cut around the best-connected member: for a chain ``a~b~c`` with
    ``a !~ c`` the neighbourhoods are {a,b}, {a,b,c}, {b,c}, so ``b`` is the centre and all three form one
    strategy; for a chain ``a~b~c~d`` (only neighbours related) ``b`` and ``c`` tie with three, ``b``
    (lower index) wins, giving {a,b,c} and then {d}. With ``eps = 0`` the strategies are exactly the
    classes of identical rows of ``K~`` (identical up to rounding, e.g. duplicated scores).

    Args:
        K_tilde: ``[G, G]`` cosine-normalised kernel (from :func:`coupling_kernel`).
        eps: neighbourhood radius, finite and ``>= 0``.
    Returns:
        ``[G]`` LongTensor of labels in ``0 .. S-1``.
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    near = (kernel_distance(K_tilde) <= eps + DISTANCE_ATOL).cpu()
    G = near.shape[0]
    labels = torch.full((G,), -1, dtype=torch.long)
    free = torch.ones(G, dtype=torch.bool)
    label = 0
    while bool(free.any()):
        counts = (near & free[None, :]).sum(dim=1)
        counts[~free] = -1
        centre = int(torch.argmax(counts))  # first maximum: ties go to the lowest index
        members = near[centre] & free
        labels[members] = label
        free &= ~members
        label += 1
    return labels.to(K_tilde.device)


def strategy_masses(labels: torch.Tensor, seq_logp: torch.Tensor | None = None) -> dict:
    """Strategy masses ``nu_alpha`` of one query (the observable of the paper's Theorem 1).

    ``count_mass[a]`` = share of rollouts with label ``a``; ``prob_mass[a]`` = share of normalised
    sequence probability, ``sum_{i in a} softmax(seq_logp)_i`` (softmax within the group, i.e. the
    policy's probability of each sampled rollout renormalised over the sampled set).

    Args:
        labels: ``[G]`` integer strategy labels (e.g. :func:`epsilon_partition`); any integers.
        seq_logp: ``[G]`` sequence log-probabilities ``log pi(tau_i)`` or ``None``.
    Returns:
        dict with ``labels`` (``[S]`` sorted distinct labels), ``count_mass`` (``[S]`` float64, sums to
        1), ``n_strategies`` (int), ``max_count_mass`` (float), and, when ``seq_logp`` is given,
        ``prob_mass`` (``[S]``, sums to 1) and ``max_prob_mass``; otherwise those two are ``None``.
    """
    check_tensor("labels", labels, ndim=1)
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.numel() == 0:
        raise ValueError("labels must hold at least one rollout")
    uniq, inv = torch.unique(labels.cpu(), sorted=True, return_inverse=True)
    count = torch.bincount(inv, minlength=uniq.numel()).to(torch.float64)
    out: dict = {
        "labels": uniq,
        "count_mass": count / count.sum(),
        "n_strategies": int(uniq.numel()),
        "max_count_mass": float(count.max() / count.sum()),
        "prob_mass": None,
        "max_prob_mass": None,
    }
    if seq_logp is not None:
        check_tensor("seq_logp", seq_logp, ndim=1)
        if seq_logp.shape != labels.shape:
            raise ValueError(f"seq_logp shape {tuple(seq_logp.shape)} != labels shape {tuple(labels.shape)}")
        w = torch.softmax(seq_logp.detach().cpu().to(torch.float64), dim=0)
        prob = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, w)
        out["prob_mass"] = prob
        out["max_prob_mass"] = float(prob.max())
    return out
