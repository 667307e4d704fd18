"""meshrl.provenance: which code made a record (version, git commit, modified or not), and meshrl.cpu's label of
the CPU that made it."""

from __future__ import annotations

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
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


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
    (package / "notes.txt").write_text("untracked\n")  # not code that was imported
    assert provenance.describe_code(package, "9.9")["dirty"] is False
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
    # a source checkout (as the tests usually run) names a full commit; an installed copy names none
    assert code["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", code["commit"])
    assert (code["dirty"] is None) == (code["commit"] is None)
    assert provenance.code_version() is code  # read once per process


def test_the_cpu_label_tells_apart_cpus_of_one_capability():
    xeon = {"model": "Intel(R) Xeon(R) Processor", "capability": "AVX512", "flags": ["avx512f", "amx_tile"]}
    epyc = {"model": "AMD EPYC", "capability": "AVX512", "flags": ["avx512f", "avx512_bf16"]}
    assert machine_label(xeon) == "AVX512 (Intel(R) Xeon(R) Processor, AMX)"
    assert machine_label(epyc) == "AVX512 (AMD EPYC)"
    assert machine_label({"capability": "AVX2"}) == "AVX2"  # a record without the model: the capability alone
    assert machine_label({"model": "AMD EPYC", "capability": "AVX512"}) == "AVX512 (AMD EPYC, flags not recorded)"
    assert machine_label(None) == "-" and machine_label({}) == "-"
