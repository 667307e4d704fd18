"""The one JSONL reader and writer of meshrl, with one error policy.

Every record file meshrl reads or writes (a run's ``metrics.jsonl``, ``samples.jsonl``, ``events.jsonl``,
``evals.jsonl``; evaluation samples; coach prefixes; off-policy traces; rollout dumps; foreign logs the doctor
reads) goes through :func:`iter_jsonl`. The policy:

- a line that is not JSON, or not a JSON object, or not UTF-8 text: ``ValueError`` naming the file and the line
  (``FILE, line N: what is wrong``), unless the caller asked to ``skip`` such lines: then they are counted, and one
  warning names the file, the count and the first bad line;
- a last line that does not parse and is not newline-terminated is what a kill during an append leaves: it is
  dropped with a warning naming the file (``partial_last="drop"``, the default for files meshrl appends to);
- blank lines are ignored.

A leaf utility like :mod:`meshrl.progress` (usable from any layer); :mod:`meshrl.runs` re-exports it as the run
directory's record format.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["BadLines", "JsonlWriter", "atomic_write_text", "fsync_dir", "iter_jsonl", "read_jsonl",
           "truncate_after_step", "umask_mode"]

log = logging.getLogger("meshrl")
TEMP_PREFIX = "."  # temporary files are hidden siblings: ".metrics.jsonl.<random>"


class BadLines:
    """How many lines :func:`iter_jsonl` skipped (``on_bad="skip"``), and the first one's reason."""

    def __init__(self) -> None:
        self.count, self.first = 0, ""


def iter_jsonl(path: str | Path, *, on_bad: str = "raise", partial_last: str = "drop", what: str = "",
               skipped: BadLines | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for every JSON-object line of ``path`` (module docstring for the policy).

    ``on_bad``: ``raise`` or ``skip`` a bad line; ``partial_last``: ``drop`` an unterminated last line that does
    not parse (a crash during an append), or treat it as any bad line (``raise``). ``what`` names the file's role
    in messages (``"prefix file"``); ``skipped`` receives the count of skipped lines."""
    p = Path(path)
    label = f"{what} {p}" if what else str(p)
    data = p.read_bytes()
    lines = data.split(b"\n")
    ends_open = not data.endswith(b"\n")
    bad = skipped if skipped is not None else BadLines()
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            record = json.loads(text)
            problem = None if isinstance(record, dict) else f"expected a JSON object, got {type(record).__name__}"
        except UnicodeDecodeError as e:
            problem = f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
        except json.JSONDecodeError as e:
            if n == len(lines) and ends_open and partial_last == "drop":
                log.warning("%s: dropped a partial last line %d (%d characters; a crash during a write)", label, n,
                            len(raw))
                break
            problem = f"not valid JSON ({e.msg})"
        except ValueError as e:  # an integer literal over Python's int string limit
            problem = f"not valid JSON ({str(e).split(';')[0]})"
        except RecursionError:
            problem = "JSON nested too deeply"
        if problem is None:
            yield n, record
            continue
        if on_bad == "raise":
            raise ValueError(f"{label}, line {n}: {problem}")
        bad.count += 1
        bad.first = bad.first or f"line {n}: {problem}"
    if bad.count and skipped is None:
        log.warning("%s: skipped %d unreadable line(s) (first: %s)", label, bad.count, bad.first)


def read_jsonl(path: str | Path, **options: Any) -> list[dict[str, Any]]:
    """Every record of ``path`` (:func:`iter_jsonl`'s options and policy)."""
    return [record for _, record in iter_jsonl(path, **options)]


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible rather than dropping the key
    return v


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(ValueError):
    """A record or a small file could not be written because the disk (or quota) is full: one line for the CLI."""


def disk_full(path: Path, err: OSError) -> DiskFullError:
    return DiskFullError(f"cannot write {path}: {err.strerror or err} (disk full). Free some space, then continue "
                         "the run with --resume (it continues from the last checkpoint; a run without one starts "
                         "again)")


class JsonlWriter:
    """Append-only JSONL file, flushed after every record so a crash loses nothing written. ``listeners`` are
    called with each record as it reads back from its line (e.g. the live run-health monitor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = path.open("a")
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def write(self, record: dict[str, Any]) -> None:
        # One write call per record: a kill leaves at most one partial last line, which readers drop.
        line = json.dumps({k: _clean(v) for k, v in record.items()})
        try:
            self._f.write(line + "\n")
            self._f.flush()
        except OSError as e:  # a partial last line may remain: readers drop it
            if e.errno in DISK_FULL_ERRNOS:
                raise disk_full(self.path, e) from e
            raise
        for listener in self.listeners:
            listener(json.loads(line))

    def close(self) -> None:
        # Closing flushes what a failed write left buffered: on a full disk that fails again (the file is closed
        # all the same), and is told as the same one-line error.
        try:
            self._f.close()
        except OSError as e:
            if e.errno in DISK_FULL_ERRNOS:
                raise disk_full(self.path, e) from e
            raise


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``): setting it to
    read it back would, for that moment, give files other threads create the wrong mode."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(mode: int) -> int:
    """``mode`` as ``open``/``mkdir`` would create it under the user's umask (``0o666`` -> ``0o644`` at 022):
    ``tempfile`` makes its files 600 and directories 700, which an atomic rename would otherwise keep."""
    return mode & ~current_umask()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync it, rename it over ``path`` and fsync the directory. The file
    gets the mode a plain write would create (the umask's), not ``tempfile``'s private 600."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}.")
    except OSError as e:
        if e.errno in DISK_FULL_ERRNOS:
            raise disk_full(path, e) from e
        raise
    try:
        os.fchmod(fd, umask_mode(0o666))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            raise disk_full(path, e) from e
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate_after_step(path: Path, step: int) -> None:
    """Drop records with ``step > step`` (written after the checkpoint a run resumes from) and a partial last
    line. The file is rewritten atomically: a kill during the rewrite leaves the old file, never a short one."""
    if not path.is_file():
        return
    lines = path.read_bytes().split(b"\n")
    kept = [lines[n - 1].decode("utf-8") for n, record in iter_jsonl(path) if record.get("step", 0) <= step]
    text = "".join(line + "\n" for line in kept)
    if text != path.read_text():
        atomic_write_text(path, text)
