"""Logged completions of TRL and verl runs, as the doctor's samples (``step``, ``completion``, ``reward``).

- TRL 1.16 ``GRPOTrainer`` with ``log_completions=True`` writes the last generation batch at every logging step to
  ``OUTPUT_DIR/completions/completions_<step>.parquet`` (columns ``step``, ``prompt``, ``completion``, one per
  reward function, ``advantage``; conversational prompts and completions are lists of messages). Read with
  pyarrow (TRL's own dependency through pandas/datasets); without it the files are noted, not read.
- verl (``trainer.rollout_data_dir``, and ``trainer.validation_data_dir`` for validation) writes one JSONL per step,
  ``<step>.jsonl``, each line ``{"input", "output", "gts", "score", "step", ...}`` (``_dump_generations`` of its
  trainer).

A file that cannot be read is a note; a row without a text completion is skipped and counted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from meshrl.doctor.records import number, read_jsonl

TRL_FILE = re.compile(r"^completions_(\d+)\.parquet$")
VERL_FILE = re.compile(r"^(\d+)\.jsonl$")
TRL_FIXED = ("step", "prompt", "completion", "advantage")


def _text(value: Any) -> str | None:
    """A completion's text: a string, or the joined contents of a list of chat messages."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(m, dict) for m in value):
        parts = [m.get("content") for m in value]
        return "".join(p for p in parts if isinstance(p, str)) if any(isinstance(p, str) for p in parts) else None
    return None


def trl_sample(row: dict[str, Any], step: int) -> dict[str, Any] | None:
    """One row of TRL's completions table as a sample (None without a text completion). With a single numeric
    column besides the fixed ones (one reward function) its value is the reward; with several the weights are
    unknown and no reward is kept."""
    text = _text(row.get("completion"))
    if text is None:
        return None
    rewards = [v for k, v in row.items() if k not in TRL_FIXED and number(v) is not None]
    sample: dict[str, Any] = {"step": int(number(row.get("step")) or step), "completion": text}
    if len(rewards) == 1:
        sample["reward"] = float(rewards[0])
    return sample


def trl_completions(root: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Samples from ``root/completions/completions_*.parquet`` (none when the folder is absent)."""
    folder = root / "completions"
    files = sorted((int(m[1]), p) for p in folder.glob("completions_*.parquet") if (m := TRL_FILE.match(p.name)))
    if not files:
        return []
    try:
        import pyarrow.parquet as pq
    except ImportError:
        notes.append(f"{folder}: {len(files)} completion file(s) not read (pyarrow is not installed)")
        return []
    samples: list[dict[str, Any]] = []
    skipped = 0
    for step, path in files:
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types for damaged files
            notes.append(f"{path.name}: unreadable parquet ({type(e).__name__}); skipped")
            continue
        for row in rows:
            sample = trl_sample(row, step)
            if sample is None:
                skipped += 1
            else:
                samples.append(sample)
    if skipped:
        notes.append(f"{folder}: skipped {skipped} row(s) without a text completion")
    return samples


def verl_dumps(folder: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Samples from verl's generation dumps ``folder/<step>.jsonl``."""
    files = sorted((int(m[1]), p) for p in folder.glob("*.jsonl") if (m := VERL_FILE.match(p.name)))
    return [s for _, path in files for s in verl_dump_file(path, notes)]


def verl_dump_file(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Samples of one dump file ``<step>.jsonl``; lines without a text ``output`` are skipped and noted."""
    step = int(path.stem)
    samples: list[dict[str, Any]] = []
    skipped = 0
    for row in read_jsonl(path, notes):
        if not isinstance(row.get("output"), str):
            skipped += 1
            continue
        sample = {"step": int(number(row.get("step")) or step), "completion": row["output"]}
        score = number(row.get("score"))
        if score is not None:
            sample["reward"] = sample["score"] = score
        samples.append(sample)
    if skipped:
        notes.append(f"{path}: skipped {skipped} line(s) without a text 'output'")
    return samples
