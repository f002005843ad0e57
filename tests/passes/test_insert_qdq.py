"""insert_qdq on small models: structure and names, numbers in onnxruntime, idempotence, validation."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from insert_qdq_helpers import cosine, feeds_for, initializer, nodes_by_name, quantize, run, tiny_cnn, with_weights
from qgraph.passes.insert_qdq import InsertQDQ, InsertQDQConfig
from qgraph.passes.insert_qdq.config import PRESETS

from qgraph import GraphHandle, PassContext, PassError, Pipeline, Recipe
from qgraph.errors import DataError, RecipeError
from qgraph.quant.math import QuantSpec, compute_scale_zero_point
from qgraph.quant.qdq import find_qdq_pairs, ort_fusion_report

FEEDS = feeds_for(tiny_cnn(), 16, seed=1)
EVAL = feeds_for(tiny_cnn(), 4, seed=2)


@pytest.fixture(scope="module")
def vnni() -> onnx.ModelProto:
    # symmetric weights pinned so the structure is exact (the preset's "auto" is tested separately)
    return quantize(tiny_cnn(), FEEDS, preset="ort-x86-vnni", weights={"symmetric": True}).model


def test_structure_names_and_sharing(vnni: onnx.ModelProto) -> None:
    nodes = nodes_by_name(vnni)
    # activations: <tensor>/q and <tensor>/dq, original float names kept, Relu absorbed (Q after it)
    for t in ("x", "r1", "p1", "c2", "r2", "g", "f"):
        assert nodes[f"{t}/q"].op_type == "QuantizeLinear" and nodes[f"{t}/q"].input[0] == t
        assert nodes[f"{t}/dq"].op_type == "DequantizeLinear" and nodes[f"{t}/dq"].output == [f"{t}/dq"]
    assert "c1/q" not in nodes and "a/q" not in nodes  # Relu absorbed: Conv -> Relu -> Q
    # one shared pair per tensor: p1 feeds Conv and Add through the same DQ
    consumers = [n for n in vnni.graph.node if "p1/dq" in n.input]
    assert sorted(n.op_type for n in consumers) == ["Add", "Conv"]
    # MaxPool and Flatten share their input group's scale/zero point (onnxruntime drops their Q/DQ)
    assert nodes["p1/q"].input[1:] == nodes["r1/q"].input[1:] == ["r1/scale", "r1/zero_point"]
    assert nodes["f/q"].input[1] == "g/scale"
    # weights per output channel, int8 symmetric; bias int32 with scale = input scale x weight scale
    w1q, w1s = initializer(vnni, "w1/q"), initializer(vnni, "w1/scale")
    assert w1q.dtype == np.int8 and w1s.shape == (8,) and nodes["w1/dq"].attribute[0].i == 0
    assert int(np.abs(w1q).max()) == 127 and not np.any(initializer(vnni, "w1/zero_point"))
    b1q, b1s = initializer(vnni, "b1/q"), initializer(vnni, "b1/scale")
    assert b1q.dtype == np.int32 and np.array_equal(b1s, (initializer(vnni, "x/scale") * w1s).astype(np.float32))
    assert initializer(vnni, "wf/scale").shape == (4,)  # Gemm transB=1: axis 0
    # u8 asymmetric activations; a Relu output's zero point is 0 (so onnxruntime drops the Relu)
    assert initializer(vnni, "r1/zero_point").dtype == np.uint8 and int(initializer(vnni, "r1/zero_point")) == 0
    # tags and graph output name
    assert all(n.doc_string == "qgraph:insert_qdq" for n in vnni.graph.node if n.op_type.endswith("Linear"))
    assert [o.name for o in vnni.graph.output] == ["y"]
    assert {p.tensor for p in find_qdq_pairs(vnni)} == {"x", "r1", "p1", "c2", "r2", "g", "f"}


def test_details_report_what_happened() -> None:
    res = quantize(tiny_cnn(), FEEDS, preset="ort-x86-vnni").records[0].result
    d = res.details
    assert d["quantized_ops"] == {"Conv": 2, "Add": 1, "GlobalAveragePool": 1, "Gemm": 1}
    assert len(d["integer_data_movement"]) == 2  # MaxPool, Flatten
    assert d["quantized_tensors"] == 7 and d["calibrated_tensors"] == 5  # p1 shares r1, f shares g
    assert [len(q["absorbed"]) for q in d["quantized"]] == [1, 0, 1, 0, 0]  # Relu after conv1 and after the Add
    assert d["reduce_range"].startswith("reduce_range: false") and "VPDPBUSD" in d["why"]
    assert res.skipped == [] and res.rewritten == 7
    cal = d["calibration"]  # where calibration is fragile, for reports: minmax clips nothing
    assert cal["method"] == "minmax" and cal["most_clipped"] == []
    assert len(cal["largest_outlier_ratio"]) == 5 and all(r["outlier_ratio"] >= 1 for r in cal["largest_outlier_ratio"])


def test_onnxruntime_fuses_everything(vnni: onnx.ModelProto) -> None:
    rep = ort_fusion_report(vnni)
    assert rep.integer == {"QGemm": 1, "QLinearAdd": 1, "QLinearConv": 2, "QLinearGlobalAveragePool": 1}
    assert rep.quantize == 1 and rep.dequantize == 0  # only the graph input is quantized in float
    assert rep.float_compute == {} and rep.ops["Relu"] == 0


def test_numbers_fused_equal_qdq_reference_and_close_to_float(vnni: onnx.ModelProto) -> None:
    float_out = [run(tiny_cnn(), f)[0] for f in EVAL]
    ref = [run(vnni, f, optimized=False)[0] for f in EVAL]  # QDQ semantics, every op in float
    fused = [run(vnni, f)[0] for f in EVAL]  # integer kernels
    step = float(np.max(np.abs(np.concatenate(float_out)))) / 64
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(ref, fused, strict=True)) < step
    assert cosine(float_out, fused) > 0.995


def test_second_run_rewrites_nothing(vnni: onnx.ModelProto) -> None:
    res = quantize(vnni, FEEDS, preset="ort-x86-vnni")
    r = res.records[0].result
    assert r.rewritten == 0 and r.nodes_added == 0 and r.details["quantized_tensors"] == 0
    assert len(res.model.graph.node) == len(vnni.graph.node)
    assert all(s.reason.startswith("already quantized") for s in r.skipped)


@pytest.mark.parametrize(
    "options",
    [
        {"preset": "ort-x86-avx2"},
        {"preset": "ort-arm"},
        {"preset": "tensorrt"},
        {"weights": {"per_channel": False, "symmetric": False, "dtype": "uint8"}, "activations": {"dtype": "int8"}},
        {"activations": {"symmetric": True, "method": "percentile", "method_options": {"percentile": 99.9}}},
        {"activations": {"method": "entropy"}, "weights": {"narrow_range": True, "reduce_range": True}},
        {"bias": "float", "op_types": ["Conv", "Gemm"]},
    ],
)
def test_variants_run_and_stay_close(options: dict[str, object]) -> None:
    m = quantize(tiny_cnn(), FEEDS, **options).model
    float_out = [run(tiny_cnn(), f)[0] for f in EVAL]
    assert cosine(float_out, [run(m, f)[0] for f in EVAL]) > 0.99


def test_tensorrt_keeps_float_weights_behind_qdq_and_symmetric_int8() -> None:
    m = quantize(tiny_cnn(), FEEDS, preset="tensorrt").model
    nodes = nodes_by_name(m)
    assert nodes["w1/q"].op_type == "QuantizeLinear" and nodes["w1/q"].input[0] == "w1"
    assert initializer(m, "w1").dtype == np.float32 and "b1/q" not in {t.name for t in m.graph.initializer}
    assert initializer(m, "x/zero_point").dtype == np.int8 and int(initializer(m, "x/zero_point")) == 0
    assert int(np.abs(initializer(m, "w1/zero_point")).max()) == 0


def test_reduce_range_gives_7_bit_weights() -> None:
    m = quantize(tiny_cnn(), FEEDS, preset="ort-x86-avx2", weights={"symmetric": True, "reduce_range": True}).model
    assert int(np.abs(initializer(m, "w2/q")).max()) == 63
    m = quantize(tiny_cnn(), FEEDS, preset="ort-x86-avx2", weights={"reduce_range": True}).model
    w = initializer(m, "w2/q")
    assert -64 <= int(w.min()) and int(w.max()) <= 63
    # the preset itself keeps 8-bit codes (its `saturation: avoid` raises only the channels at risk)
    assert int(np.abs(initializer(quantize(tiny_cnn(), FEEDS, preset="ort-x86-avx2").model, "w2/q")).max()) > 64


def test_auto_symmetry_gives_lopsided_layers_a_zero_point() -> None:
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,2] y) { h = MatMul(x, w)  y = MatMul(h, v) }
    """
    rng = np.random.default_rng(0)
    lopsided = rng.uniform(0.1, 1.0, (4, 4)).astype(np.float32)  # all positive: a zero point doubles resolution
    half = rng.normal(0, 1, (2, 2)).astype(np.float32)
    centered = np.concatenate([half, -half])  # each column spans [-a, a]: symmetric is already optimal
    m = with_weights(text, {"w": lopsided, "v": centered})
    feeds = feeds_for(m, 32)
    q = quantize(m, feeds, preset="ort-x86-vnni", weights={"symmetric": "auto"}).model
    assert np.any(initializer(q, "w/zero_point") != 0) and not np.any(initializer(q, "v/zero_point"))
    assert initializer(q, "w/zero_point").tolist() == [-128] * 4  # range [0, max]: every code of int8 in use
    assert int(initializer(q, "w/q").max()) == 127
    assert cosine([run(m, f)[0] for f in feeds], [run(q, f)[0] for f in feeds]) > 0.999


def test_old_opsets_are_raised_when_the_options_need_it() -> None:
    old = tiny_cnn(opset=11)
    res = quantize(old, FEEDS, preset="ort-x86-vnni")
    assert {o.domain: o.version for o in res.model.opset_import}[""] == 13
    decisions = res.records[0].result.decisions
    assert any(d.startswith("opset raised 11 -> 13: per-channel weight quantization") for d in decisions)
    assert "opset raised 11 -> 13" in {p.key: p.value for p in res.model.metadata_props}["qgraph.passes"]
    dq = [n for n in res.model.graph.node if n.op_type == "DequantizeLinear" and n.attribute]
    assert dq  # per-channel weights (axis attribute) after the raise
    kept = quantize(old, FEEDS, weights={"per_channel": False})  # per-tensor is fine at opset 11: nothing raised
    assert {o.domain: o.version for o in kept.model.opset_import}[""] == 11
    with pytest.raises(PassError, match=r"per-channel .* opset >= 13 .* `opset: keep`"):
        quantize(old, FEEDS, preset="ort-x86-vnni", opset="keep")
    with pytest.raises(PassError, match=r"int4 quantization needs opset >= 21"):
        quantize(tiny_cnn(), FEEDS, weights={"dtype": "int4"}, opset="keep")


def test_static_without_data_says_how_to_pass_it() -> None:
    # bad input, refused before any pass runs (`qgraph.pipeline.preflight.require_data`): exit 2, not a pass failure
    with pytest.raises(DataError, match="--calibration-data"):
        quantize(tiny_cnn(), None, preset="ort-x86-vnni")


def test_presets_expand_and_explicit_keys_win() -> None:
    cfg = InsertQDQConfig(preset="ort-x86-avx2", weights={"per_channel": False})
    assert cfg.weights.reduce_range is False and cfg.weights.per_channel is False
    assert cfg.activations.dtype.value == "uint8" and cfg.saturation == "avoid"
    assert "VPMADDUBSW" in PRESETS["ort-x86-avx2"].why
    assert InsertQDQConfig(preset="tensorrt").weights.format == "float_qdq"
    text = Pipeline([InsertQDQ(cfg)]).to_yaml()
    assert "preset: ort-x86-avx2" in text and "per_channel: false" in text and "reduce_range" not in text
    again = Recipe.from_text(text)  # preset + the user's options round-trip
    assert again.passes[0].config == cfg
    # Editing the preset in the written recipe switches everything the preset decides (issue #12 item 7).
    vnni = Recipe.from_text(text.replace("ort-x86-avx2", "ort-x86-vnni")).passes[0].config
    assert vnni.weights.reduce_range is False and vnni.saturation == "off" and vnni.weights.per_channel is False
    with pytest.raises(RecipeError, match="why"):
        Recipe.from_text("name: r\npasses:\n  - pass: insert_qdq\n    preset: tensorrt\n    why: because\n")
    with pytest.raises(RecipeError):
        InsertQDQ(preset="ort-x86-sse")
    with pytest.raises(RecipeError, match="preset"):
        Recipe.from_text("name: r\npasses:\n  - pass: insert_qdq\n    preset: ort-x86\n")


def test_selector_and_op_types_limit_what_is_quantized() -> None:
    res = quantize(tiny_cnn(), FEEDS, op_types=["Conv"], nodes={"exclude": {"regex": ["^$"]}})
    d = res.records[0].result.details
    assert d["quantized_ops"] == {"Conv": 2}
    res = quantize(tiny_cnn(), FEEDS, nodes={"names": ["does_not_exist"]})
    assert any("does_not_exist" in n for n in res.records[0].result.unmatched)


def test_unsupported_error_mode_lists_nodes() -> None:
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,8] x) => (float[1,8] y) { s = Sin(x)  y = MatMul(s, w) }
    """
    m = with_weights(text, {"w": np.eye(8, dtype=np.float32)})
    feeds = feeds_for(m, 2)
    quantize(m, feeds, op_types=["MatMul", "Sin"])  # float: fine, Sin reported
    with pytest.raises(PassError, match="Sin has no integer kernel"):
        quantize(m, feeds, op_types=["MatMul", "Sin"], unsupported="error")


def test_tiny_bias_scale_raises_the_weight_scale() -> None:
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,2] y) { y = Gemm<transB=1>(x, w, b) }
    """
    m = with_weights(text, {"w": np.full((2, 4), 1e-9, np.float32), "b": np.array([5e3, -1.0], np.float32)})
    res = quantize(m, [{"x": np.ones((1, 4), np.float32) * 1e-3}], preset="ort-x86-vnni")
    assert "weight scales raised" in " ".join(res.records[0].result.notes)
    b, bs = initializer(res.model, "b/q"), initializer(res.model, "b/scale")
    assert abs(float(b[0]) * float(bs[0]) - 5e3) < 5e3 * 1e-6


def test_constant_masks_and_outliers_are_not_quantized() -> None:
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,16] x, float[1,16] m) => (float[1,16] y) {
      h = MatMul(x, w)
      inv = Sub(one, m)
      big = Mul(inv, neg)
      s = Add(h, big)
      y = MatMul(s, w2)
    }
    """
    rng = np.random.default_rng(0)
    m = with_weights(
        text,
        {
            "w": rng.normal(0, 0.3, (16, 16)).astype(np.float32),
            "w2": rng.normal(0, 0.3, (16, 16)).astype(np.float32),
            "one": np.array(1.0, np.float32),
            "neg": np.array(-10000.0, np.float32),
        },
    )
    feeds = [
        {"x": rng.standard_normal((1, 16)).astype(np.float32), "m": (rng.random((1, 16)) > 0.3).astype(np.float32)}
        for _ in range(8)
    ]
    res = quantize(m, feeds, preset="ort-x86-vnni")
    r = res.records[0].result
    reasons = {s.node: s.reason for s in r.skipped}
    assert "masking" in " ".join(reasons.values())
    assert "big" in r.details["excluded_tensors"] or "s" in r.details["excluded_tensors"]
    assert r.details["quantized_ops"].get("MatMul") == 1  # the first MatMul; the one reading s stays float


def test_extreme_outlier_tensor_stays_float() -> None:
    """One value 1,000x the bulk (below the masking magnitude): the outlier ratio, measured in the same in-graph
    calibration run, keeps that tensor float."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,256] x) => (float[1,16] y) {
      h = MatMul(x, w)
      y = MatMul(h, w2)
    }
    """
    rng = np.random.default_rng(1)
    m = with_weights(text, {"w": np.eye(256, dtype=np.float32), "w2": rng.normal(0, 0.1, (256, 16)).astype(np.float32)})
    feeds = [{"x": rng.standard_normal((1, 256)).astype(np.float32)} for _ in range(64)]
    feeds[5]["x"][0, 7] = 3000.0
    r = quantize(m, feeds, preset="ort-x86-vnni").records[0].result
    assert "extreme outliers" in r.details["excluded_tensors"].get("h", "")
    worst = r.details["calibration"]["largest_outlier_ratio"][0]
    assert worst["tensor"] in ("x", "h") and worst["outlier_ratio"] > 100


def test_calibration_uses_the_current_graph_ranges() -> None:
    res = quantize(tiny_cnn(), FEEDS, preset="ort-x86-vnni")
    m = res.model
    x_scale = float(initializer(m, "x/scale"))
    xs = np.concatenate([f["x"] for f in FEEDS])
    spec = QuantSpec(dtype="uint8")
    expected, _ = compute_scale_zero_point(float(xs.min()), float(xs.max()), spec)
    assert x_scale == pytest.approx(float(expected), rel=1e-6)


def test_bounded_whole_graph_walks() -> None:
    handle = GraphHandle(tiny_cnn())
    from insert_qdq_helpers import source

    InsertQDQ(preset="ort-x86-vnni").run(handle, PassContext(calibration_data=source(FEEDS)))
    assert handle.walks["index"] <= 4 and handle.walks["export"] <= 1 and handle.walks["toposort"] <= 2


@pytest.mark.parametrize(
    ("weights", "activations", "wtype"),
    [("int4", "uint8", onnx.TensorProto.INT4), ("int8", "uint16", onnx.TensorProto.INT8)],
)
def test_4_and_16_bit_types_at_opset_21(weights: str, activations: str, wtype: int) -> None:
    m = tiny_cnn(opset=21)
    m.ir_version = 10
    res = quantize(m, FEEDS, weights={"dtype": weights}, activations={"dtype": activations})
    inits = {t.name: t for t in res.model.graph.initializer}
    assert inits["w1/q"].data_type == wtype
    float_out = [run(m, f)[0] for f in EVAL]
    assert cosine(float_out, [run(res.model, f)[0] for f in EVAL]) > (0.95 if weights == "int4" else 0.999)


def test_weights_from_constant_nodes_leave_no_dead_nodes() -> None:
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,2] y) {
      w = Constant<value = float[4,2] {1,2,3,4,5,6,7,8}>()
      y = MatMul(x, w)
    }
    """
    m = with_weights(text, {})
    res = quantize(m, feeds_for(m, 2), preset="ort-x86-vnni", weights={"symmetric": True})
    ops = sorted(n.op_type for n in res.model.graph.node)
    assert ops == ["DequantizeLinear", "DequantizeLinear", "MatMul", "QuantizeLinear"]
    assert initializer(res.model, "w/q")[:, 1].tolist() == [32, 64, 95, 127]  # per column: 8 -> 127
    assert cosine([run(m, f)[0] for f in feeds_for(m, 2)], [run(res.model, f)[0] for f in feeds_for(m, 2)]) > 0.999
