"""The code sandbox: outcomes, limits, isolation, cleanup; and code extraction / grading."""

from __future__ import annotations

import os
import sys
import time

import pytest

from meshrl.rewards.sandbox import SANDBOX_STATUSES, extract_code, grade_code, run_code, sandbox_isolation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox targets Linux")

ADD = "def add(a, b):\n    return a + b\n"
CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
ISOLATION = sandbox_isolation() if sys.platform.startswith("linux") else ""
STRONG_CLEANUP = "pidns" in ISOLATION or "cgroup" in ISOLATION


def survivors(path: str) -> list[str]:
    """Live processes whose working directory is (or was) ``path``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/cwd").startswith(path):
                    found.append(pid)
            except OSError:
                continue
    return found


def wait_no_survivors(path: str, within: float = 2.0) -> list[str]:
    deadline = time.monotonic() + within
    while (left := survivors(path)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def first_line(text: str) -> str:
    return text.strip().splitlines()[0]


def test_passing_solution_humaneval_style():
    res = run_code(ADD + "print('hello')", tests=CHECK, entry_point="add")
    assert res.passed and res.status == "passed", res.stderr
    assert res.stdout == "hello\n" and res.returncode == 0 and res.isolation == ISOLATION
    assert set(SANDBOX_STATUSES) == {"passed", "failed", "timeout", "error", "memory"}
    assert run_code("x = 1").passed  # no tests: passes when it runs to completion
    assert run_code(ADD, tests="assert add(2, 2) == 4").passed  # module-level tests, no entry point


def test_failing_assertion_and_errors():
    res = run_code("def add(a, b):\n    return a - b\n", tests=CHECK, entry_point="add")
    assert not res.passed and res.status == "failed" and "AssertionError" in res.stderr
    assert "tests.py" in res.stderr  # the traceback names the test line
    assert run_code("def add(a, b:\n", tests=CHECK, entry_point="add").status == "error"  # SyntaxError
    missing = run_code("def plus(a, b):\n    return a + b\n", tests=CHECK, entry_point="add")
    assert missing.status == "error" and "entry point" in missing.stderr
    raising = run_code("def add(a, b):\n    raise TypeError('no')\n", tests=CHECK, entry_point="add")
    assert raising.status == "error" and "TypeError" in raising.stderr


@pytest.mark.parametrize(
    "code",
    ["import sys\nsys.exit(0)", "exit()", "raise SystemExit", "import os\nos._exit(0)",
     ADD.replace("return a + b", "import sys; sys.exit(0)")],
)
def test_exiting_early_never_passes(code):
    res = run_code(code, tests=CHECK, entry_point="add")
    assert res.status == "failed" and not res.passed


def test_patching_the_harness_does_not_forge_a_pass():
    code = (
        "import os, __main__\n"
        "assert 'marker' not in repr(vars(__main__))\n"
        "real = os.write\n"
        "os.write = lambda fd, data: real(fd, data.replace(b':failed', b':passed'))\n"
        "os._exit = lambda status: None\n"
    )
    res = run_code(code, tests="assert False")
    assert res.status == "failed" and "AssertionError" in res.stderr
    assert run_code("print('no newline', end='')").stdout == "no newline"  # the marker is stripped cleanly


def test_infinite_loop_times_out_and_group_is_killed():
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(os.getcwd(), flush=True)\n"
        "while True:\n"
        "    pass\n"
    )
    start = time.monotonic()
    res = run_code(code, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert res.status == "timeout" and not res.passed
    assert 1.0 <= res.duration_s < 2.0 and elapsed < 3.0
    assert res.returncode is not None and res.returncode < 0
    workdir = first_line(res.stdout)
    assert workdir.startswith("/") and not wait_no_survivors(workdir)


@pytest.mark.skipif(not STRONG_CLEANUP, reason=f"no PID namespace or cgroup here ({ISOLATION})")
def test_setsid_escapee_is_killed():
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(os.getcwd(), flush=True)\n"
    )
    res = run_code(code, timeout_s=5.0)
    assert res.passed
    assert not wait_no_survivors(first_line(res.stdout))


def test_memory_bomb():
    res = run_code("x = bytearray(4 * 1024 ** 3)\n", memory_mb=256)
    assert res.status == "memory" and not res.passed
    res = run_code("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 ** 2))\n", memory_mb=256)
    assert res.status == "memory"


def test_fork_bomb_is_bounded():
    code = (
        "import os, time\n"
        "print(os.getcwd(), flush=True)\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(300):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print('blocked', type(exc).__name__)\n"
        "print('forked', n, flush=True)\n"
    )
    start = time.monotonic()
    res = run_code(code, timeout_s=5.0, max_procs=16)
    assert time.monotonic() - start < 6.5
    lines = res.stdout.splitlines()
    if "cgroup" in ISOLATION or "uid 0" not in ISOLATION:  # a process cap is in force
        assert "blocked BlockingIOError" in lines
        assert int(lines[-1].split()[1]) < 16
    assert not wait_no_survivors(lines[0])


def test_huge_file_is_stopped():
    code = (
        "import os\n"
        "try:\n"
        "    with open('big.bin', 'wb') as fh:\n"
        "        for _ in range(64):\n"
        "            fh.write(b'x' * (1 << 20))\n"
        "except OSError as exc:\n"
        "    print('stopped', exc.errno, os.path.getsize('big.bin'))\n"
    )
    res = run_code(code, max_file_mb=2)
    word, errno_, size = res.stdout.split()
    assert word == "stopped" and int(errno_) == 27 and int(size) <= 2 << 20  # EFBIG
    unguarded = run_code("open('big.bin', 'wb').write(b'x' * (4 << 20))\n", max_file_mb=2)
    assert unguarded.status == "error" and "File too large" in unguarded.stderr


def test_output_is_capped():
    res = run_code("print('y' * 100000)", max_output_bytes=1000)
    assert res.passed and len(res.stdout) < 1100 and "more bytes cut" in res.stdout


NETWORK = (
    "import socket\n"
    "try:\n"
    "    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
    "    print('connected')\n"
    "except OSError as exc:\n"
    "    print('blocked', type(exc).__name__)\n"
)


@pytest.mark.parametrize("isolate", [True, False])
def test_network_attempt_fails(isolate):
    res = run_code(NETWORK, isolate=isolate)
    assert res.stdout.strip() == "blocked PermissionError"
    dns = run_code("import socket\nsocket.gethostbyname('example.com')", isolate=isolate)
    assert dns.status == "error" and "PermissionError" in dns.stderr


@pytest.mark.skipif("netns" not in ISOLATION, reason=f"no network namespace here ({ISOLATION})")
def test_network_namespace_stops_a_raw_socket():
    code = (
        "import _socket\n"
        "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "s.settimeout(2)\n"
        "print(s.connect_ex(('1.1.1.1', 80)) != 0)\n"
    )
    assert run_code(code).stdout.strip() == "True"


def test_temp_dir_is_fresh_and_removed():
    code = "import os\nprint(os.getcwd())\nprint(os.listdir('.'))\nopen('junk.txt', 'w').write('x')\nos.mkdir('d')\n"
    res = run_code(code)
    cwd, listing = res.stdout.splitlines()
    assert listing == "[]" and os.path.basename(os.path.dirname(cwd)).startswith("meshrl-sandbox-")
    assert not os.path.exists(os.path.dirname(cwd))
    assert run_code("import os\nprint(os.environ['HOME'] == os.getcwd())").stdout.strip() == "True"


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("MESHRL_FAKE_SECRET", "hunter2")
    monkeypatch.setenv("PYTHONPATH", "/nonexistent/injected")
    code = "import os, sys\nprint(sorted(os.environ))\nprint('hunter2' in repr(os.environ))\nprint(sys.path)\n"
    res = run_code(code)
    keys, leaked, path = res.stdout.splitlines()
    assert "MESHRL_FAKE_SECRET" not in keys and "PYTHONPATH" not in keys and leaked == "False"
    assert "/nonexistent/injected" not in path
    assert run_code("print(input())").status == "error"  # stdin is empty (EOFError)


def test_plain_mode_still_passes_and_times_out():
    assert run_code(ADD, tests=CHECK, entry_point="add", isolate=False).passed
    res = run_code("while True:\n    pass\n", timeout_s=0.5, isolate=False)
    assert res.status == "timeout" and res.duration_s < 1.5


def test_extract_code():
    assert extract_code("no fences, just code = 1") == "no fences, just code = 1"
    text = "first\n```python\na = 1\n```\nthen\n```py\nb = 2\n```\nand ```\nc = 3\n```"
    assert extract_code(text) == "b = 2\n"  # the last python-tagged block wins over an untagged one
    assert extract_code("look:\n```\nc = 3\n```\n") == "c = 3\n"
    assert extract_code("```Python3 title\nd = 4\n```") == "d = 4\n"
    assert extract_code("```python\ne = 5\nf = 6") == "e = 5\nf = 6"  # truncated generation
    assert extract_code("```text\nnot code\n```") == "```text\nnot code\n```"


def test_grade_code():
    good = "Here you go:\n```python\n" + ADD + "```\nThis adds."
    assert grade_code(good, CHECK, "add", timeout_s=5) == 1.0
    assert grade_code(good.replace("a + b", "a * b"), CHECK, "add") == 0.0
    assert grade_code("```python\nwhile True:\n    pass\n```", CHECK, "add", timeout_s=0.5) == 0.0
    assert grade_code(ADD, "assert add(1, 1) == 2") == 1.0


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"code": None}, "code"),
        ({"code": "x", "tests": 3}, "tests"),
        ({"code": "x", "entry_point": "not an identifier"}, "entry_point"),
        ({"code": "x", "timeout_s": 0}, "timeout_s"),
        ({"code": "x", "timeout_s": float("inf")}, "timeout_s"),
        ({"code": "x", "memory_mb": 0}, "memory_mb"),
        ({"code": "x", "max_procs": 1.5}, "max_procs"),
        ({"code": "x", "max_file_mb": -1}, "max_file_mb"),
        ({"code": "x", "max_output_bytes": True}, "max_output_bytes"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    code = kwargs.pop("code")
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        run_code(code, **kwargs)


def test_missing_interpreter_is_an_error():
    res = run_code("x = 1", python="/nonexistent/python3")
    assert res.status == "error" and not res.passed


SYSTEM_PYTHON = "/usr/bin/python3"
SWITCHES_USER = (
    os.geteuid() == 0 and os.path.exists(SYSTEM_PYTHON) and "uid 0" not in sandbox_isolation(SYSTEM_PYTHON)
)


@pytest.mark.skipif(not SWITCHES_USER, reason="needs root and an interpreter that 'nobody' can execute")
@pytest.mark.parametrize("isolate", [True, False])
def test_root_caller_runs_code_as_nobody_with_nproc_cap(monkeypatch, isolate):
    import meshrl.rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_make_cgroup", lambda max_procs: None)  # RLIMIT_NPROC alone
    code = (
        "import os, time\n"
        "print(os.getcwd(), os.getuid(), flush=True)\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(300):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print('blocked', type(exc).__name__)\n"
        "try:\n"
        "    open('/root/.profile')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    res = run_code(code, python=SYSTEM_PYTHON, max_procs=16, isolate=isolate)
    cwd_uid, blocked, denied = res.stdout.splitlines()
    assert cwd_uid.split()[1] != "0" and "cgroup" not in res.isolation
    assert blocked == "blocked BlockingIOError" and denied in {"PermissionError", "FileNotFoundError"}
    assert not wait_no_survivors(cwd_uid.split()[0])


@pytest.mark.skipif(not SWITCHES_USER, reason="needs root and an interpreter that 'nobody' can execute")
def test_namespace_init_leaving_the_group_is_killed(monkeypatch):
    import meshrl.rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_make_cgroup", lambda max_procs: None)  # only the PID namespace cleans up
    code = "import os, time\nos.setsid()\nprint(os.getcwd(), flush=True)\ntime.sleep(60)\n"
    res = run_code(code, python=SYSTEM_PYTHON, timeout_s=1.0)
    assert res.status == "timeout" and "pidns" in res.isolation
    assert not wait_no_survivors(first_line(res.stdout))


def test_a_crash_is_an_error_with_a_negative_signal():
    code = "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
    res = run_code(code, tests=CHECK, entry_point="add")
    assert res.status == "error" and res.returncode == -11 and "exited" in res.stderr


def _processes_with_home(workdir: str) -> list[int]:
    """Pids whose environment says HOME=workdir (the sandbox gives its harness and program that HOME); read-only."""
    found = []
    marker = f"HOME={workdir}".encode()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    if marker in fh.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                continue
    return found


def _sleeping_run(pidfile: str, isolate: bool) -> float:
    with open(pidfile, "w") as fh:
        fh.write(str(os.getpid()))
    return float(run_code("import time\ntime.sleep(30)\ndef f():\n    return 1\n", tests="def check(c):\n    pass\n",
                          entry_point="f", timeout_s=20, isolate=isolate).passed)


@pytest.mark.parametrize("isolate", [True, False])
def test_a_caller_killed_mid_run_leaves_no_process_and_its_workdir_is_swept(tmp_path, isolate):
    """A scorer process killed at the reward's limit (5 s by default, shorter than the sandbox's 10 s) never
    reached run_code's clean-up: its working directory and cgroup stayed, and without bubblewrap the program
    (and the harness waiting on it) lived on."""
    import glob

    from meshrl.rewards import RewardRunner

    pidfile = str(tmp_path / "scorer.pid")
    runner = RewardRunner(lambda c, p: _sleeping_run(pidfile, isolate), timeout_s=2.0, isolation="process")
    assert runner(["x"], [{"id": "slow"}]) == [0.0]
    assert runner.pop_stats()["reward/timeouts"] == 1
    import tempfile
    from pathlib import Path

    scorer_pid = int(Path(pidfile).read_text())
    left = glob.glob(os.path.join(tempfile.gettempdir(), f"meshrl-sandbox-{scorer_pid}-*"))
    assert len(left) == 1
    deadline = time.monotonic() + 5
    while _processes_with_home(left[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with_home(left[0]) == []
    assert run_code("x = 1\n", timeout_s=5).passed  # the next run sweeps what the dead caller left
    assert not os.path.exists(left[0])
