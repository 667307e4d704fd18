"""Reading run directories and eval directories for ``meshrl report``.

Everything here is tolerant: a missing file, an unreadable line, a non-numeric value ("nan", "inf" as
the trainer writes non-finite floats) or a missing metric becomes a note, never an exception. Only an
input path that is neither a run directory nor an eval directory is an error (``ValueError``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshrl.doctor.records import dig, read_jsonl

log = logging.getLogger("meshrl.report")

STRATEGY_MASS_PREFIX = "strategy/mass/"


def as_number(value: Any) -> float | None:
    """A finite float, or ``None`` for strings ("nan", "inf", text), bools, ``None``, containers, NaN/inf."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _read_mapping(path: Path, notes: list[str], loader: str) -> dict[str, Any]:
    try:
        text = path.read_text(errors="replace")
        data = yaml.safe_load(text) if loader == "yaml" else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        notes.append(f"{path.name}: unreadable ({type(e).__name__})")
        return {}
    if not isinstance(data, dict):
        notes.append(f"{path.name}: not a mapping")
        return {}
    return data


@dataclass
class RunData:
    """One training run directory: resolved config, per-step metrics, events, held-out evals, summary."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def recipe(self) -> str:
        return str(self.config.get("recipe") or "?")

    def numeric_keys(self) -> set[str]:
        return {k for r in self.records for k, v in r.items() if as_number(v) is not None}

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return sorted(k for k in self.numeric_keys() if k.startswith(prefix))

    def has(self, key: str) -> bool:
        return any(as_number(r.get(key)) is not None for r in self.records)

    def series(self, key: str, rows: Iterable[dict[str, Any]] | None = None) -> tuple[list[float], list[float]]:
        """(steps, values) of ``key`` over ``rows`` (default: metrics), skipping non-numeric values."""
        xs: list[float] = []
        ys: list[float] = []
        for r in self.records if rows is None else rows:
            step, value = as_number(r.get("step")), as_number(r.get(key))
            if step is not None and value is not None:
                xs.append(step)
                ys.append(value)
        return xs, ys

    def eval_rows(self) -> list[dict[str, Any]]:
        """Held-out eval records: ``evals.jsonl`` when present, else the ``eval/*`` keys of the metrics."""
        return self.evals or [r for r in self.records if any(k.startswith("eval/") for k in r)]

    def eval_keys(self) -> list[str]:
        keys = {k for r in self.eval_rows() for k, v in r.items() if k.startswith("eval/") and as_number(v) is not None}
        return sorted(keys, key=eval_key_order)

    def last_string(self, key: str) -> str | None:
        for r in reversed(self.records):
            if isinstance(r.get(key), str):
                return r[key]
        return None

    def last_number(self, key: str) -> float | None:
        for r in reversed(self.records):
            v = as_number(r.get(key))
            if v is not None:
                return v
        return None

    def total(self, key: str) -> float | None:
        values = self.series(key)[1]
        return sum(values) if values else None

    def mei_threshold(self) -> float | None:
        """The MEI warning threshold: from the monitor's events, else ``diag.mei.threshold`` if numeric."""
        for e in self.events:
            if e.get("event") in ("mei_first_crossing", "mei_warning") and as_number(e.get("threshold")) is not None:
                return as_number(e["threshold"])
        return as_number(dig(self.config, "diag.mei.threshold"))

    def mei_first_crossing(self) -> tuple[float | None, bool]:
        """(step, from_events): the logged first crossing, else the first step with mei/query above threshold."""
        for e in self.events:
            if e.get("event") == "mei_first_crossing" and as_number(e.get("step")) is not None:
                return as_number(e["step"]), True
        threshold = self.mei_threshold()
        if threshold is not None:
            for step, value in zip(*self.series("mei/query"), strict=True):
                if value > threshold:
                    return step, False
        return None, False

    def held_out(self, which: str) -> dict[str, Any] | None:
        """``summary.json``'s ``final`` or ``best`` record (with its ``step``), if any."""
        rec = (self.summary or {}).get(which)
        return rec if isinstance(rec, dict) and as_number(rec.get("step")) is not None else None


@dataclass
class EvalData:
    """One ``meshrl eval`` output directory (``eval.json``)."""

    path: Path
    data: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> dict[str, Any]:
        cfg = self.data.get("config")
        return cfg if isinstance(cfg, dict) else {}

    @property
    def overall(self) -> dict[str, float]:
        block = self.data.get("overall")
        if not isinstance(block, dict):
            return {}
        return {k: v for k, v in ((k, as_number(v)) for k, v in block.items()) if v is not None}

    def at_k(self, kind: str) -> list[tuple[int, float]]:
        """Sorted ``(k, value)`` for ``kind@k`` keys of the overall block (kind: ``pass`` or ``mean``)."""
        out = []
        for key, value in self.overall.items():
            head, _, k = key.partition("@")
            if head == kind and k.isdigit() and int(k) >= 1:
                out.append((int(k), value))
        return sorted(out)


def eval_key_order(key: str) -> tuple[int, int, str]:
    head, _, k = key.removeprefix("eval/").partition("@")
    rank = {"mean": 0, "pass": 1}.get(head, 2)
    return rank, int(k) if k.isdigit() else 0, key


def load_run(path: Path) -> RunData:
    notes: list[str] = []
    cfg_path, metrics_path = path / "config.yaml", path / "metrics.jsonl"
    config = _read_mapping(cfg_path, notes, "yaml") if cfg_path.is_file() else {}
    if not cfg_path.is_file():
        notes.append("config.yaml missing")
    records: list[dict[str, Any]] = []
    if metrics_path.is_file():
        by_step: dict[float, dict[str, Any]] = {}
        for i, r in enumerate(read_jsonl(metrics_path, notes)):
            step = as_number(r.get("step"))
            if step is None:  # a record without a usable step is placed by its position
                step = float(i + 1)
                r = {**r, "step": step}
            by_step[step] = r  # a resumed run may repeat a step: the later record wins
        records = [by_step[s] for s in sorted(by_step)]
    else:
        notes.append("metrics.jsonl missing")
    events = read_jsonl(path / "events.jsonl", notes) if (path / "events.jsonl").is_file() else []
    evals = read_jsonl(path / "evals.jsonl", notes) if (path / "evals.jsonl").is_file() else []
    summary = _read_mapping(path / "summary.json", notes, "json") if (path / "summary.json").is_file() else None
    for note in notes:
        log.info("%s: %s", path, note)
    return RunData(path=path, config=config, records=records, events=events, evals=evals, summary=summary,
                   notes=notes)


def load_eval(path: Path) -> EvalData:
    notes: list[str] = []
    data = _read_mapping(path / "eval.json", notes, "json")
    if not isinstance(data.get("overall"), dict):
        notes.append("eval.json has no overall results")
    for note in notes:
        log.info("%s: %s", path, note)
    return EvalData(path=path, data=data, notes=notes)


def load_inputs(paths: Sequence[str | Path]) -> tuple[list[RunData], list[EvalData]]:
    """Classify and load each path: an eval dir holds ``eval.json``; a run dir ``metrics.jsonl`` or
    ``config.yaml``. Anything else raises ``ValueError`` naming the path."""
    if not paths:
        raise ValueError("give at least one run directory or eval directory")
    runs: list[RunData] = []
    evals: list[EvalData] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise ValueError(f"{path}: not a directory (expected a run directory or an eval directory)")
        if (path / "eval.json").is_file():
            evals.append(load_eval(path))
        elif (path / "metrics.jsonl").is_file() or (path / "config.yaml").is_file():
            runs.append(load_run(path))
        else:
            raise ValueError(f"{path}: neither a run directory (metrics.jsonl / config.yaml) nor an eval "
                             "directory (eval.json)")
    _label(runs, lambda r: r.recipe)
    _label(evals, lambda e: str(e.config.get("data") or "?"))
    return runs, evals


def _label(items: Sequence[RunData] | Sequence[EvalData], extra: Any) -> None:
    """Legend labels ``name (recipe)``; a name used twice gets its parent directory prepended."""
    names = [it.name for it in items]
    for it in items:
        name = it.name if names.count(it.name) == 1 else f"{it.path.parent.name}/{it.name}"
        it.label = f"{name} ({extra(it)})"
