"""Recipe presets as data: each recipe is a set of switches over the same pure functions.

Defaults follow docs/method.md §2 and the cited papers; the trainer reads a :class:`Recipe` and never
branches on its name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from meshrl.algos._checks import check_choice


@dataclass(frozen=True)
class Recipe:
    """Algorithm switches of one training recipe (no model, task or optimiser settings)."""

    name: str
    advantage: str = "grpo"  # key of ADVANTAGE_ESTIMATORS
    adv_scale: str = "std"  # "std" (GRPO) or "none" (Dr. GRPO)
    policy_loss: str = "ppo_clip"  # key of POLICY_LOSSES
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_dual: float | None = None
    loss_agg: str = "seq-mean-token-mean"
    kl_coef: float = 0.0  # beta of KL(pi || pi_ref); 0 = no reference model needed for KL
    kl_kind: str = "k3"
    js_coef: float = 0.0  # beta of JS(pi, pi_ref)
    js_mode: str = "exact"  # "exact" over the vocabulary, or "sampled" (js_sampled)
    dynamic_sampling: bool = False  # DAPO: drop groups with all-equal rewards and refill the batch
    overlong_shaping: bool = False  # DAPO soft overlong punishment
    overlong_cache_frac: float = 0.2  # L_cache / L_max (DAPO: 4096 / 20480)
    overlong_factor: float = 1.0
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def needs_reference(self) -> bool:
        """True when a term of the loss needs the frozen reference policy."""
        return self.kl_coef > 0 or self.js_coef > 0

    def replace(self, **changes: object) -> Recipe:
        """Copy with fields changed; unknown field names raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown recipe field(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


RECIPES: dict[str, Recipe] = {
    "grpo": Recipe(
        name="grpo",
        notes="GRPO (Shao et al. 2024): std-normalised group advantages, PPO clip 0.2, "
        "seq-mean-token-mean, no KL by default.",
    ),
    "dr_grpo": Recipe(
        name="dr_grpo",
        advantage="dr_grpo",
        adv_scale="none",
        loss_agg="seq-mean-token-sum-norm",
        notes="Dr. GRPO (Liu et al. 2025): no std division, constant length normaliser.",
    ),
    "grpo_kl": Recipe(
        name="grpo_kl",
        kl_coef=1e-3,
        kl_kind="k3",
        notes="GRPO + beta KL(pi || pi_ref), k3 estimator (DeepSeekMath uses beta 0.04; verl examples 1e-3).",
    ),
    "grpo_js": Recipe(
        name="grpo_js",
        js_coef=1e-3,
        js_mode="exact",
        notes="GRPO + beta JS(pi, pi_ref): a true divergence (>= 0), exact over the vocabulary.",
    ),
    "dapo": Recipe(
        name="dapo",
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token-mean",
        dynamic_sampling=True,
        overlong_shaping=True,
        notes="DAPO (Yu et al. 2025): clip-higher 0.2/0.28, token-mean, dynamic sampling, "
        "soft overlong punishment (L_cache = 0.2 L_max).",
    ),
    "gspo": Recipe(
        name="gspo",
        policy_loss="gspo",
        clip_low=3e-4,
        clip_high=4e-4,
        loss_agg="seq-mean-token-mean",
        notes="GSPO (Zheng et al. 2025): sequence ratio exp(mean log rho), sequence clipping 3e-4/4e-4.",
    ),
    "gspo_token": Recipe(
        name="gspo_token",
        policy_loss="gspo_token",
        clip_low=3e-4,
        clip_high=4e-4,
        loss_agg="seq-mean-token-mean",
        notes="GSPO-token (Zheng et al. 2025 §4.3): token advantages with the sequence ratio.",
    ),
    "cispo": Recipe(
        name="cispo",
        policy_loss="cispo",
        clip_low=1.0,
        clip_high=0.28,
        loss_agg="token-mean",
        notes="CISPO (MiniMax-M1 2025): clipped, stop-gradient IS weight times log-prob.",
    ),
}


def recipe(name: str) -> Recipe:
    """Return the preset named ``name``; unknown names raise ``ValueError`` listing the known ones."""
    check_choice("recipe", name, RECIPES)
    return RECIPES[name]
