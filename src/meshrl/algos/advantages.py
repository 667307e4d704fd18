"""Group-relative advantage estimators (GRPO, Dr. GRPO) and reward shapers (DAPO)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from meshrl.algos._checks import check_choice, check_tensor

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}


def register_advantage(name: str) -> Callable:
    """Decorator: add an advantage estimator ``fn(rewards, group_ids, **kw) -> [B]`` to the registry."""

    def deco(fn: Callable) -> Callable:
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


def group_index(group_ids: Sequence[Hashable] | torch.Tensor, n: int) -> torch.Tensor:
    """Map arbitrary hashable group labels to dense integer ids ``[B]`` (first-seen order).

    Groups need not be contiguous in the batch: rows are matched by label, never by position.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        labels = group_ids.tolist()
    else:
        labels = list(group_ids)
    if len(labels) != n:
        raise ValueError(f"group_ids has {len(labels)} entries but rewards has {n}")
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in labels], dtype=torch.long)


def _group_stats(rewards: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-row group mean, unbiased group std and group size, gathered back to ``[B]``."""
    n_groups = int(idx.max()) + 1 if idx.numel() else 0
    r = rewards.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, idx, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, idx, r)
    mean = total / count
    dev2 = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, idx, (r - mean[idx]) ** 2)
    std = torch.sqrt(dev2 / (count - 1).clamp(min=1))
    return mean[idx], std[idx], count[idx]


def _group_varies(rewards: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the row's group holds at least two different rewards (exact min/max comparison)."""
    n_groups = int(idx.max()) + 1
    r = rewards.to(torch.float64)
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, idx, r, "amin")
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, idx, r, "amax")
    return (hi > lo)[idx]


@register_advantage("grpo")
def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    scale: str = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages, one scalar per rollout.

    Formula (GRPO, Shao et al. 2024, DeepSeekMath eq. 3 outcome supervision)::

        A_i = (r_i - mean_{j in g(i)} r_j) / (std_{j in g(i)} r_j + eps)     scale="std"
        A_i =  r_i - mean_{j in g(i)} r_j                                   scale="none"  (Dr. GRPO,
                                                                             Liu et al. 2025, §3.1)

    ``std`` is the unbiased (n-1) estimator, as ``torch.std`` in verl's ``compute_grpo_outcome_advantage``.
    A group of one rollout gets advantage 0 (nothing to compare against). Groups whose rewards are all
    equal get exactly 0 as well: in floating point their mean need not equal each reward
    (``(0.1 + 0.1 + 0.1) / 3 != 0.1``), and dividing that rounding residue by a std of the same size
    would turn it into an O(1) advantage when ``eps`` is small or zero.

    Args:
        rewards: ``[B]`` float rewards.
        group_ids: ``[B]`` hashable labels (e.g. query ids) or an integer tensor; need not be contiguous.
        scale: ``"std"`` or ``"none"``.
        eps: ``>= 0``, added to the std (keeps the scale finite for near-constant groups).
    Returns:
        ``[B]`` advantages in ``rewards.dtype`` when it is floating point, else in the default float
        dtype (integer or bool rewards such as 0/1 correctness must not truncate the advantages).
    """
    check_tensor("rewards", rewards, ndim=1)
    check_choice("scale", scale, ("std", "none"))
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    idx = group_index(group_ids, rewards.shape[0])
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    if rewards.numel() == 0:
        return rewards.to(out_dtype).clone()
    mean, std, count = _group_stats(rewards, idx)
    adv = rewards.to(torch.float64) - mean
    if scale == "std":
        adv = adv / (std + eps)
    # Groups of one and all-equal groups carry no comparison: advantage exactly 0.
    adv = torch.where((count > 1) & _group_varies(rewards, idx), adv, torch.zeros_like(adv))
    return adv.to(out_dtype)


@register_advantage("dr_grpo")
def dr_grpo_advantages(
    rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor, **_: object
) -> torch.Tensor:
    """Dr. GRPO advantages: ``A_i = r_i - mean_g r`` (no std division; Liu et al. 2025, "Understanding
    R1-Zero-Like Training", §3.1). Equivalent to ``group_advantages(..., scale="none")``."""
    return group_advantages(rewards, group_ids, scale="none")


def advantage_estimator(name: str) -> Callable[..., torch.Tensor]:
    """Look up an advantage estimator by name; unknown names raise ``ValueError`` listing the known ones."""
    check_choice("advantage estimator", name, ADVANTAGE_ESTIMATORS)
    return ADVANTAGE_ESTIMATORS[name]


def dynamic_sampling_mask(
    rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor
) -> torch.Tensor:
    """DAPO dynamic sampling filter: ``True`` for rows whose group's rewards are not all equal.

    Source: Yu et al. 2025, "DAPO", eq. 11 constraint ``0 < |{o_i : is_equivalent(a, o_i)}| < G``,
    generalised to real-valued rewards as "the group's reward std is non-zero". Groups of one are dropped
    (their advantage is 0, so they carry no gradient).

    Returns ``[B]`` bool.
    """
    check_tensor("rewards", rewards, ndim=1)
    idx = group_index(group_ids, rewards.shape[0])
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    return _group_varies(rewards, idx)


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the task reward.

    Formula (Yu et al. 2025, "DAPO", eq. 13), with ``L_max = max_len`` and ``L_cache = cache_len``::

        R(y) = 0                                  if |y| <= L_max - L_cache
        R(y) = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        R(y) = -1                                 if |y| > L_max

    multiplied by ``factor`` (verl's ``overlong_buffer.penalty_factor``).

    Args:
        lengths: ``[B]`` response lengths in tokens.
    Returns:
        ``[B]`` float penalties in ``[-factor, 0]``.
    """
    check_tensor("lengths", lengths, ndim=1)
    if not (0 < cache_len <= max_len):
        raise ValueError(f"cache_len must be in (0, max_len={max_len}], got {cache_len}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    n = lengths.to(torch.float64)
    expected = max_len - cache_len
    pen = ((expected - n) / cache_len).clamp(min=-1.0, max=0.0)
    return (pen * factor).to(torch.float32)
