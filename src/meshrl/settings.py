"""Declared settings: each config field's default, help text and bounds, written once.

A config section is a dataclass whose fields come from :func:`setting` (a value) or :func:`section` (a nested
section). The range checks (:func:`check_settings`), ``docs/config.md`` and ``meshrl train --help-config`` are all
generated from these declarations (:func:`iter_settings`), so the three cannot disagree. Checks that relate two
fields (``cov_lb < cov_ub``) stay as code in the section's owner.

A leaf utility like :mod:`meshrl.progress`: usable from any layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, get_type_hints

__all__ = ["SettingDoc", "bounds_text", "check_settings", "iter_settings", "parse_settings", "section", "setting"]


def setting(default: Any = MISSING, *, help: str, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, choices: tuple[Any, ...] | None = None,
            factory: Any = MISSING, allow_inf: bool = False) -> Any:
    """A config field with its help text and bounds: ``ge``/``gt``/``le``/``lt`` for numbers, ``choices`` for a
    value out of a fixed set (for a list field, every element). ``factory`` for mutable defaults.

    A number must be finite unless ``allow_inf`` (NaN never is: every comparison with it is false, so a bound
    on it would silently pass or silently disable a check); the YAML loader refuses both already, this also holds
    for a config built in Python."""
    if not help:
        raise ValueError("a setting needs its help text")
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "allow_inf": allow_inf,
            "choices": tuple(choices) if choices is not None else None}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """A nested config section (a dataclass built from :func:`setting` fields)."""
    return field(default_factory=cls, metadata={"help": help, "section": True})


def bounds_text(f: dataclasses.Field) -> str:
    """What a field allows, as the errors and the docs say it: ``>= 0``, ``in (0, 1]``, ``one of a, b``."""
    m = f.metadata
    if m.get("choices") is not None:
        return "one of " + ", ".join(str(c) for c in m["choices"])
    lo = ("[", m["ge"]) if m.get("ge") is not None else ("(", m["gt"]) if m.get("gt") is not None else None
    hi = ("]", m["le"]) if m.get("le") is not None else (")", m["lt"]) if m.get("lt") is not None else None
    if lo and hi:
        return f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return ""


def _num(x: float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 1e15 else str(x)


def _within(value: Any, m: dict[str, Any]) -> bool:
    if value is None:
        return True  # null: unset (the fields that allow it say what it means); the type check is the loader's
    if m.get("choices") is not None:
        items = value if isinstance(value, list) else [value]
        return all(v in m["choices"] for v in items)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True  # bounds are for numbers; the type check is the loader's
    if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not m.get("allow_inf", False))):
        return False
    return ((m.get("ge") is None or value >= m["ge"]) and (m.get("gt") is None or value > m["gt"])
            and (m.get("le") is None or value <= m["le"]) and (m.get("lt") is None or value < m["lt"]))


def _allowed(f: dataclasses.Field, value: Any) -> str:
    """What ``f`` allows, said of a refused ``value``: a non-finite number is told it must be finite."""
    bounds = bounds_text(f)
    if isinstance(value, float) and not math.isfinite(value) and f.metadata.get("choices") is None:
        return f"a finite number {bounds}".rstrip()
    return bounds


def check_settings(obj: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``(dotted key, value, what is allowed)`` of every field of ``obj`` (recursively) outside its bounds."""
    bad: list[tuple[str, Any, str]] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value) and not isinstance(value, type):
            bad.extend(check_settings(value, f"{key}."))
        elif f.metadata and not _within(value, f.metadata):
            bad.append((key, value, _allowed(f, value)))
    return bad


_KINDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "text"}


def _typed(value: Any, hint: Any, allow_inf: bool) -> Any:
    """``value`` as ``hint`` (bool, int, float or str), or ``MISSING`` when it is not one: an integer-valued float
    is an integer (``3.0``), an integer is a number; a bool is neither (YAML's and a spec's ``true``)."""
    if hint is bool:
        return value if isinstance(value, bool) else MISSING
    if hint is str:
        return value if isinstance(value, str) else MISSING
    if isinstance(value, bool) or not isinstance(value, int | float):
        return MISSING
    if isinstance(value, float) and not (math.isfinite(value) or (allow_inf and math.isinf(value))):
        return MISSING
    if hint is int:
        return int(value) if float(value).is_integer() else MISSING
    return float(value) if hint is float else MISSING


def parse_settings(cls: type, values: dict[str, Any], where: str) -> Any:
    """An instance of settings class ``cls`` (flat: bool, int, float and str fields) from ``values``, each typed
    and bounded as declared; an unknown key, a wrong type or a value out of bounds is one ``ValueError``
    ``"{where}: option KEY must be ..., got VALUE"`` (e.g. the options of a task spec)."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; known: {', '.join(known)}")
    hints = get_type_hints(cls)
    typed: dict[str, Any] = {}
    for key, value in values.items():
        f = known[key]
        typed[key] = _typed(value, hints[key], bool(f.metadata.get("allow_inf")))
        if typed[key] is MISSING:
            raise ValueError(f"{where}: option {key} must be {_KINDS.get(hints[key], hints[key])}"
                             f"{' ' + bounds_text(f) if bounds_text(f) else ''}, got {value!r}")
    obj = cls(**typed)
    bad = check_settings(obj)
    if bad:
        key, value, allowed = bad[0]
        raise ValueError(f"{where}: option {key} must be {allowed}, got {value!r}")
    return obj


@dataclass(frozen=True)
class SettingDoc:
    """One documented config key."""

    key: str
    type: str
    default: Any
    bounds: str
    help: str
    is_section: bool = False


def _type_name(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if not getattr(hint, "__args__", None) else None
    return text or str(hint).replace("typing.", "")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        value = f.default_factory()
        return None if is_dataclass(value) else value
    return None


def iter_settings(cls: type, prefix: str = "") -> Iterator[SettingDoc]:
    """Every key of config class ``cls`` (sections first, then their keys), in declaration order."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        help_text = f.metadata.get("help", "") if f.metadata else ""
        default = f.default_factory() if f.default_factory is not MISSING else None
        if is_dataclass(default):
            yield SettingDoc(key, "section", None, "", help_text, is_section=True)
            yield from iter_settings(type(default), f"{key}.")
        else:
            yield SettingDoc(key, _type_name(hints[f.name]), _default(f),
                             bounds_text(f) if f.metadata else "", help_text)
