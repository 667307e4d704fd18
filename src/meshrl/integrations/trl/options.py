"""Mesh Learning settings for TRL and the pieces that do not need trl: layout, conditioning, advantages.

TRL groups completions by position: its ``RepeatSampler`` puts the ``num_generations`` completions of one
dataset row in consecutive rows, and the advantage is computed over ``view(-1, num_generations)``. Mesh
keeps that block as the *query* and cuts it into the m prefix groups (plus one bare group with
``bare_group``): completion ``k`` of a block belongs to group ``k // n``, ``n = num_generations / groups``.
Under both budgets the block holds every rollout of a query, so what the budget changes is the size G of
the baseline it is compared with (:func:`meshrl.mesh.baseline_group_size`):

- ``matched``: G = num_generations, m groups of G/m (the baseline runs with the same num_generations);
- ``per_prefix``: G = num_generations / m per prefix, m groups of G (the baseline needs m*G).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from meshrl.mesh import BUDGET_MODES, REDUCTIONS, budget_groups
from meshrl.mesh.coach import check_conditioning, condition_prompt
from meshrl.runs.correct import CORRECT_AT  # a rollout is correct when its reward reaches 1

SUPPORTED_TRL = ("1.16", "2")  # >= 1.16, < 2: the override points used here were read in trl 1.16.0
ADV_UNITS = ("prefix_group", "query")
BALANCES = ("paper", "support")


def check_trl_version(version: str | None = None) -> str:
    """The installed trl version, or ``ValueError`` naming it when it is outside ``>= 1.16, < 2``."""
    if version is None:
        try:
            version = metadata.version("trl")
        except metadata.PackageNotFoundError:
            raise ValueError("trl is not installed: pip install 'meshrl[trl]' (trl>=1.16,<2)") from None
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    major, minor = (parts + [0, 0])[:2]
    if not (major == 1 and minor >= 16):
        raise ValueError(f"trl {version} is not supported by meshrl.integrations.trl: it needs trl>=1.16,<2 "
                         "(the GRPOTrainer override points it uses were checked against trl 1.16.0)")
    return version


@dataclass(frozen=True)
class MeshOptions:
    """The knobs of ``meshrl train --recipe mesh`` (README "Mesh Learning"), for :class:`MeshGRPOTrainer`.

    ``mu = 0`` gives the CP-only control arm (prefixes, no balancing). ``group_size`` is meshrl's
    ``rollout.group_size`` G: when given, ``num_generations`` must be the rollouts per query that the
    budget implies (G for ``matched``, m*G for ``per_prefix``; bare group included); when ``None`` the
    budget only names the comparison (see the module docstring). ``problem_column`` names the dataset
    column holding the problem text the prefix file is keyed by (``meshrl export trl`` writes ``problem``).
    ``correct_reward`` names the reward function whose value marks a completion correct (needed when there
    is more than one; ``None`` with one reward function uses it).
    """

    m: int = 4
    placement: str = "system"
    template: str = "wrapped"
    budget: str = "matched"
    adv_unit: str = "prefix_group"
    mu: float = 1e-5
    balance: str = "paper"
    subtract_ref: bool = True
    reduction: str = "mean"
    bare_group: bool = False
    group_size: int | None = None
    problem_column: str = "problem"
    correct_reward: str | None = None
    correct_threshold: float = CORRECT_AT

    def __post_init__(self) -> None:
        check_conditioning(self.m, self.placement, self.template)
        for name, value, known in (("budget", self.budget, BUDGET_MODES), ("adv_unit", self.adv_unit, ADV_UNITS),
                                   ("balance", self.balance, BALANCES), ("reduction", self.reduction, REDUCTIONS)):
            if value not in known:
                raise ValueError(f"mesh.{name}={value!r}; known: {', '.join(known)}")
        if self.group_size is not None:
            budget_groups(self.group_size, self.groups, self.budget)  # ValueError naming the bad value
        if isinstance(self.mu, bool) or not isinstance(self.mu, int | float) or not math.isfinite(self.mu) \
                or self.mu < 0:
            raise ValueError(f"mesh.mu must be a finite number >= 0, got {self.mu!r}")

    @property
    def groups(self) -> int:
        """Rollout groups per query: the m prefix groups, plus the bare one with ``bare_group``."""
        return self.m + int(self.bare_group)

    def layout(self, num_generations: int) -> tuple[int, list[int]]:
        """``(n, strategies)``: completions per group and the strategy id of each group (-1 = bare).

        ``ValueError`` naming ``num_generations`` when it does not split into the groups.
        """
        if num_generations % self.groups:
            extra = " + 1 (bare_group)" if self.bare_group else ""
            raise ValueError(f"GRPOConfig.num_generations={num_generations} does not divide into mesh.m={self.m}"
                             f"{extra} prefix groups; use a multiple of {self.groups}")
        if self.group_size is not None:
            want = sum(budget_groups(self.group_size, self.groups, self.budget))
            if num_generations != want:
                raise ValueError(f"GRPOConfig.num_generations={num_generations} but mesh.budget={self.budget!r} with "
                                 f"group_size={self.group_size} and {self.groups} groups draws {want} rollouts "
                                 "per query")
        strategies = [*range(self.m), -1] if self.bare_group else list(range(self.m))
        return num_generations // self.groups, strategies

    def baseline_group_size(self, num_generations: int) -> int:
        """Group size G of the prefix-free baseline that draws as many rollouts per query (see module doc)."""
        n, _ = self.layout(num_generations)
        return num_generations if self.budget == "matched" else n * self.groups

    def strategy_of(self, position_in_block: int, num_generations: int) -> int:
        n, strategies = self.layout(num_generations)
        return strategies[position_in_block // n]

    def conditioned_prompt(self, prompt: Any, prefix: str) -> Any:
        """The TRL prompt of one rollout conditioned on a coach prefix, in the prompt's own format
        (:func:`meshrl.mesh.coach.condition_prompt`, which ``meshrl export trl`` uses too)."""
        return condition_prompt(prompt, prefix, self.placement, self.template)


def trl_group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str) -> torch.Tensor:
    """TRL 1.16's ``sum_then_normalize`` advantage over consecutive groups of ``group_size`` rows.

    ``A = (r - nanmean_group(r)) / (std + 1e-4)`` with std the unbiased NaN-ignoring std over the group
    (``scale_rewards="group"``) or over the batch (``"batch"``), no division for ``"none"``; NaN rewards
    (unscorable rows) get advantage 0. Used with ``group_size`` = the prefix-group size for
    ``adv_unit="prefix_group"`` (TRL itself uses ``num_generations``, the query).

    Args: rewards ``[N]`` (weighted sum of the reward functions), N divisible by ``group_size``.
    Returns: ``[N]`` advantages.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of {group_size} rows, got {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif scale_rewards in ("group", "none"):
        std = _nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"GRPOConfig.scale_rewards={scale_rewards!r}; known: group, batch, none")
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaN (Bessel over the non-NaN count)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    var = torch.nansum((x - mean) ** 2, dim=dim) / (count - 1).clamp(min=1)
    return var.sqrt()
