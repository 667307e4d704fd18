"""The clean-up of a run and the sweep of killed callers' leftovers never follow a link and remove only what the
caller created (``meshrl/rewards/sandbox_cleanup.py``)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from meshrl.rewards import sandbox_cleanup
from meshrl.rewards.sandbox import run_code

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox targets Linux")
CLEANUP = Path(sandbox_cleanup.__file__)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def victim(tmp_path):
    """A tree the caller owns, with modes a clean-up must not change."""
    tree = tmp_path / "victim"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "keep").write_text("keep me")
    tree.chmod(0o751)
    (tree / "sub").chmod(0o500)
    yield tree
    (tree / "sub").chmod(0o700)


def test_the_sweep_ignores_a_planted_link_and_another_user_s_directory(tmp_path, victim, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    dead = _dead_pid()
    (temp / f"meshrl-sandbox-{dead}-planted").symlink_to(victim)
    (temp / f"meshrl-sandbox-{dead}-file").write_text("not a directory")
    leftover = temp / f"meshrl-sandbox-{dead}-left"  # a killed caller's working directory: removed
    (leftover / "work" / "deep").mkdir(parents=True)
    (leftover / "work" / "deep").chmod(0)
    if os.geteuid() == 0:
        foreign = temp / f"meshrl-sandbox-{dead}-foreign"
        foreign.mkdir()
        os.chown(foreign, 65534, 65534)
    assert run_code("x = 1\n").passed
    assert _mode(victim) == 0o751 and _mode(victim / "sub") == 0o500
    assert (victim / "sub" / "keep").read_text() == "keep me"
    assert (temp / f"meshrl-sandbox-{dead}-planted").is_symlink()
    assert (temp / f"meshrl-sandbox-{dead}-file").exists()
    assert not leftover.exists()
    if os.geteuid() == 0:
        assert foreign.is_dir()


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


LEAVE_LINK = """
import os
os.makedirs("a")
os.symlink({target!r}, "a/link")
os.chmod("a", 0)
"""


def test_a_program_s_link_in_an_unreadable_directory_is_not_followed_by_the_clean_up(victim):
    if os.geteuid() != 0:  # the run's own clean-up, end to end
        assert run_code(LEAVE_LINK.format(target=str(victim))).passed
        assert _mode(victim) == 0o751 and _mode(victim / "sub") == 0o500
        return
    # Root reads through mode 000, so the attack needs a non-root caller: the same tree and clean-up, as nobody.
    work = Path(tempfile.mkdtemp())
    try:
        work.chmod(0o755)
        # a copy nobody can read: the checkout may sit in a directory only its owner can enter (mktemp -d)
        module = work / "sandbox_cleanup.py"
        shutil.copy(CLEANUP, module)
        module.chmod(0o644)
        script = (
            "import importlib.util, os, stat, sys\n"
            f"spec = importlib.util.spec_from_file_location('c', {str(module)!r})\n"
            "c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)\n"
            f"victim = os.path.join({str(work)!r}, 'victim'); os.makedirs(victim + '/sub')\n"
            "os.chmod(victim + '/sub', 0o500); os.chmod(victim, 0o751)\n"
            f"owned = os.path.join({str(work)!r}, 'meshrl-sandbox-1-x'); os.makedirs(owned + '/work/a')\n"
            "os.symlink(victim, owned + '/work/a/link'); os.chmod(owned + '/work/a', 0)\n"
            "print('removed', c.remove_owned_dir(owned), os.path.exists(owned))\n"
            "modes = [oct(stat.S_IMODE(os.stat(p).st_mode)) for p in (victim, victim + '/sub')]\n"
            "print('modes', *modes)\n"
        )
        os.chown(work, 65534, 65534)
        for python in ("/usr/bin/python3", sys.executable):  # one the user nobody can run (not under /root)
            try:
                done = subprocess.run([python, "-I", "-c", script], capture_output=True, text=True, timeout=60,
                                      cwd="/", preexec_fn=_as_nobody)
                break
            except PermissionError:
                continue
        else:
            pytest.skip("no interpreter the user nobody can run")
        assert done.returncode == 0, done.stderr
        assert "removed True False" in done.stdout and "modes 0o751 0o500" in done.stdout, done.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_only_a_real_directory_of_the_caller_is_removed(tmp_path, victim):
    link = tmp_path / "meshrl-sandbox-1-link"
    link.symlink_to(victim)
    assert sandbox_cleanup.remove_owned_dir(str(link)) is False
    assert link.is_symlink() and (victim / "sub" / "keep").exists()
    inner = tmp_path / "meshrl-sandbox-1-real"
    (inner / "a" / "b").mkdir(parents=True)
    (inner / "a" / "link").symlink_to(victim)
    (inner / "a" / "b").chmod(0)
    assert sandbox_cleanup.remove_owned_dir(str(inner)) is True
    assert not inner.exists() and (victim / "sub" / "keep").exists() and _mode(victim) == 0o751
