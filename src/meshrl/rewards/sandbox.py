"""Run untrusted Python (model-written code plus its tests) in a limited subprocess, and grade it.

Enforced (Linux):

- **Wall clock**: the child leads a new session; at ``timeout_s`` its whole process group is SIGKILLed
  while the leader is still unreaped (so the group id cannot have been reused).
- **rlimits** set in ``preexec_fn``, inherited by every descendant: ``RLIMIT_CPU = ceil(timeout_s) + 1``
  s and ``RLIMIT_AS = memory_mb`` per process, ``RLIMIT_FSIZE = max_file_mb`` per file (stdout/stderr
  included), ``RLIMIT_CORE = 0``.
- **Namespaces**, preferred when they work (probed once per interpreter): ``unshare --net --pid --fork
  --kill-child --mount-proc`` (as non-root inside an unprivileged user namespace). The new network
  namespace has only a loopback that is down: no connection can be made, whatever the code does. The
  program is PID 1 of a new PID namespace, so when it dies the kernel kills every process left in it
  (even ones that left the process group with ``setsid``); the private ``/proc`` shows only the sandbox.
- **User**: a root caller runs the program as ``user`` (default ``nobody``) when that user can execute
  the interpreter (probed: one under ``/root`` cannot), else as root, which can read every file on the
  machine (prefer a non-root grader, or an interpreter outside ``/root``).
- **Process count**: ``RLIMIT_NPROC`` counts every task of the real user and is ignored for root, so it is
  set to "that user's current tasks + max_procs" and binds only when the program runs as non-root. A
  root caller also gets a ``pids`` cgroup with ``pids.max = max_procs`` when the cgroup file system is
  writable; the parent kills every process left in it afterwards. As root with neither, only the wall
  clock and the PID namespace bound a fork bomb.
- **Environment**: no inherited variables (no secrets, no ``PYTHONPATH``); ``python -I -B`` (isolated:
  no user site, ``PYTHON*`` ignored, cwd not on ``sys.path``); a fresh temporary working directory (also
  ``HOME``/``TMPDIR``) removed afterwards; stdin ``/dev/null``; the payload arrives on an anonymous file,
  never on the command line. At most ``max_output_bytes`` of stdout and of stderr are returned.

Best-effort only: the in-process ``socket`` guard (the only network barrier without ``unshare``; code can
bypass it through ``_socket`` or ``ctypes``), total disk use (many ``max_file_mb`` files fit in the
time limit), ``setsid`` escapees without a PID namespace or cgroup, and the pass marker: the harness
shares the interpreter with the code, so it defeats ``sys.exit(0)`` / ``os._exit(0)`` shortcuts but not
code that deliberately inspects the harness' frames. Not a boundary against a determined attacker: use
a container or VM for that.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pwd
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

__all__ = ["SANDBOX_STATUSES", "SandboxResult", "extract_code", "grade_code", "run_code", "sandbox_isolation"]

SANDBOX_STATUSES = ("passed", "failed", "timeout", "error", "memory")
_UNSHARE = ("unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc")

# Runs in the child around the untrusted code: reads the JSON payload from stdin (then stdin is /dev/null),
# guards ``socket``, runs code then tests in one namespace (HumanEval style), calls check(entry_point),
# and reports the status after a per-run random marker on stdout.
_HARNESS = r"""
import builtins, json, linecache, os, socket, sys, traceback
def _deny(*args, **kwargs):
    raise PermissionError("network access is disabled in the meshrl sandbox")
class _GuardedSocket(socket.socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
            _deny()
        super().__init__(family, type, proto, fileno)
def _run(src, name, ns):
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    exec(compile(src, name, "exec"), ns)
def _main(p, isinstance=isinstance, print_exc=traceback.print_exc):
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        _run(p["code"], "solution.py", ns)
        if p["tests"] is not None:
            _run(p["tests"], "tests.py", ns)
        if p["entry_point"]:
            if "check" not in ns or p["entry_point"] not in ns:
                raise NameError("check() or entry point %r is not defined" % p["entry_point"])
            ns["check"](ns[p["entry_point"]])
        return "passed"
    except SystemExit as exc:
        print("sandbox: the program exited (SystemExit(%r)) before the harness finished" % (exc.code,),
              file=sys.stderr)
        return "failed"
    except BaseException as exc:
        try:
            print_exc()
        except BaseException:
            pass
        return "failed" if isinstance(exc, AssertionError) else "memory" if isinstance(exc, MemoryError) else "error"
def _harness(write=os.write, exit=os._exit):  # bound before the program runs: it cannot patch them
    p = json.loads(sys.stdin.buffer.read())
    marker = p.pop("marker")  # a local: not reachable as a module global of __main__
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    socket.socket = _GuardedSocket
    socket.getaddrinfo = socket.gethostbyname = socket.gethostbyname_ex = _deny
    status = _main(p)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    try:
        write(1, ("\n%s:%s\n" % (marker, status)).encode())
    finally:
        exit(0 if status == "passed" else 1)
_harness()
"""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of :func:`run_code`: ``status`` in :data:`SANDBOX_STATUSES`, ``passed = status == "passed"``,
    ``returncode`` negative for a signal (``-9`` after the timeout kill), ``isolation`` the mode used."""

    passed: bool
    status: str
    stdout: str
    stderr: str
    duration_s: float
    returncode: int | None
    isolation: str = ""


@dataclass(frozen=True)
class _Mode:
    label: str
    prefix: tuple[str, ...]
    uid: int  # real uid the program runs as
    gid: int
    switch: bool  # switch uid/gid in preexec_fn (the unshare modes switch with --setuid themselves)


def _candidate_modes(isolate: bool, user: str | int | None) -> list[_Mode]:
    euid, egid = os.geteuid(), os.getegid()
    target = None
    if euid == 0 and user is not None:
        with contextlib.suppress(KeyError, OverflowError, TypeError):
            entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
            target = (entry.pw_uid, entry.pw_gid) if entry.pw_uid != 0 else None
    modes = []
    if isolate and shutil.which("unshare"):
        if euid == 0:
            if target is not None:
                switch = ("--setuid", str(target[0]), "--setgid", str(target[1]), "--")
                modes.append(_Mode(f"netns+pidns, uid {target[0]}", _UNSHARE + switch, *target, False))
            modes.append(_Mode("netns+pidns, uid 0", (*_UNSHARE, "--"), 0, egid, False))
        else:
            prefix = ("unshare", "--user", "--map-root-user", *_UNSHARE[1:], "--")
            modes.append(_Mode(f"userns+netns+pidns, uid {euid}", prefix, euid, egid, False))
    if target is not None:
        modes.append(_Mode(f"no namespaces, uid {target[0]}", (), *target, True))
    return [*modes, _Mode(f"no namespaces, uid {euid}", (), euid, egid, False)]


@functools.lru_cache(maxsize=16)
def _select_mode(python: str, isolate: bool, user: str | int | None) -> _Mode:
    """The first candidate mode in which ``python -I -c 'import socket'`` runs (cached per arguments)."""
    modes = _candidate_modes(isolate, user)
    for mode in modes[:-1]:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(
                [*mode.prefix, python, "-I", "-B", "-c", "import socket"], cwd="/", env=_child_env("/"),
                stdin=subprocess.DEVNULL, capture_output=True, timeout=30, preexec_fn=_limiter({}, None, mode),
            )
            if done.returncode == 0:
                return mode
    return modes[-1]


def sandbox_isolation(python: str = sys.executable, *, isolate: bool = True, user: str | int | None = "nobody") -> str:
    """The isolation :func:`run_code` gets with these arguments here, e.g. ``"netns+pidns, uid 65534"``,
    ``"no namespaces, uid 1000"``, plus ``" + pids cgroup"`` when a root caller can make one."""
    cgroup = _make_cgroup(1)
    if cgroup is not None:
        _remove_cgroup(cgroup)
    return _select_mode(python, isolate, user).label + (" + pids cgroup" if cgroup else "")


def _child_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8"}


def _proc_status() -> Iterator[dict[str, str]]:
    """The ``/proc/<pid>/status`` fields of every visible process (skipping ones that vanish meanwhile)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as fh:
                    yield {k: v.strip() for k, v in (line.split(":", 1) for line in fh if ":" in line)}
            except (OSError, ValueError):
                continue


def _count_tasks(uid: int) -> int:
    """Tasks (threads included, as ``RLIMIT_NPROC`` counts them) whose real uid is ``uid``."""
    return sum(int(f.get("Threads", 1)) for f in _proc_status() if f.get("Uid", "-1").split()[0] == str(uid))


def _kill_children(pid: int) -> None:
    """SIGKILL the children of ``pid``: under ``unshare --fork``, the PID namespace's init, whose death
    kills the whole namespace even if it left the process group with ``setsid``."""
    for fields in _proc_status():
        if fields.get("PPid") == str(pid):
            with contextlib.suppress(OSError, KeyError, ValueError):
                os.kill(int(fields["Pid"]), signal.SIGKILL)


def _make_cgroup(max_procs: int) -> str | None:
    """A fresh cgroup with ``pids.max = max_procs`` (v1 ``pids`` hierarchy or cgroup v2), root only."""
    if os.geteuid() != 0:
        return None
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        path = os.path.join(base, f"meshrl-sandbox-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as fh:
                fh.write(str(max_procs))
            return path
        except OSError:
            _remove_cgroup(path)
    return None


def _remove_cgroup(path: str) -> None:
    """SIGKILL whatever is still in the cgroup, then remove it (retrying while the kernel tears down)."""
    for _ in range(200):
        with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as fh:
            for pid in fh.read().split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)


def _rmtree(path: str) -> None:
    """Remove the working directory even if the program made parts of it unreadable."""
    shutil.rmtree(path, ignore_errors=True)
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, d), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _limiter(limits: dict[int, tuple[int, int]], cgroup: str | None, mode: _Mode) -> Callable[[], None]:
    """``preexec_fn``: lower the rlimits (never above the current hard limit), join the cgroup (needs
    root), then switch user if the mode says so."""

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
        if mode.switch:
            os.setgroups([])
            os.setgid(mode.gid)
            os.setuid(mode.uid)

    return apply


def _wait(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait for the leader to exit WITHOUT reaping it (its pid keeps the group id); ``True`` on timeout."""
    delay = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return False
        except ChildProcessError:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.02)


def _read_capped(fh: IO[bytes], cap: int) -> tuple[bytes, bytes]:
    """The first ``cap`` bytes of a finished output file (with a note if cut) and its last 512 bytes."""
    size = os.fstat(fh.fileno()).st_size
    fh.seek(0)
    head = fh.read(cap) + (f"\n[... {size - cap} more bytes cut]".encode() if size > cap else b"")
    fh.seek(max(0, size - 512))
    return head, fh.read()


def _spawn(
    argv: list[str], workdir: str, files: tuple[IO[bytes], ...], limits: dict[int, tuple[int, int]],
    cgroup: str | None, mode: _Mode,
) -> tuple[subprocess.Popen, bool]:
    """Start the child in a new session; if joining the cgroup fails, start it again without one.
    Returns the process and whether it joined the cgroup."""
    for group in (cgroup, None) if cgroup else (None,):
        files[0].seek(0)
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=_child_env(workdir), stdin=files[0], stdout=files[1],
                                    stderr=files[2], start_new_session=True, preexec_fn=_limiter(limits, group, mode))
            return proc, group is not None
        except subprocess.SubprocessError:
            if group is None:
                raise
    raise AssertionError("unreachable")


def _check_args(code: object, tests: object, entry_point: object, timeout_s: object, **ints: object) -> None:
    for name, value in (("code", code), ("tests", tests), ("entry_point", entry_point)):
        if not isinstance(value, str) and (name == "code" or value is not None):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if isinstance(entry_point, str) and not entry_point.isidentifier():
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def run_code(
    code: str,
    *,
    tests: str | None = None,
    entry_point: str | None = None,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_procs: int = 32,
    max_file_mb: int = 10,
    max_output_bytes: int = 65536,
    python: str = sys.executable,
    user: str | int | None = "nobody",
    isolate: bool = True,
) -> SandboxResult:
    """Run ``code``, then ``tests``, then ``check(entry_point)`` in a sandboxed subprocess.

    HumanEval convention: ``code`` and ``tests`` run in one ``__main__`` namespace, as if appended into one
    file; ``tests`` defines ``check(candidate)`` and the harness calls it with the function named
    ``entry_point``. Without ``entry_point`` the tests are module-level code (bare asserts); without
    ``tests`` the program passes when it runs to completion.

    Statuses: ``passed``; ``failed``: an ``AssertionError``, or the program exited (``sys.exit``,
    ``os._exit``) before the harness finished (exiting early never passes); ``timeout``: wall clock or
    CPU limit; ``memory``: ``MemoryError`` under ``RLIMIT_AS``; ``error``: any other exception
    (``SyntaxError``, missing entry point, a write past ``max_file_mb``...), a crash, or a sandbox that
    could not start. What is enforced and what is best-effort: see the module docstring.

    Args:
        timeout_s: wall-clock limit; the CPU limit per process is ``ceil(timeout_s) + 1`` s.
        memory_mb: address-space limit per process (``RLIMIT_AS``).
        max_procs: processes/threads the program may add (fork-bomb guard).
        max_file_mb: largest file the program may write, stdout and stderr included.
        max_output_bytes: bytes of stdout and of stderr returned (the rest is cut with a note).
        python: the interpreter.
        user: for a root caller, the user (name or uid) to run as if it can execute ``python``; ``None``
            keeps root. Ignored for other callers.
        isolate: use ``unshare`` namespaces when they work; ``False`` keeps rlimits and the socket guard.
    """
    _check_args(code, tests, entry_point, timeout_s, memory_mb=memory_mb, max_procs=max_procs,
                max_file_mb=max_file_mb, max_output_bytes=max_output_bytes)
    mode = _select_mode(python, isolate, user)
    marker = secrets.token_hex(16)
    cpu = math.ceil(timeout_s) + 1
    limits = {resource.RLIMIT_CPU: (cpu, cpu + 1), resource.RLIMIT_AS: (memory_mb << 20, memory_mb << 20),
              resource.RLIMIT_FSIZE: (max_file_mb << 20, max_file_mb << 20), resource.RLIMIT_CORE: (0, 0)}
    if mode.uid != 0:
        limits[resource.RLIMIT_NPROC] = (_count_tasks(mode.uid) + max_procs,) * 2
    payload = json.dumps({"code": code, "tests": tests, "entry_point": entry_point, "marker": marker}).encode()
    workdir = tempfile.mkdtemp(prefix="meshrl-sandbox-")
    cgroup = _make_cgroup(max_procs)
    start = time.monotonic()
    try:
        if mode.uid != os.geteuid():
            os.chown(workdir, mode.uid, mode.gid)
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            stdin.write(payload)
            try:
                proc, joined = _spawn([*mode.prefix, python, "-I", "-B", "-c", _HARNESS], workdir, (stdin, out, err),
                                      limits, cgroup, mode)
            except (OSError, subprocess.SubprocessError) as exc:
                return SandboxResult(False, "error", "", f"sandbox: could not start: {exc}",
                                     time.monotonic() - start, None, mode.label)
            try:
                timed_out = _wait(proc, start + timeout_s)
            finally:
                if mode.prefix:
                    _kill_children(proc.pid)
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole group, also after a normal exit
                rc = proc.wait()
            duration = time.monotonic() - start
            stdout, tail = _read_capped(out, max_output_bytes)
            stderr = _read_capped(err, max_output_bytes)[0].decode("utf-8", "replace")
    finally:
        if cgroup is not None:
            _remove_cgroup(cgroup)
        _rmtree(workdir)
    found = re.search(rb"\n" + marker.encode() + rb":(\w+)\n", tail)
    if found:
        stdout = stdout.replace(found.group(0), b"")
    if timed_out or (rc == -signal.SIGXCPU and not found):
        status = "timeout"
        stderr += f"\nsandbox: killed after the {timeout_s:g} s limit" if timed_out else ""
    elif found and found.group(1).decode() in SANDBOX_STATUSES:
        status = found.group(1).decode()
        status = "error" if status == "passed" and rc != 0 else status  # killed after the harness reported
    elif "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        status = "memory"
    else:
        status = "failed" if rc == 0 else "error"  # rc 0 without a marker: os._exit(0) before the harness ended
    isolation = mode.label + (" + pids cgroup" if joined else "")
    return SandboxResult(status == "passed", status, stdout.decode("utf-8", "replace"), stderr, duration, rc,
                         isolation)


_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str) -> str:
    """The code in a model completion: the last fenced block tagged ``python``/``py``/``python3``, else the
    last untagged fenced block, else the whole text. An unclosed last fence (a truncated generation) runs
    to the end of the text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(completion)]
    for wanted in (("python", "py", "python3"), ("",)):
        tagged = [body for lang, body in blocks if lang in wanted]
        if tagged:
            return tagged[-1]
    return completion


def grade_code(
    completion: str, tests: str, entry_point: str | None = None, timeout_s: float = 10.0, **run_kwargs: object
) -> float:
    """1.0 if the code extracted from ``completion`` (:func:`extract_code`) passes ``tests`` under
    :func:`run_code` (extra keyword arguments go to it), else 0.0. When completions are only a function
    body (HumanEval), prepend the prompt to ``completion`` first."""
    if not isinstance(completion, str):
        raise ValueError(f"completion must be a string, got {type(completion).__name__}")
    result = run_code(extract_code(completion), tests=tests, entry_point=entry_point, timeout_s=timeout_s,
                      **run_kwargs)  # type: ignore[arg-type]
    return 1.0 if result.passed else 0.0
