"""qgraph.quant.blockwise layouts against onnxruntime's kernels: MatMulNBits and blocked DequantizeLinear give
exactly the product with the weights `qgraph.quant.blockwise` dequantizes, for every bits / symmetry / block size
(property-based)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from qgraph.passes.quantize_weights.packing import dequantize_linear, matmul_nbits

from qgraph.quant.blockwise import (
    BlockFormat,
    pack_codes,
    pack_int4,
    pack_zero_points,
    quantize_weight,
    unpack_codes,
    unpack_int4,
    unpack_zero_points,
)

FORMATS = st.builds(BlockFormat, bits=st.sampled_from([4, 8]), block_size=st.sampled_from([16, 32, 64, 128, 256]),
                    symmetric=st.booleans())


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], k: int, n: int, opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


@settings(max_examples=40, deadline=None)
@given(fmt=FORMATS, k=st.integers(1, 300), n=st.integers(1, 24), seed=st.integers(0, 2**16), hqq=st.booleans())
def test_matmul_nbits_kernel_computes_the_dequantized_product(fmt: BlockFormat, k: int, n: int, seed: int,
                                                             hqq: bool) -> None:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * rng.uniform(0.01, 3)).astype(np.float32)
    bq = quantize_weight(w, fmt, (1.0, 0.9, 0.8))
    if hqq and not fmt.symmetric and fmt.bits == 4:  # a fractional zero point (HQQ) is stored as float (4-bit only)
        bq.zero_point = bq.zero_point + rng.uniform(-0.4, 0.4, bq.zero_point.shape).astype(np.float32)
    packed = matmul_nbits(bq, "W", np.dtype(np.float32), 0)
    node = helper.make_node("MatMulNBits", ["A", *(t.name for t in packed.tensors.values())], ["Y"],
                            domain="com.microsoft", **packed.attrs)
    a = rng.standard_normal((3, k)).astype(np.float32)
    got = _session(_model([node], list(packed.tensors.values()), k, n, 17)).run(None, {"A": a})[0]
    want = a.astype(np.float64) @ bq.dequantize().astype(np.float64)
    tol = 1e-5 * (np.abs(a) @ np.abs(bq.dequantize())).max() + 1e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


@settings(max_examples=30, deadline=None)
@given(fmt=FORMATS, k=st.integers(1, 300), n=st.integers(1, 24), seed=st.integers(0, 2**16), signed=st.booleans(),
       transposed=st.booleans())
def test_blocked_dequantize_linear_gives_the_dequantized_weight(fmt: BlockFormat, k: int, n: int, seed: int,
                                                               signed: bool, transposed: bool) -> None:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    bq = quantize_weight(w, fmt)
    packed = dequantize_linear(bq, "W", np.dtype(np.float32), signed, transposed)
    t = packed.tensors
    dq = helper.make_node("DequantizeLinear", [t["codes"].name, t["scale"].name,
                                               *([t["zero_point"].name] if "zero_point" in t else [])],
                          ["Wq"], **packed.attrs)
    mm = helper.make_node("Gemm", ["A", "Wq"], ["Y"], transB=1) if transposed else helper.make_node(
        "MatMul", ["A", "Wq"], ["Y"])
    a = rng.standard_normal((3, k)).astype(np.float32)
    got = _session(_model([dq, mm], list(t.values()), k, n, 21)).run(None, {"A": a})[0]
    want = a.astype(np.float64) @ bq.dequantize().astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * (np.abs(a) @ np.abs(bq.dequantize())).max() + 1e-6)


@given(bits=st.sampled_from([4, 8]), n=st.integers(1, 9), nb=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_codes_and_zero_points_round_trip(bits: int, n: int, nb: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, (n, nb, 32)).astype(np.uint8)
    assert np.array_equal(unpack_codes(pack_codes(codes, bits), bits), codes)
    zero = rng.integers(0, 2**bits, (n, nb)).astype(np.float32)
    packed = pack_zero_points(zero, bits)
    assert packed.shape == (n, -(-nb * bits // 8))
    assert np.array_equal(unpack_zero_points(packed, bits, nb), zero)
    values = rng.integers(-8, 8, 2 * nb + 1)
    assert np.array_equal(unpack_int4(pack_int4(values), values.size, signed=True), values)


def test_int4_tensor_matches_onnx_reference_packing() -> None:
    values = np.array([[-8, 7, 1], [0, -1, 3]])
    proto = helper.make_tensor("t", TensorProto.INT4, [2, 3], values.ravel().tolist())
    assert pack_int4(values) == proto.raw_data or np.array_equal(numpy_helper.to_array(proto).astype(int), values)
    raw = helper.make_tensor("t", TensorProto.INT4, [2, 3], pack_int4(values), raw=True)
    assert np.array_equal(numpy_helper.to_array(raw).astype(int), values)
