"""The wire format between the sandboxed program and the trusted test harness: plain literals only.

Both child programs of :func:`meshrl.rewards.sandbox.run_code` embed this module's source (they run
under ``python -I`` and cannot import meshrl). A message is a 4-byte big-endian length and a JSON
document. Values travel as JSON with a one-key object tagging each container JSON lacks:
``{"t": [...]}`` tuple, ``{"s": [...]}`` set, ``{"f": [...]}`` frozenset, ``{"d": [[k, v], ...]}`` dict,
``{"b": "hex"}`` bytes, ``{"c": [re, im]}`` complex; lists are JSON arrays, and ``None``, bools, ints,
floats (NaN and infinities included) and strings are JSON's own.

Why not pickle: unpickling runs constructors the sender chooses, so a program could hand the harness an
object whose ``__eq__`` always says yes (or whose ``__reduce__`` runs code in the trusted process).
:func:`decode_value` builds only built-in objects, whatever bytes arrive.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

MAX_MESSAGE_BYTES = 64 << 20
_TAGS = {"t": tuple, "s": set, "f": frozenset}


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed message of plain literals."""


def lift_int_digit_limit() -> None:
    """Let ints of any size cross as JSON and be compared in the tests: CPython's default 4300-digit limit on
    int/str conversion would make a correct answer of 10**5000 fail. Called by the two child programs only
    (the limit is process-wide); a huge int costs time, which the run's time limit bounds."""
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)


def encode_value(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-ready data (see the module docstring); ``TypeError`` for anything else.

    Exact types only, so a subclass cannot smuggle methods through; numpy scalars become their Python
    value (a solution may legitimately return ``numpy.int64``)."""
    if depth > 200:
        raise TypeError("value nested more than 200 levels deep")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode_value(v, depth + 1) for v in value]
    if kind in (tuple, set, frozenset):
        tag = {tuple: "t", set: "s", frozenset: "f"}[kind]
        return {tag: [encode_value(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    if kind.__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return encode_value(value.item(), depth + 1)
    raise TypeError(f"a value of type {kind.__name__} cannot cross the sandbox boundary (plain literals only)")


def decode_value(data: Any) -> Any:
    """Rebuild a value from :func:`encode_value`'s output, creating only built-in objects."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode_value(v) for v in data]
    if kind is not dict or len(data) != 1:
        raise ProtocolError(f"not an encoded value: {type(data).__name__}")
    ((tag, body),) = data.items()
    try:
        if tag in _TAGS and type(body) is list:
            return _TAGS[tag](decode_value(v) for v in body)
        if tag == "d" and type(body) is list:
            return {decode_value(k): decode_value(v) for k, v in (_pair(item) for item in body)}
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(body[0], body[1])
    except (TypeError, ValueError) as exc:  # an unhashable key or bad hex
        raise ProtocolError(f"bad {tag!r} value: {exc}") from None
    raise ProtocolError(f"unknown value tag {tag!r}")


def _pair(item: Any) -> tuple[Any, Any]:
    if type(item) is not list or len(item) != 2:
        raise ProtocolError("a dict item is not a [key, value] pair")
    return item[0], item[1]


def send_message(fd: int, message: dict) -> None:
    """Write one framed JSON message to ``fd`` (all of it, retrying short writes)."""
    body = json.dumps(message, separators=(",", ":")).encode("utf-8", "surrogatepass")
    data = len(body).to_bytes(4, "big") + body
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_message(fd: int) -> dict | None:
    """The next framed message from ``fd``; ``None`` at end of file (the other side is gone).

    ``ProtocolError`` for an oversized frame, bytes that are not UTF-8 JSON, or JSON that is not an object."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    body = _read_exact(fd, size)
    if body is None:
        return None
    try:
        message = json.loads(body.decode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"malformed message: {type(exc).__name__}") from None
    if type(message) is not dict:
        raise ProtocolError("a message must be a JSON object")
    return message
