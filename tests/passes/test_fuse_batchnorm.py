"""fuse_batchnorm: structure, numbers (onnxruntime), skip reasons, subgraphs, real topologies, linearity.

Numeric tolerance: outputs of the rewritten model must match the original in onnxruntime within
``max|new - old| <= 1e-5 * max|old|`` (float32). On the deep real topologies float32 rounding compounds through
50+ layers, so the same 1e-5 bound is asserted per tensor (`Prep.local_errors`: each node fed the original's
values) and end to end it is relaxed only to 3x the drift onnxruntime's own Conv-BN fusion causes on the
unmodified model (see `test_light_models`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from qgraph.passes.fuse_batchnorm import FuseBatchNorm
from qgraph.passes.fuse_batchnorm.bn_math import BNAffine

from qgraph import Pipeline, get_pass
from qgraph.testing.models import conv_bn_net, conv_bn_relu_chain, random_feeds

TOL = 1e-5  # max|new - old| <= TOL * max|old| (float32)
RNG = np.random.default_rng(0)


# ---------------------------------------------------------------------------------------------- builders
def _model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, list[int]],
    outputs: list[str] | dict[str, list[int]],
    inits: dict[str, np.ndarray],
    opset: int = 17,
    elem: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(k, elem, v) for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, elem, outputs[o] if isinstance(outputs, dict) else None) for o in outputs],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)  # typed, shaped outputs (onnx's full check wants them)


def _bn(prefix: str, c: int, dtype: Any = np.float32, rng: np.random.Generator = RNG) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.s": (rng.uniform(0.5, 1.5, c) * rng.choice([-1, 1], c)).astype(dtype),
        f"{prefix}.b": rng.normal(0, 0.3, c).astype(dtype),
        f"{prefix}.m": rng.normal(0, 0.3, c).astype(dtype),
        f"{prefix}.v": rng.uniform(0.2, 2.0, c).astype(dtype),
    }


def _bn_node(x: str, y: str, prefix: str = "bn", eps: float = 1e-5, **attrs: Any) -> onnx.NodeProto:
    ins = [x, f"{prefix}.s", f"{prefix}.b", f"{prefix}.m", f"{prefix}.v"]
    return helper.make_node("BatchNormalization", ins, [y], name=prefix, epsilon=eps, **attrs)


def _w(*shape: int) -> np.ndarray:
    return RNG.normal(0, 0.5, shape).astype(np.float32)


def _case(name: str) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Model for pattern ``name`` and the expected ``details`` entries."""
    n = helper.make_node
    if name == "conv":
        nodes = [n("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]), _bn_node("c", "y")]
        return _model(nodes, {"x": [1, 4, 6, 6]}, ["y"], {"w": _w(6, 4, 3, 3), **_bn("bn", 6)}), {
            "folded_into_preceding": {"Conv": 1}
        }
    if name == "conv_bias_group":
        nodes = [n("Conv", ["x", "w", "cb"], ["c"], name="conv", group=2, strides=[2, 2]), _bn_node("c", "y")]
        return _model(nodes, {"x": [2, 4, 7, 7]}, ["y"], {"w": _w(6, 2, 3, 3), "cb": _w(6), **_bn("bn", 6)}), {
            "folded_into_preceding": {"Conv": 1}
        }
    if name == "conv_transpose":
        nodes = [n("ConvTranspose", ["x", "w"], ["c"], name="convt", strides=[2, 2]), _bn_node("c", "y")]
        return _model(nodes, {"x": [1, 4, 5, 5]}, ["y"], {"w": _w(4, 6, 3, 3), **_bn("bn", 6)}), {
            "folded_into_preceding": {"ConvTranspose": 1}
        }
    if name == "conv_transpose_group":
        nodes = [n("ConvTranspose", ["x", "w", "cb"], ["c"], name="convt", group=2), _bn_node("c", "y")]
        return _model(nodes, {"x": [1, 4, 5, 5]}, ["y"], {"w": _w(4, 3, 3, 3), "cb": _w(6), **_bn("bn", 6)}), {
            "folded_into_preceding": {"ConvTranspose": 1}
        }
    if name == "gemm":
        nodes = [n("Gemm", ["x", "w", "gc"], ["c"], name="gemm", alpha=0.7, beta=1.3), _bn_node("c", "y")]
        return _model(nodes, {"x": [3, 5]}, ["y"], {"w": _w(5, 4), "gc": _w(4), **_bn("bn", 4)}), {
            "folded_into_preceding": {"Gemm": 1}
        }
    if name == "gemm_transb_no_c":
        nodes = [n("Gemm", ["x", "w"], ["c"], name="gemm", transB=1), _bn_node("c", "y")]
        return _model(nodes, {"x": [3, 5]}, ["y"], {"w": _w(4, 5), **_bn("bn", 4)}), {
            "folded_into_preceding": {"Gemm": 1}
        }
    if name == "matmul":
        nodes = [n("MatMul", ["x", "w"], ["c"], name="mm"), _bn_node("c", "y")]
        return _model(nodes, {"x": [3, 5]}, ["y"], {"w": _w(5, 4), **_bn("bn", 4)}), {
            "folded_into_preceding": {"MatMul": 1}
        }
    if name == "matmul_add":
        nodes = [
            n("MatMul", ["x", "w"], ["c"], name="mm"),
            n("Add", ["c", "ab"], ["d"], name="add"),
            _bn_node("d", "y"),
        ]
        return _model(nodes, {"x": [3, 5]}, ["y"], {"w": _w(5, 4), "ab": _w(4), **_bn("bn", 4)}), {
            "folded_into_preceding": {"MatMul+Add": 1}
        }
    if name == "bn_conv":
        nodes = [_bn_node("x", "b"), n("Conv", ["b", "w", "cb"], ["y"], name="conv")]
        return _model(nodes, {"x": [1, 4, 6, 6]}, ["y"], {"w": _w(6, 4, 3, 3), "cb": _w(6), **_bn("bn", 4)}), {
            "folded_into_following": {"Conv": 1}
        }
    if name == "bn_conv_group":
        nodes = [_bn_node("x", "b"), n("Conv", ["b", "w"], ["y"], name="conv", group=2)]
        return _model(nodes, {"x": [1, 4, 6, 6]}, ["y"], {"w": _w(6, 2, 1, 1), **_bn("bn", 4)}), {
            "folded_into_following": {"Conv": 1}
        }
    if name == "bn_gemm":
        nodes = [_bn_node("x", "b"), n("Gemm", ["b", "w", "gc"], ["y"], name="gemm", transB=1, alpha=1.5, beta=0.5)]
        return _model(nodes, {"x": [3, 4]}, ["y"], {"w": _w(2, 4), "gc": _w(2), **_bn("bn", 4)}), {
            "folded_into_following": {"Gemm": 1}
        }
    if name == "bn_two_convs":
        nodes = [
            _bn_node("x", "b"),
            n("Conv", ["b", "w1"], ["y1"], name="c1"),
            n("Conv", ["b", "w2"], ["y2"], name="c2", strides=[2, 2]),
        ]
        inits = {"w1": _w(3, 4, 1, 1), "w2": _w(5, 4, 3, 3), **_bn("bn", 4)}
        return _model(nodes, {"x": [1, 4, 6, 6]}, ["y1", "y2"], inits), {"folded_into_following": {"Conv": 2}}
    if name == "conv_bn_bn":
        nodes = [n("Conv", ["x", "w"], ["c"], name="conv"), _bn_node("c", "d", "bn1"), _bn_node("d", "y", "bn2")]
        return _model(nodes, {"x": [1, 4, 6, 6]}, ["y"], {"w": _w(6, 4, 3, 3), **_bn("bn1", 6), **_bn("bn2", 6)}), {
            "folded_into_preceding": {"Conv": 2}
        }
    if name == "concat_bn":
        nodes = [n("Concat", ["x", "x2"], ["c"], name="cat", axis=1), _bn_node("c", "b"), n("Relu", ["b"], ["y"])]
        return _model(nodes, {"x": [1, 2, 5, 5], "x2": [1, 3, 5, 5]}, ["y"], _bn("bn", 5)), {"rewritten_to_mul_add": 1}
    if name == "bn_padded_conv":
        nodes = [_bn_node("x", "b"), n("Conv", ["b", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])]
        return _model(nodes, {"x": [1, 4, 6, 6]}, ["y"], {"w": _w(6, 4, 3, 3), **_bn("bn", 4)}), {
            "rewritten_to_mul_add": 1
        }
    raise KeyError(name)


CASES = [
    "conv",
    "conv_bias_group",
    "conv_transpose",
    "conv_transpose_group",
    "gemm",
    "gemm_transb_no_c",
    "matmul",
    "matmul_add",
    "bn_conv",
    "bn_conv_group",
    "bn_gemm",
    "bn_two_convs",
    "conv_bn_bn",
    "concat_bn",
    "bn_padded_conv",
]


# ---------------------------------------------------------------------------------------------- structure
def test_conv_bn_structure_and_formula(prep: Any) -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,4,4] x) => (float[1,2,4,4] y) {
      c = Conv <pads = [1, 1, 1, 1]> (x, w)
      b = BatchNormalization <epsilon = 0.001> (c, s, bias, mean, var)
      y = Relu(b)
    }""")
    w = np.arange(2 * 2 * 3 * 3, dtype=np.float32).reshape(2, 2, 3, 3) / 10
    params = {"s": [2.0, -1.0], "bias": [0.5, 0.25], "mean": [1.0, -2.0], "var": [3.999, 0.999]}
    model.graph.initializer.append(numpy_helper.from_array(w, "w"))
    for k, v in params.items():
        model.graph.initializer.append(numpy_helper.from_array(np.array(v, np.float32), k))
    out, (res,), _handle = prep.apply(model, FuseBatchNorm())
    assert [n.op_type for n in out.graph.node] == ["Conv", "Relu"]
    conv = out.graph.node[0]
    assert conv.output[0] == "b"  # the BN's output name is kept
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    s = np.array([2.0, -1.0]) / np.sqrt(np.array([3.999, 0.999]) + 0.001)  # = [1, -1] / ... exactly [1.0, -1.0]
    np.testing.assert_allclose(inits["w"], w * s[:, None, None, None], rtol=1e-7)
    np.testing.assert_allclose(inits[conv.input[2]], [0.5 - 1.0 * s[0], 0.25 + 2.0 * s[1]], rtol=1e-7)
    assert conv.input[2] == "conv/bias" or conv.input[2].endswith("/bias")
    assert (res.matched, res.rewritten, res.nodes_removed, res.skipped) == (1, 1, 1, [])
    assert res.details["folded_into_preceding"] == {"Conv": 1}
    assert prep.relative_error(model, out, random_feeds(model, 1)[0]) <= TOL


@pytest.mark.parametrize("case", CASES)
def test_patterns_match_in_onnxruntime(case: str, prep: Any) -> None:
    model, expected = _case(case)
    out, (res,), _ = prep.apply(model, FuseBatchNorm())
    ops = prep.ops(out)
    assert ops["BatchNormalization"] == 0
    for key, value in expected.items():
        assert res.details[key] == value, (key, res.details)
    assert res.rewritten == res.matched == sum(prep.ops(model)[o] for o in ["BatchNormalization"])
    if case == "matmul":
        added = [n for n in out.graph.node if n.op_type == "Add"]
        assert [n.name for n in added] == ["bn/bn_folded"] and added[0].doc_string == "qgraph:fuse_batchnorm"
    if case == "bn_padded_conv":
        assert "pads its input" in res.skipped[0].reason and "Mul+Add" in res.skipped[0].reason
        assert [n.op_type for n in out.graph.node] == ["Mul", "Add", "Conv"]
    for seed in range(2):
        assert prep.relative_error(model, out, random_feeds(model, 1, seed=seed)[0]) <= TOL


# ---------------------------------------------------------------------------------------------- skips
def _conv_bn(**kw: Any) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    return [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), _bn_node("c", "y", **kw)], {
        "w": _w(3, 2, 1, 1),
        **_bn("bn", 3),
    }


def test_training_mode_bn_is_kept_with_reason(prep: Any) -> None:
    nodes, inits = _conv_bn(training_mode=1)
    nodes[1].output.extend(["running_mean", "running_var"])  # training mode needs all three outputs
    model = _model(nodes, {"x": [2, 2, 3, 3]}, {"y": [2, 3, 3, 3]}, inits, opset=15)
    out, (res,), _ = prep.apply(model, FuseBatchNorm())
    assert prep.ops(out)["BatchNormalization"] == 1
    assert res.rewritten == 0 and "training_mode=1" in res.skipped[0].reason and res.details["kept"] == 1


def test_non_constant_parameters_are_kept(prep: Any) -> None:
    nodes, inits = _conv_bn()
    scale = inits.pop("bn.s")
    model = _model(nodes, {"x": [1, 2, 3, 3], "bn.s": [3]}, ["y"], inits)
    out, (res,), _ = prep.apply(model, FuseBatchNorm())
    assert prep.ops(out)["BatchNormalization"] == 1
    assert res.skipped[0].reason == "scale 'bn.s' is not a constant"
    assert scale.shape == (3,)


def test_shared_weight_is_not_modified(prep: Any) -> None:
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w"], ["c1"], name="conv1"),
        _bn_node("c1", "y1", "bn1"),
        n("Conv", ["x", "w"], ["c2"], name="conv2"),
        _bn_node("c2", "y2", "bn2"),
    ]
    model = _model(nodes, {"x": [1, 2, 3, 3]}, ["y1", "y2"], {"w": _w(3, 2, 1, 1), **_bn("bn1", 3), **_bn("bn2", 3)})
    out, (res,), _ = prep.apply(model, FuseBatchNorm())
    reasons = sorted(s.reason for s in res.skipped)
    assert len(reasons) == 2 and all("'w' is shared with other consumers" in r for r in reasons)
    assert res.details["rewritten_to_mul_add"] == 2
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(inits["w"], numpy_helper.to_array(model.graph.initializer[0]))
    assert prep.relative_error(model, out, random_feeds(model, 1)[0]) <= TOL


def test_conv_output_used_elsewhere_or_graph_output(prep: Any) -> None:
    n = helper.make_node
    nodes = [n("Conv", ["x", "w"], ["c"], name="conv"), _bn_node("c", "y"), n("Relu", ["c"], ["z"])]
    model = _model(nodes, {"x": [1, 2, 3, 3]}, ["y", "z"], {"w": _w(3, 2, 1, 1), **_bn("bn", 3)})
    _out, (res,), _ = prep.apply(model, FuseBatchNorm(standalone_to_mul_add=False))
    assert "also feeds 1 other node(s)" in res.skipped[0].reason and res.details["kept"] == 1
    model2 = _model(nodes[:2], {"x": [1, 2, 3, 3]}, ["y", "c"], {"w": _w(3, 2, 1, 1), **_bn("bn", 3)})
    out2, (res2,), _ = prep.apply(model2, FuseBatchNorm())
    assert "is a graph output" in res2.skipped[0].reason
    assert prep.relative_error(model2, out2, random_feeds(model2, 1)[0]) <= TOL


def test_non_float_weight_is_skipped(prep: Any) -> None:
    nodes, inits = _conv_bn()
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in inits.items()}
    model = _model(nodes, {"x": [1, 2, 3, 3]}, {"y": [1, 3, 3, 3]}, bf16, opset=22, elem=TensorProto.BFLOAT16)
    out, (res,), _ = prep.apply(model, FuseBatchNorm(standalone_to_mul_add=False))
    assert "has non-float dtype bfloat16" in res.skipped[0].reason and res.rewritten == 0
    assert prep.graph_bytes(out) == prep.graph_bytes(prep.apply(model)[0])  # weights untouched, still bfloat16


def test_matmul_on_3d_input_is_not_folded(prep: Any) -> None:
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["c"], name="mm"), _bn_node("c", "y")]
    model = _model(nodes, {"x": [2, 3, 5]}, ["y"], {"w": _w(5, 3), **_bn("bn", 3)})  # BN axis 1 = 3 rows, not features
    out, (res,), _ = prep.apply(model, FuseBatchNorm())
    assert "rank 3" in res.skipped[0].reason and res.details["rewritten_to_mul_add"] == 1
    assert prep.relative_error(model, out, random_feeds(model, 1)[0]) <= TOL


# ---------------------------------------------------------------------------------------------- property
@st.composite
def _fold_case(draw: st.DrawFn) -> tuple[str, str, int, int, int, float, int]:
    op = draw(st.sampled_from(["Conv", "ConvTranspose", "Gemm", "Gemm_transB", "BN_Conv", "BN_Gemm"]))
    dtype = draw(st.sampled_from(["float32", "float16"] + (["float64"] if "Gemm" in op else [])))
    group = draw(st.sampled_from([1, 2, 3])) if "Conv" in op else 1
    cin = group * draw(st.integers(1, 3))
    cout = group * draw(st.integers(1, 3))
    eps = draw(st.sampled_from([1e-5, 1e-3, 0.1, 1e-9]))
    return op, dtype, group, cin, cout, eps, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_fold_case())
def test_property_fused_matches_unfused(prep: Any, case: tuple[str, str, int, int, int, float, int]) -> None:
    op, dtype_name, group, cin, cout, eps, seed = case
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype_name)
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    k = 1 + 2 * int(rng.integers(0, 2))
    n = helper.make_node
    if op in ("Conv", "ConvTranspose"):
        w_shape = (cout, cin // group, k, k) if op == "Conv" else (cin, cout // group, k, k)
        nodes = [n(op, ["x", "w", "cb"], ["c"], name="op", group=group), _bn_node("c", "y", eps=eps)]
        x_shape, c = [2, cin, 5, 5], cout
        inits = {"w": rng.normal(0, 0.5, w_shape), "cb": rng.normal(0, 0.5, cout)}
    elif op.startswith("Gemm"):
        trans_b = int(op == "Gemm_transB")
        nodes = [
            n("Gemm", ["x", "w", "cb"], ["c"], name="op", transB=trans_b, alpha=0.9, beta=1.1),
            _bn_node("c", "y", eps=eps),
        ]
        x_shape, c = [3, cin], cout
        inits = {"w": rng.normal(0, 0.5, (cout, cin) if trans_b else (cin, cout)), "cb": rng.normal(0, 0.5, cout)}
    elif op == "BN_Conv":
        nodes = [_bn_node("x", "b", eps=eps), n("Conv", ["b", "w", "cb"], ["y"], name="op", group=group)]
        x_shape, c = [2, cin, 5, 5], cin
        inits = {"w": rng.normal(0, 0.5, (cout, cin // group, k, k)), "cb": rng.normal(0, 0.5, cout)}
    else:
        nodes = [_bn_node("x", "b", eps=eps), n("Gemm", ["b", "w", "cb"], ["y"], name="op", alpha=1.2, beta=0.8)]
        x_shape, c = [3, cin], cin
        inits = {"w": rng.normal(0, 0.5, (cin, cout)), "cb": rng.normal(0, 0.5, cout)}
    inits.update(_bn("bn", c, np.float64, rng))
    inits["bn.v"] = rng.uniform(0.01, 2.0, c)
    model = _model(nodes, {"x": x_shape}, ["y"], {k_: v.astype(dtype) for k_, v in inits.items()}, elem=elem)
    out, (res,), _ = prep.apply(model, FuseBatchNorm())
    assert prep.ops(out)["BatchNormalization"] == 0 and res.rewritten == 1
    feed = {"x": rng.normal(0, 1, x_shape).astype(dtype)}
    tol = {"float16": 1e-2, "float32": TOL, "float64": 1e-12}[dtype_name]
    assert prep.relative_error(model, out, feed) <= tol


def test_bn_affine_formula() -> None:
    a = BNAffine.from_params(np.array([2.0]), np.array([1.0]), np.array([3.0]), np.array([0.0]), 4.0)
    assert a.s.tolist() == [1.0] and a.t.tolist() == [-2.0]


# ---------------------------------------------------------------------------------------------- subgraphs
def test_bn_inside_loop_and_if_is_fused(prep: Any) -> None:
    n = helper.make_node
    f = TensorProto.FLOAT
    body = helper.make_graph(
        [
            n("Conv", ["acc", "w"], ["c"], name="body/conv", pads=[1, 1, 1, 1]),
            _bn_node("c", "b", "bn"),
            n("Relu", ["b"], ["acc_out"], name="body/relu"),
            n("Identity", ["cond"], ["cond_out"], name="body/id"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", 9, []),
            helper.make_tensor_value_info("acc", f, [1, 3, 4, 4]),
        ],
        [helper.make_tensor_value_info("cond_out", 9, []), helper.make_tensor_value_info("acc_out", f, [1, 3, 4, 4])],
    )
    then_g = helper.make_graph(
        [n("Conv", ["x", "w2"], ["tc"], name="then/conv"), _bn_node("tc", "tb", "bn2")],
        "then",
        [],
        [helper.make_tensor_value_info("tb", f, [1, 3, 4, 4])],
    )
    else_g = helper.make_graph(
        [n("Relu", ["x"], ["eb"], name="else/relu")], "else", [], [helper.make_tensor_value_info("eb", f, [1, 3, 4, 4])]
    )
    nodes = [
        n("Loop", ["trip", "", "x"], ["looped"], name="loop", body=body),
        n("If", ["flag"], ["branch"], name="if", then_branch=then_g, else_branch=else_g),
        n("Add", ["looped", "branch"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", f, [1, 3, 4, 4]), helper.make_tensor_value_info("flag", 9, [])],
        [helper.make_tensor_value_info("y", f, [1, 3, 4, 4])],
        [
            numpy_helper.from_array(v, k)
            for k, v in {
                "w": _w(3, 3, 3, 3),
                "w2": _w(3, 3, 1, 1),
                "trip": np.array(3, np.int64),
                **_bn("bn", 3),
                **_bn("bn2", 3),
            }.items()
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    out, (res,), _ = prep.apply(model, FuseBatchNorm())
    assert res.rewritten == 2 and res.details["scopes"] == 4
    loop = next(x for x in out.graph.node if x.op_type == "Loop")
    assert [x.op_type for x in loop.attribute[0].g.node] == ["Conv", "Relu", "Identity"]
    x = random_feeds(model, 1)[0]["x"]
    for flag in (True, False):
        feed = {"x": x, "flag": np.array(flag)}
        assert prep.relative_error(model, out, feed) <= TOL


# ---------------------------------------------------------------------------------------------- idempotence, pipeline
def test_second_run_changes_nothing(prep: Any) -> None:
    model, _ = _case("concat_bn")
    once, _, _ = prep.apply(model, FuseBatchNorm())
    twice, (res,), _ = prep.apply(once, FuseBatchNorm())
    assert (res.matched, res.rewritten, res.nodes_added, res.nodes_removed) == (0, 0, 0, 0)
    assert prep.graph_bytes(once) == prep.graph_bytes(twice)


def test_registered_and_runs_in_a_verified_pipeline(prep: Any) -> None:
    assert get_pass("fuse_batchnorm") is FuseBatchNorm
    model = conv_bn_net(opset=17)
    result = Pipeline([get_pass("fuse_batchnorm")()]).run(model, verify=True)
    assert prep.ops(result.model)["BatchNormalization"] == 0
    assert (
        result.records[0].verify is not None
        and result.records[0].result.rewritten == prep.ops(model)["BatchNormalization"]
    )


# ---------------------------------------------------------------------------------------------- linearity
def test_whole_graph_walks_are_bounded() -> None:
    from qgraph import GraphHandle, PassContext

    for blocks in (200, 2000):
        handle = GraphHandle(conv_bn_relu_chain(blocks))
        res = FuseBatchNorm().run(handle, PassContext())
        assert res.rewritten == blocks
        assert sum(handle.walks.values()) <= 2, handle.walks  # one index build for new names, at most
        assert len(handle.graph.nodes) == 2 * blocks


# ---------------------------------------------------------------------------------------------- real topologies
# name -> (BatchNormalization nodes, folded into a preceding Conv, rewritten to Mul+Add)
LIGHT = {"resnet50": (53, 53, 0), "inception_v2": (69, 69, 0), "shufflenet": (49, 49, 0), "densenet121": (121, 59, 62)}


@pytest.mark.parametrize("name", list(LIGHT))
def test_light_models(name: str, light_model: Any, prep: Any) -> None:
    model = light_model(name)
    total, into_conv, mul_add = LIGHT[name]
    before = prep.ops(model)
    assert before["BatchNormalization"] == total
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    after_conv = sum(producers.get(n.input[0]) == "Conv" for n in model.graph.node if n.op_type == "BatchNormalization")
    assert after_conv == into_conv  # "every BN that follows a Conv"
    out, (res,), handle = prep.apply(model, FuseBatchNorm())
    ops = prep.ops(out)
    assert ops["BatchNormalization"] == 0
    assert res.details["folded_into_preceding"] == {"Conv": into_conv}
    assert res.details["rewritten_to_mul_add"] == mul_add
    assert (ops["Mul"], ops["Add"]) == (before["Mul"] + mul_add, before["Add"] + mul_add)
    assert len(res.skipped) == mul_add and all(s.reason.endswith("rewritten to Mul+Add") for s in res.skipped)
    assert sum(handle.walks.values()) <= 3
    feed = random_feeds(model, 1, seed=0)[0]
    local = prep.local_errors(model, out, feed)
    worst = max(local, key=lambda k: local[k])
    assert len(local) > total and local[worst] <= TOL, (worst, local[worst])
    end_to_end = prep.relative_error(model, out, feed)
    # onnxruntime's own Conv-BN fusion (ORT_ENABLE_BASIC) of the unmodified model: the float32 noise floor.
    ort_own = prep.relative_error(model, model, feed, level_b="basic")
    assert end_to_end <= max(TOL, 3 * ort_own), (end_to_end, ort_own)
