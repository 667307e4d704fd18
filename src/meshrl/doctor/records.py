"""A run's own records in one engine-neutral form, and the reader for meshrl run directories.

Every engine adapter (:mod:`meshrl.doctor.engines`) produces a :class:`RunRecords` whose per-step metrics
use meshrl's names (the ones in README "Training": ``reward/mean``, ``entropy/mean``, ``grad/norm``, ...);
the checks read only those names. Reading is tolerant: unreadable lines are counted in ``notes``, and a
non-finite value is kept as ``nan`` / ``inf`` (the trainer writes them as strings) because the non-finite
check needs to see it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshrl.jsonl import BadLines, iter_jsonl


def number(value: Any) -> float | None:
    """A float (NaN / inf included, also from the strings "nan", "inf", "-inf"), else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # an integer beyond the float range: its float is +-inf, as a long float literal's is
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return None


def read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Every readable record of a (possibly foreign) JSONL log; unreadable lines are skipped and noted."""
    bad = BadLines()
    rows = [row for _, row in iter_jsonl(path, on_bad="skip", skipped=bad)]
    if bad.count:
        notes.append(f"{path.name}: skipped {bad.count} unreadable line(s)")
    return rows


@dataclass
class RunRecords:
    """What one run left behind, in meshrl's metric names.

    ``steps``: one dict per logged step (sorted, key ``step``); ``samples``: logged completions with ``step``,
    ``completion`` and where known ``reward``, ``score``, ``truncated``, ``problem_id``, ``group_id``;
    ``evals``: held-out records with ``step`` and ``eval/*`` keys; ``config``: the settings the checks use
    (``max_new_tokens``, ``group_size``, ``lr``, ``warmup_steps``, ``steps``, ``task``, ``reward_kind``,
    ``extracts_answer``, ``mei_threshold``), ``None`` where unknown; ``mapping``: engine name -> meshrl name
    actually used.
    """

    path: Path
    engine: str
    steps: list[dict[str, float]]
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    mapping: dict[str, str] = field(default_factory=dict)
    # series already extracted (the checks ask for the same keys many times); records are not changed once read
    _series: dict[tuple[str, bool], tuple[list[int], list[float]]] = field(default_factory=dict, init=False,
                                                                           repr=False, compare=False)

    def series(self, key: str, *, finite: bool = True) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` (only finite values unless ``finite=False``); the caller must not change
        the lists."""
        hit = self._series.get((key, finite))
        if hit is not None:
            return hit
        xs, ys = [], []
        for r in self.steps:
            v = r.get(key)
            if v is not None and (not finite or math.isfinite(v)):
                xs.append(int(r["step"]))
                ys.append(v)
        self._series[(key, finite)] = (xs, ys)
        return xs, ys

    def has(self, key: str) -> bool:
        return any(key in r for r in self.steps)

    def first_of(self, *keys: str) -> str | None:
        """The first of ``keys`` that has a finite value on some step."""
        return next((k for k in keys if self.series(k)[1]), None)


def _numeric(record: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in record.items():
        f = number(v)
        if f is not None:
            out[k] = f
    return out


def by_step(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Numeric records keyed by ``step``, later records replacing earlier ones (a resumed run repeats steps),
    merged per step (TensorBoard logs one tag per event)."""
    merged: dict[int, dict[str, float]] = {}
    for i, r in enumerate(rows):
        num = _numeric(r)
        step = int(num["step"]) if "step" in num and math.isfinite(num["step"]) else i + 1
        merged.setdefault(step, {}).update(num)
        merged[step]["step"] = float(step)
    return [merged[s] for s in sorted(merged)]


def dig(mapping: Any, dotted: str) -> Any:
    """``mapping["a"]["b"]`` for ``"a.b"``; ``None`` when any level is missing or not a mapping."""
    node = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _reward_kind(task: str | None, options: dict[str, Any], notes: list[str]) -> tuple[str | None, bool]:
    """(the task's reward kind, whether its scorer grades the strictly extracted final answer). The latter is
    read from the names the scorer's code uses (``grade`` or ``extract_answer`` of ``meshrl.rewards``): a task
    such as ``tiny:add`` that takes the first integer instead has kind ``number`` but no parser to fail."""
    if not task:
        return None, False
    try:
        from meshrl.tasks import load_task

        loaded = load_task(task, **options)
    except Exception as e:  # noqa: BLE001 - any failure only means the parser check cannot run
        notes.append(f"task {task!r} could not be loaded to learn its reward kind ({type(e).__name__}: {e})")
        return None, False
    code = getattr(type(loaded).score, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    return str(loaded.reward_kind), bool(names & {"grade", "extract_answer"})


def meshrl_config(cfg: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The settings the checks use, from a resolved meshrl ``config.yaml``."""
    threshold = dig(cfg, "diag.mei.threshold")
    return {
        "max_new_tokens": dig(cfg, "rollout.max_new_tokens"), "group_size": dig(cfg, "rollout.group_size"),
        "lr": dig(cfg, "optim.lr"), "warmup_steps": dig(cfg, "optim.warmup_steps"), "steps": cfg.get("steps"),
        "task": cfg.get("task"), "recipe": cfg.get("recipe"),
        **dict(zip(("reward_kind", "extracts_answer"),
                   _reward_kind(cfg.get("task"), cfg.get("task_options") or {}, notes), strict=True)),
        "mei_threshold": threshold if isinstance(threshold, int | float) else None,
    }


def is_meshrl_run(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() and (path / "config.yaml").is_file()


def load_meshrl(path: Path) -> RunRecords:
    """A meshrl run directory (``config.yaml``, ``metrics.jsonl``, ``samples.jsonl``, ``events.jsonl``,
    ``evals.jsonl``, ``summary.json``)."""
    notes: list[str] = []
    try:
        cfg = yaml.safe_load((path / "config.yaml").read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:  # ValueError: bytes that are not UTF-8
        notes.append(f"config.yaml unreadable ({type(e).__name__})")
        cfg = {}
    steps = by_step(read_jsonl(path / "metrics.jsonl", notes))
    for r in steps:  # one total clipped share, as the other engines log it
        if "clip/frac" not in r and ("clip/frac_low" in r or "clip/frac_high" in r):
            r["clip/frac"] = r.get("clip/frac_low", 0.0) + r.get("clip/frac_high", 0.0)
    opt = {n: read_jsonl(path / f"{n}.jsonl", notes) if (path / f"{n}.jsonl").is_file() else []
           for n in ("samples", "events", "evals")}
    evals = opt["evals"] or [r for r in steps if any(k.startswith("eval/") for k in r)]
    return RunRecords(path=path, engine="meshrl", steps=steps, samples=opt["samples"], events=opt["events"],
                      evals=evals, config=meshrl_config(cfg if isinstance(cfg, dict) else {}, notes), notes=notes)
