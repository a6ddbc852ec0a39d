"""Parse a binary .onnx without materialising its inline weights.

protobuf's parser copies every byte it is given, so a model stored inline (< 2 GB in one file)
costs its whole size in RAM, twice over while it is parsed. `parse` walks the protobuf wire
format over a read-only mapping of the file instead and hands protobuf the structure only: each
main-graph initializer whose `raw_data` is at least `MIN_BYTES` (and matches its shape) becomes
an external-data reference into the model file itself

    TensorProto{dims, data_type, name, raw_data=<n bytes at file offset o>}
  ->  TensorProto{dims, data_type, name, data_location=EXTERNAL,
                  external_data={location: <the file's name>, offset: o, length: n}}

so it is under the same lazy contract as external data: validated at load, read only when a pass
needs its values, copied to `weights.bin` from the file. The pages of the weights are never
touched by the walk. Every other field is copied as it is, in order.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import onnx

from mtkc.ir.model_checks import external_size

MIN_BYTES = 1024  # smaller tensors stay inline (torch.onnx.export's external-data threshold)

_GRAPH = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
_INITIALIZER = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number
_TENSOR = onnx.TensorProto.DESCRIPTOR.fields_by_name
_RAW_DATA = _TENSOR["raw_data"].number
_EXTERNAL_DATA = _TENSOR["external_data"].number
_DATA_LOCATION = _TENSOR["data_location"].number
_LEN = 2  # wire type of length-delimited fields


def parse(path: Path) -> onnx.ModelProto | None:
    """`path` parsed with its big inline initializers left in the file (see module doc); None when
    the file is not binary protobuf the walk understands (the caller parses it as usual)."""
    if onnx.serialization.registry.get_format_from_file_extension(path.suffix) not in (None, "protobuf"):
        return None
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            out = bytearray()
            for field, wire, begin, start, end in _spans(buf, 0, len(buf)):
                if field == _GRAPH and wire == _LEN:
                    out += _length_delimited(_GRAPH, _graph(buf, start, end, path.name))
                else:
                    out += buf[begin:end]
    except (OSError, ValueError, IndexError):  # IndexError: a varint runs past the end
        return None
    try:
        return onnx.ModelProto.FromString(bytes(out))
    except Exception:  # noqa: BLE001 -- DecodeError and friends: the caller's parse reports it
        return None


def _graph(buf, pos: int, end: int, location: str) -> bytearray:
    out = bytearray()
    for field, wire, begin, start, stop in _spans(buf, pos, end):
        if field == _INITIALIZER and wire == _LEN:
            out += _length_delimited(_INITIALIZER, _tensor(buf, start, stop, location))
        else:
            out += buf[begin:stop]
    return out


def _tensor(buf, pos: int, end: int, location: str) -> bytes:
    """The initializer's bytes, its raw_data turned into a reference when it is big and sound."""
    spans = list(_spans(buf, pos, end))
    raw = [s for s in spans if s[0] == _RAW_DATA and s[1] == _LEN]
    external = any(f == _EXTERNAL_DATA or (f == _DATA_LOCATION and w == 0 and _varint(buf, b)[0])
                   for f, w, _, b, _ in spans)
    if not raw or external:
        return buf[pos:end]
    _, _, _, offset, stop = raw[-1]  # the last occurrence wins
    if stop - offset < MIN_BYTES:
        return buf[pos:end]
    head = b"".join(buf[b:e] for f, _, b, _, e in spans if f not in (_RAW_DATA, _DATA_LOCATION))
    try:
        if external_size(onnx.TensorProto.FromString(head)) != stop - offset:
            return buf[pos:end]  # a wrong length stays inline: load refuses it with the inline reason
    except Exception:  # noqa: BLE001 -- an unknown data type, a broken header: left to protobuf
        return buf[pos:end]
    entries = [("location", location), ("offset", str(offset)), ("length", str(stop - offset))]
    refs = b"".join(_length_delimited(_EXTERNAL_DATA, _length_delimited(1, k.encode()) + _length_delimited(2, v.encode()))
                    for k, v in entries)
    return head + refs + _uvarint(_DATA_LOCATION << 3) + _uvarint(onnx.TensorProto.EXTERNAL)


def _spans(buf, pos: int, end: int):
    """(field number, wire type, field start, payload start, end) of each field in buf[pos:end]."""
    while pos < end:
        begin = pos
        key, pos = _varint(buf, pos)
        wire = key & 7
        start = pos
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == _LEN:
            n, start = _varint(buf, pos)
            pos = start + n
        else:
            raise ValueError(f"wire type {wire}")
        if pos > end:
            raise ValueError("truncated field")
        yield key >> 3, wire, begin, start, pos


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if shift > 63:
            raise ValueError("varint too long")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(field: int, payload) -> bytes:
    return _uvarint(field << 3 | _LEN) + _uvarint(len(payload)) + bytes(payload)
