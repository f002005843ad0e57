"""Real networks lowered to older opsets match the original in onnxruntime (max err <= 1e-5 * max|y|)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from qgraph.passes.lower_opset import lower_model

RNG = np.random.default_rng(42)


def _w(*shape: int, scale: float = 0.2) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in sess.run(None, feeds)]


def _check_close(original: onnx.ModelProto, lowered: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    for a, b in zip(_run(original, feeds), _run(lowered, feeds), strict=True):
        assert a.shape == b.shape
        assert float(np.max(np.abs(a - b))) <= 1e-5 * float(np.max(np.abs(a)))


class _G:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def init(self, arr: np.ndarray) -> str:
        self.n += 1
        name = f"w{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def op(self, op: str, inputs: list[str], n_out: int = 1, **attrs: object) -> str:
        self.n += 1
        outs = [f"{op.lower()}{self.n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"{op}_{self.n}", **attrs))
        return outs[0]

    def model(
        self,
        x: onnx.ValueInfoProto,
        y: str,
        y_shape: list[int],
        opset: int,
        extra: list[onnx.ValueInfoProto] | None = None,
    ) -> onnx.ModelProto:
        g = helper.make_graph(
            self.nodes,
            "net",
            [x, *(extra or [])],
            [helper.make_tensor_value_info(y, TensorProto.FLOAT, y_shape)],
            self.inits,
        )
        ir = {17: 8, 18: 8, 23: 10}.get(opset, 8)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)
        onnx.checker.check_model(m, full_check=True)
        return m


def conv_bn_net(opset: int = 17) -> onnx.ModelProto:
    """A small residual Conv-BN-ReLU network with pooling, ReLU6 (Clip), resize, concat and a classifier."""
    g = _G()

    def conv_bn(x: str, cin: int, cout: int, stride: int = 1) -> str:
        c = g.op(
            "Conv",
            [x, g.init(_w(cout, cin, 3, 3)), g.init(_w(cout))],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[stride, stride],
        )
        bn = g.op(
            "BatchNormalization",
            [c, g.init(1 + _w(cout)), g.init(_w(cout)), g.init(_w(cout)), g.init(np.abs(1 + _w(cout)))],
            epsilon=1e-5,
        )
        return g.op("Clip", [bn, g.init(np.float32(0)), g.init(np.float32(6))])

    h = conv_bn("x", 3, 8)
    h = g.op("Add", [conv_bn(h, 8, 8), h])
    p = g.op("MaxPool", [h], kernel_shape=[2, 2], strides=[2, 2])
    q = conv_bn(p, 8, 16)
    up = g.op("Resize", [q, "", g.init(np.array([1, 1, 2, 2], np.float32))], mode="nearest")
    cat = g.op("Concat", [up, h], axis=1)
    z = g.op("Relu", [conv_bn(cat, 24, 16, 2)])
    gap = (
        g.op("ReduceMean", [z, g.init(np.array([2, 3], np.int64))], keepdims=0)
        if opset >= 18
        else g.op("GlobalAveragePool", [z])
    )
    flat = g.op("Flatten", [gap], axis=1)
    logits = g.op("Gemm", [flat, g.init(_w(10, 16)), g.init(_w(10))], transB=1)
    y = g.op("Softmax", [logits], axis=-1)
    return g.model(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16, 16]), y, [2, 10], opset)


def transformer_encoder(opset: int = 17, d: int = 16, heads: int = 2, seq: int = 8) -> onnx.ModelProto:
    """Pre-LN encoder block: LayerNorm, multi-head attention from MatMul/Softmax, erf-GELU MLP, residuals."""
    g = _G()
    hd = d // heads
    ln1 = g.op("LayerNormalization", ["x", g.init(1 + _w(d)), g.init(_w(d))], axis=-1, epsilon=1e-5)

    def heads_of(t: str) -> str:
        r = g.op("Reshape", [t, g.init(np.array([0, seq, heads, hd], np.int64))])
        return g.op("Transpose", [r], perm=[0, 2, 1, 3])

    q = heads_of(g.op("Add", [g.op("MatMul", [ln1, g.init(_w(d, d))]), g.init(_w(d))]))
    k = heads_of(g.op("Add", [g.op("MatMul", [ln1, g.init(_w(d, d))]), g.init(_w(d))]))
    v = heads_of(g.op("Add", [g.op("MatMul", [ln1, g.init(_w(d, d))]), g.init(_w(d))]))
    scores = g.op(
        "Div", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), g.init(np.float32(np.sqrt(hd)))]
    )
    scores = g.op("Add", [scores, "mask"])
    attn = g.op("Softmax", [scores], axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [attn, v])], perm=[0, 2, 1, 3])
    merged = g.op("Reshape", [ctx, g.init(np.array([0, seq, d], np.int64))])
    h = g.op("Add", ["x", g.op("MatMul", [merged, g.init(_w(d, d))])])
    ln2 = g.op("LayerNormalization", [h, g.init(1 + _w(d)), g.init(_w(d))], axis=-1, epsilon=1e-5)
    f1 = g.op("Add", [g.op("MatMul", [ln2, g.init(_w(d, 4 * d))]), g.init(_w(4 * d))])
    if opset >= 20:
        act = g.op("Gelu", [f1])
    else:
        erf = g.op("Erf", [g.op("Div", [f1, g.init(np.float32(np.sqrt(2.0)))])])
        act = g.op("Mul", [g.op("Mul", [f1, g.op("Add", [erf, g.init(np.float32(1))])]), g.init(np.float32(0.5))])
    y = g.op("Add", [h, g.op("MatMul", [act, g.init(_w(4 * d, d))])])
    return g.model(
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, d]),
        y,
        [1, seq, d],
        opset,
        [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, seq, seq])],
    )


def attention_block_23(d: int = 16, heads: int = 2, seq: int = 8) -> onnx.ModelProto:
    """Opset-23 block with RMSNormalization, RotaryEmbedding, Attention and Gelu ops."""
    g = _G()
    hd = d // heads
    n = g.op("RMSNormalization", ["x", g.init(1 + _w(d))], axis=-1, epsilon=1e-5)
    q = g.op("MatMul", [n, g.init(_w(d, d))])
    k = g.op("MatMul", [n, g.init(_w(d, d))])
    v = g.op("MatMul", [n, g.init(_w(d, d))])
    pos = g.init(np.arange(seq, dtype=np.int64)[None, :])
    cos = g.init(np.cos(np.arange(seq)[:, None] / (10 ** (np.arange(hd // 2)[None, :] / 2))).astype(np.float32))
    sin = g.init(np.sin(np.arange(seq)[:, None] / (10 ** (np.arange(hd // 2)[None, :] / 2))).astype(np.float32))
    q = g.op("RotaryEmbedding", [q, cos, sin, pos], num_heads=heads)
    k = g.op("RotaryEmbedding", [k, cos, sin, pos], num_heads=heads)
    a = g.op("Attention", [q, k, v], q_num_heads=heads, kv_num_heads=heads, is_causal=1)
    h = g.op("Add", ["x", g.op("MatMul", [a, g.init(_w(d, d))])])
    y = g.op("Add", [h, g.op("Gelu", [g.op("MatMul", [h, g.init(_w(d, d))])], approximate="tanh")])
    return g.model(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, d]), y, [1, seq, d], 23)


@pytest.mark.parametrize("target", [13, 11])
def test_conv_bn_net_lowers_exactly(target: int) -> None:
    m = conv_bn_net(17)
    res = lower_model(m, target)
    assert res.model.opset_import[0].version == target
    ops = {n.op_type for n in res.model.graph.node}
    assert {"Conv", "BatchNormalization", "Clip", "Resize", "Softmax"} <= ops
    _check_close(m, res.model, {"x": RNG.standard_normal((2, 3, 16, 16)).astype(np.float32)})


@pytest.mark.parametrize("target", [13, 11])
def test_conv_bn_net_opset18_reduce_mean(target: int) -> None:
    m = conv_bn_net(18)
    res = lower_model(m, target)
    _check_close(m, res.model, {"x": RNG.standard_normal((2, 3, 16, 16)).astype(np.float32)})


@pytest.mark.parametrize("target", [13, 11])
def test_transformer_encoder_lowers_exactly(target: int) -> None:
    m = transformer_encoder(17)
    res = lower_model(m, target)
    ops = {n.op_type for n in res.model.graph.node}
    assert "LayerNormalization" not in ops and {"ReduceMean", "Softmax", "Erf"} <= ops
    mask = np.triu(np.full((8, 8), -1e4, np.float32), 1)[None, None]
    _check_close(m, res.model, {"x": RNG.standard_normal((1, 8, 16)).astype(np.float32), "mask": mask})


@pytest.mark.parametrize("target", [17, 13, 11])
def test_transformer_with_gelu_op_lowers_exactly(target: int) -> None:
    m = transformer_encoder(20)
    res = lower_model(m, target)
    assert "Gelu" not in {n.op_type for n in res.model.graph.node}
    mask = np.zeros((1, 1, 8, 8), np.float32)
    _check_close(m, res.model, {"x": RNG.standard_normal((1, 8, 16)).astype(np.float32), "mask": mask})


@pytest.mark.parametrize("target", [17, 13, 11])
def test_attention_rms_rotary_block_lowers_exactly(target: int) -> None:
    m = attention_block_23()
    res = lower_model(m, target)
    ops = {n.op_type for n in res.model.graph.node}
    assert not {"Attention", "RMSNormalization", "RotaryEmbedding", "Gelu"} & ops
    _check_close(m, res.model, {"x": RNG.standard_normal((1, 8, 16)).astype(np.float32)})
