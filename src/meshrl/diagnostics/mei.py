"""MEI, the Mirrored Entanglement Index, per group of rollouts and as trainer metrics.

Formula (docs/method.md §1.2; the Mesh Learning paper, §2.3)::

    MEI = ||sum_i phi_i||^2 / sum_i ||phi_i||^2 = (1^T Phi 1) / tr(Phi),      Phi_ij = phi_i . phi_j

over the G rollouts of one group. Range [0, G] (Cauchy-Schwarz): G mutually orthogonal features give 1,
G identical ones give G, c equal-sized mutually orthogonal clusters of identical features give G / c,
hence the paper's reading **G / MEI** as a count of directions (logged as ``g_over_mei``: meaningful for MEI in
[1, G] only; it exceeds G when the features are anti-correlated, MEI < 1, and is NaN at MEI = 0).

**Effective directions** (``directions``) is a count that is always one: the participation ratio of the Gram
matrix's spectrum, ``(sum_k lambda_k)^2 / sum_k lambda_k^2 = tr(Phi)^2 / ||Phi||_F^2`` (Phi is symmetric, so the
squared eigenvalues sum to its squared Frobenius norm). It lies in [1, rank Phi] <= G, equals c for c equal-sized
orthogonal clusters (as G / MEI does), 1 for G copies of one direction whatever their signs (phi and -phi span
one direction; G / MEI is NaN there), and G only for G orthogonal features of equal norms.
Since ``MEI = 1 + sum_{i != j} Phi_ij / tr(Phi)``, ``(MEI - 1) / (G - 1)`` is the mean pairwise cosine
when all norms are equal (and a norm-weighted mean of the pairwise inner products otherwise); the
exact mean pairwise cosine comes from the Gram matrix.

Scale: MEI lives on [0, G], so it is only comparable between groups of the same size. The paper's
release computes it per prompt row, i.e. per prefix group (G = 4) for Mesh and per query (G = 16) for
the baselines. :func:`mei_metrics` reports both groupings, the group size and the scale-free readings
(effective directions, cosines) so that plots can say which one they show.

Undefined cases are NaN, never a made-up number: a group whose features are all zero (``tr Phi = 0``,
e.g. every response token masked) has no MEI; the mean cosine needs two non-zero features; the
approximate cosine needs ``G >= 2``. Batch means ignore NaN groups (NaN if every group is NaN).
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Sequence

import torch

from meshrl.algos import check_tensor, group_index

#: Standard feature-map names (docs/method.md §1.2). ``mei_metrics`` accepts any name matching FEATURE_NAME_RE so
#: that variants (``head_sketch``, ``full_subset``) can be recorded exactly.
FEATURE_MAPS = ("bias", "head", "full")
FEATURE_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
#: Groupings reported by :func:`mei_metrics`.
SCOPES = ("query", "prefix_group")
#: Statistic suffixes of the metric keys (``""`` is the mean MEI itself).
STATS = ("", "directions", "directions_median", "g_over_mei", "g_over_mei_median", "g_over_mei_of_mean",
         "mean_cos", "approx_cos", "max", "group_size", "n_groups")

GroupIds = Sequence[Hashable] | torch.Tensor


def gram_matrix(features: torch.Tensor, *, name: str = "features") -> torch.Tensor:
    """``[B, B]`` float64 Gram matrix ``Phi = features features^T`` of ``features [B, F]``."""
    check_tensor(name, features, ndim=2)
    f = features.detach().to(torch.float64)
    return f @ f.T


def _as_gram(x: torch.Tensor, name: str, is_gram: bool) -> torch.Tensor:
    return _check_gram(x, name) if is_gram else gram_matrix(x, name=name)


def _dense_ids(name: str, ids: GroupIds, n: int) -> torch.Tensor:
    """Dense group index ``[n]`` of ``ids``; ``ValueError`` naming ``name`` on a length mismatch."""
    if isinstance(ids, torch.Tensor) and ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if isinstance(ids, (str, bytes)) or len(ids) != n:
        raise ValueError(f"{name} must have one label per rollout ({n}), got {len(ids)}")
    return group_index(ids, n)


def _check_gram(gram: torch.Tensor, name: str = "gram") -> torch.Tensor:
    check_tensor(name, gram, ndim=2)
    if gram.shape[0] != gram.shape[1]:
        raise ValueError(f"{name} must be square [G, G], got shape {tuple(gram.shape)}")
    if not gram.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {gram.dtype}")
    return gram.detach().to(torch.float64)


def mei_from_gram(gram: torch.Tensor) -> float:
    """MEI of one group from its Gram matrix ``[G, G]``: ``sum(Phi) / trace(Phi)`` (NaN if the trace is 0)."""
    g = _check_gram(gram)
    tr = float(torch.diagonal(g).sum())
    return float(g.sum()) / tr if tr > 0 else math.nan


def mean_pairwise_cosine(gram: torch.Tensor) -> float:
    """Exact mean of ``cos(phi_i, phi_j)`` over pairs ``i < j`` of non-zero features (NaN if < 2)."""
    g = _check_gram(gram)
    norms = torch.diagonal(g).clamp(min=0).sqrt()
    keep = norms > 0
    n = int(keep.sum())
    if n < 2:
        return math.nan
    sub = g[keep][:, keep] / (norms[keep][:, None] * norms[keep][None, :])
    off = sub.sum() - torch.diagonal(sub).sum()
    return float(off) / (n * (n - 1))


def participation_ratio(gram: torch.Tensor) -> float:
    """Effective directions of one group: ``tr(Phi)^2 / ||Phi||_F^2``, in [1, rank Phi] (NaN if the trace is 0)."""
    g = _check_gram(gram)
    tr = float(torch.diagonal(g).sum())
    return tr * tr / float((g * g).sum()) if tr > 0 else math.nan


def _group_stats(gram: torch.Tensor) -> tuple[float, float, float, float, float]:
    """(MEI, G/MEI, exact mean cosine, approximate cosine (MEI-1)/(G-1), effective directions)."""
    G = gram.shape[0]
    mei = mei_from_gram(gram)
    g_over = G / mei if mei > 0 else math.nan
    approx = (mei - 1.0) / (G - 1) if G >= 2 else math.nan
    return mei, g_over, mean_pairwise_cosine(gram), approx, participation_ratio(gram)


def _nanmean(x: torch.Tensor) -> float:
    return float(x.nanmean()) if x.numel() and not torch.isnan(x).all() else math.nan


def _nanmedian(x: torch.Tensor) -> float:
    """Median of the non-NaN entries (the mean of the two middle ones for an even count); NaN if none."""
    finite = x[~torch.isnan(x)]
    return float(finite.quantile(0.5)) if finite.numel() else math.nan


def group_mei(features_or_gram: torch.Tensor, group_ids: GroupIds, *, is_gram: bool = False) -> dict:
    """MEI and its readings for every group of rollouts under an arbitrary grouping.

    Groups are matched by label, never by batch position (``meshrl.algos.group_index``), so any
    grouping works: per query over all its rollouts, per (query, prefix) group, per anything.

    Args:
        features_or_gram: ``[B, F]`` features ``phi_i`` (``is_gram=False``) or the ``[B, B]`` Gram
            matrix of the whole batch (``is_gram=True``, e.g. from :func:`head_gram`). Only the
            diagonal blocks of the groups are used.
        group_ids: ``[B]`` hashable labels or an integer tensor.
        is_gram: how to read the first argument (a square features matrix is otherwise ambiguous).
    Returns:
        dict with per-group entries (index ``g`` follows first appearance in ``group_ids``)
        ``labels`` (list), ``size`` (LongTensor ``[n]``) and float64 tensors ``[n]``
        ``mei``, ``g_over_mei``, ``mean_cos``, ``approx_cos``, ``directions``; and batch means (floats, NaN
        groups ignored) ``mei_mean``, ``g_over_mei_mean``, ``mean_cos_mean``, ``approx_cos_mean``,
        ``directions_mean``, plus ``mei_max``.
    """
    gram = _as_gram(features_or_gram, "features_or_gram", is_gram)
    idx = _dense_ids("group_ids", group_ids, gram.shape[0])
    labels = _labels_in_order(group_ids, idx)
    stats = []
    for g in range(len(labels)):
        sel = (idx == g).nonzero(as_tuple=True)[0].to(gram.device)
        stats.append(_group_stats(gram[sel][:, sel]))
    cols = torch.tensor(stats, dtype=torch.float64).reshape(len(labels), 5)
    out: dict = {
        "labels": labels,
        "size": torch.bincount(idx, minlength=len(labels)),
        "mei": cols[:, 0],
        "g_over_mei": cols[:, 1],
        "mean_cos": cols[:, 2],
        "approx_cos": cols[:, 3],
        "directions": cols[:, 4],
    }
    for key in ("mei", "g_over_mei", "mean_cos", "approx_cos", "directions"):
        out[f"{key}_mean"] = _nanmean(out[key])
    finite = cols[:, 0][~torch.isnan(cols[:, 0])]
    out["mei_max"] = float(finite.max()) if finite.numel() else math.nan
    return out


def _labels_in_order(group_ids: GroupIds, idx: torch.Tensor) -> list:
    raw = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    labels: list = [None] * (int(idx.max()) + 1 if idx.numel() else 0)
    for lab, i in zip(raw, idx.tolist(), strict=True):
        labels[i] = lab
    return labels


def mei_key(feature: str, scope: str, stat: str = "") -> str:
    """Metric key ``mei/<feature>/<scope>[_<stat>]``, e.g. ``mei/bias/query_directions``."""
    if not (isinstance(feature, str) and FEATURE_NAME_RE.match(feature)):
        raise ValueError(f"feature must be a non-empty name of letters, digits, '_', '.', '-', got {feature!r}")
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; known: {', '.join(SCOPES)}")
    if stat not in STATS:
        raise ValueError(f"unknown stat {stat!r}; known: {', '.join(s or repr('') for s in STATS)}")
    return f"mei/{feature}/{scope}" + (f"_{stat}" if stat else "")


def _scope_metrics(gram: torch.Tensor, ids: GroupIds, feature: str, scope: str) -> dict[str, float]:
    r = group_mei(gram, ids, is_gram=True)
    size = float(r["size"].double().mean()) if r["size"].numel() else math.nan
    vals = {
        "": r["mei_mean"],
        "directions": r["directions_mean"],
        "directions_median": _nanmedian(r["directions"]),
        "g_over_mei": r["g_over_mei_mean"],
        "g_over_mei_median": _nanmedian(r["g_over_mei"]),
        "g_over_mei_of_mean": size / r["mei_mean"] if r["mei_mean"] > 0 else math.nan,
        "mean_cos": r["mean_cos_mean"],
        "approx_cos": r["approx_cos_mean"],
        "max": r["mei_max"],
        "group_size": size,
        "n_groups": float(len(r["labels"])),
    }
    return {mei_key(feature, scope, k): v for k, v in vals.items()}


def mei_metrics(
    phi: torch.Tensor,
    query_ids: GroupIds,
    prefix_ids: GroupIds | None = None,
    feature: str = "bias",
    *,
    is_gram: bool = False,
) -> dict[str, float]:
    """MEI metrics of one batch for the trainer's log, on every scale the comparison needs.

    Keys are ``mei/<feature>/<scope>[_<stat>]`` so that the feature map used is part of every record
    (``feature`` is ``"bias"``, ``"head"``, ``"full"`` or a variant name such as ``"head_sketch"``):

    - scope ``query``: one group per query over ALL its rollouts (for Mesh: across its prefix groups);
    - scope ``prefix_group``: one group per (query id, prefix id) pair, the paper release's scale
      (only when ``prefix_ids`` is given; prefix ids may repeat across queries).

    Stats per scope: ``""`` batch-mean MEI (range [0, group size]), ``directions`` the mean over groups of the
    effective directions (participation ratio, in [1, G]; ``meshrl report`` and the doctor use it) and
    ``directions_median``; the paper's reading ``g_over_mei`` the mean of G/MEI (a mean of ratios: one
    near-orthogonal group, MEI near 0, dominates it, and it exceeds G for anti-aligned rollouts, so it is not a
    count), ``g_over_mei_median`` its median over groups, ``g_over_mei_of_mean`` mean G / mean MEI,
    ``mean_cos`` mean exact pairwise cosine, ``approx_cos`` mean (MEI-1)/(G-1) (scale-free in [-1/(G-1), 1]),
    ``max`` largest group MEI, ``group_size`` mean G, ``n_groups``. Example:
    ``mei/bias/query``, ``mei/bias/query_directions``, ``mei/bias/prefix_group``.

    Args:
        phi: ``[B, F]`` features (``bias_features``, ``fisher_scores``) or ``[B, B]`` Gram with ``is_gram``.
        query_ids: ``[B]`` query labels. prefix_ids: ``[B]`` prefix/strategy labels or ``None``.
        feature: feature-map name written into the keys.
    Returns:
        ``dict[str, float]`` (NaN where undefined, see the module docstring).
    """
    mei_key(feature, "query")  # validates the name
    gram = _as_gram(phi, "phi", is_gram)
    _dense_ids("query_ids", query_ids, gram.shape[0])
    out = _scope_metrics(gram, query_ids, feature, "query")
    if prefix_ids is not None:
        _dense_ids("prefix_ids", prefix_ids, gram.shape[0])
        q = query_ids.tolist() if isinstance(query_ids, torch.Tensor) else list(query_ids)
        p = prefix_ids.tolist() if isinstance(prefix_ids, torch.Tensor) else list(prefix_ids)
        out |= _scope_metrics(gram, list(zip(q, p, strict=True)), feature, "prefix_group")
    return out
