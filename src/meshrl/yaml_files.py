"""YAML files that hold a mapping (a config file, a preset): read with an error that names the file and line, a
repeated key refused (PyYAML keeps the last one silently), and merged key by key.

A leaf utility like :mod:`meshrl.settings`: usable from any layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["deep_merge", "read_yaml_mapping"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (PyYAML keeps the last one silently)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} repeats (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """Parse a YAML file holding a mapping; every failure is a ``ValueError`` naming the file (and line)."""
    if not path.is_file():
        raise ValueError(f"{what} not found: {path}" + (" (it is a directory)" if path.is_dir() else ""))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{what} {path}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x})") from None
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{what} {path}{where}: YAML syntax error: {problem}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{what} {path} must hold a mapping at the top level, got {type(loaded).__name__}")
    return loaded


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``b`` over ``a``: nested mappings merged key by key, any other value of ``b`` replacing ``a``'s."""
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
