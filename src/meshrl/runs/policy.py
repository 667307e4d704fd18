"""Whether a path is a meshrl run directory. Loading a policy from one needs the run's validated config, so
:func:`meshrl.trainer.load_policy` and :func:`meshrl.trainer.read_run_config` live in the trainer."""

from __future__ import annotations

from pathlib import Path


def is_run_dir(spec: str | Path) -> bool:
    p = Path(spec)
    return (p / "config.yaml").is_file() and (p / "checkpoints").is_dir()
