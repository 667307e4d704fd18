"""Run-directory logging: metrics.jsonl, samples.jsonl, events.jsonl and optional trackers."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from meshrl.trainer.checkpoint import atomic_write_text

log = logging.getLogger("meshrl")


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible rather than dropping the key
    return v


class JsonlWriter:
    """Append-only JSONL file, flushed after every record so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        # One write call per record: a kill leaves at most one partial last line, which readers drop.
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` for every record of ``path``. A last line that does not parse (what a kill during an
    append leaves) is dropped with a warning naming the file; a bad line elsewhere is an error naming it."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from e
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                log.warning("%s: dropped a partial last line %d (%d characters; a crash during a write)",
                            path, i, len(line))
                break
            raise ValueError(f"{path}, line {i}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {i}: a JSON object was expected")
        out.append((line, record))
    return out


def truncate_after_step(path: Path, step: int) -> None:
    """Drop records with ``step > step`` (written after the checkpoint a run resumes from) and a partial last
    line. The file is rewritten atomically: a kill during the rewrite leaves the old file, never a short one."""
    if not path.is_file():
        return
    kept = [line for line, record in _parse_lines(path) if record.get("step", 0) <= step]
    text = "".join(line + "\n" for line in kept)
    if text != path.read_text():
        atomic_write_text(path, text)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a run's JSONL file (a partial last line is dropped with a warning)."""
    return [record for _, record in _parse_lines(path)]


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
