"""The metrics of the steps one :func:`meshrl.trainer.train` call ran, as a read-only sequence backed by the run's
``metrics.jsonl``.

A list of every step's metrics dict grows the trainer's process by a few KB a step (about 4 KB: 400 MB over
100,000 steps) for a return value most callers read once. :class:`StepHistory` keeps the file's path, the range of
steps and the last step's metrics (constant memory); indexing, iterating and slicing read the records back (each
value as written: JSON keeps floats exactly, and the non-finite ones written as text are floats again).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from meshrl.jsonl import iter_jsonl

Metrics = dict[str, Any]
_NON_FINITE = {str(x): x for x in (math.nan, math.inf, -math.inf)}


class StepHistory(Sequence[Metrics]):
    """Steps ``first_step + 1 .. first_step + len(self)`` of the run whose records are in ``path``.

    Records are picked by their ``step`` field, so earlier steps of a resumed run are left out; reading a step
    whose record is no longer in the file (a later resume rewound it) raises ``LookupError`` naming the file.
    """

    def __init__(self, path: Path, first_step: int) -> None:
        self.path, self.first_step = path, first_step
        self._count = 0
        self._last: Metrics | None = None

    def append(self, metrics: Metrics) -> None:
        """Count the step whose ``metrics`` were just written to the file (kept: the last step's only)."""
        if metrics.get("step") != self.first_step + self._count + 1:
            raise ValueError(f"step {metrics.get('step')!r} after step {self.first_step + self._count}")
        self._count += 1
        self._last = metrics

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Metrics: ...

    @overload
    def __getitem__(self, index: slice) -> list[Metrics]: ...

    def __getitem__(self, index: int | slice) -> Metrics | list[Metrics]:
        if isinstance(index, slice):
            return list(self)[index]
        i = operator.index(index)
        i = i + self._count if i < 0 else i
        if not 0 <= i < self._count:
            raise IndexError(f"step history index {index} out of range ({self._count} steps)")
        if i == self._count - 1:
            return self._last
        return next(itertools.islice(self, i, None))

    def __iter__(self) -> Iterator[Metrics]:
        if not self._count:
            return
        first, last = self.first_step + 1, self.first_step + self._count
        expected = first
        if not self.path.is_file():
            raise LookupError(f"{self.path}: no such file (the run directory was removed?); keep list(history) "
                              "while it exists")
        for _, record in iter_jsonl(self.path):
            step = record.get("step")
            if not isinstance(step, int) or not first <= step <= last:
                continue
            if step != expected:
                break
            yield {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}
            expected += 1
            if expected > last:
                return
        raise LookupError(f"{self.path}: no record of step {expected} (steps {first}-{last} of this history); "
                          "the file was rewritten since")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepHistory | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable (it grows while the run goes on), as a list is

    def __repr__(self) -> str:
        return f"StepHistory({self.path}, steps {self.first_step + 1}-{self.first_step + self._count})"
