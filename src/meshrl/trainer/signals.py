"""Stop requests: SIGTERM and Ctrl-C end a run at the next step boundary, with a checkpoint of that boundary.

Preemption on clusters arrives as SIGTERM, at any moment, often mid-update. Raising there (as a plain
``KeyboardInterrupt`` would) leaves weights half-way through a step's mini-batches next to the previous
step's counters, and a checkpoint of that state resumes into a different run. So the first signal only
records the request: the loop finishes the step, writes its records, saves and stops. A second signal
stops the run (:class:`RunInterrupted` raised where the program is) as soon as Python runs again: Python acts on a
signal between bytecodes, so a native operation under way (one matmul, one C++ kernel) finishes first, which takes
seconds on a long update and tens of seconds where bf16 is emulated. Inside a section that must not be cut (a
checkpoint save) it waits for the section's end; the trainer then saves only if the state it holds is still a
step boundary.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

log = logging.getLogger("meshrl")

HANDLED = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal (a KeyboardInterrupt, so callers that stop on Ctrl-C stop on it too)."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    def __reduce__(self):  # a run stopped in a worker process reaches its parent as itself (pickled)
        return type(self), (self.signum, str(self))


class StopRequests:
    """Context manager that turns SIGTERM / SIGINT into :attr:`requested` (see the module docstring).

    Outside the main thread signals cannot be caught; there the handlers are not installed and a signal
    acts as it would without this class.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}
        self._critical = 0
        self._pending: int | None = None  # a second signal that arrived inside a critical section

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequests:
        for sig in HANDLED:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not in the main thread
                break
        return self

    def __exit__(self, *exc: object) -> bool:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        return False

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            log.warning("%s received: finishing this step, then saving a checkpoint and stopping "
                        "(send it again to stop as soon as the operation under way returns)", name)
            return
        if self._critical:
            self._pending = signum
            return
        raise RunInterrupted(signum, f"stopped at once by a second {name}")

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section that a second signal does not cut (it is acted on when the section ends)."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if not self._critical and self._pending is not None:
            signum, self._pending = self._pending, None
            raise RunInterrupted(signum, f"stopped at once by a second {signal.Signals(signum).name}")
