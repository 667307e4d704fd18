"""Scalars from TensorBoard event files without TensorFlow or the ``tensorboard`` package.

An event file is a TFRecord stream: each record is ``uint64 length | uint32 masked CRC32C(length) | data |
uint32 masked CRC32C(data)`` (little-endian), and each ``data`` is a serialized ``tensorflow.Event``
protobuf. Only the fields scalars need are decoded, by hand:

- ``Event``: ``wall_time`` (1, double), ``step`` (2, int64), ``summary`` (5, message);
- ``Summary``: repeated ``value`` (1, message);
- ``Summary.Value``: ``tag`` (1, string), ``simple_value`` (2, float; what ``add_scalar`` of PyTorch's and
  TensorFlow 1's writers store), ``tensor`` (8, ``TensorProto``; TensorFlow 2 / tensorboard's own writer);
- ``TensorProto``: ``dtype`` (1; 1 = float32, 2 = float64), ``tensor_content`` (4, raw bytes),
  ``float_val`` (5), ``double_val`` (6) for a scalar tensor.

The length header's CRC is checked (a record with a bad header ends the file: the rest cannot be framed);
a record cut short by a killed writer ends the file too. Both are reported, never raised.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_CRC_TABLE: list[int] = []


def _crc_table() -> list[int]:
    if not _CRC_TABLE:
        for i in range(256):  # CRC-32C (Castagnoli), reflected polynomial 0x82F63B78
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC_TABLE.append(c)
    return _CRC_TABLE


def crc32c(data: bytes) -> int:
    table, c = _crc_table(), 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masking: rotate right by 15 bits and add 0xa282ead8 (mod 2^32)."""
    c = crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    out, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7


def proto_fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of a protobuf message: varints as int, fixed64/fixed32 as their
    raw 8 / 4 bytes, length-delimited fields as bytes. ``ValueError`` on malformed input."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise ValueError("truncated protobuf field")
        yield number, wire, value


def _tensor_scalar(buf: bytes) -> float | None:
    dtype, content, floats, doubles = 0, b"", b"", b""
    for number, wire, value in proto_fields(buf):
        if number == 1 and wire == 0:
            dtype = int(value)  # type: ignore[arg-type]
        elif number == 4 and wire == 2:
            content = value  # type: ignore[assignment]
        elif number == 5:  # packed (wire 2) or one unpacked float (wire 5)
            floats += value  # type: ignore[operator]
        elif number == 6:
            doubles += value  # type: ignore[operator]
    if dtype == 1 and (content or floats):
        return struct.unpack("<f", (content or floats)[:4])[0]
    if dtype == 2 and (content or doubles):
        return struct.unpack("<d", (content or doubles)[:8])[0]
    return None


def _summary_scalars(buf: bytes) -> Iterator[tuple[str, float]]:
    for number, wire, value in proto_fields(buf):
        if number != 1 or wire != 2:
            continue
        tag, scalar = None, None
        for n2, w2, v2 in proto_fields(value):  # type: ignore[arg-type]
            if n2 == 1 and w2 == 2:
                tag = v2.decode("utf-8", "replace")  # type: ignore[union-attr]
            elif n2 == 2 and w2 == 5:
                scalar = struct.unpack("<f", v2)[0]  # type: ignore[arg-type]
            elif n2 == 8 and w2 == 2:
                scalar = _tensor_scalar(v2)  # type: ignore[arg-type]
        if tag is not None and scalar is not None:
            yield tag, scalar


@dataclass
class ScalarEvent:
    step: int
    tag: str
    value: float
    wall_time: float


def read_records(path: Path, problems: list[str]) -> Iterator[bytes]:
    """The data of each TFRecord in ``path``; a bad header CRC or a cut record ends it (noted in ``problems``)."""
    raw = path.read_bytes()
    pos = 0
    while pos < len(raw):
        if pos + 12 > len(raw):
            problems.append(f"{path.name}: file ends inside a record header (a writer was stopped)")
            return
        header = raw[pos:pos + 8]
        (length,), (crc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[pos + 8:pos + 12])
        if crc != masked_crc32c(header):
            problems.append(f"{path.name}: bad record header CRC at byte {pos}; the rest of the file is skipped")
            return
        start, end = pos + 12, pos + 12 + length
        if end + 4 > len(raw):
            problems.append(f"{path.name}: last record cut short (a writer was stopped)")
            return
        yield raw[start:end]
        pos = end + 4


def read_scalars(path: Path, problems: list[str]) -> list[ScalarEvent]:
    """Every scalar of one event file, in file order; undecodable events are counted in ``problems``."""
    out: list[ScalarEvent] = []
    bad = 0
    for data in read_records(path, problems):
        try:
            step, wall, summary = 0, 0.0, None
            for number, wire, value in proto_fields(data):
                if number == 1 and wire == 1:
                    wall = struct.unpack("<d", value)[0]  # type: ignore[arg-type]
                elif number == 2 and wire == 0:
                    step = int(value)  # type: ignore[arg-type]
                elif number == 5 and wire == 2:
                    summary = value
            if summary is not None:
                out.extend(ScalarEvent(step, tag, v, wall) for tag, v in _summary_scalars(summary))  # type: ignore[arg-type]
        except (ValueError, struct.error):
            bad += 1
    if bad:
        problems.append(f"{path.name}: {bad} undecodable event(s) skipped")
    return out


def event_files(root: Path) -> list[Path]:
    """TensorBoard event files under ``root`` (any depth), sorted by path."""
    return sorted(p for p in root.rglob("events.out.tfevents.*") if p.is_file())
