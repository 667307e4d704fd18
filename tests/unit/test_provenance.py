"""meshrl.provenance: which code made a record (version, git commit, modified or not), and meshrl.cpu's label of
the CPU that made it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import meshrl
from meshrl import provenance
from meshrl.cpu import machine_label

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(cwd: Path, *args: str) -> str:
    """git with none of the user's configuration (signing, hooks) or a calling hook's ``GIT_*`` variables."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout.strip()


def _checkout(root: Path) -> Path:
    """A git work tree laid out like meshrl's (``src/meshrl/__init__.py`` committed); returns the package dir."""
    package = root / "src" / "meshrl"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    return package


@needs_git
def test_a_source_checkout_records_its_commit_and_whether_tracked_files_changed(tmp_path):
    package = _checkout(tmp_path / "repo")
    head = _git(tmp_path / "repo", "rev-parse", "HEAD")
    assert provenance.describe_code(package, "9.9") == {"meshrl": "9.9", "commit": head, "dirty": False}
    (package / "notes.txt").write_text("untracked\n")  # not code
    (tmp_path / "repo" / "README.md").write_text("docs are not code\n")
    assert provenance.describe_code(package, "9.9")["dirty"] is False
    (package / "new_module.py").write_text("y = 1\n")  # untracked, and maybe imported
    assert provenance.describe_code(package, "9.9")["dirty"] is True
    (package / "new_module.py").unlink()
    (package / "__init__.py").write_text("x = 2\n")
    assert provenance.describe_code(package, "9.9") == {"meshrl": "9.9", "commit": head, "dirty": True}
    dirty = {"meshrl": "9.9", "commit": head, "dirty": True}
    assert provenance.describe(dirty) == f"meshrl 9.9 at {head[:7]}, modified"


@needs_git
def test_a_meshrl_inside_another_repository_is_not_given_its_commit(tmp_path):
    # e.g. a virtualenv inside the user's own project: the project's commit says nothing of meshrl's code
    _checkout(tmp_path / "project")
    installed = tmp_path / "project" / "venv" / "site-packages" / "meshrl"
    installed.mkdir(parents=True)
    assert provenance.describe_code(installed, "1.0") == {"meshrl": "1.0", "commit": None, "dirty": None}


def test_no_git_or_no_repository_records_the_version_alone(tmp_path, monkeypatch):
    plain = tmp_path / "site-packages" / "meshrl"
    plain.mkdir(parents=True)
    assert provenance.describe_code(plain, "1.0") == {"meshrl": "1.0", "commit": None, "dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # git cannot be found
    assert provenance.source_checkout(plain) is None
    assert provenance.describe({"meshrl": "1.0", "commit": None, "dirty": None}) == "meshrl 1.0 (no commit recorded)"
    assert provenance.describe(None) == "code not recorded"


def test_this_process_records_its_own_meshrl():
    code = provenance.code_version()
    assert code["meshrl"] == meshrl.__version__
    package = Path(meshrl.__file__).resolve().parent
    root = package.parents[1]
    if shutil.which("git") and package == (root / "src" / "meshrl") and (root / ".git").exists():
        assert code["commit"] == _git(root, "rev-parse", "HEAD")  # a source checkout (setup.sh's editable install)
        assert isinstance(code["dirty"], bool)
    else:  # an installed copy names no commit
        assert code["commit"] is None and code["dirty"] is None
    assert code["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", code["commit"])
    assert provenance.code_version() is code  # read once per process


def test_a_git_that_hangs_or_fails_records_no_commit(tmp_path, monkeypatch):
    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], provenance.GIT_TIMEOUT_S)

    monkeypatch.setattr(provenance.subprocess, "run", hang)
    assert provenance.describe_code(tmp_path, "1.0") == {"meshrl": "1.0", "commit": None, "dirty": None}

    def undecodable(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(provenance.subprocess, "run", undecodable)
    assert provenance.describe_code(tmp_path, "1.0")["commit"] is None


def test_describe_says_when_modified_is_unknown():
    head = "a" * 40
    assert provenance.describe({"meshrl": "1.0", "commit": head, "dirty": False}) == "meshrl 1.0 at aaaaaaa"
    assert provenance.describe({"meshrl": "1.0", "commit": head, "dirty": None}) == (
        "meshrl 1.0 at aaaaaaa, modified or not unknown")


def test_the_cpu_label_tells_apart_cpus_of_one_capability():
    xeon = {"model": "Intel(R) Xeon(R) Processor", "capability": "AVX512", "flags": ["avx512f", "amx_tile"]}
    epyc = {"model": "AMD EPYC", "capability": "AVX512", "flags": ["avx512f", "avx512_bf16"]}
    assert machine_label(xeon) == "AVX512 (Intel(R) Xeon(R) Processor, AMX)"
    assert machine_label(epyc) == "AVX512 (AMD EPYC)"
    assert machine_label({"capability": "AVX2"}) == "AVX2"  # a record without the model: the capability alone
    assert machine_label({"model": "AMD EPYC", "capability": "AVX512"}) == "AVX512 (AMD EPYC, flags not recorded)"
    assert machine_label(None) == "-" and machine_label({}) == "-"
    # a run under an ISA override did not round as the CPU's own kernels do
    capped = {**epyc, "isa_overrides": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
    assert machine_label(capped) == "AVX512 (AMD EPYC; ONEDNN_MAX_CPU_ISA=AVX2)"
