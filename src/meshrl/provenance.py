"""Which code made a record: meshrl's version and, for a source checkout, its git commit and whether the tracked
files differed from it.

A run's numbers are a function of its seed, its settings, the machine's rounding (:mod:`meshrl.cpu`) and the code;
the first three are recorded beside every run, and this records the fourth. Read once per process (the code that
runs is the code imported at start, whatever happens to the files later)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

#: seconds any one git call may take (a network file system or a huge work tree must not hold a run's start)
GIT_TIMEOUT_S = 10.0


def _git(args: list[str], cwd: Path) -> str | None:
    """``git args`` in ``cwd``: its standard output stripped, or None when git is absent, fails or is too slow."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_checkout(package_dir: Path) -> Path | None:
    """The git work tree whose ``src/meshrl`` is ``package_dir``, or None: an installed copy (site-packages) has
    none, and a meshrl installed inside somebody else's repository (a virtualenv in their project) must not be
    credited with that repository's commit."""
    top = _git(["rev-parse", "--show-toplevel"], package_dir)
    if top is None:
        return None
    root = Path(top)
    return root if (root / "src" / "meshrl").resolve() == package_dir.resolve() else None


def describe_code(package_dir: Path, version: str) -> dict[str, Any]:
    """The record :func:`code_version` returns, for the package at ``package_dir``: ``{"meshrl": version,
    "commit": sha or None, "dirty": bool or None}``. ``dirty`` is whether tracked files differ from the commit
    (untracked files are not code that was imported); both are None outside a source checkout."""
    root = source_checkout(package_dir)
    commit = _git(["rev-parse", "HEAD"], root) if root is not None else None
    status = _git(["status", "--porcelain", "--untracked-files=no"], root) if commit is not None else None
    return {"meshrl": version, "commit": commit, "dirty": None if status is None else bool(status)}


@functools.cache
def code_version() -> dict[str, Any]:
    """This process's meshrl: version, git commit and whether the checkout was modified (see :func:`describe_code`);
    read once per process."""
    import meshrl

    return describe_code(Path(meshrl.__file__).parent, meshrl.__version__)


def describe(code: dict[str, Any] | None) -> str:
    """One line for a :func:`code_version` record: ``meshrl 0.1.0 at 198c8eb`` (``, modified`` when dirty),
    ``meshrl 0.1.0 (no commit recorded)`` outside a checkout, ``code not recorded`` for None."""
    if not code:
        return "code not recorded"
    if not code.get("commit"):
        return f"meshrl {code.get('meshrl', '?')} (no commit recorded)"
    return f"meshrl {code.get('meshrl', '?')} at {code['commit'][:7]}{', modified' if code.get('dirty') else ''}"
