"""Run untrusted Python (model-written code) against trusted tests, and grade it.

Two processes per run, so that the verdict cannot be forged (a reward-hacking hole for RL on code):

- the **program** (:mod:`meshrl.rewards.sandbox_program`) runs the untrusted code, confined as
  :mod:`meshrl.rewards.sandbox_modes` describes (bubblewrap when it works here: only the working
  directory writable, no network, no host sockets, an unprivileged user), and answers calls;
- the **harness** (:mod:`meshrl.rewards.sandbox_harness`) runs the tests outside the sandbox, calling the
  program's functions through proxies; arguments and results cross as plain literals
  (:mod:`meshrl.rewards.sandbox_codec`, never pickle). The tests never enter the sandbox, and the verdict
  travels on a pipe only the harness holds: printing a fake result, walking the stack, patching
  anything, exiting early or returning an object with a forged ``__eq__`` cannot make a run pass.

Limits enforced on the program (Linux):

- **Wall clock**: both processes lead new sessions; at ``timeout_s`` their process groups are SIGKILLed
  while the leaders are unreaped (so the group ids cannot have been reused); with a PID namespace the
  kernel then kills everything left in it (even ``setsid`` escapees).
- **rlimits** set in ``preexec_fn``, inherited by every descendant: ``RLIMIT_CPU = ceil(timeout_s) + 1``
  s and ``RLIMIT_AS = memory_mb`` per process, ``RLIMIT_FSIZE = max_file_mb`` per file (stdout/stderr
  included), ``RLIMIT_CORE = 0``.
- **Process count**: ``RLIMIT_NPROC`` counts every task of the real user and is ignored for root, so it is
  set to "that user's current tasks + max_procs" and binds only when the program runs as non-root. A
  root caller also gets a ``pids`` cgroup with ``pids.max = max_procs`` when the cgroup file system is
  writable; the parent kills every process left in it afterwards.
- **A killed caller** (a scorer process SIGKILLed at the reward's time limit): the harness, ``unshare`` and an
  un-namespaced program die with it (``PR_SET_PDEATHSIG``; bubblewrap's ``--die-with-parent``), and the next
  :func:`run_code` removes the working directory and cgroup it left (their names carry the creator's pid).
- **Environment**: no inherited variables (no secrets, no ``PYTHONPATH``); ``python -I -B``; a fresh
  temporary working directory (also ``HOME``/``TMPDIR``) removed afterwards; stdin ``/dev/null``; the
  code arrives on an anonymous file, never on the command line. At most ``max_output_bytes`` of stdout
  and of stderr are returned.

Refused unless accepted (:func:`check_sandbox`, ``reward.sandbox_allow_weak``): the fallback mechanisms (no
bubblewrap), which lack everything the module docstring of :mod:`meshrl.rewards.sandbox_modes` lists. The harness
runs ``python -I -S`` (nothing from site-packages); the clean-up never follows a link
(:mod:`meshrl.rewards.sandbox_cleanup`). Not enforced: total disk use inside the working
directory (many ``max_file_mb`` files fit in the time limit). Values that are not plain literals
(objects, generators, functions) cannot cross, so tests that need them fail with ``error``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from meshrl.rewards.fdwait import wait_readable
from meshrl.rewards.sandbox_cleanup import OWNED_PREFIX, orphans, remove_owned_dir
from meshrl.rewards.sandbox_modes import Mode, child_env, limiter, program_switch, select_mode

__all__ = ["SANDBOX_STATUSES", "SandboxResult", "WeakSandboxError", "allow_weak_sandbox", "check_sandbox",
           "extract_code", "grade_code", "run_code", "sandbox_isolation"]

SANDBOX_STATUSES = ("passed", "failed", "timeout", "error", "memory")
_EXIT_GRACE_S = 0.5  # how long the program gets to exit by itself once the harness has decided


ALLOW_WEAK_ENV = "MESHRL_SANDBOX_ALLOW_WEAK"
_weak_allowed = False  # set by allow_weak_sandbox() (``reward.sandbox_allow_weak``); forked scorers inherit it


class WeakSandboxError(ValueError):
    """Model-written code would run under a mechanism that cannot contain it, and nobody accepted the risk."""


def allow_weak_sandbox(allowed: bool = True) -> None:
    """Accept (for this process and the scorers it forks) running model-written code without bubblewrap."""
    global _weak_allowed
    _weak_allowed = bool(allowed)


def check_sandbox(python: str = sys.executable, *, isolate: bool = True, user: str | int | None = "nobody",
                  allow_weak: bool | None = None) -> str:
    """The mechanism :func:`run_code` would use (its label), or :class:`WeakSandboxError` when it is a fallback
    (``unshare``, no namespaces) and the risk was not accepted: ``allow_weak``, else :func:`allow_weak_sandbox`
    or ``MESHRL_SANDBOX_ALLOW_WEAK=1`` (``reward.sandbox_allow_weak=true`` in a training config)."""
    mode = select_mode(python, isolate, user)
    if allow_weak is None:
        allow_weak = _weak_allowed or os.environ.get(ALLOW_WEAK_ENV, "").strip().lower() in ("1", "true", "yes")
    if not mode.bwrap_binds and not allow_weak:
        raise WeakSandboxError(
            f"refusing to run model-written code under the weak sandbox '{mode.label}' (bubblewrap is missing or "
            "cannot run here): the program could forge its reward, read the tests, leave state or code for later "
            "runs and kill its caller (docs/reliability.md, 'Sandbox for code rewards'); install bubblewrap "
            f"(scripts/setup.sh), or accept the risk with reward.sandbox_allow_weak=true ({ALLOW_WEAK_ENV}=1)")
    return mode.label


@functools.cache
def _child_source(name: str) -> str:
    """``sandbox_codec.py`` + ``name``'s source, run as ``python -I -c`` (which cannot import meshrl)."""
    here = Path(__file__).parent
    lines = [*(here / "sandbox_codec.py").read_text().splitlines(), *(here / name).read_text().splitlines()]
    kept = [line for line in lines if not line.rstrip().endswith("# sandbox: inline")]
    future = "from __future__ import annotations"
    return "\n".join([future, *(line for line in kept if line != future), "main()", ""])


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of :func:`run_code`: ``status`` in :data:`SANDBOX_STATUSES`, ``passed = status == "passed"``,
    ``returncode`` the program's (negative for a signal, ``-9`` after the timeout kill), ``isolation`` the
    mechanism used (e.g. ``"bwrap: mountns+pidns+netns, uid 65534"``)."""

    passed: bool
    status: str
    stdout: str
    stderr: str
    duration_s: float
    returncode: int | None
    isolation: str = ""


def sandbox_isolation(python: str = sys.executable, *, isolate: bool = True, user: str | int | None = "nobody") -> str:
    """The mechanism :func:`run_code` uses with these arguments here, e.g. ``"bwrap: mountns+pidns+netns, uid
    65534"`` or ``"no namespaces, uid 1000"``, plus ``" + pids cgroup"`` when a root caller can make one."""
    cgroup = _make_cgroup(1)
    if cgroup is not None:
        _remove_cgroup(cgroup)
    return select_mode(python, isolate, user).label + (" + pids cgroup" if cgroup else "")


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
    for base in _CGROUP_BASES:
        path = os.path.join(base, f"{OWNED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
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


_CGROUP_BASES = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")


def _sweep_orphans() -> None:
    """Remove what killed callers left: a scorer process SIGKILLed at the reward's time limit (shorter than the
    sandbox's own) never reaches :func:`run_code`'s clean-up, so its working directory (with whatever the program
    wrote) and its cgroup stayed. Its processes died with it (``PR_SET_PDEATHSIG``, ``--die-with-parent``)."""
    for path in orphans(tempfile.gettempdir()):
        remove_owned_dir(path)  # never through a planted link, never another user's
    if os.geteuid() == 0:
        for base in _CGROUP_BASES:
            for path in orphans(base):
                if os.path.isfile(os.path.join(path, "pids.max")):
                    _remove_cgroup(path)


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


@dataclass
class _Run:
    """The open files and pipes of one run (closed by :meth:`close`)."""

    workdir: str
    mode: Mode
    files: list[IO[bytes]]  # code in, program out, program err, tests in, harness out
    pipes: dict[str, int]
    hidden: tuple[str, ...] = ()

    @classmethod
    def open(cls, workdir: str, mode: Mode, code: str, tests: dict[str, str | None], hidden: tuple[str, ...]) -> _Run:
        files = [tempfile.TemporaryFile() for _ in range(5)]  # noqa: SIM115 (closed by close())
        files[0].write(json.dumps({"code": code}).encode())
        files[3].write(json.dumps(tests).encode())
        for fh in files:
            fh.seek(0)
        pipes: dict[str, int] = {}
        for name in ("request", "reply", "verdict"):
            pipes[name + "_r"], pipes[name + "_w"] = os.pipe()  # not inheritable: only pass_fds cross
        return cls(workdir, mode, files, pipes, hidden)

    def close_child_ends(self) -> None:
        for name in [n for n in self.pipes if n != "verdict_r"]:
            os.close(self.pipes.pop(name))

    def close(self) -> None:
        for fd in self.pipes.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pipes.clear()
        for fh in self.files:
            fh.close()


def _spawn_program(run: _Run, python: str, limits: dict[int, tuple[int, int]],
                   cgroup: str | None) -> tuple[subprocess.Popen, bool]:
    """Start the sandboxed program; if joining the cgroup fails, start it again without one.
    Returns the process and whether it joined the cgroup."""
    uid, gid = program_switch(run.mode)
    p = run.pipes
    argv = [*run.mode.argv(run.workdir, run.hidden), python, "-I", "-B", "-c", _child_source("sandbox_program.py"),
            str(p["request_r"]), str(p["reply_w"]), str(uid), str(gid), run.workdir]
    for group in (cgroup, None) if cgroup else (None,):
        run.files[0].seek(0)
        try:
            proc = subprocess.Popen(argv, cwd="/", env=child_env(run.workdir), stdin=run.files[0],
                                    stdout=run.files[1], stderr=run.files[2], start_new_session=True,
                                    pass_fds=(p["request_r"], p["reply_w"]),
                                    preexec_fn=limiter(limits, group, run.mode))
            return proc, group is not None
        except subprocess.SubprocessError:
            if group is None:
                raise
    raise AssertionError("unreachable")


def _spawn_harness(run: _Run, python: str, limits: dict[int, tuple[int, int]]) -> subprocess.Popen:
    """Start the trusted harness: the caller's user, no namespaces, the same rlimits."""
    p = run.pipes
    argv = [python, "-I", "-S", "-B", "-c", _child_source("sandbox_harness.py"), str(p["request_w"]), str(p["reply_r"]),
            str(p["verdict_w"])]
    return subprocess.Popen(argv, cwd="/", env=child_env(run.workdir), stdin=run.files[3], stdout=run.files[4],
                            stderr=subprocess.STDOUT, start_new_session=True,
                            pass_fds=(p["request_w"], p["reply_r"], p["verdict_w"]),
                            preexec_fn=limiter(limits, None, None))


def _read_verdict(fd: int, deadline: float) -> str | None:
    """What the harness wrote on the verdict pipe by the time it closed it; ``None`` at the deadline."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not wait_readable(fd, left):
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            return data.decode("ascii", "replace").strip()
        data += chunk


def _reap(procs: list[subprocess.Popen], namespaced: bool) -> list[int]:
    """SIGKILL each process group (and, under a PID namespace, its init), then reap; the return codes."""
    for proc in procs:
        if namespaced and proc is procs[0]:
            _kill_children(proc.pid)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group, also after a normal exit
    return [proc.wait() for proc in procs]


def _exit_signal(rc: int, mode: Mode) -> int:
    """The signal that ended the program (bubblewrap reports a child's signal as ``128 + signal``), else 0."""
    if rc < 0:
        return -rc
    return rc - 128 if mode.bwrap_binds and rc > 128 else 0


def _status(verdict: str | None, rc: int, mode: Mode) -> str:
    """The run's status from the harness' verdict, refined by how the program ended when it exited early."""
    if verdict is None:
        return "timeout"
    if verdict == "exited":
        sig = _exit_signal(rc, mode)
        if sig == signal.SIGXCPU:
            return "timeout"
        return "error" if sig not in (0, signal.SIGKILL) else "failed"
    return verdict if verdict in SANDBOX_STATUSES else "error"  # no verdict: the harness itself failed


def _execute(run: _Run, python: str, limits: tuple[dict[int, tuple[int, int]], ...], cgroup: str | None,
             start: float, timeout_s: float, max_output_bytes: int) -> SandboxResult:
    """Start both processes, wait for the verdict (or the deadline), kill and reap both, build the result.
    ``limits``: the program's rlimits, the harness' rlimits."""
    label = run.mode.label
    try:
        program, joined = _spawn_program(run, python, limits[0], cgroup)
    except (OSError, subprocess.SubprocessError) as exc:
        return SandboxResult(False, "error", "", f"sandbox: could not start: {exc}", time.monotonic() - start, None,
                             label)
    procs = [program]
    try:
        procs.append(_spawn_harness(run, python, limits[1]))
        run.close_child_ends()
        deadline = start + timeout_s
        verdict = _read_verdict(run.pipes["verdict_r"], deadline)
        if verdict is not None:
            _wait(program, min(deadline, time.monotonic() + _EXIT_GRACE_S))
    except (OSError, subprocess.SubprocessError) as exc:
        verdict = f"could not run the harness: {exc}"
    finally:
        rc = _reap(procs, bool(run.mode.prefix))[0]
    duration = time.monotonic() - start
    status = _status(verdict, rc, run.mode)
    rc = -_exit_signal(rc, run.mode) or rc  # bwrap's 128 + signal as the usual negative signal number
    stdout = _read_capped(run.files[1], max_output_bytes)[0].decode("utf-8", "replace")
    stderr = "".join(_read_capped(fh, max_output_bytes)[0].decode("utf-8", "replace") for fh in run.files[2::2])
    if verdict is None:
        stderr += f"\nsandbox: killed after the {timeout_s:g} s limit"
    elif status == "error" and verdict not in SANDBOX_STATUSES + ("exited",):
        stderr += f"\nsandbox: {verdict or 'the harness gave no verdict'}"
    isolation = label + (" + pids cgroup" if joined else "")
    return SandboxResult(status == "passed", status, stdout, stderr, duration, rc, isolation)


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
    trusted_code: str | None = None,
    hidden_paths: Sequence[str | os.PathLike] = (),
    allow_weak: bool | None = None,
) -> SandboxResult:
    """Run ``code`` in the sandbox, then ``tests`` and ``check(entry_point)`` in the trusted harness.

    HumanEval convention: ``tests`` defines ``check(candidate)`` and the harness calls it with the
    program's function named ``entry_point``; the tests also see every other top-level function of the
    code (and its top-level literal values) by name, except names of built-ins (a program's ``abs`` or
    ``set`` would answer the tests' own calls). Without ``entry_point`` the tests are module-level
    code (bare asserts); without ``tests`` the program passes when its code runs to completion.

    Statuses: ``passed``; ``failed``: an ``AssertionError``, or the program exited (``sys.exit``,
    ``os._exit``) before the tests finished (exiting early never passes); ``timeout``: wall clock or
    CPU limit; ``memory``: ``MemoryError`` under ``RLIMIT_AS``; ``error``: any other exception
    (``SyntaxError``, missing entry point, a result that is not a plain literal, a write past
    ``max_file_mb``...), a crash, or a sandbox that could not start. See the module docstring for what is
    enforced.

    Args:
        timeout_s: wall-clock limit; the CPU limit per process is ``ceil(timeout_s) + 1`` s.
        memory_mb: address-space limit per process of the program (``RLIMIT_AS``).
        max_procs: processes/threads the program may add (fork-bomb guard).
        max_file_mb: largest file the program may write, stdout and stderr included.
        max_output_bytes: bytes of stdout and of stderr returned (the rest is cut with a note).
        python: the interpreter (for both processes).
        user: for a root caller, the user (name or uid) the program runs as; ``None`` keeps root.
            Ignored for other callers.
        isolate: use namespaces (bubblewrap, else ``unshare``) when they work; ``False`` keeps rlimits and
            the socket guard.
        trusted_code: definitions the tests may call (e.g. the problem's prompt), run in the harness
            before the tests; its names replace the program's, except ``entry_point``, so a program cannot
            redefine a helper the tests check its answer with.
        hidden_paths: files or directories the program must not read although they lie inside a
            directory it sees (e.g. the benchmark file shipped inside the interpreter's site-packages,
            which holds the reference solutions); they appear empty. Under bubblewrap only.
        allow_weak: run under a fallback mechanism (no bubblewrap) instead of raising
            :class:`WeakSandboxError`; ``None``: as :func:`allow_weak_sandbox` / ``MESHRL_SANDBOX_ALLOW_WEAK`` say.
    """
    if trusted_code is not None and not isinstance(trusted_code, str):
        raise ValueError(f"trusted_code must be a string, got {type(trusted_code).__name__}")
    _check_args(code, tests, entry_point, timeout_s, memory_mb=memory_mb, max_procs=max_procs,
                max_file_mb=max_file_mb, max_output_bytes=max_output_bytes)
    check_sandbox(python, isolate=isolate, user=user, allow_weak=allow_weak)
    mode = select_mode(python, isolate, user)
    cpu = math.ceil(timeout_s) + 1
    limits = {resource.RLIMIT_CPU: (cpu, cpu + 1), resource.RLIMIT_AS: (memory_mb << 20, memory_mb << 20),
              resource.RLIMIT_FSIZE: (max_file_mb << 20, max_file_mb << 20), resource.RLIMIT_CORE: (0, 0)}
    harness_limits = {**limits, resource.RLIMIT_AS: (max(memory_mb, 512) << 20,) * 2}
    _sweep_orphans()
    owned = tempfile.mkdtemp(prefix=f"{OWNED_PREFIX}{os.getpid()}-")  # the caller's: what the sweep may remove
    workdir = os.path.join(owned, "work")  # the program's, inside it
    cgroup = _make_cgroup(max_procs)
    start = time.monotonic()
    run = None
    try:
        os.mkdir(workdir, 0o700)
        if mode.uid != os.geteuid():
            os.chmod(owned, 0o711)  # the program's user may pass through, not list
            os.chown(workdir, mode.uid, mode.gid)
        tests_payload = {"tests": tests, "entry_point": entry_point, "trusted_code": trusted_code}
        run = _Run.open(workdir, mode, code, tests_payload, tuple(str(p) for p in hidden_paths))
        program_limits = dict(limits)
        if mode.uid != 0:
            program_limits[resource.RLIMIT_NPROC] = (_count_tasks(mode.uid) + max_procs,) * 2
        return _execute(run, python, (program_limits, harness_limits), cgroup, start, timeout_s, max_output_bytes)
    finally:
        if run is not None:
            run.close()
        if cgroup is not None:
            _remove_cgroup(cgroup)
        remove_owned_dir(owned)


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
