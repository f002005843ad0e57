"""Quantized layers built to stress u8×s8 pair sums, and a numpy model of onnxruntime's AVX2 arithmetic on them.

Every model reads ``x`` (float) and quantizes it to u8 (or s8) codes spread over the whole code range, then runs
one integer layer with random full-range s8 weights (so many pairs can overflow int16). `avx2_reference`
computes what onnxruntime's AVX2 kernels give (the rules of `qgraph.runtime.kernels.pairs`: pairs along K in the
kernel's (kh, kw, c) order per group, raw codes, s8 activations shifted to u8, padding with the zero point) directly in
numpy, independently of the ONNX emulation it checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from qgraph.runtime.kernels.pairs import INT16_MAX, INT16_MIN


@dataclass(frozen=True)
class Case:
    """One test layer: its model, its input, and how to read it back in numpy."""

    name: str
    model: onnx.ModelProto
    x: np.ndarray


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], xshape: list[int], opset: int = 13,
           name: str = "layer") -> onnx.ModelProto:
    graph = h.make_graph(nodes, name, [h.make_tensor_value_info("x", T.FLOAT, xshape)],
                         [h.make_tensor_value_info("y", T.FLOAT, None)], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _act(signed: bool) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    zp = np.int8(-30) if signed else np.uint8(17)
    nodes = [h.make_node("QuantizeLinear", ["x", "as", "azp"], ["xq"], name="x/q"),
             h.make_node("DequantizeLinear", ["xq", "as", "azp"], ["xd"], name="x/dq")]
    return nodes, [nh.from_array(np.array(np.float32(0.05)), "as"), nh.from_array(np.array(zp), "azp")]


def _out() -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    nodes = [h.make_node("QuantizeLinear", ["c", "os", "ozp"], ["cq"], name="c/q"),
             h.make_node("DequantizeLinear", ["cq", "os", "ozp"], ["y"], name="c/dq")]
    return nodes, [nh.from_array(np.array(np.float32(0.5)), "os"), nh.from_array(np.array(np.uint8(128)), "ozp")]


def _bias(rng: np.random.Generator, n: int, ws: np.ndarray) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """int32 bias codes at scale ``s_x · s_w`` (what onnxruntime's fused kernels add to the int32 sum)."""
    codes = rng.integers(-20000, 20000, size=n).astype(np.int32)
    return ([h.make_node("DequantizeLinear", ["b", "bs"], ["bd"], axis=0, name="b/dq")],
            [nh.from_array(codes, "b"), nh.from_array((np.float32(0.05) * ws).astype(np.float32), "bs")])


def conv_case(name: str, c: int, o: int, k: int, *, group: int = 1, stride: int = 1, pad: int = 1,
              signed: bool = False, wzp: int = 0, size: int = 9, seed: int = 0, bias: bool = False) -> Case:
    """A Q/DQ convolution (onnxruntime fuses it into QLinearConv), with int32 bias codes when ``bias``."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-128, 128, size=(o, c // group, k, k)).astype(np.int8)
    ws = (rng.random(o) * 0.01 + 0.005).astype(np.float32)
    an, ai = _act(signed)
    on, oi = _out()
    bn, bi = _bias(rng, o, ws) if bias else ([], [])
    nodes = [*an, h.make_node("DequantizeLinear", ["w", "ws", "wzp"], ["wd"], axis=0, name="w/dq"), *bn,
             h.make_node("Conv", ["xd", "wd", *(["bd"] if bias else [])], ["c"], group=group, strides=[stride] * 2,
                         pads=[pad] * 4, kernel_shape=[k, k], name="conv"), *on]
    inits = [nh.from_array(w, "w"), nh.from_array(ws, "ws"), nh.from_array(np.full(o, wzp, np.int8), "wzp"), *ai, *oi,
             *bi]
    x = (np.random.default_rng(seed + 1).random((1, c, size, size)) * 14 - 2).astype(np.float32)
    return Case(name, _model(nodes, inits, [1, c, size, size]), x)


def matmul_case(name: str, k: int, n: int, *, rows: tuple[int, ...] = (5,), signed: bool = False, wzp: int = 0,
                quantized_output: bool = True, seed: int = 0) -> Case:
    """A Q/DQ MatMul with a constant weight (QLinearMatMul, or MatMulIntegerToFloat without the output Q/DQ)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-128, 128, size=(k, n)).astype(np.int8)
    an, ai = _act(signed)
    on, oi = _out() if quantized_output else ([], [])
    nodes = [*an, h.make_node("DequantizeLinear", ["w", "ws", "wzp"], ["wd"], axis=1, name="w/dq"),
             h.make_node("MatMul", ["xd", "wd"], ["c" if quantized_output else "y"], name="matmul"), *on]
    inits = [nh.from_array(w, "w"), nh.from_array((rng.random(n) * 0.01 + 0.005).astype(np.float32), "ws"),
             nh.from_array(np.full(n, wzp, np.int8), "wzp"), *ai, *oi]
    x = (np.random.default_rng(seed + 1).random((*rows, k)) * 14 - 2).astype(np.float32)
    return Case(name, _model(nodes, inits, [*rows, k]), x)


def gemm_case(name: str, k: int, n: int, *, trans_b: bool = True, quantized_output: bool = True, alpha: float = 1.0,
              seed: int = 0) -> Case:
    """A Q/DQ Gemm with int32 bias codes (onnxruntime's QGemm, with a float output without the output Q/DQ)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-128, 128, size=(n, k) if trans_b else (k, n)).astype(np.int8)
    ws = (rng.random(n) * 0.01 + 0.005).astype(np.float32)
    an, ai = _act(False)
    on, oi = _out() if quantized_output else ([], [])
    bn, bi = _bias(rng, n, ws)
    nodes = [*an, h.make_node("DequantizeLinear", ["w", "ws", "wzp"], ["wd"], axis=0 if trans_b else 1, name="w/dq"),
             *bn,
             h.make_node("Gemm", ["xd", "wd", "bd"], ["c" if quantized_output else "y"], transB=int(trans_b),
                         alpha=alpha, name="gemm"), *on]
    inits = [nh.from_array(w, "w"), nh.from_array(ws, "ws"), nh.from_array(np.zeros(n, np.int8), "wzp"), *ai, *oi, *bi]
    x = (np.random.default_rng(seed + 1).random((5, k)) * 14 - 2).astype(np.float32)
    return Case(name, _model(nodes, inits, [5, k]), x)


def dynamic_case(name: str, k: int, n: int, *, contrib: bool = False, seed: int = 0) -> Case:
    """Dynamic quantization: DynamicQuantizeLinear + MatMulInteger (or onnxruntime's DynamicQuantizeMatMul)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-128, 128, size=(k, n)).astype(np.int8)
    scale = nh.from_array((rng.random(n) * 0.01 + 0.005).astype(np.float32), "ws")
    if contrib:
        nodes = [h.make_node("DynamicQuantizeMatMul", ["x", "w", "ws", "wz"], ["y"], domain="com.microsoft",
                             name="dqmm")]
        inits = [nh.from_array(w, "w"), nh.from_array(np.zeros(n, np.int8), "wz"), scale]
    else:
        nodes = [h.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dynq"),
                 h.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"], name="mmi"),
                 h.make_node("Cast", ["acc"], ["accf"], to=T.FLOAT, name="cast"),
                 h.make_node("Mul", ["xs", "ws"], ["sc"], name="scale"), h.make_node("Mul", ["accf", "sc"], ["y"])]
        inits = [nh.from_array(w, "w"), nh.from_array(np.full(n, 20, np.int8), "wz"), scale]
    x = (np.random.default_rng(seed + 1).random((5, k)) * 14 - 2).astype(np.float32)
    return Case(name, _model(nodes, inits, [5, k]), x)


def cases() -> list[Case]:
    """The layer shapes the emulation must get exactly right."""
    return [
        conv_case("conv_even", 8, 4, 3), conv_case("conv_odd_channels", 7, 4, 3),
        conv_case("conv_1x1", 16, 4, 1, pad=0), conv_case("conv_groups", 8, 4, 3, group=2),
        conv_case("conv_depthwise", 8, 8, 3, group=8), conv_case("conv_stride", 6, 4, 3, stride=2),
        conv_case("conv_s8_activations", 8, 4, 3, signed=True), conv_case("conv_weight_zero_point", 8, 4, 3, wzp=20),
        matmul_case("matmul", 64, 8), matmul_case("matmul_odd_k", 63, 8), matmul_case("matmul_3d", 48, 16, rows=(2, 3)),
        matmul_case("matmul_s8_activations", 64, 8, signed=True),
        matmul_case("matmul_weight_zero_point", 64, 8, wzp=20),
        matmul_case("matmul_float_output", 64, 8, quantized_output=False),
        dynamic_case("dynamic", 64, 8), dynamic_case("dynamic_contrib", 64, 8, contrib=True),
    ]


def requant_cases() -> list[Case]:
    """Layers onnxruntime fuses, for writing each as its fused kernel computes it: the shapes of `cases` and int32
    biases, Gemms (transposed weights, float outputs)."""
    return [*(c for c in cases() if not c.name.startswith("dynamic")),
            conv_case("conv_bias", 8, 4, 3, bias=True), conv_case("conv_bias_groups", 8, 4, 3, group=2, bias=True),
            # sums beyond float32's exact integers (256 x 9 products of up to 255 x 128): ConvInteger, not float
            conv_case("conv_wide", 256, 4, 3, bias=True),
            gemm_case("gemm_trans_b", 64, 8), gemm_case("gemm", 63, 8, trans_b=False),
            gemm_case("gemm_float_output", 64, 8, quantized_output=False)]


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return nh.to_array(next(t for t in model.graph.initializer if t.name == name))


def _pair_correction(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``Σ_i sat16(p_i) - p_i`` for ``a (M, K) @ w (K, N)`` on raw codes (what saturation removes)."""
    if a.shape[1] % 2:
        a, w = np.pad(a, ((0, 0), (0, 1))), np.pad(w, ((0, 1), (0, 0)))
    p = a[:, 0::2, None] * w[None, 0::2, :] + a[:, 1::2, None] * w[None, 1::2, :]
    out: np.ndarray = (np.clip(p, INT16_MIN, INT16_MAX) - p).sum(axis=1)
    return out


def _conv_correction(case: Case, q: np.ndarray, zp: int, shift: int, w: np.ndarray) -> np.ndarray:
    node = next(n for n in case.model.graph.node if n.op_type == "Conv")
    attrs = {a.name: h.get_attribute_value(a) for a in node.attribute}
    g, st, pd, k = attrs.get("group", 1), attrs["strides"][0], attrs["pads"][0], attrs["kernel_shape"][0]
    c, o = q.shape[1], w.shape[0]
    padded = np.pad(q[0], ((0, 0), (pd, pd), (pd, pd)), constant_values=zp) + shift
    oh = (padded.shape[1] - k) // st + 1
    corr = np.zeros((o, oh, oh))
    cg, og = c // g, o // g
    if cg == 1 and og == 1:
        return corr  # depthwise: no pairs
    for gi in range(g):
        cols = [padded[gi * cg:(gi + 1) * cg, i:i + st * oh:st, j:j + st * oh:st].reshape(cg, -1)
                for i in range(k) for j in range(k)]
        a = np.concatenate(cols, 0).T  # (positions, K) in (kh, kw, c) order
        wg = w[gi * og:(gi + 1) * og].transpose(0, 2, 3, 1).reshape(og, -1).T
        corr[gi * og:(gi + 1) * og] = _pair_correction(a, wg).T.reshape(og, oh, oh)
    return corr[None]


def avx2_correction(case: Case) -> np.ndarray:
    """What AVX2's pair saturation adds to the case's layer output, in the output's units (float, before any
    output quantization; int32 accumulator units times the scales for dynamic layers)."""
    m = case.model
    w = _init(m, "w").astype(np.int64)
    if any(n.op_type in ("DynamicQuantizeLinear", "DynamicQuantizeMatMul") for n in m.graph.node):
        lo, hi = min(float(case.x.min()), 0.0), max(float(case.x.max()), 0.0)
        scale = (hi - lo) / 255.0
        zp = int(np.clip(np.rint(-lo / scale), 0, 255))
        q = np.clip(np.rint(case.x / scale) + zp, 0, 255).astype(np.int64)
        ws = _init(m, "ws").astype(np.float64)
        return _pair_correction(q, w) * scale * ws  # type: ignore[no-any-return]
    s, zp0 = float(_init(m, "as")), _init(m, "azp")
    lo, hi = (-128, 127) if zp0.dtype == np.int8 else (0, 255)
    q = np.clip(np.rint(case.x / s) + int(zp0), lo, hi).astype(np.int64)
    shift = 128 if zp0.dtype == np.int8 else 0
    ws = _init(m, "ws").astype(np.float64)
    if m.graph.node[3].op_type == "Conv":
        return _conv_correction(case, q, int(zp0), shift, w) * s * ws[None, :, None, None]
    flat = (q + shift).reshape(-1, q.shape[-1])
    return (_pair_correction(flat, w) * s * ws[None, :]).reshape(*q.shape[:-1], -1)  # type: ignore[no-any-return]
