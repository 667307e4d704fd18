"""One progress bar for every long job (train, eval, coach, calibrate, census, probe, the testbed warm start).

On stderr, so stdout stays clean for ``--json`` output; a no-op when disabled. On a terminal it is a rich bar
with ETA; otherwise (a log file, CI, a pipe) rich would draw nothing until the end, so it prints one plain line
per twentieth of the work instead (``label: 35/700 (5%), 12s elapsed, eta 3m48s, loss 0.912``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

PLAIN_LINES = 20  # lines a plain (non-terminal) bar prints over the whole job


@contextmanager
def progress_bar(label: str, total: int, enabled: bool = True, *, start: int = 0,
                 transient: bool = False) -> Iterator[Callable[..., None]]:
    """Yield ``advance(k=1, description=None)``; ``completed`` may be set instead of advancing."""
    if not enabled:
        yield lambda k=1, description=None, completed=None: None
        return
    if not sys.stderr.isatty():
        yield PlainProgress(label, total, start=start).advance
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"),
                   console=Console(stderr=True), transient=transient)
    with bar:
        task = bar.add_task("", total=total, completed=start)

        def advance(k: int = 1, description: str | None = None, completed: int | None = None) -> None:
            kwargs = {"description": description} if description is not None else {}
            if completed is not None:
                bar.update(task, completed=completed, **kwargs)
            else:
                bar.update(task, advance=k, **kwargs)

        yield advance


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class PlainProgress:
    """Plain progress lines for a non-terminal: one each time another ``1/PLAIN_LINES`` of ``total`` is done,
    and one at the end, with the elapsed time, an ETA from the rate so far and the latest description."""

    def __init__(self, label: str, total: int, *, start: int = 0, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done, self.first = label, total, start, start
        self.stream = stream or sys.stderr
        self.every = max(1, total // PLAIN_LINES)
        self.description = ""
        self.t0 = time.perf_counter()

    def advance(self, k: int = 1, description: str | None = None, completed: int | None = None) -> None:
        before = self.done
        self.done = completed if completed is not None else self.done + k
        if description is not None:
            self.description = description
        if self.done // self.every > before // self.every or (self.done >= self.total > before):
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        parts = [f"{self.label}: {self.done}/{self.total}"]
        if self.total:
            parts[0] += f" ({100 * self.done // self.total}%)"
        parts.append(f"{_duration(elapsed)} elapsed")
        if self.done - self.first > 0 and self.done < self.total:
            parts.append(f"eta {_duration(elapsed / (self.done - self.first) * (self.total - self.done))}")
        if self.description:
            parts.append(self.description)
        return ", ".join(parts)
