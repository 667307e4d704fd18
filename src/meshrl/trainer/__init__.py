"""Single-process RLVR trainer (engine layer)."""

from meshrl.trainer.config import RunConfig, load_config
from meshrl.trainer.loop import NonFiniteAbort, Trainer, train

__all__ = ["NonFiniteAbort", "RunConfig", "Trainer", "load_config", "train"]
