"""Pure tensor functions of RLVR: advantages, policy losses, divergences, aggregation, recipes, and the
plug-ins around them (entropy control, off-policy terms, preference and distillation losses).

No trainer state; every function documents its formula, its source and its tensor shapes.
"""

from meshrl.algos._checks import check_choice, check_mask, check_tensor
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
from meshrl.algos.entropy_control import (
    ADVANTAGE_SHAPERS,
    COVARIANCE_LOSSES,
    TOKEN_MASKS,
    clip_cov_loss,
    clip_cov_selection,
    clipped_by_loss,
    clipped_tokens,
    covariance_loss,
    entropy_advantage,
    high_entropy_mask,
    kl_cov_loss,
    kl_cov_penalty,
    kl_cov_selection,
    shape_advantages,
    token_covariance,
    token_mask,
)
from meshrl.algos.offpolicy import (
    OFF_POLICY_SHAPES,
    importance_weight_stats,
    logprob_mismatch_stats,
    luffy_off_policy_loss,
    m2po_mask,
    rollout_is_weights,
    rollout_rejection_mask,
)
from meshrl.algos.policy_losses import (
    POLICY_LOSSES,
    cispo_loss,
    gspo_loss,
    gspo_token_loss,
    policy_loss,
    ppo_clip_loss,
    register_policy_loss,
)
from meshrl.algos.preference import DPO_LOSSES, dpo_loss, topk_forward_kl
from meshrl.algos.recipes import RECIPES, Recipe, recipe

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SHAPERS",
    "COVARIANCE_LOSSES",
    "DPO_LOSSES",
    "OFF_POLICY_SHAPES",
    "TOKEN_MASKS",
    "check_choice",
    "check_mask",
    "check_tensor",
    "clip_cov_loss",
    "clip_cov_selection",
    "clipped_by_loss",
    "clipped_tokens",
    "covariance_loss",
    "dpo_loss",
    "entropy_advantage",
    "high_entropy_mask",
    "kl_cov_loss",
    "kl_cov_penalty",
    "kl_cov_selection",
    "logprob_mismatch_stats",
    "luffy_off_policy_loss",
    "m2po_mask",
    "importance_weight_stats",
    "rollout_is_weights",
    "rollout_rejection_mask",
    "shape_advantages",
    "token_covariance",
    "token_mask",
    "topk_forward_kl",
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
