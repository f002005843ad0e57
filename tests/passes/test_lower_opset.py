"""Unit tests of the opset lowering engine: one structural + numeric check per adapter family."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import parser
from qgraph.passes.lower_opset import LoweringError, lower_model

from qgraph.errors import PassError


def _model(text: str) -> onnx.ModelProto:
    m = parser.parse_model(text)
    onnx.checker.check_model(m)
    return m


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[Any]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return list(
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    )


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _opset(model: onnx.ModelProto) -> int:
    return next(i.version for i in model.opset_import if i.domain in ("", "ai.onnx"))


def _same(a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    for x, y in zip(_run(a, feeds), _run(b, feeds), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)


RNG = np.random.default_rng(0)
X234 = RNG.standard_normal((2, 3, 4)).astype(np.float32)


def test_restamp_changes_only_the_opset_and_ir() -> None:
    m = _model('<ir_version: 8, opset_import: ["" : 14]> g (float[2,3,4] x) => (float[2,3,4] y) { y = Relu(x) }')
    res = lower_model(m, 11)
    assert _ops(res.model) == ["Relu"]
    assert _opset(res.model) == 11 and res.model.ir_version == 6
    assert res.adapters == {"Relu-14: restamp": 1, "Relu-13: restamp": 1}
    _same(m, res.model, {"x": X234})


def test_input_model_is_not_modified() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[2,3,4] x) => (float[2,1,4] y) '
        "{ ax = Constant<value = int64[1] {1}>() y = ReduceMean<keepdims=1>(x, ax) }"
    )
    before = m.SerializeToString()
    lower_model(m, 13)
    assert m.SerializeToString() == before


def test_restamp_refuses_dtype_the_target_lacks() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 19]> g (string[2] a, string[2] b) => (bool[2] y) { y = Equal(a, b) }'
    )
    with pytest.raises(LoweringError) as err:
        lower_model(m, 17)
    assert len(err.value.refusals) == 1
    assert "Equal-13 does not accept tensor(string)" in err.value.refusals[0].reason


def test_small_int_add_is_computed_in_int32() -> None:
    m = _model('<ir_version: 8, opset_import: ["" : 14]> g (int8[4] a, int8[4] b) => (int8[4] y) { y = Add(a, b) }')
    res = lower_model(m, 13)
    assert _ops(res.model) == ["Cast", "Cast", "Add", "Cast"]
    a = np.array([100, -100, 5, 127], np.int8)
    b = np.array([100, -100, 7, 1], np.int8)
    np.testing.assert_array_equal(_run(res.model, {"a": a, "b": b})[0], (a.astype(np.int32) + b).astype(np.int8))


@pytest.mark.parametrize("target", [17, 13, 11])
def test_reduce_axes_input_becomes_attribute(target: int) -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[2,3,4] x) => (float[2,4] y) '
        "{ ax = Constant<value = int64[1] {1}>() y = ReduceMax<keepdims=0>(x, ax) }"
    )
    res = lower_model(m, target)
    red = next(n for n in res.model.graph.node if n.op_type == "ReduceMax")
    assert list(red.input) == ["x"]
    assert onnx.helper.get_attribute_value(red.attribute[[a.name for a in red.attribute].index("axes")]) == [1]
    _same(m, res.model, {"x": X234})


def test_reduce_empty_axes_with_noop_keeps_only_the_elementwise_part() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[2,3,4] x) => (float[2,3,4] y) '
        "{ ax = Constant<value = int64[0] {}>() y = ReduceL2<noop_with_empty_axes=1>(x, ax) }"
    )
    res = lower_model(m, 13)
    assert _ops(res.model) == ["Constant", "Mul", "Sqrt"]
    _same(m, res.model, {"x": X234})


@pytest.mark.parametrize(
    ("op", "keepdims", "target"), [("ReduceL2", 0, 13), ("ReduceMax", 1, 11), ("ReduceSum", 0, 11)]
)
def test_reduce_runtime_axes_are_exact(op: str, keepdims: int, target: int) -> None:
    opset = 13 if op == "ReduceSum" else 18
    m = _model(
        f'<ir_version: 8, opset_import: ["" : {opset}]> g (float[2,3,4] x, int64[2] ax) => (float y) '
        f"{{ y = {op}<keepdims={keepdims}>(x, ax) }}"
    )
    res = lower_model(m, target)
    assert "If" in _ops(res.model)
    for axes in ([0, 2], [-1, 1], [1, 1]):
        feeds = {"x": X234, "ax": np.array(axes, np.int64)}
        _same(m, res.model, feeds)


@pytest.mark.parametrize("op", ["Squeeze", "Unsqueeze"])
def test_squeeze_axes_to_attribute_and_refusal(op: str) -> None:
    shape_in, shape_out = ("[2,1,4]", "[2,4]") if op == "Squeeze" else ("[2,4]", "[2,1,4]")
    m = _model(
        f'<ir_version: 8, opset_import: ["" : 13]> g (float{shape_in} x) => (float{shape_out} y) '
        f"{{ ax = Constant<value = int64[1] {{1}}>() y = {op}(x, ax) }}"
    )
    res = lower_model(m, 11)
    node = next(n for n in res.model.graph.node if n.op_type == op)
    assert list(node.input) == ["x"] and node.attribute[0].ints == [1]
    dyn = _model(
        f'<ir_version: 8, opset_import: ["" : 13]> g (float{shape_in} x, int64[1] ax) => (float{shape_out} y) '
        f"{{ y = {op}(x, ax) }}"
    )
    with pytest.raises(PassError, match="not a constant"):
        lower_model(dyn, 11)


@pytest.mark.parametrize(
    ("axis", "expect"), [(-1, ["Softmax"]), (2, ["Softmax"]), (1, ["Transpose", "Softmax", "Transpose"])]
)
def test_softmax_axis_semantics(axis: int, expect: list[str]) -> None:
    m = _model(
        f'<ir_version: 8, opset_import: ["" : 13]> g (float[2,3,4] x) => (float[2,3,4] y) '
        f"{{ y = Softmax<axis={axis}>(x) }}"
    )
    res = lower_model(m, 11)
    assert _ops(res.model) == expect
    _same(m, res.model, {"x": X234})


def test_logsoftmax_first_axis_uses_transpose() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 13]> g (float[2,3,4] x) => (float[2,3,4] y) { y = LogSoftmax<axis=0>(x) }'
    )
    res = lower_model(m, 11)
    perm = res.model.graph.node[0].attribute[0].ints
    assert list(perm) == [1, 2, 0]
    _same(m, res.model, {"x": X234})


def test_pad_axes_and_inputs_to_attributes() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 19]> g (float[2,3,4] x) => (float[2,5,4] y) '
        "{ p = Constant<value = int64[2] {1, 1}>() v = Constant<value = float {2.5}>() "
        'ax = Constant<value = int64[1] {1}>() y = Pad<mode="constant">(x, p, v, ax) }'
    )
    res17 = lower_model(m, 17)
    pad = next(n for n in res17.model.graph.node if n.op_type == "Pad")
    assert len(pad.input) == 3
    _same(m, res17.model, {"x": X234})
    wrap = _model(
        '<ir_version: 8, opset_import: ["" : 19]> g (float[2,3,4] x, int64[6] p) => (float y) '
        '{ y = Pad<mode="wrap">(x, p) }'
    )
    with pytest.raises(PassError, match="wrap"):
        lower_model(wrap, 17)


def test_clip_split_and_resize_moves() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[2,6] x) => (float[2,3] a, float[2,3] b) '
        "{ lo = Constant<value = float {-0.5}>() hi = Constant<value = float {0.5}>() c = Clip(x, lo, hi) "
        "a, b = Split<axis=1, num_outputs=2>(c) }"
    )
    res = lower_model(m, 13)
    split = next(n for n in res.model.graph.node if n.op_type == "Split")
    assert len(split.input) == 2 and not any(a.name == "num_outputs" for a in split.attribute)
    x = RNG.standard_normal((2, 6)).astype(np.float32)
    _same(m, res.model, {"x": x})
    res11 = lower_model(m, 11)
    assert [a.name for a in next(n for n in res11.model.graph.node if n.op_type == "Split").attribute] == [
        "axis",
        "split",
    ]
    _same(m, res11.model, {"x": x})
    r = _model(
        '<ir_version: 8, opset_import: ["" : 19]> g (float[1,1,2,2] x) => (float[1,1,4,4] y) '
        '{ s = Constant<value = float[2] {2.0, 2.0}>() y = Resize<mode="linear", axes=[2, 3]>(x, , s) }'
    )
    out = lower_model(r, 11)
    rz = next(n for n in out.model.graph.node if n.op_type == "Resize")
    assert len(rz.input) == 3 and all(rz.input)
    _same(r, out.model, {"x": RNG.standard_normal((1, 1, 2, 2)).astype(np.float32)})


def test_function_body_expansion_for_gelu_and_mish() -> None:
    m = _model(
        '<ir_version: 9, opset_import: ["" : 20]> g (float[2,3,4] x) => (float[2,3,4] y) '
        '{ a = Gelu<approximate="tanh">(x) y = Mish(a) }'
    )
    res = lower_model(m, 13)
    ops = _ops(res.model)
    assert "Gelu" not in ops and "Mish" not in ops and "Tanh" in ops and "Softplus" in ops
    assert res.adapters["Gelu-20: function_body"] == 1
    _same(m, res.model, {"x": X234})


def test_layernorm_decomposition_structure_and_numbers() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[2,3,4] x, float[4] s, float[4] b) => (float[2,3,4] y) '
        "{ y = LayerNormalization<axis=-1, epsilon=1e-5>(x, s, b) }"
    )
    res = lower_model(m, 11)
    assert _ops(res.model) == ["ReduceMean", "Sub", "Mul", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Add"]
    feeds = {
        "x": X234 * 10 + 3,
        "s": RNG.standard_normal(4).astype(np.float32),
        "b": RNG.standard_normal(4).astype(np.float32),
    }
    _same(m, res.model, feeds)


def test_trilu_and_bitwise_decompositions() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[3,4] x, int32[3,4] a, int32[3,4] b) '
        "=> (float[3,4] y, int32[3,4] z, int32[3,4] n) "
        "{ y = Trilu<upper=0>(x) z = BitwiseXor(a, b) n = BitwiseNot(a) }"
    )
    res = lower_model(m, 13)
    assert not {"Trilu", "BitwiseXor", "BitwiseNot"} & set(_ops(res.model))
    a = RNG.integers(-(2**31), 2**31 - 1, (3, 4), dtype=np.int32)
    b = RNG.integers(-(2**31), 2**31 - 1, (3, 4), dtype=np.int32)
    y, z, n = _run(res.model, {"x": X234[0, :3], "a": a, "b": b})
    np.testing.assert_array_equal(y, np.tril(X234[0, :3]))
    np.testing.assert_array_equal(z, a ^ b)
    np.testing.assert_array_equal(n, ~a)


def test_subgraphs_are_lowered() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (bool c, float[2,3,4] x) => (float[2,4] y) '
        "{ y = If(c) < then_branch = t () => (float[2,4] a) "
        "{ ax = Constant<value = int64[1] {1}>() a = ReduceMean<keepdims=0>(x, ax) }, "
        "else_branch = e () => (float[2,4] b) "
        "{ ax2 = Constant<value = int64[1] {1}>() b = ReduceMax<keepdims=0>(x, ax2) } > }"
    )
    res = lower_model(m, 13)
    branch = res.model.graph.node[0].attribute[0].g
    assert [a.name for a in branch.node[-1].attribute] == ["keepdims", "axes"]
    for c in (True, False):
        _same(m, res.model, {"c": np.array(c), "x": X234})


def test_refusals_are_collected_for_every_node() -> None:
    m = _model(
        '<ir_version: 9, opset_import: ["" : 20]> g (string[2] s, float[1,1,2,2,2] x, float[1,2,2,2,3] gr) '
        '=> (bool[2] y, float[1,1,2,2,2] z) { y = RegexFullMatch<pattern="a.*">(s) z = GridSample(x, gr) }'
    )
    with pytest.raises(LoweringError) as err:
        lower_model(m, 17)
    ops = sorted(r.op for r in err.value.refusals)
    assert ops == ["GridSample", "RegexFullMatch"]
    assert "no decomposition" in str(err.value) and "GridSample-16" in str(err.value)


def test_idempotence_and_same_target_is_a_copy() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[2,3,4] x) => (float[2,3,4] y) '
        "{ ax = Constant<value = int64[1] {1}>() r = ReduceMean<keepdims=1>(x, ax) y = Softmax<axis=1>(r) }"
    )
    once = lower_model(m, 11).model
    twice = lower_model(once, 11)
    assert twice.model.SerializeToString() == once.SerializeToString()
    assert not twice.changed


def test_bad_targets_are_pass_errors() -> None:
    m = _model('<ir_version: 8, opset_import: ["" : 13]> g (float[2] x) => (float[2] y) { y = Relu(x) }')
    with pytest.raises(PassError, match="raise_model"):
        lower_model(m, 17)
    with pytest.raises(PassError, match="below opset"):
        lower_model(m, 5)


def test_dtype_upcast_and_bool_reduce() -> None:
    m = _model(
        '<ir_version: 9, opset_import: ["" : 20]> g (float16[4] x, bool[2,3] b) => (bool[4] y, bool[2] z) '
        "{ y = IsInf(x) ax = Constant<value = int64[1] {1}>() z = ReduceMax<keepdims=0>(b, ax) }"
    )
    res = lower_model(m, 13)
    x = np.array([np.inf, -np.inf, 1.0, np.nan], np.float16)
    bb = np.array([[True, False, False], [False, False, False]])
    y, z = _run(res.model, {"x": x, "b": bb})
    np.testing.assert_array_equal(y, np.isinf(x))
    np.testing.assert_array_equal(z, bb.any(axis=1))


def test_shape_start_end_and_argmax_last_index() -> None:
    m = _model(
        '<ir_version: 8, opset_import: ["" : 15]> g (float[2,3,4] x) => (int64[2] s, int64[2,4] i) '
        "{ s = Shape<start=1>(x) i = ArgMax<axis=1, keepdims=0, select_last_index=1>(x) }"
    )
    res = lower_model(m, 11)
    assert "Slice" in _ops(res.model)
    x = np.round(X234)
    s, i = _run(res.model, {"x": x})
    np.testing.assert_array_equal(s, [3, 4])
    np.testing.assert_array_equal(i, 2 - np.argmax(x[:, ::-1, :], axis=1))
