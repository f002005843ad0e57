"""`QuantLayer.mean_error`: a quantized layer's mean output error from its mean input row, against the layer run
in onnxruntime with its float and its quantized weight (Gemm with alpha and transB, MatMul + Add, a grouped strided
Conv)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qgraph import GraphHandle
from qgraph.quant.layers import find_layers
from qgraph.runtime.compare import make_session
from qgraph.runtime.row_means import conv_rows, matrix_rows, row_means


def _qdq_layer(op: str, w: np.ndarray, b: np.ndarray, attrs: dict[str, Any]) -> onnx.ModelProto:
    """x -> Relu -> op(x, DQ(int8 w), DQ(int32 b)) with per-channel weight scales (axis of the output channels)."""
    axis = 0 if op == "Conv" or (op == "Gemm" and attrs.get("transB")) else 1
    scale = (np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != axis)) / 127).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    codes = np.clip(np.rint(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    bias_scale = (0.05 * scale).astype(np.float32)  # s_x * s_w with s_x = 0.05
    inits = [numpy_helper.from_array(codes, "wq"), numpy_helper.from_array(scale, "ws"),
             numpy_helper.from_array(np.zeros(scale.size, np.int8), "wz"),
             numpy_helper.from_array(np.rint(b / bias_scale).astype(np.int32), "bq"),
             numpy_helper.from_array(bias_scale, "bs"), numpy_helper.from_array(np.zeros(b.size, np.int32), "bz")]
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=axis),
             helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["b"], axis=0)]
    if op == "MatMul":
        nodes += [helper.make_node("MatMul", ["r", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    else:
        nodes.append(helper.make_node(op, ["r", "w", "b"], ["y"], **attrs))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _float_layer(model: onnx.ModelProto, w: np.ndarray, b: np.ndarray, beta: float) -> onnx.ModelProto:
    """The same layer with the float weight and bias written in (Gemm's bias divided by beta: beta stays)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [n for n in out.graph.node if n.op_type != "DequantizeLinear"]
    del out.graph.node[:]
    out.graph.node.extend(keep)
    del out.graph.initializer[:]
    out.graph.initializer.extend([numpy_helper.from_array(w, "w"), numpy_helper.from_array(
        (b / beta).astype(np.float32), "b")])
    return out


CASES = [
    ("Gemm", (5, 7), {"alpha": 0.5, "transB": 1}, (9, 7)),
    ("Gemm", (7, 5), {"alpha": 1.5}, (9, 7)),
    ("MatMul", (7, 5), {}, (2, 3, 7)),
    ("Conv", (6, 2, 3, 3), {"group": 2, "pads": [1, 0, 2, 1], "strides": [1, 2]}, (2, 4, 9, 8)),
]


@pytest.mark.parametrize(("op", "w_shape", "attrs", "x_shape"), CASES, ids=[c[0] + str(c[2]) for c in CASES])
def test_mean_error_is_the_mean_output_difference(op: str, w_shape: tuple[int, ...], attrs: dict[str, Any],
                                                  x_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.5, w_shape).astype(np.float32)
    channels = w_shape[0] if op == "Conv" or attrs.get("transB") else w_shape[1]
    b = rng.normal(0, 0.3, channels).astype(np.float32)
    model = _qdq_layer(op, w, b, attrs)
    (layer,), _ = find_layers(GraphHandle(model))
    feeds = [{"x": rng.normal(0.2, 1, x_shape).astype(np.float32)} for _ in range(3)]
    if op == "Conv":
        source = conv_rows("r", x_shape[1], w_shape[2:], attrs)
    else:
        source = matrix_rows("r", x_shape[0] if attrs.get("transA") else x_shape[-1], bool(attrs.get("transA")))
    (row,) = row_means(model, [source], feeds)
    beta = float(attrs.get("beta", 1.0))
    got = layer.mean_error(w, b.astype(np.float64), row)
    q, f = make_session(model), make_session(_float_layer(model, w, b, beta))
    axis = 1 if op == "Conv" else -1

    def mean(session: Any) -> np.ndarray:
        outs = [session.run(None, feed)[0].astype(np.float64) for feed in feeds]
        flat = [np.moveaxis(o, axis, -1).reshape(-1, channels) for o in outs]
        return np.concatenate(flat).mean(axis=0)

    want = mean(f) - mean(q)
    assert np.abs(want).max() > 1e-4  # quantization moved the means: the identity is tested, not 0 = 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
