"""Atomic checkpoints: safetensors weights + optimizer + RNG state + step, with a ``latest`` pointer.

Layout::

    RUN_DIR/checkpoints/step_000010/{model.safetensors, optimizer.pt, rng.pt, state.json}
    RUN_DIR/checkpoints/latest          # text file holding "step_000010"

Each checkpoint is written into a temporary sibling directory and renamed into place, and ``latest`` is
replaced atomically, so a crash mid-write never leaves a half checkpoint behind the pointer.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(
    run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    state: dict[str, Any], keep_last: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically, move ``latest`` to it and prune older ones."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(root / "latest", name)
    _prune(root, keep_last, keep=name)
    return final


def _prune(root: Path, keep_last: int, keep: str) -> None:
    ckpts = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for p in ckpts[:-keep_last] if keep_last > 0 else []:
        if p.name != keep:
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise ValueError(f"checkpoint pointer {pointer} names {path.name}, which is incomplete or missing")
    return path


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = True
) -> dict[str, Any]:
    """Restore weights (and optimizer, RNG) from ``path``; return its ``state.json`` dict."""
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise ValueError(f"checkpoint {path} does not match the model: missing={missing} unexpected={unexpected}")
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    if restore_rng:
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "state.json").read_text())
