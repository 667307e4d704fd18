"""Mesh Learning inside verl (>= 0.9, < 0.10), without forking it.

- :mod:`~meshrl.integrations.verl.plugin`: the ``verl.plugins`` entry point; on ``import verl`` it registers
  meshrl's policy losses (``meshrl_<name>``, :mod:`~meshrl.integrations.verl.losses`) and the trainer mode
  ``meshrl`` (:mod:`~meshrl.integrations.verl.trainer`).
- :mod:`~meshrl.integrations.verl.loss_fn`: the actor loss wrapper (verl's PPO loss + strategy balancing + JS).
- :mod:`~meshrl.integrations.verl.balance_step`: per-rollout balancing weights from a step's batch.
- :mod:`~meshrl.integrations.verl.mei`: MEI from count-sketched bias features of verl's old-log-prob pass.
- :mod:`~meshrl.integrations.verl.reward`: the reward function that ``meshrl export verl`` (:mod:`meshrl.export.verl`)
  names in the reward module it writes (needs no verl).

Importing this package imports no verl; the modules that need verl import it themselves.
"""
