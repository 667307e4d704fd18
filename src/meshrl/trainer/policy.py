"""Load a policy for sampling: a model spec, or a meshrl run directory (its latest checkpoint).

Here, not in :mod:`meshrl.runs`, because a run directory is rebuilt from its validated ``config.yaml``
(:func:`meshrl.trainer.load_config`): the run directory's format sits below the trainer, its config above it.
"""

from __future__ import annotations

from pathlib import Path

from meshrl.models import apply_lora, load_model
from meshrl.runs import is_run_dir
from meshrl.runs.checkpoint import latest_checkpoint, load_named_checkpoint, restore_checkpoint, step_dirs
from meshrl.trainer.config import RunConfig, load_config


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The validated :class:`meshrl.trainer.RunConfig` a run recorded in ``RUN_DIR/config.yaml``."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no config.yaml (not a meshrl run directory)")
    return load_config(path)


def load_policy(spec: str, *, dtype: str = "float32", seed: int = 0):
    """``(model, tokenizer, description)`` for a model spec or a run directory.

    A run directory is rebuilt from its ``config.yaml`` (model spec, seed, LoRA) and then takes the weights
    of ``checkpoints/latest`` (or of ``RUN_DIR/checkpoints/step_N`` when ``spec`` points at one).
    """
    path = Path(spec)
    ckpt = None
    if path.name.startswith("step_") and is_run_dir(path.parent.parent):
        path, ckpt = path.parent.parent, path
    if not is_run_dir(path):
        model, tok = load_model(spec, dtype=dtype, seed=seed)
        return model, tok, spec
    cfg = read_run_config(path)
    model, tok = load_model(cfg.model, dtype=dtype, seed=cfg.seed)
    if cfg.train.lora_r > 0:
        model = apply_lora(model, r=cfg.train.lora_r, alpha=cfg.train.lora_alpha)
    # Every file is checked against the sizes and SHA-256 its state.json recorded: a named step that fails is
    # refused; otherwise the newest intact checkpoint is used, with a warning naming what was passed over.
    if ckpt is not None:
        state = load_named_checkpoint(ckpt, model)
    elif latest_checkpoint(path) is None and not step_dirs(path / "checkpoints"):
        raise ValueError(f"run directory {path} has no checkpoint yet")
    else:
        _, state = restore_checkpoint(path, model, optimizer=None, restore_rng=False)
    return model.eval(), tok, f"{path} @ step {state['step']}"
