"""Block-level blame for block-quantized weights (MatMulNBits, blocked DequantizeLinear) in `qgraph diff`.

For every layer of B whose weight is block-quantized and whose float weight A still holds (the layer keeps its
node name; the codes are named ``<float weight>/packed`` or ``<float weight>/quantized``), the codes are
dequantized with `qgraph.quant.blockwise` and compared with A's weight block by block: the layer's weight SQNR, and its
worst block (output column, input channels) with that block's SQNR and share of the layer's squared error. The unit
of blame is the block: one scale and zero point that a different clip or algorithm would choose differently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qgraph.quant.blockwise import BlockFormat, BlockQuant, to_blocks, unpack_codes, unpack_int4, unpack_zero_points
from qgraph.quant.math import QuantDtype, dtype_range
from qgraph.quant.qdq import is_dequantize


@dataclass
class BlockBlame:
    """One block-quantized layer against its float weight."""

    node: str
    bits: int
    block_size: int
    weight_sqnr_db: float
    worst_column: int
    worst_channels: tuple[int, int]
    worst_block_sqnr_db: float
    worst_block_share: float  # of the layer's squared weight error

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def _db(signal: float, noise: float) -> float:
    return float("inf") if noise <= 0 else 10 * float(np.log10(max(signal, 1e-30) / noise))


def _nbits(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> tuple[BlockQuant, str] | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.input[1] not in inits or node.input[2] not in inits or not node.input[1].endswith("/packed"):
        return None
    fmt = BlockFormat(int(attrs["bits"]), int(attrs["block_size"]), len(node.input) < 4 or not node.input[3])
    k, n = int(attrs["K"]), int(attrs["N"])
    codes = unpack_codes(numpy_helper.to_array(inits[node.input[1]]), fmt.bits)
    scale = numpy_helper.to_array(inits[node.input[2]]).astype(np.float32).reshape(n, -1)
    if fmt.symmetric:
        zero = np.full(scale.shape, fmt.mid, np.float32)
    else:
        z = numpy_helper.to_array(inits[node.input[3]])
        zero = (z.astype(np.float32).reshape(n, -1) if z.dtype.kind == "f"
                else unpack_zero_points(z.reshape(n, -1), fmt.bits, scale.shape[1]))
    return BlockQuant(fmt, k, codes, scale, zero), node.input[1][: -len("/packed")]


def _blocked_dq(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> tuple[BlockQuant, str] | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    name = node.input[0]
    if "block_size" not in attrs or name not in inits or not name.endswith("/quantized"):
        return None
    axis = int(attrs.get("axis", 0))  # 1: a Gemm transB weight stored [N, K]
    t = inits[name]
    signed = t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.INT8)
    bits = 4 if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) else 8
    rows, cols = int(t.dims[0]), int(t.dims[1])
    q = (unpack_int4(t.raw_data, rows * cols, signed).reshape(rows, cols) if bits == 4
         else numpy_helper.to_array(t).astype(np.int16))
    q = q.T if axis == 1 else q
    k = q.shape[0]
    zp = (numpy_helper.to_array(inits[node.input[2]]).astype(np.float32) if len(node.input) > 2 and node.input[2]
          and node.input[2] in inits and bits == 8 else None)
    if len(node.input) > 2 and node.input[2] and bits == 4:
        z = inits[node.input[2]]
        zp = unpack_int4(z.raw_data, int(np.prod(z.dims)), signed).reshape(tuple(z.dims)).astype(np.float32)
    shift = -dtype_range(QuantDtype(f"int{bits}"))[0] if signed else 0  # signed -> unsigned storage
    fmt = BlockFormat(bits, int(attrs["block_size"]), zp is None)
    scale = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
    scale, zp = (scale, zp) if axis == 1 else (scale.T, zp.T if zp is not None else None)  # [N, nb]
    zero = (zp + shift) if zp is not None else np.full(scale.shape, fmt.mid, np.float32)
    codes = to_blocks((q + shift).astype(np.float32), fmt.block_size).astype(np.uint8)
    return BlockQuant(fmt, k, codes, scale, zero.astype(np.float32)), name[: -len("/quantized")]


def block_blame(a: onnx.ModelProto, b: onnx.ModelProto) -> list[BlockBlame]:
    """Every block-quantized layer of ``b`` whose float weight ``a`` holds, worst weight SQNR first."""
    float_weights = {t.name: t for t in a.graph.initializer}
    alphas = {n.input[1]: float(next((x.f for x in n.attribute if x.name == "alpha"), 1.0))
              for n in a.graph.node if n.op_type == "Gemm" and len(n.input) > 1}  # folded into the codes
    inits = {t.name: t for t in b.graph.initializer}
    reader = {i: n for n in b.graph.node for i in n.input if i}  # a DequantizeLinear is blamed as the layer it feeds
    out: list[BlockBlame] = []
    for node in b.graph.node:
        found = (_nbits(node, inits) if node.op_type == "MatMulNBits"
                 else _blocked_dq(node, inits) if is_dequantize(node.op_type, node.domain) else None)
        if found is None or found[1] not in float_weights:
            continue
        bq, weight = found
        w = numpy_helper.to_array(float_weights[weight]).astype(np.float32) * np.float32(alphas.get(weight, 1.0))
        if w.ndim != 2 or w.shape[0] != bq.k:
            w = w.T  # a Gemm transB weight
        if w.shape != (bq.k, bq.codes.shape[0]):
            continue
        blocks = to_blocks(w, bq.fmt.block_size)
        err = ((bq.codes.astype(np.float32) - bq.zero_point[..., None]) * bq.scale[..., None] - blocks) ** 2
        per_block, energy = err.sum(axis=-1), (blocks**2).sum(axis=-1)
        col, blk = np.unravel_index(int(np.argmax(per_block)), per_block.shape)
        total = float(per_block.sum())
        lo = int(blk) * bq.fmt.block_size
        layer = reader.get(node.output[0], node) if is_dequantize(node.op_type, node.domain) else node
        out.append(BlockBlame(layer.name or layer.output[0], bq.fmt.bits, bq.fmt.block_size,
                              _db(float(energy.sum()), total), int(col), (lo, min(lo + bq.fmt.block_size, bq.k)),
                              _db(float(energy[col, blk]), float(per_block[col, blk])),
                              float(per_block[col, blk]) / total if total > 0 else 0.0))
    return sorted(out, key=lambda r: r.weight_sqnr_db)
