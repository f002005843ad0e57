"""Streamed ``quantize_weights`` for models larger than memory: one initializer at a time, external data in and out.

`quantize_file` never holds the model's weights: it parses the graph without its external data, selects the layers
as the pass does (the same `qgraph.NodeSelector`, on a weightless `qgraph.GraphHandle`), then for each initializer
in file order either

- reads a selected layer's weight from its external-data file (one ``pread`` of its bytes), quantizes it with the
  configured data-free algorithm (rtn/hqq), appends the packed tensors to the output's data file and rewrites the
  node (`packing`: the same bytes as the in-memory pass), or
- copies any other external tensor's bytes to the output's data file in 64 MB chunks.

Peak memory is the graph plus the largest layer's float weight and its temporaries, whatever the model's size.
The output (``dst`` and ``dst.name + ".data"``) is written to temporary files beside ``dst`` and renamed into place
last. gptq/awq need every layer's input statistics from an onnxruntime session over the whole model: use the
pipeline for them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import onnx
from onnx import helper

from qgraph import GraphHandle, PassError, PassResult, __version__, selected_ids
from qgraph.graph import is_default_domain
from qgraph.io.outputs import temporary_file
from qgraph.quant.blockwise import BlockFormat

from .packing import MS_DOMAIN, Packed

_COPY_CHUNK = 64 << 20
_FLOATS: dict[int, np.dtype[Any]] = {onnx.TensorProto.FLOAT: np.dtype(np.float32),
                                     onnx.TensorProto.FLOAT16: np.dtype(np.float16)}


class _DataWriter:
    """Appends tensors' bytes to the output data file and points the tensors at them (64-byte aligned)."""

    def __init__(self, handle: IO[bytes], location: str) -> None:
        self.f, self.location, self.offset = handle, location, 0

    def _place(self, tensor: onnx.TensorProto, length: int) -> None:
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(self.offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
        pad = -(self.offset + length) % 64
        self.f.write(b"\0" * pad)
        self.offset += length + pad

    def put(self, tensor: onnx.TensorProto) -> None:
        """Move ``tensor``'s raw data to the file."""
        data = tensor.raw_data
        self.f.write(data)
        tensor.ClearField("raw_data")
        self._place(tensor, len(data))

    def copy(self, tensor: onnx.TensorProto, src: Path) -> None:
        """Copy an external tensor's bytes from ``src`` chunk by chunk."""
        offset, length = _extent(tensor, src)
        with src.open("rb") as f:
            f.seek(offset)
            left = length
            while left:
                chunk = f.read(min(_COPY_CHUNK, left))
                if not chunk:
                    raise PassError(f"{src}: truncated external data for {tensor.name!r}")
                self.f.write(chunk)
                left -= len(chunk)
        self._place(tensor, length)


def _info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _extent(tensor: onnx.TensorProto, src: Path) -> tuple[int, int]:
    info = _info(tensor)
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else src.stat().st_size - offset
    return offset, length


def _read(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    """A float initializer's values (from its external file when it has one)."""
    dtype = _FLOATS[int(tensor.data_type)].newbyteorder("<")
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return onnx.numpy_helper.to_array(tensor)
    src = folder / _info(tensor)["location"]
    offset, length = _extent(tensor, src)
    with src.open("rb") as f:
        f.seek(offset)
        buf = np.fromfile(f, dtype=dtype, count=length // dtype.itemsize)
    return buf.reshape(tuple(tensor.dims))


def _layers(model: onnx.ModelProto, quantizer: Any, res: PassResult) -> dict[int, onnx.NodeProto]:
    """Selected MatMul/Gemm proto nodes with a float 2-D initializer weight read by them alone, by position."""
    handle = GraphHandle(model)  # weightless: external tensors stay unread
    selected, unmatched = selected_ids(handle, quantizer.config.nodes)
    res.unmatched.extend(unmatched)
    inits = {t.name: t for t in model.graph.initializer}
    uses: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    out: dict[int, onnx.NodeProto] = {}
    for i, (proto, node) in enumerate(zip(model.graph.node, handle.graph.nodes, strict=True)):
        if proto.op_type not in ("MatMul", "Gemm") or not is_default_domain(proto.domain):
            continue
        if (selected is not None and id(node) not in selected) or len(proto.input) < 2:
            continue
        w = inits.get(proto.input[1])
        if w is None:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in proto.attribute}
        why = ("its weight is not a 2-D float32/float16 tensor" if w.data_type not in _FLOATS or len(w.dims) != 2
               else "its weight is shared with other nodes" if uses[w.name] != 1
               else "Gemm with transA=1" if attrs.get("transA", 0)
               else "Gemm with a bias C (streamed output takes MatMul/biasless Gemm; use the pipeline)"
               if proto.op_type == "Gemm" and len(proto.input) > 2 and proto.input[2] else None)
        if why:
            res.skip(str(node.name), why)
            continue
        out[i] = proto
    res.matched = len(out) + len(res.skipped)
    return out


def _rewrite(proto: onnx.NodeProto, packed: Packed) -> None:
    del proto.input[1:]
    proto.input.extend([t.name for t in packed.tensors.values()])
    alpha = next((helper.get_attribute_value(a) for a in proto.attribute if a.name == "alpha"), 1.0)
    if alpha != 1.0:
        raise PassError(f"{proto.name}: Gemm alpha {alpha} is folded by the in-memory pass only")
    del proto.attribute[:]
    proto.op_type, proto.domain = "MatMulNBits", MS_DOMAIN
    proto.attribute.extend(helper.make_attribute(k, v) for k, v in packed.attrs.items())


def quantize_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], quantizer: Any,
                  progress: Callable[[int, int], None] | None = None) -> PassResult:
    """Quantize ``src`` into ``dst`` (+ ``dst.data``) with ``quantizer`` (a configured `QuantizeWeights` whose
    algorithm is rtn or hqq and format matmul_nbits), streaming every weight (module docstring)."""
    cfg = quantizer.config
    if cfg.needs_data or cfg.format != "matmul_nbits":
        raise PassError("quantize_file streams rtn/hqq into MatMulNBits; run gptq/awq or `format: qdq` through the "
                        "pipeline (`qgraph run`)")
    src_p, dst_p = Path(src), Path(dst)
    model = onnx.load(str(src_p), load_external_data=False)
    res = PassResult()
    layers = _layers(model, quantizer, res)
    folder = src_p.parent
    data_name = dst_p.name + ".data"
    folder_out = dst_p.parent if str(dst_p.parent) else Path(".")
    with temporary_file(folder_out, "model") as tmp_model, temporary_file(folder_out, "data") as tmp_data:
        with tmp_data.open("wb") as f:
            _stream(model, layers, quantizer, folder, _DataWriter(f, data_name), res, progress)
        if layers:
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        _provenance(model, quantizer, res)
        tmp_model.write_bytes(model.SerializeToString())
        os.replace(tmp_data, folder_out / data_name)  # the data first: the model never points at a missing file
        os.replace(tmp_model, dst_p)
    return res


def _provenance(model: onnx.ModelProto, quantizer: Any, res: PassResult) -> None:
    """What the pipeline records, for the one streamed pass (`qgraph diff` reads the skip reasons from it)."""
    entry = {"pass": quantizer.name, "options": quantizer.config.recipe_options(), "streamed": True,
             "matched": res.matched, "rewritten": res.rewritten, "skipped": len(res.skipped),
             "skipped_nodes": [s.to_dict() for s in res.skipped], "decisions": res.decisions}
    for key, value in (("qgraph.version", __version__), ("qgraph.passes", json.dumps([entry], sort_keys=True))):
        model.metadata_props.add(key=key, value=value)


def _stream(model: onnx.ModelProto, layers: dict[int, onnx.NodeProto], quantizer: Any, folder: Path,
            out: _DataWriter, res: PassResult, progress: Callable[[int, int], None] | None) -> None:
    cfg = quantizer.config
    by_weight = {p.input[1]: p for p in layers.values()}
    quantized: list[int] = []
    added: list[onnx.TensorProto] = []
    before = after = 0
    total = len(model.graph.initializer)
    for i, tensor in enumerate(model.graph.initializer):
        node = by_weight.get(tensor.name)
        if node is None:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                out.copy(tensor, folder / _info(tensor)["location"])
        else:
            w = _read(tensor, folder)
            trans = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
            matrix = np.asarray(w.T if trans else w, np.float32)
            bq = quantizer.quantize_matrix(matrix, BlockFormat(cfg.bits, cfg.block_size, cfg.symmetric))
            packed = quantizer.pack(bq, tensor.name, w.dtype, trans)
            before, after = before + w.nbytes, after + packed.nbytes
            del w, matrix, bq
            for t in packed.tensors.values():
                out.put(t)
                added.append(t)
            _rewrite(node, packed)
            quantized.append(i)
            res.rewritten += 1
        if progress is not None:
            progress(i + 1, total)
    for i in reversed(quantized):  # the float weights go; every other tensor stays as it is
        del model.graph.initializer[i]
    model.graph.initializer.extend(added)
    if res.rewritten:
        res.decide(f"{res.rewritten} weight(s) quantized by {cfg.algorithm}, {cfg.bits}-bit, block {cfg.block_size}, "
                   f"streamed as com.microsoft.MatMulNBits: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB "
                   f"({after / max(before, 1):.3f}x)")
