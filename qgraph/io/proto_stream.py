"""Protobuf I/O without whole-model copies: Python protobuf (upb) copies a bytes field on every read and serializes a
message to size it (``ByteSize()``), so a 1 GB model serialized or sized at once costs 1-2 GB more. These functions
write, size and read models field by field, each large tensor's data touched once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import onnx
from google.protobuf.message import DecodeError

from qgraph.errors import ModelError, WriteError
from qgraph.io.inputs import input_file_problem


def read_header(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The model at ``path`` without its graph (IR version, opsets, producer, metadata...), read by skipping the
    graph's bytes on disk: constant memory whatever the model's size. Raises `ModelError` on a malformed file."""
    p = Path(path)
    problem = input_file_problem(p)
    if problem is not None:
        raise ModelError(f"model {p}: {problem}.")
    header = bytearray()
    try:
        with p.open("rb") as f:
            while True:
                start = f.tell()
                tag = _read_varint(f)
                if tag is None:
                    break
                wire = tag & 7
                if wire == 0:
                    _read_varint(f)
                elif wire == 1:
                    f.seek(8, os.SEEK_CUR)
                elif wire == 5:
                    f.seek(4, os.SEEK_CUR)
                elif wire == 2:
                    length = _read_varint(f)
                    if length is None:
                        raise ValueError("truncated field")
                    if tag >> 3 == _GRAPH_FIELD:
                        f.seek(length, os.SEEK_CUR)
                        continue
                    f.seek(length, os.SEEK_CUR)
                else:
                    raise ValueError(f"wire type {wire}")
                end = f.tell()
                f.seek(start)
                header += f.read(end - start)
        out = onnx.ModelProto()
        out.ParseFromString(bytes(header))
        return out
    except (OSError, ValueError, DecodeError) as exc:
        raise ModelError(f"{p} is not a readable ONNX model ({exc}). Re-export it or check the download.") from exc


def _read_varint(f: IO[bytes]) -> int | None:
    shift = value = 0
    while True:
        b = f.read(1)
        if not b:
            if shift:
                raise ValueError("truncated varint")
            return None
        value |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return value
        shift += 7


#: Field numbers of ``ModelProto.graph`` and ``GraphProto.initializer``.
_GRAPH_FIELD, _INITIALIZER_FIELD = 7, 5


def write_streamed(model: onnx.ModelProto, f: IO[bytes]) -> None:
    """Write ``model.SerializeToString(deterministic=True)`` to ``f`` byte for byte, one initializer at a time.

    Serializing a whole model needs two more copies of it in flight (protobuf's buffer and the Python bytes);
    this writes the fields in field-number order (as deterministic serialization does) with the graph's
    initializers serialized one by one, their lengths known up front from ``ByteSize()``."""
    graph = model.graph
    g_head, g_tail = _split_fields(graph, _INITIALIZER_FIELD, onnx.GraphProto)
    m_head, m_tail = _split_fields(model, _GRAPH_FIELD, onnx.ModelProto)
    inits = [(t, tensor_size(t)) for t in graph.initializer]
    init_tag = _varint((_INITIALIZER_FIELD << 3) | 2)
    g_len = len(g_head) + len(g_tail) + sum(len(init_tag) + len(_varint(n)) + n for _, n in inits)
    f.write(m_head)
    if model.HasField("graph"):
        f.write(_varint((_GRAPH_FIELD << 3) | 2) + _varint(g_len) + g_head)
        for t, n in inits:
            f.write(init_tag + _varint(n))
            _write_tensor(t, f)
        f.write(g_tail)
    f.write(m_tail)


#: Field number of ``TensorProto.raw_data``.
_RAW_DATA_FIELD = 9


def _write_tensor(t: onnx.TensorProto, f: IO[bytes]) -> None:
    """``t.SerializeToString(deterministic=True)`` written to ``f``; a large ``raw_data`` is written from the one
    copy protobuf hands out (serializing the tensor whole would hold two more)."""
    expected = _raw_bytes(t)
    if expected is None:
        f.write(t.SerializeToString(deterministic=True))
        return
    head, tail = _split_fields(t, _RAW_DATA_FIELD, onnx.TensorProto)
    raw = t.raw_data
    if len(raw) != expected:
        raise WriteError(f"tensor {t.name!r}: raw_data holds {len(raw)} bytes but its dims and type need {expected}; "
                         "the model is malformed. Nothing was written.")
    f.write(head + _varint((_RAW_DATA_FIELD << 3) | 2) + _varint(len(raw)))
    f.write(raw)
    del raw
    f.write(tail)


def _raw_bytes(t: onnx.TensorProto) -> int | None:
    """``len(t.raw_data)`` from dims and type, for a large plain-typed tensor in raw form (else None): reading
    ``raw_data``, or calling ``ByteSize()`` (protobuf serializes the message to size it), copies it."""
    if not t.HasField("raw_data") or t.data_type not in _ITEMSIZE:
        return None
    n = _ITEMSIZE[t.data_type]
    for d in t.dims:
        n *= int(d)
    return n if n >= (1 << 20) else None


def tensor_size(t: onnx.TensorProto) -> int:
    """``t.ByteSize()`` without serializing a large raw tensor (computed from its other fields and its dims)."""
    raw = _raw_bytes(t)
    if raw is None:
        return int(t.ByteSize())
    head, tail = _split_fields(t, _RAW_DATA_FIELD, onnx.TensorProto)
    return len(head) + len(tail) + len(_varint((_RAW_DATA_FIELD << 3) | 2)) + len(_varint(raw)) + raw


def serialized_size(model: onnx.ModelProto) -> int:
    """``model.ByteSize()`` computed without serializing the weights (for models of any size)."""
    g_head, g_tail = _split_fields(model.graph, _INITIALIZER_FIELD, onnx.GraphProto)
    m_head, m_tail = _split_fields(model, _GRAPH_FIELD, onnx.ModelProto)
    tag = len(_varint((_INITIALIZER_FIELD << 3) | 2))
    sizes = [tensor_size(t) for t in model.graph.initializer]
    g_len = len(g_head) + len(g_tail) + sum(tag + len(_varint(n)) + n for n in sizes)
    graph = len(_varint((_GRAPH_FIELD << 3) | 2)) + len(_varint(g_len)) + g_len if model.HasField("graph") else 0
    return len(m_head) + graph + len(m_tail)


#: Bytes per element of the element types whose raw_data length follows from the dims.
_ITEMSIZE: dict[int, int] = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.DOUBLE: 8, onnx.TensorProto.FLOAT16: 2,
             onnx.TensorProto.BFLOAT16: 2, onnx.TensorProto.INT8: 1, onnx.TensorProto.UINT8: 1,
             onnx.TensorProto.INT16: 2, onnx.TensorProto.UINT16: 2, onnx.TensorProto.INT32: 4,
             onnx.TensorProto.UINT32: 4, onnx.TensorProto.INT64: 8, onnx.TensorProto.UINT64: 8,
             onnx.TensorProto.BOOL: 1}


def _split_fields(msg: Any, number: int, kind: Any) -> tuple[bytes, bytes]:
    """Serialized fields of ``msg`` numbered below and above ``number`` (the field itself left out)."""
    head, tail = kind(), kind()
    for fd in msg.DESCRIPTOR.fields:  # not ListFields(): it would read (copy) the skipped field too
        if fd.number == number:
            continue
        dst = head if fd.number < number else tail
        if fd.is_repeated:
            if len(getattr(msg, fd.name)):
                getattr(dst, fd.name).extend(getattr(msg, fd.name))
        elif msg.HasField(fd.name):
            if fd.message_type is not None:
                getattr(dst, fd.name).CopyFrom(getattr(msg, fd.name))
            else:
                setattr(dst, fd.name, getattr(msg, fd.name))
    return head.SerializeToString(deterministic=True), tail.SerializeToString(deterministic=True)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


