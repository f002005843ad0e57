"""The tensors and attributes of each output format for one quantized weight (`qgraph.quant.blockwise` layouts).

- ``matmul_nbits``: ``com.microsoft.MatMulNBits(A, B, scales, zero_points?, g_idx?, bias?)`` with ``K``, ``N``,
  ``bits``, ``block_size``, ``accuracy_level``: ``B [N, nb, B·bits/8]`` uint8, ``scales [N·nb]`` in the weight's
  float type, ``zero_points`` packed uint8 (asymmetric) or float (HQQ's fractional ones), absent when symmetric.
- ``qdq``: ``DequantizeLinear(codes, scale, zero_point?, axis, block_size)`` (opset 21) whose output replaces the
  float weight: codes in the weight's own layout (``[K, N]``; a Gemm with ``transB`` keeps ``[N, K]``, blocked
  along axis 1), ``int4``/``int8`` (signed) or ``uint4``/``uint8``.

Both are built as protobuf tensors so the in-memory rewrite (`emission`) and the streamed one (`streaming`) write
the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qgraph.quant.blockwise import BlockQuant, pack_codes, pack_int4, pack_zero_points, qdq_layout

MS_DOMAIN = "com.microsoft"


@dataclass
class Packed:
    """One weight's replacement: ``tensors`` by role (``B``/``scales``/``zero_points`` or
    ``codes``/``scale``/``zero_point``), named by the caller, and the node's attributes."""

    op: str
    tensors: dict[str, onnx.TensorProto]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor's data."""
        return sum(len(t.raw_data) for t in self.tensors.values())


def _dense(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(value), name)


def _int(name: str, value: np.ndarray, bits: int, signed: bool) -> onnx.TensorProto:
    if bits == 4:
        kind = onnx.TensorProto.INT4 if signed else onnx.TensorProto.UINT4
        return helper.make_tensor(name, kind, list(value.shape), pack_int4(value), raw=True)
    return _dense(name, value.astype(np.int8 if signed else np.uint8))


def matmul_nbits(bq: BlockQuant, base: str, dtype: np.dtype[Any], accuracy_level: int) -> Packed:
    """MatMulNBits operands of ``bq`` named ``<base>/packed``, ``<base>/scale``, ``<base>/zero_point``."""
    fmt = bq.fmt
    n = bq.codes.shape[0]
    tensors = {
        "B": _dense(f"{base}/packed", pack_codes(bq.codes, fmt.bits)),
        "scales": _dense(f"{base}/scale", bq.scale.reshape(-1).astype(dtype)),
    }
    if not fmt.symmetric:
        if fmt.bits == 8 and not bq.integer_zero_points:
            raise ValueError("MatMulNBits on CPU reads float zero points only with 4-bit codes")
        z = (pack_zero_points(bq.zero_point, fmt.bits) if bq.integer_zero_points
             else bq.zero_point.reshape(-1).astype(dtype))
        tensors["zero_points"] = _dense(f"{base}/zero_point", z)
    attrs = {"K": bq.k, "N": n, "bits": fmt.bits, "block_size": fmt.block_size}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    return Packed("MatMulNBits", tensors, attrs)


def dequantize_linear(bq: BlockQuant, base: str, dtype: np.dtype[Any], signed: bool, transposed: bool) -> Packed:
    """Blocked DequantizeLinear operands of ``bq`` (``transposed``: the weight is stored ``[N, K]``)."""
    fmt = bq.fmt
    codes, scale, zero = qdq_layout(bq, signed)
    if transposed:
        codes, scale = codes.T, scale.T
        zero = zero.T if zero is not None else None
    tensors = {
        "codes": _int(f"{base}/quantized", np.ascontiguousarray(codes), fmt.bits, signed),
        "scale": _dense(f"{base}/scale", scale.astype(dtype)),
    }
    if zero is not None:
        tensors["zero_point"] = _int(f"{base}/zero_point", np.ascontiguousarray(zero), fmt.bits, signed)
    return Packed("DequantizeLinear", tensors, {"axis": 1 if transposed else 0, "block_size": fmt.block_size})
