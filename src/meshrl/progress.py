"""One progress bar for every long job (train, eval, coach, calibrate, census, probe).

Rich bar with ETA on stderr, so stdout stays clean for ``--json`` output; a no-op when disabled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(label: str, total: int, enabled: bool = True, *, start: int = 0,
                 transient: bool = False) -> Iterator[Callable[..., None]]:
    """Yield ``advance(k=1, description=None)``; ``completed`` may be set instead of advancing."""
    if not enabled:
        yield lambda k=1, description=None, completed=None: None
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
