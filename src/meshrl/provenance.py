"""Which code made a record: meshrl's version and, for a source checkout, its git commit and whether the code
differed from it.

A run's numbers are a function of its seed, its settings, the machine's rounding (:mod:`meshrl.cpu`) and the code;
the first three are recorded beside every run, and this records the fourth. Read once per process, at its first
use (the trainer reads it as a run starts), so a file edited later in a long process does not change the record.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

log = logging.getLogger("meshrl")

#: seconds any one git call may take (a network file system or a huge work tree must not hold a run's start)
GIT_TIMEOUT_S = 10.0
#: what counts as code in a checkout: the package and the experiments that run it (docs, data and benchmark
#: figures changing do not make a run's code modified)
CODE_PATHS = ("src", "experiments")


def _git(args: list[str], cwd: Path) -> str | None:
    """``git args`` in ``cwd``: its standard output stripped, or None when git is absent, fails or is too slow.

    Read-only: ``--no-optional-locks`` keeps ``git status`` from taking the index lock (a call killed at the
    timeout would leave it behind, and the user's own git commands would then fail), and the caller's ``GIT_*``
    variables (a git hook's ``GIT_DIR``, ``GIT_INDEX_FILE``) are not passed on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(["git", "--no-optional-locks", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False, env=env, stdin=subprocess.DEVNULL)
    except (OSError, ValueError, subprocess.SubprocessError) as e:  # absent, too slow, undecodable output
        log.debug("git %s in %s: %s", " ".join(args), cwd, e)
        return None
    if done.returncode != 0:
        log.debug("git %s in %s: %s", " ".join(args), cwd, done.stderr.strip())
        return None
    return done.stdout.strip()


def source_checkout(package_dir: Path) -> Path | None:
    """The git work tree whose ``src/meshrl`` is ``package_dir``, or None: an installed copy (site-packages) has
    none, and a meshrl installed inside somebody else's repository (a virtualenv in their project) must not be
    credited with that repository's commit."""
    top = _git(["rev-parse", "--show-toplevel"], package_dir)
    if top is None:
        return None
    root = Path(top)
    return root if (root / "src" / "meshrl").resolve() == package_dir.resolve() else None


def _modified(status: str) -> bool:
    """From ``git status --porcelain`` over :data:`CODE_PATHS`: a tracked file changed, or an untracked Python file
    (a new module may well have been imported)."""
    return any(not line.startswith("??") or line.rstrip().endswith(".py") for line in status.splitlines())


def describe_code(package_dir: Path, version: str) -> dict[str, Any]:
    """The record :func:`code_version` returns, for the package at ``package_dir``: ``{"meshrl": version,
    "commit": sha or None, "dirty": bool or None}``. ``dirty``: whether the code (:data:`CODE_PATHS`) differs from
    the commit; both are None outside a source checkout, ``dirty`` None where git could not say."""
    root = source_checkout(package_dir)
    commit = _git(["rev-parse", "HEAD"], root) if root is not None else None
    status = (_git(["status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS], root)
              if commit is not None else None)
    return {"meshrl": version, "commit": commit, "dirty": None if status is None else _modified(status)}


@functools.cache
def code_version() -> dict[str, Any]:
    """This process's meshrl: version, git commit and whether the checkout's code was modified (see
    :func:`describe_code`); read once per process."""
    import meshrl

    return describe_code(Path(meshrl.__file__).parent, meshrl.__version__)


def describe(code: dict[str, Any] | None) -> str:
    """One line for a :func:`code_version` record: ``meshrl 0.1.0 at 198c8eb`` (``, modified`` when dirty,
    ``, modified or not unknown`` when git could not say), ``meshrl 0.1.0 (no commit recorded)`` outside a checkout,
    ``code not recorded`` for None."""
    if not code:
        return "code not recorded"
    if not code.get("commit"):
        return f"meshrl {code.get('meshrl', '?')} (no commit recorded)"
    state = {True: ", modified", False: "", None: ", modified or not unknown"}[code.get("dirty")]
    return f"meshrl {code.get('meshrl', '?')} at {code['commit'][:7]}{state}"
