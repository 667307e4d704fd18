"""Mesh Learning and the MEI monitor inside TRL's ``GRPOTrainer`` (docs/scale-out.md, "TRL").

- :class:`MeshGRPOTrainer`: a ``GRPOTrainer`` subclass running Coach Prompting + Strategy-Balancing
  Regularisation from a ``meshrl coach`` prefix file, with the knobs of ``meshrl train --recipe mesh``
  (:class:`MeshOptions`).
- :class:`MEICallback`: MEI (bias feature map) per query and per prefix group, effective directions and the
  calibrated-threshold warning for any TRL GRPO run, optionally stopping or checkpointing at the warning.
- :class:`HealthCallback`: meshrl doctor's checks during the run, on TRL's log so far (warn, checkpoint or stop).
- :func:`meshrl.integrations.trl.reward.task_reward_func`: a task's own scorer as a TRL reward function, for the
  dataset ``meshrl export trl`` writes (:mod:`meshrl.export.trl`).

Names are resolved lazily: ``import meshrl.integrations.trl`` (or its ``options`` and ``reward`` modules) does not
import trl.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "MeshGRPOTrainer": "meshrl.integrations.trl.mesh_trainer",
    "MEICallback": "meshrl.integrations.trl.mei",
    "HealthCallback": "meshrl.integrations.trl.health",
    "MeshOptions": "meshrl.integrations.trl.options",
    "check_trl_version": "meshrl.integrations.trl.options",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not module.endswith(".options"):  # name the unsupported trl before its import fails somewhere inside
        import_module("meshrl.integrations.trl.options").check_trl_version()
    return getattr(import_module(module), name)
