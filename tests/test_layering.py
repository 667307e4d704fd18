"""Imports point down the layers (docs/architecture.md): checked on the source, not by convention."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "meshrl"
LAYER = {
    "algos": 1, "stats": 1,
    "mesh": 2, "diagnostics": 2,
    "rewards": 3, "tasks": 3, "models": 3, "rollout": 3, "trainer": 3, "testbed": 3, "evaluation": 3, "analysis": 3,
    "doctor": 3,
    "cli": 4, "integrations": 4, "report": 4,
}
FACES = {"cli", "integrations", "report"}


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


def test_imports_point_down():
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        if len(rel) < 2:
            continue
        own = rel[0]
        for dep in _imports(path):
            if dep == own or dep not in LAYER:
                continue
            # The CLI is the outermost face: it may call the report and integration faces; nothing else may.
            if (dep in FACES and own != "cli") or LAYER[dep] > LAYER[own]:
                bad.append(f"{path.relative_to(SRC)} imports meshrl.{dep}")
    assert not bad, "\n".join(bad)
