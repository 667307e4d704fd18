"""verl plugin entry point (group ``verl.plugins``): registers meshrl's losses and trainer mode on ``import verl``.

verl 0.9.1 loads every entry point of the group at the end of ``verl/__init__.py``, in the driver and in every Ray
worker, and logs a failing one at DEBUG only. So this module records what it registered and what failed
(:data:`REGISTERED`, :data:`FAILED`) and :func:`check_registered` turns a failure into an error naming its cause.
The trainer mode needs verl's v1 trainer (TransferQueue, Ray); without it the losses still register.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

REGISTERED: dict[str, list[str]] = {"policy_loss": [], "trainer": []}
FAILED: dict[str, str] = {}


SUPPORTED = ((0, 9), (0, 10))  # verl versions >= 0.9 and < 0.10: the extension points were read on 0.9.1


def _version_problem() -> str | None:
    import verl

    raw = getattr(verl, "__version__", "")
    try:
        major_minor = tuple(int(x) for x in raw.split(".")[:2])
    except ValueError:
        return f"cannot read verl's version {raw!r}"
    if not SUPPORTED[0] <= major_minor < SUPPORTED[1]:
        return f"verl {raw} is not supported (meshrl's plugin is written for verl >= 0.9, < 0.10)"
    return None


def _register() -> None:
    problem = _version_problem()
    if problem:
        FAILED["verl"] = problem
        logger.warning("meshrl: %s; its losses and trainer mode are not registered", problem)
        return
    from meshrl.integrations.verl.losses import register_all

    REGISTERED["policy_loss"] = register_all()
    try:
        from meshrl.integrations.verl.trainer import TRAINER_MODE
    except ImportError as e:  # verl's v1 trainer imports TransferQueue and Ray; losses work without them
        FAILED["trainer"] = f"{type(e).__name__}: {e}"
        logger.warning("meshrl: verl trainer mode 'meshrl' not registered (%s)", FAILED["trainer"])
    else:
        REGISTERED["trainer"] = [TRAINER_MODE]


def check_registered(*, trainer: bool = True) -> None:
    """Raise ``RuntimeError`` unless meshrl's losses (and, with ``trainer``, its trainer mode) are in verl's
    registries."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from meshrl.integrations.verl.losses import PREFIX

    if "verl" in FAILED:
        raise RuntimeError(f"meshrl's verl plugin did not register: {FAILED['verl']}")
    if not any(name.startswith(PREFIX) for name in POLICY_LOSS_REGISTRY):
        raise RuntimeError("meshrl's policy losses are not registered in verl: is meshrl installed in this "
                           "environment (its `verl.plugins` entry point) and VERL_USE_EXTERNAL_PLUGINS not 'none'?")
    if trainer:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

        if "meshrl" not in TRAINER_REGISTRY:
            raise RuntimeError(f"verl trainer mode 'meshrl' is not registered: {FAILED.get('trainer', 'unknown')}")


_register()
