"""Waiting for a pipe to become readable, whatever its descriptor number."""

from __future__ import annotations

import math
import select


def wait_readable(fd: int, timeout_s: float | None) -> bool:
    """True once ``fd`` has data (or end of file) to read, False after ``timeout_s`` seconds (None: no limit).

    ``select.select`` refuses descriptors from FD_SETSIZE on (1024 on Linux: "filedescriptor out of range in
    select()"), which a long-lived process reaches once it has opened that many files, pipes or sockets (seen: a
    test process whose finished trainers were never collected, 24 descriptors each; every reward then failed).
    ``poll`` has no such limit."""
    if not hasattr(select, "poll"):  # no poll (Windows): select, with its limit
        return bool(select.select([fd], [], [], timeout_s)[0])
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(None if timeout_s is None else math.ceil(max(timeout_s, 0.0) * 1000)))
