"""``fuse_affine``: constant per-channel Mul/Add/Sub/Div around a Conv go into its weight and bias, results kept."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from qgraph.passes.fuse_affine import FuseAffine, FuseAffineConfig

from qgraph import GraphHandle, PassContext, Recipe

_RNG = np.random.default_rng(0)


class _Builder:
    """A small graph written node by node, every constant an initializer (as exporters write them)."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: Any) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def op(self, op: str, inputs: list[str], out: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"n_{out}", **attrs))
        return out

    def conv(self, x: str, out: str, cin: int, cout: int, k: int, pad: int, group: int = 1) -> str:
        w = self.const(f"{out}_w", _RNG.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin * k * k / group))
        b = self.const(f"{out}_b", _RNG.standard_normal(cout) * 0.1)
        return self.op("Conv", [x, w, b], out, kernel_shape=[k, k], pads=[pad] * 4, group=group)

    def model(self, outputs: list[tuple[str, list[int]]]) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, "lcnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 10])],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _lcnet() -> onnx.ModelProto:
    """PP-LCNetV3's blocks as Paddle exports them (an affine block ``Mul(a) -> Add(b)`` after every convolution and
    after every activation), an SE-free depthwise/pointwise chain, a ConvTranspose head, and three steps that must
    stay: a per-pixel Mul, ``c - x``, and a shift before a padded convolution."""
    g = _Builder()
    y = g.conv("x", "c1", 8, 16, 3, 1)
    y = g.op("Mul", [y, g.const("a1", 1.7)], "m1")
    y = g.op("Add", [g.const("b1", -0.3), y], "p1")  # the constant first: Add is commutative
    y = g.op("HardSwish", [y], "h1")
    y = g.op("Mul", [y, g.const("a2", 0.8)], "m2")
    y = g.op("Add", [y, g.const("b2", 0.25)], "p2")
    y = g.conv(y, "c2", 16, 16, 1, 0)  # 1x1, no padding: the affine step after h1 folds into it
    y = g.op("Mul", [y, g.const("s3", _RNG.uniform(0.5, 2.0, (1, 16, 1, 1)))], "m3")
    y = g.op("Div", [y, g.const("d3", 1.5)], "v3")
    y = g.op("Sub", [y, g.const("e3", _RNG.standard_normal((16, 1, 1)))], "s3o")
    y = g.op("Relu", [y], "r3")
    y = g.op("Mul", [y, g.const("a4", 0.5)], "m4")  # a pure scale: folds into the padded depthwise conv
    y = g.conv(y, "dw", 16, 16, 3, 1, group=16)
    y = g.op("HardSwish", [y], "h5")
    y = g.op("Add", [y, g.const("b5", 0.1)], "p5")  # a shift before a padded conv: stays
    y = g.conv(y, "c6", 16, 8, 3, 1)
    wt = g.const("wt", _RNG.standard_normal((8, 4, 2, 2)) * 0.3)  # ConvTranspose [C_in, M / group, k, k], 2 groups
    y = g.op("ConvTranspose", [y, wt], "t7", strides=[2, 2], group=2)
    y = g.op("Mul", [y, g.const("s7", _RNG.uniform(-2.0, 2.0, (1, 8, 1, 1)))], "m7")
    y = g.op("Add", [y, g.const("b7", _RNG.standard_normal((1, 8, 1, 1)))], "out")
    z = g.conv("x", "c8", 8, 4, 1, 0)
    g.op("Mul", [z, g.const("px", _RNG.standard_normal((1, 1, 10, 10)))], "m8")  # per pixel: stays
    z = g.conv("x", "c9", 8, 4, 1, 0)
    g.op("Sub", [g.const("one", 1.0), z], "side")  # c - x: stays
    return g.model([("out", [1, 8, 20, 20]), ("m8", [1, 4, 10, 10]), ("side", [1, 4, 10, 10])])


def _feed(shape: tuple[int, ...] = (1, 8, 10, 10)) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}


def test_affine_blocks_fold_into_the_convolutions_around_them(prep: Any) -> None:
    model = _lcnet()
    out, (res,), _ = prep.apply(model, FuseAffine())
    ops = prep.ops(out)
    # after c1: m1, p1; after c2: m3, v3, s3o; after the ConvTranspose: m7, out; before c2: m2, p2; before dw: m4
    assert res.details_dict() == {"after": 7, "before": 3}
    assert res.rewritten == res.nodes_removed == 10
    assert ops["Mul"] == 1 and ops["Add"] == 1 and ops["Sub"] == 1 and ops["Div"] == 0  # m8, p5, side remain
    reasons = {s.node: s.reason for s in res.skipped}
    assert "pads its border with 0" in reasons["n_p5"]
    assert "one value per channel" in reasons["n_m8"]
    assert "c - x" in reasons["n_side"]
    assert [o.name for o in out.graph.output] == ["out", "m8", "side"]  # the convolutions took the last nodes' outputs
    assert prep.relative_error(model, out, _feed()) < 1e-5
    _, (again,), _ = prep.apply(out, FuseAffine())
    assert again.rewritten == 0  # idempotent


def test_before_off_and_conv_only(prep: Any) -> None:
    model = _lcnet()
    out, (res,), _ = prep.apply(model, FuseAffine(FuseAffineConfig(before=False, op_types=("Conv",))))
    assert res.details_dict() == {"after": 5, "before": 0}  # the ConvTranspose's m7/out stay, nothing folds forward
    assert prep.relative_error(model, out, _feed()) < 1e-5


def test_a_shared_weight_is_not_rescaled_for_its_other_reader(prep: Any) -> None:
    g = _Builder()
    w = g.const("w", _RNG.standard_normal((4, 8, 1, 1)))
    a = g.op("Conv", ["x", w], "a")
    g.op("Mul", [a, g.const("s", 3.0)], "sa")
    g.op("Conv", ["x", w], "b")
    model = g.model([("sa", [1, 4, 10, 10]), ("b", [1, 4, 10, 10])])
    out, (res,), _ = prep.apply(model, FuseAffine())
    assert res.rewritten == 1 and prep.ops(out)["Mul"] == 0
    assert prep.relative_error(model, out, _feed()) < 1e-6


@settings(max_examples=30, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), per_group=st.integers(1, 3), out_per_group=st.integers(1, 3),
       k=st.sampled_from([1, 3]), scalar=st.booleans(), seed=st.integers(0, 2**16))
def test_folding_is_exact_for_any_grouping(groups: int, per_group: int, out_per_group: int, k: int, scalar: bool,
                                           seed: int) -> None:
    """Property: Mul/Add before and after a grouped convolution without padding fold into it, and the folded
    model computes what the original does (float64 reference: the rewrite, not float32 rounding, is checked)."""
    rng = np.random.default_rng(seed)
    cin, cout = groups * per_group, groups * out_per_group
    shape = (1,) if scalar else (1, cin, 1, 1)
    s_in, d_in = rng.uniform(-2, 2, shape), rng.standard_normal(shape)
    oshape = (1,) if scalar else (1, cout, 1, 1)
    s_out, d_out = rng.uniform(-2, 2, oshape), rng.standard_normal(oshape)
    w, b = rng.standard_normal((cout, per_group, k, k)), rng.standard_normal(cout)
    nodes = [helper.make_node("Mul", ["x", "si"], ["u"]), helper.make_node("Add", ["u", "di"], ["v"]),
             helper.make_node("Conv", ["v", "w", "b"], ["c"], group=groups, kernel_shape=[k, k]),
             helper.make_node("Mul", ["c", "so"], ["m"]), helper.make_node("Add", ["m", "do"], ["y"])]
    inits = [numpy_helper.from_array(np.asarray(v, np.float64), n)
             for n, v in {"si": s_in, "di": d_in, "w": w, "b": b, "so": s_out, "do": d_out}.items()]
    side = 5
    x_info = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, cin, side, side])
    y_info = helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)
    graph = helper.make_graph(nodes, "g", [x_info], [y_info], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    handle = GraphHandle(model)
    res = FuseAffine().run(handle, PassContext())
    assert res.details_dict() == {"after": 2, "before": 2}
    out = handle.to_onnx()
    x = {"x": rng.standard_normal((1, cin, side, side))}
    want = ReferenceEvaluator(model).run(None, x)[0]  # onnxruntime has no float64 Conv
    got = ReferenceEvaluator(out).run(None, x)[0]
    assert [n.op_type for n in out.graph.node] == ["Conv"]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * float(np.abs(want).max()))


def _rapidocr_rec() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")  # not imported: its __init__ needs cv2
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("rapidocr_onnxruntime is not installed "
                    "(python -m pip install --no-deps rapidocr-onnxruntime==1.4.4)")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / "ch_PP-OCRv4_rec_infer.onnx"


def test_pp_ocrv4_recognizer_keeps_its_outputs() -> None:
    """The real PP-LCNetV3 recognizer (trained weights): its affine blocks fold, and the probabilities move no more
    than onnxruntime's own graph optimizations move them (float32 summation order; measured 1.03e-5 against
    2.7e-5), or 3e-5 of their scale on a host whose optimizations keep every bit."""
    model = onnx.load(str(_rapidocr_rec()))
    prep = Recipe.from_dict({"name": "p", "passes": [{"pass": "fold_constants"}, {"pass": "fuse_activations"}]})
    base = prep.pipeline().run(model).model
    result = Recipe.from_dict({"name": "a", "passes": [{"pass": "fuse_affine"}]}).pipeline().run(base)
    details = result.records[-1].result.details_dict()
    assert details["after"] >= 50 and details["before"] >= 20  # measured: 56 and 24
    x = {"x": np.random.default_rng(3).uniform(-1, 1, (2, 3, 48, 320)).astype(np.float32)}

    def run(m: onnx.ModelProto, level: ort.GraphOptimizationLevel) -> np.ndarray:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        return np.asarray(ort.InferenceSession(m.SerializeToString(), opts).run(None, x)[0])

    plain = run(base, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    noise = float(np.abs(run(base, ort.GraphOptimizationLevel.ORT_ENABLE_ALL) - plain).max())
    err = float(np.abs(run(result.model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL) - plain).max())
    # any weight rewrite moves a 100-layer float32 model by its summation-order noise: onnxruntime's own
    # optimizations move it by 2.7e-5 on an AVX512 host; a wrong fold moves it by far more than either bound
    assert err <= max(noise, 3e-5 * float(np.abs(plain).max())), (err, noise)
    assert sum(n.op_type in ("Mul", "Add") for n in result.model.graph.node) < sum(
        n.op_type in ("Mul", "Add") for n in base.graph.node) - 70


def test_a_tensor_an_if_branch_reads_or_returns_keeps_its_producer(prep: Any) -> None:
    """``c`` feeds the Mul and, implicitly, the If's then-branch; in the else-branch ``e_c`` feeds a Mul and is one
    of the branch's outputs. Folding either Mul would take its input away; the branch's third chain folds."""
    w = numpy_helper.from_array(_RNG.standard_normal((4, 8, 1, 1)).astype(np.float32), "w")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    shape = [1, 4, 10, 10]

    def outs(*names: str) -> list[onnx.ValueInfoProto]:
        return [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in names]

    then_g = helper.make_graph([helper.make_node("Identity", ["c"], [f"t{i}"]) for i in range(3)], "then", [],
                               outs("t0", "t1", "t2"))
    else_g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["e_c"]), helper.make_node("Mul", ["e_c", "two"], ["e_m"]),
         helper.make_node("Conv", ["x", "w"], ["e_d"]), helper.make_node("Mul", ["e_d", "two"], ["e_n"])],
        "else", [], outs("e_c", "e_m", "e_n"))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Mul", ["c", "two"], ["m"], name="mul"),
             helper.make_node("If", ["flag"], ["p0", "p1", "p2"], name="if", then_branch=then_g, else_branch=else_g)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 10]),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])], outs("m", "p0", "p1", "p2"),
        [w, two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, (res,), _ = prep.apply(model, FuseAffine())
    assert res.details_dict() == {"after": 1, "before": 0}  # e_n's Mul only
    for flag in (True, False):
        feed = {**_feed(), "flag": np.array(flag)}
        want = ort.InferenceSession(model.SerializeToString()).run(None, feed)
        got = ort.InferenceSession(out.SerializeToString()).run(None, feed)
        for a, b in zip(want, got, strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
