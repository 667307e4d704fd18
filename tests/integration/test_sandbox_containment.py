"""File system, identity and network containment of the sandboxed program (bubblewrap mechanism).

Each attack runs as the program and reports what it managed; the test then checks the host side too
(the file it tried to write is absent, the victim file is intact, the socket server saw no client).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from meshrl.rewards import sandbox_modes
from meshrl.rewards.sandbox import run_code, sandbox_isolation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox targets Linux")



def _bwrap_can_run() -> bool:
    if not sys.platform.startswith("linux") or not shutil.which("bwrap"):
        return False
    done = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "true"],
                          capture_output=True, timeout=30)
    return done.returncode == 0


ISOLATION = sandbox_isolation() if sys.platform.startswith("linux") else ""
BWRAP = ISOLATION.startswith("bwrap")
BWRAP_RUNS = _bwrap_can_run()
# Skipped only where bwrap cannot run at all: where it can, the attacks must be contained.
needs_bwrap = pytest.mark.skipif(not BWRAP_RUNS, reason="bwrap is missing or cannot create namespaces here")


def attempt(body: str) -> str:
    """Run ``body`` (which sets ``outcome``) in the sandbox; the outcome it printed."""
    indented = "".join("    " + line + "\n" for line in body.splitlines())
    code = ("import os, socket\noutcome = 'not run'\ntry:\n" + indented
            + "except OSError as exc:\n    outcome = type(exc).__name__\n")
    res = run_code(code + "print('OUTCOME', outcome)\n", timeout_s=10)
    lines = [line for line in res.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, res
    return lines[-1].split(" ", 1)[1]


@pytest.fixture
def host_dir():
    """A root-owned directory outside the work dir, with a mode-600 secret and a victim file."""
    path = tempfile.mkdtemp(prefix="meshrl-host-")
    os.chmod(path, 0o755)
    with open(os.path.join(path, "secret"), "w") as fh:
        fh.write("hunter2")
    os.chmod(os.path.join(path, "secret"), 0o600)
    with open(os.path.join(path, "victim"), "w") as fh:
        fh.write("keep me")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_bwrap
def test_bwrap_is_chosen_when_it_works_here():
    assert BWRAP, ISOLATION
    if os.geteuid() == 0:
        assert "uid 0" not in ISOLATION  # the program drops to an unprivileged user


def test_fallback_is_named_when_bwrap_is_missing(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    modes = sandbox_modes.candidate_modes(sys.executable, True, "nobody")
    assert not any(mode.label.startswith("bwrap") for mode in modes)
    assert modes[-1].label.startswith("no namespaces")


@needs_bwrap
def test_runs_as_an_unprivileged_user_with_the_projects_interpreter():
    res = run_code("import os, sys\nprint(os.getuid(), os.getgid(), os.getgroups(), sys.executable)")
    uid, gid, groups, exe = res.stdout.split(" ", 3)
    assert res.passed and exe.strip() == sys.executable
    if os.geteuid() == 0:
        assert uid != "0" and gid != "0" and groups == "[]"


@needs_bwrap
@pytest.mark.parametrize("where", ["home", "tmp", "dev_shm", "root_dir", "interpreter_prefix", "etc"])
def test_writes_outside_the_work_dir_fail(where):
    target = {"home": os.path.join(os.path.expanduser("~"), "meshrl-sandbox-escape"),
              "tmp": "/tmp/meshrl-sandbox-escape", "dev_shm": "/dev/shm/meshrl-sandbox-escape",
              "root_dir": "/meshrl-sandbox-escape", "interpreter_prefix": os.path.join(sys.prefix, "meshrl-escape"),
              "etc": "/etc/meshrl-sandbox-escape"}[where]
    try:
        outcome = attempt(f"open({target!r}, 'w').write('x')\noutcome = 'wrote'")
        assert outcome in {"PermissionError", "FileNotFoundError", "OSError"}, outcome  # OSError: EROFS
        assert not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)


@needs_bwrap
def test_work_dir_is_writable():
    assert attempt("open('here.txt', 'w').write('x')\noutcome = open('here.txt').read()") == "x"


@needs_bwrap
def test_host_files_are_absent_or_unreadable(host_dir):
    victim, secret = os.path.join(host_dir, "victim"), os.path.join(host_dir, "secret")
    assert attempt(f"os.remove({victim!r})\noutcome = 'deleted'") == "FileNotFoundError"
    with open(victim) as fh:
        assert fh.read() == "keep me"
    assert attempt(f"outcome = open({secret!r}).read()") == "FileNotFoundError"
    if os.path.exists("/etc/shadow"):  # visible (read-only /etc) but not readable by the sandbox user
        assert attempt("outcome = open('/etc/shadow').read()[:3]") in {"PermissionError", "FileNotFoundError"}
    home = os.path.realpath(os.path.expanduser("~"))
    listing = attempt(f"outcome = str(sorted(os.listdir({home!r})))")
    needed = {d[len(home) + 1:].split("/")[0] for d in sandbox_modes._interpreter_dirs(sys.executable)
              if d.startswith(home + "/")}  # the path down to an interpreter under the home (e.g. .pyenv)
    assert listing == "FileNotFoundError" or set(eval(listing)) <= needed, listing


@needs_bwrap
def test_host_unix_sockets_are_unreachable(host_dir):
    path = os.path.join(host_dir, "sock")
    abstract = "\0meshrl-sandbox-test-" + os.path.basename(host_dir)
    servers, accepted = [], []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(1)
        server.settimeout(0.1)
        servers.append(server)

    def watch() -> None:
        for server in servers:
            with contextlib.suppress(OSError):
                accepted.append(server.accept())

    try:
        for address in (path, abstract, "/run/systemd/private", "/var/run/docker.sock"):
            body = (f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\ns.connect({address!r})\n"
                    "outcome = 'connected'")
            assert attempt(body) in {"FileNotFoundError", "ConnectionRefusedError", "PermissionError"}, address
        thread = threading.Thread(target=watch)
        thread.start()
        thread.join()
        assert not accepted
    finally:
        for server in servers:
            server.close()


@needs_bwrap
def test_no_network_even_to_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        body = ("import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\ns.settimeout(2)\n"
                f"rc = s.connect_ex(('127.0.0.1', {port}))\nrc2 = s.connect_ex(('1.1.1.1', 80))\n"
                "outcome = 'blocked' if rc and rc2 else 'connected'")
        assert attempt(body) == "blocked"
    finally:
        server.close()


@needs_bwrap
def test_only_the_sandbox_processes_are_visible():
    outcome = attempt("outcome = str(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert len(eval(outcome)) <= 3  # bwrap's init, the program (and a helper): no host or harness process


LEAVE_STATE = """
import os, tempfile
places = [os.getcwd(), os.environ.get("HOME", ""), tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm", "/run/lock",
          "/var/lock", "/dev/mqueue"]
left = []
for place in places:
    try:
        with open(os.path.join(place, "meshrl-sandbox-state-{tag}"), "w") as fh:
            fh.write("the tests were: ...")
        left.append(place)
    except OSError:
        pass
print("LEFT", left)
"""
FIND_STATE = """
import os
found = []
for root in ("/", os.environ.get("HOME", "/")):
    for top, dirs, files in os.walk(root):
        if top == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys", "usr")]
        found += [os.path.join(top, f) for f in files if f == "meshrl-sandbox-state-{tag}"]
print("FOUND", found)
"""


@needs_bwrap
def test_no_state_is_carried_to_the_next_run():
    tag = os.urandom(6).hex()
    first = run_code(LEAVE_STATE.replace("{tag}", tag), timeout_s=10)
    assert first.passed and "LEFT [" in first.stdout, first
    second = run_code(FIND_STATE.replace("{tag}", tag), timeout_s=30)
    assert second.passed and "FOUND []" in second.stdout, (first.stdout, second)
