"""The plug-in seams: every hook of ``Plugin`` is declared in exactly one hook set, and nothing outside
``meshrl/trainer/plugins/`` imports a plug-in or reads a plug-in's config section by name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from meshrl.trainer.plugins import CONFIG_HOOKS, REGISTRY, SAMPLING_HOOKS, STATE_HOOKS, UPDATE_HOOKS, Plugin

SRC = Path(__file__).resolve().parents[2] / "src" / "meshrl"
PLUGINS = SRC / "trainer" / "plugins"


def test_every_hook_is_in_exactly_one_set():
    public = {n for n, v in inspect.getmembers(Plugin) if not n.startswith("_") and callable(v)
              and not isinstance(inspect.getattr_static(Plugin, n), type)}
    sets = [CONFIG_HOOKS, SAMPLING_HOOKS, UPDATE_HOOKS, STATE_HOOKS]
    declared = [h for s in sets for h in s]
    assert len(declared) == len(set(declared)), "a hook is in two sets"
    assert set(declared) == public, (public - set(declared), set(declared) - public)


def _outside_plugins():
    for path in SRC.rglob("*.py"):
        if PLUGINS not in path.parents:
            yield path, ast.parse(path.read_text())


# slow: parses every module under src/meshrl (0.5 to 1.5 s each, one thread, busy 2-core box)
@pytest.mark.slow
def test_no_module_outside_the_plugins_package_imports_a_plugin():
    plugin_modules = {f"meshrl.trainer.plugins.{p.stem}" for p in PLUGINS.glob("*.py") if p.stem != "__init__"}
    for path, tree in _outside_plugins():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                assert not names & plugin_modules, f"{path}: imports {names & plugin_modules}"


# slow: parses every module under src/meshrl (0.5 to 1.5 s each, one thread, busy 2-core box)
@pytest.mark.slow
def test_no_module_outside_the_plugins_package_reads_a_plugins_section_by_name():
    for path, tree in _outside_plugins():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in REGISTRY and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "plugins"):
                raise AssertionError(f"{path}:{node.lineno}: reads plugins.{node.attr}")
