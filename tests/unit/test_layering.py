"""Imports point down the layers (docs/architecture.md): checked on the source, not by convention."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "meshrl"
# Bottom to top. A module imports from its own group or a lower one only. Layer 3, the engine, is four ordered groups.
GROUPS: list[tuple[str, set[str]]] = [
    ("1 core", {"algos", "stats"}),
    ("2 method", {"mesh", "diagnostics"}),
    # the doctor's checks run inside the trainer (live health) and it imports only tasks, rewards and jsonl: it sits
    # with the data layer, below the trainer
    ("3 engine: data", {"rewards", "tasks", "models", "runs", "doctor"}),
    ("3 engine: sampling", {"rollout", "agents"}),
    ("3 engine: training", {"trainer"}),
    ("3 engine: using runs", {"evaluation", "analysis", "testbed"}),
    ("4 faces", {"cli", "export", "integrations", "report"}),
]
LAYER = {pkg: rank for rank, (_, pkgs) in enumerate(GROUPS) for pkg in pkgs}
FACES = GROUPS[-1][1]
# Upward imports that remain, each as (file under src/meshrl, the package it imports), with why. The test fails
# when one is no longer needed, so that the list only shrinks.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshrl."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("meshrl.")}
    return out


def test_every_package_has_a_layer():
    pkgs = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert pkgs <= set(LAYER), f"assign a layer to {pkgs - set(LAYER)} in this test and docs/architecture.md"


def _upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        if len(rel) < 2:
            continue
        own = rel[0]
        for dep in _imports(path):
            if dep == own or dep not in LAYER:
                continue
            # The CLI is the outermost face: it may call the other faces (report, export, integrations); nothing
            # else may.
            if (dep in FACES and own != "cli") or LAYER[dep] > LAYER[own]:
                found.add((path.relative_to(SRC).as_posix(), dep))
    return found


# slow: parses every module under src/meshrl (0.5 to 1.5 s each, one thread, busy 2-core box)
@pytest.mark.slow
def test_imports_point_down():
    bad = sorted(_upward_imports() - ALLOWED_UPWARD)
    assert not bad, "\n".join(f"{f} imports meshrl.{dep}" for f, dep in bad)


# slow: parses every module under src/meshrl (0.5 to 1.5 s each, one thread, busy 2-core box)
@pytest.mark.slow
def test_every_allowed_upward_import_is_still_needed():
    stale = sorted(ALLOWED_UPWARD - _upward_imports())
    assert not stale, "drop from ALLOWED_UPWARD: " + ", ".join(f"{f} -> meshrl.{dep}" for f, dep in stale)


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = ["meshrl", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# slow: parses every module under src/meshrl (0.5 to 1.5 s each, one thread, busy 2-core box)
@pytest.mark.slow
def test_no_private_names_cross_modules():
    """``from meshrl.x.y import _name`` (or anything from a private module ``meshrl.x._y``) only inside the package
    that defines it: its own helpers."""
    bad = []
    for path in SRC.rglob("*.py"):
        own = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshrl.")):
                continue
            source_pkg = node.module.rsplit(".", 1)[0] if node.module.count(".") > 1 else node.module
            private_module = any(part.startswith("_") for part in node.module.split(".")[1:])
            for alias in node.names:
                if (alias.name.startswith("_") or private_module) and not own.startswith(source_pkg):
                    bad.append(f"{path.relative_to(SRC)} imports {node.module}.{alias.name}")
    assert not bad, "\n".join(bad)


# slow: parses every module under src/meshrl (0.5 to 1.5 s each, one thread, busy 2-core box)
@pytest.mark.slow
def test_private_attributes_of_meshrl_objects_stay_inside():
    """No ``trainer._x`` style access: a private attribute is read only through ``self`` / ``cls``. The integrations
    are left out: there ``trainer`` is TRL's or verl's, whose private hooks are their extension points."""
    bad = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] == "integrations":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("trainer", "engine", "plugins", "sampler")):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


# slow: parses every module under src/meshrl (0.5 to 1.5 s each, one thread, busy 2-core box)
@pytest.mark.slow
def test_trainer_submodules_are_imported_only_inside_the_trainer():
    """Outside ``meshrl.trainer`` its public API is ``from meshrl.trainer import ...``."""
    bad = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] == "trainer":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path.relative_to(SRC)} imports {n}" for n in names if n.startswith("meshrl.trainer.")]
    assert not bad, "\n".join(bad)
