"""Optional trackers besides a run's own records (metrics.jsonl and friends: :mod:`meshrl.jsonl`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("meshrl")


class Trackers:
    """Optional TensorBoard / W&B / trackio sinks selected with ``--report-to``."""

    def __init__(self, names: list[str], run_dir: Path, config: dict[str, Any]) -> None:
        self._sinks: list[Any] = []
        for name in names:
            self._sinks.append(self._open(name, run_dir, config))

    @staticmethod
    def _open(name: str, run_dir: Path, config: dict[str, Any]) -> Any:
        try:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                return ("tensorboard", SummaryWriter(log_dir=str(run_dir / "tensorboard")))
            if name == "wandb":
                import wandb

                return ("wandb", wandb.init(project="meshrl", dir=str(run_dir), config=config))
            if name == "trackio":
                import trackio

                return ("trackio", trackio.init(project="meshrl", config=config))
        except ImportError as e:
            raise ValueError(f"--report-to {name}: the package is not installed ({e})") from e
        raise ValueError(f"unknown --report-to target {name!r}; known: tensorboard, wandb, trackio")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float) and k != "step"}
        for kind, sink in self._sinks:
            if kind == "tensorboard":
                for k, v in scalars.items():
                    sink.add_scalar(k, v, step)
            else:
                sink.log(scalars, step=step)

    def close(self) -> None:
        for kind, sink in self._sinks:
            if kind == "tensorboard":
                sink.close()
            else:
                sink.finish()
