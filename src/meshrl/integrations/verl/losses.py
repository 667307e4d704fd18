"""meshrl's policy losses as verl policy-loss functions (``actor_rollout_ref.actor.policy_loss.loss_mode``).

verl's ``ppo_loss`` (``verl/workers/utils/losses.py``, 0.9.1) calls a registered loss with keywords only::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        -> (loss scalar, metrics dict)

and expects it to aggregate with ``agg_loss(..., **config.global_batch_info)`` so that the loss stays invariant to
the data-parallel size and the micro-batching. Each adapter here computes meshrl's per-token loss matrix
(:func:`meshrl.algos.policy_loss`), multiplies it by verl's rollout-correction weights when given, and aggregates
it exactly so. Registered names: ``meshrl_<name>`` for every loss in :data:`meshrl.algos.POLICY_LOSSES`.

What differs from verl's own losses (checked on the installed 0.9.1 source):

- ``meshrl_ppo_clip``: PPO-clip without the dual clip that verl's ``vanilla`` always applies (``clip_ratio_c``,
  3 by default, bounds the loss of negative-advantage tokens); meshrl's GRPO recipes use none.
- ``meshrl_gspo``: the sequence-level GSPO objective (Zheng et al. 2025, eqs. 5-7). verl's ``gspo`` is the
  GSPO-token form (eqs. 13-14); ``meshrl_gspo_token`` is that form with meshrl's clamps (the log-ratio clamped at
  +-20 per token, verl clamps the sequence log-ratio at 10). On unclipped data the three agree in value and
  gradient (``tests/verl_engine/test_verl_losses.py`` checks it), so the GSPO names are for exact parity with meshrl's
  trainer, not a new objective.
- ``meshrl_cispo``: meshrl's CISPO reads the same clip bounds; verl's ``cispo`` clamps with ``clip_ratio`` on both
  sides by default while meshrl's recipe sets ``clip_ratio_low=1.0`` (no lower bound): set it in the config.

The Jensen-Shannon penalty is not a policy loss here: ``ppo_loss`` never passes the reference log-probs to a
registered loss, so the JS term lives in the meshrl loss wrapper (:mod:`meshrl.integrations.verl.loss_fn`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from meshrl.algos import POLICY_LOSSES, policy_loss

PREFIX = "meshrl_"
#: Metrics get verl's ``actor/`` prefix when the actor reports them; ``meshrl/`` keeps them apart from verl's.
METRIC_PREFIX = "meshrl/"


def clip_bounds(config: Any) -> tuple[float, float]:
    """``(clip_low, clip_high)`` from an ActorConfig as verl reads them: ``clip_ratio_low/high`` else ``clip_ratio``."""
    if config is None:
        raise ValueError("a meshrl policy loss needs verl's actor config (config=None was passed)")
    base = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else base
    high = config.clip_ratio_high if config.clip_ratio_high is not None else base
    return float(low), float(high)


def _global_batch_info(config: Any) -> dict:
    info = getattr(config, "global_batch_info", None)
    return dict(info) if info else {}


def make_verl_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """A verl policy-loss function running meshrl's loss ``name`` (a key of :data:`meshrl.algos.POLICY_LOSSES`)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown meshrl policy loss {name!r}; known: {', '.join(sorted(POLICY_LOSSES))}")

    def verl_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        low, high = clip_bounds(config)
        loss_mat, stats = policy_loss(name, log_prob, old_log_prob, advantages, response_mask,
                                      clip_low=low, clip_high=high)
        if rollout_is_weights is not None:
            loss_mat = loss_mat * rollout_is_weights
        loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                        **_global_batch_info(config))
        return loss, {METRIC_PREFIX + k: float(v) for k, v in stats.items()}

    verl_policy_loss.__name__ = f"{PREFIX}{name}"
    verl_policy_loss.__doc__ = f"meshrl's ``{name}`` loss aggregated by verl's ``agg_loss`` (see module docstring)."
    return verl_policy_loss


def register_all() -> list[str]:
    """Register ``meshrl_<name>`` in verl's policy-loss registry for every meshrl loss; return the names."""
    names = []
    for name in sorted(POLICY_LOSSES):
        register_policy_loss(PREFIX + name)(make_verl_policy_loss(name))
        names.append(PREFIX + name)
    return names
