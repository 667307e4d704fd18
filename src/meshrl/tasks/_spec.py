"""Parsing of task spec strings (``BASE?key=value&key=value``) and small shared helpers."""

from __future__ import annotations

import json
import random
from typing import Any, TypeVar
from urllib.parse import unquote

T = TypeVar("T")


def coerce_value(text: str) -> Any:
    """Coerce a query-string value: int, float, ``true``/``false``, a JSON list, else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def int_option(task: str, key: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` of option ``key`` as an integer (``3``, ``3.0``, ``"3"``), at least ``minimum``; anything else
    raises ``ValueError`` naming the task and the option."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif (isinstance(value, float) and value.is_integer()) or (
            isinstance(value, str) and value.strip().lstrip("-").isdigit()):
        number = int(value)
    if number is None or (minimum is not None and number < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"task {task!r}: option {key} must be an integer{bound}, got {value!r}")
    return number


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"BASE?k=v&k2=v2"`` into ``("BASE", {"k": v, "k2": v2})`` with coerced values.

    Values are percent-decoded (``%26`` for ``&``) but ``+`` is kept literally, so arithmetic
    operators survive.  A key without ``=``, or a key given twice (which value was meant is not ours to guess),
    raises ``ValueError``.
    """
    base, _, query = spec.partition("?")
    options: dict[str, Any] = {}
    for part in query.split("&") if query else []:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"task spec {spec!r}: option {part!r} is not of the form key=value")
        name = unquote(key)
        if name in options:
            raise ValueError(f"task spec {spec!r}: option {name} is given twice ({options[name]!r}, then "
                             f"{unquote(value)!r}); give it once")
        options[name] = coerce_value(unquote(value))
    return base, options


def held_out_split(items: list[T], eval_fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Deterministically split ``items`` into ``(train, eval)``.

    ``round(eval_fraction * len(items))`` items (at least one when the fraction is positive) are
    chosen by a seeded shuffle; both parts keep the original order.  The parts are disjoint.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n_eval = round(eval_fraction * len(items))
    if eval_fraction > 0 and items:
        n_eval = min(max(n_eval, 1), len(items) - 1) if len(items) > 1 else 0
    order = list(range(len(items)))
    random.Random(f"meshrl-split-{seed}").shuffle(order)
    eval_idx = set(order[:n_eval])
    train = [x for i, x in enumerate(items) if i not in eval_idx]
    held = [x for i, x in enumerate(items) if i in eval_idx]
    return train, held
