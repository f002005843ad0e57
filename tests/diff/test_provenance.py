"""Why a node is not integer (`qgraph.analysis.diff.provenance.float_reasons`): the quantizing pass's reason wins over a
preparation pass's skip and a later pass's consequential skip, in ``qgraph diff`` and in the run report alike."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qgraph import Pipeline, Recipe
from qgraph.analysis.diff.provenance import Skip, float_reasons, provenance_reasons
from qgraph.analysis.diff.structural import structural_diff
from qgraph.analysis.report import build_report
from qgraph.data import CallableSource
from qgraph.pipeline.pass_api import get_pass

DW_HARDSWISH = """<ir_version: 8, opset_import: ["" : 17]>
dw (float[1,8,16,16] x) => (float[1,4] y) {
  d = Conv<group = 8, pads = [1,1,1,1]>(x, wd, bd)
  h = HardSwish(d)
  p = Conv(h, wp, bp)
  r = Relu(p)
  g = GlobalAveragePool(r)
  f = Flatten(g)
  y = Gemm<transB = 1>(f, wf, bf)
}"""


def test_float_reasons_priority() -> None:
    skips = [Skip("equalize_weights", False, "a", "not scale-equivariant"),
             Skip("insert_qdq", True, "a", "kept float for speed"),
             Skip("correct_bias", False, "a", "not read through a DequantizeLinear"),
             Skip("equalize_weights", False, "b", "no second layer"),
             Skip("correct_bias", False, "b", "not read through a DequantizeLinear"),
             Skip("insert_qdq", True, "c", "no integer kernel"),
             Skip("float_fallback", True, "c", "already float")]
    assert float_reasons(skips) == {
        "a": "insert_qdq: kept float for speed (also skipped by equalize_weights, correct_bias)",
        "b": "equalize_weights: no second layer (also skipped by correct_bias)",  # no quantizing reason: the first
        "c": "insert_qdq: no integer kernel (also skipped by float_fallback)",
    }
    # provenance written before `quantizes` was recorded: the quantizing passes are known by name
    old = [{"pass": "equalize_weights", "skipped": 1, "skipped_nodes": [{"node": "a", "reason": "prep"}]},
           {"pass": "insert_qdq", "skipped": 1, "skipped_nodes": [{"node": "a", "reason": "quant"}]}]
    assert provenance_reasons(old) == {"a": "insert_qdq: quant (also skipped by equalize_weights)"}


def _model() -> onnx.ModelProto:
    m = onnx.parser.parse_model(DW_HARDSWISH)
    rng = np.random.default_rng(0)
    shapes = {"wd": (8, 1, 3, 3), "bd": (8,), "wp": (8, 8, 1, 1), "bp": (8,), "wf": (4, 8), "bf": (4,)}
    for name, shape in shapes.items():
        m.graph.initializer.append(numpy_helper.from_array(rng.normal(0, 0.4, shape).astype(np.float32), name))
    for i, node in enumerate(m.graph.node):
        node.name = f"{node.op_type.lower()}{i}"
    return m


def test_diff_and_report_show_the_quantizing_pass_reason() -> None:
    model = _model()
    feeds = [{"x": np.random.default_rng(s).standard_normal((1, 8, 16, 16)).astype(np.float32)} for s in range(4)]
    recipe = Recipe("why", [get_pass("equalize_weights")(), get_pass("insert_qdq")(preset="ort-x86-vnni",
                    depthwise="float", latency={"mode": "off"}), get_pass("correct_bias")()])
    result = Pipeline(recipe.passes, recipe=recipe).run(model, calibration_data=CallableSource(lambda: feeds, "t"),
                                                        keep_stages=True)
    skipped_by = {r.name: [s.node for s in r.result.skipped] for r in result.records}
    # all three passes left the depthwise conv alone, each for its own reason
    assert all("conv0" in nodes for nodes in skipped_by.values()), skipped_by
    expected = ("insert_qdq: depthwise Conv (group 8) left float (depthwise: float): its per-tensor input scale "
                "would serve channels of very different ranges (also skipped by equalize_weights, correct_bias)")
    diffed = {n.node: n for n in structural_diff(model, result.model).coverage_b.nodes}
    reported = {n.node: n for n in build_report(recipe, result).coverage.nodes}
    for coverage in (diffed, reported):
        assert coverage["conv0"].status == "float" and coverage["conv0"].reason == expected
        assert coverage["conv2"].status == "int8" and coverage["conv2"].reason == ""



def test_float_fallback_reason_wins_and_is_not_a_skip() -> None:
    model = _model()
    feeds = [{"x": np.random.default_rng(s).standard_normal((1, 8, 16, 16)).astype(np.float32)} for s in range(4)]
    recipe = Recipe("back", [get_pass("equalize_weights")(),
                             get_pass("insert_qdq")(preset="ort-x86-vnni", latency={"mode": "off"}),
                             get_pass("float_fallback")(nodes={"names": ["conv0"], "op_types": ["Gemm"]})])
    result = Pipeline(recipe.passes, recipe=recipe).run(model, calibration_data=CallableSource(lambda: feeds, "t"),
                                                        keep_stages=True)
    fallback = result.records[-1].result
    assert fallback.skipped == [] and sorted(fallback.details["fallen_back"]) == ["conv0", "gemm6"]
    assert [s.node for s in result.records[0].result.skipped] == ["conv0"]  # equalize_weights: HardSwish follows
    diffed = {n.node: n for n in structural_diff(model, result.model).coverage_b.nodes}
    reported = {n.node: n for n in build_report(recipe, result).coverage.nodes}
    for coverage in (diffed, reported):
        assert coverage["conv0"].status == "float" and coverage["conv0"].reason == (
            "float_fallback: returned to float (selected: name in nodes.names) (also skipped by equalize_weights)")
        assert coverage["gemm6"].status == "float" and coverage["gemm6"].reason == (
            "float_fallback: returned to float (selected: op_type Gemm in nodes.op_types)")
        assert coverage["conv2"].status == "int8" and coverage["conv2"].reason == ""
