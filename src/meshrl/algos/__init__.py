"""Pure tensor functions of RLVR: advantages, policy losses, divergences, aggregation, recipes.

No trainer state; every function documents its formula, its source and its tensor shapes.
"""

from meshrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    group_advantages,
    group_index,
    overlong_penalty,
    register_advantage,
)
from meshrl.algos.aggregation import AGG_MODES, aggregate, masked_mean
from meshrl.algos.divergences import KL_ESTIMATORS, js_divergence, js_sampled, kl_penalty
from meshrl.algos.policy_losses import (
    POLICY_LOSSES,
    cispo_loss,
    gspo_loss,
    gspo_token_loss,
    policy_loss,
    ppo_clip_loss,
    register_policy_loss,
)
from meshrl.algos.recipes import RECIPES, Recipe, recipe

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "RECIPES",
    "Recipe",
    "advantage_estimator",
    "aggregate",
    "cispo_loss",
    "dr_grpo_advantages",
    "dynamic_sampling_mask",
    "group_advantages",
    "group_index",
    "gspo_loss",
    "gspo_token_loss",
    "js_divergence",
    "js_sampled",
    "kl_penalty",
    "masked_mean",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip_loss",
    "recipe",
    "register_advantage",
    "register_policy_loss",
]
