"""Latency-aware placement: decisions from synthetic cost tables (deterministic: nothing is timed here, so the
whole-model check, `latency_check.py`, is off)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from insert_qdq_helpers import feeds_for, quantize, source, tiny_cnn, with_weights
from qgraph.passes.insert_qdq import InsertQDQ
from qgraph.passes.insert_qdq.latency import Cost, Decision, Edge, decide

from qgraph.errors import DataError, PassError, RecipeError
from qgraph.runtime.latency import SHIPPED_TABLE, load_latency_table, op_signature


# ---------------------------------------------------------------------------------------------- decide()
def test_a_unit_slower_in_int8_stays_float_and_a_faster_one_is_int8() -> None:
    costs: list[Cost | None] = [Cost(30.0, 10.0, "t"), Cost(5.0, 10.0, "t")]
    d = decide(costs, [], forced=set())
    assert d.int8 == [False, True]
    assert d.local[0] == (30.0, 10.0)


def test_forced_units_stay_int8_and_unknown_costs_keep_int8() -> None:
    costs: list[Cost | None] = [Cost(30.0, 10.0, "t"), None]
    assert decide(costs, [], forced={0}).int8 == [True, True]


def test_conversions_keep_a_small_gain_float_between_float_neighbours() -> None:
    # 0 (float-only) -> 1 (int8 saves 4 µs) -> 2 (float-only): an int8 island costs Q + DQ = 6 µs > 4 µs
    costs: list[Cost | None] = [Cost(50.0, 10.0, "t"), Cost(16.0, 20.0, "t"), Cost(50.0, 10.0, "t")]
    edges = [Edge(0, 1, q_us=3.0, dq_us=3.0), Edge(1, 2, q_us=3.0, dq_us=3.0)]
    d = decide(costs, edges, forced=set())
    assert d.int8 == [False, False, False]
    # the same unit saving 10 µs is worth its conversions
    costs[1] = Cost(10.0, 20.0, "t")
    assert decide(costs, edges, forced=set()).int8 == [False, True, False]


def test_slow_int8_data_movement_between_two_units_breaks_the_int8_region() -> None:
    # a channel shuffle between 0 and 1: 400 µs on integers (NHWC after an int8 producer), 20 µs in float
    costs: list[Cost | None] = [Cost(80.0, 100.0, "t"), Cost(30.0, 55.0, "t")]
    edges = [Edge(0, 1, float_us=20.0, int8_us=400.0, q_us=10.0, dq_us=10.0)]
    d = decide(costs, edges, forced=set())
    # float -> int8: 100 + 20 + Q 10 + 30 = 160 beats both float (175), both int8 (510) and int8 -> float (545)
    assert d.int8 == [False, True]
    assert d.total(costs, edges) == pytest.approx(160.0)
    assert d.local[0] == (pytest.approx(80.0 + 400.0), pytest.approx(100.0 + 20.0 + 10.0))  # own + edges


def test_a_component_better_all_float_is_switched_as_a_whole() -> None:
    # each unit alone prefers int8 only if its neighbours are int8; all float is cheaper overall
    costs: list[Cost | None] = [Cost(10.0, 9.0, "t"), Cost(10.0, 9.0, "t")]
    edges = [Edge(None, 0, q_us=5.0, dq_us=5.0), Edge(0, 1, int8_us=0.0, float_us=0.0, q_us=5.0, dq_us=5.0)]
    assert decide(costs, edges, forced=set()).int8 == [False, False]


def test_a_float_conv_onnxruntime_would_requantize_takes_its_producer_along() -> None:
    # 0 (Add) -> 1 (Conv, input DQ from 0, output Q to 2) -> shuffle -> 2; 1 float alone is re-quantized by
    # onnxruntime (WeightBiasQuantization), so the choice is 1 int8 (slow shuffle) or 0 and 1 both float
    costs: list[Cost | None] = [Cost(20.0, 30.0, "t"), Cost(80.0, 100.0, "t"), Cost(40.0, 55.0, "t")]
    edges = [Edge(0, 1, q_us=5.0, dq_us=5.0), Edge(1, 2, float_us=20.0, int8_us=400.0, q_us=10.0, dq_us=10.0)]
    free = decide(costs, edges, forced=set())
    assert free.int8 == [True, False, True]  # what the model alone would pick: impossible on onnxruntime
    d = decide(costs, edges, forced=set(), requant={1: [0]})
    assert d.int8 == [False, False, True]
    assert d.total(costs, edges) == pytest.approx(30.0 + 100.0 + 20.0 + 10.0 + 40.0)
    # with the producer forced int8, the Conv must be int8 as well
    assert decide(costs, edges, forced={0}, requant={1: [0]}).int8 == [True, True, True]


# ---------------------------------------------------------------------------------------------- the table
def test_the_shipped_table_loads_and_estimates_a_depthwise_conv() -> None:
    table = load_latency_table(SHIPPED_TABLE)
    assert table.presets, "the shipped table has no preset"
    preset = next(iter(table.presets))
    sig = op_signature("Conv", {"group": 256}, (1, 256, 14, 14), (256, 1, 3, 3))
    assert sig is not None and sig[0] == "Conv/depthwise/3x3" and sig[2] == 256 * 196 * 9
    est = table.estimate(preset, *sig)
    assert est is not None and est[0] > 0 and est[1] > 0


def _table(tmp_path: Path, entries: list[dict[str, Any]], preset: str = "ort-x86-vnni") -> Path:
    data = {"version": 1, "host": "test", "runtime": "test", "threads": 2,
            "presets": {preset: {"quantize_ns": 1.0, "dequantize_ns": 1.0, "entries": entries}}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    return path


def test_a_malformed_table_is_a_data_error(tmp_path: Path) -> None:
    bad = _table(tmp_path, [{"kind": "Conv/dense/3x3", "bucket": "c8", "work": -1, "float_us": 1, "int8_us": 1,
                             "samples": 1}])
    with pytest.raises(DataError, match="work"):
        load_latency_table(bad)
    with pytest.raises(DataError, match="cannot read"):
        load_latency_table(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------- the pass
def _conv_entry(int8_us: float, float_us: float) -> dict[str, Any]:
    return {"kind": "Conv/dense/3x3", "bucket": "c8-hw64", "work": 8 * 64 * 27, "float_us": float_us,
            "int8_us": int8_us, "samples": 1}


def test_table_keeps_slow_convs_float_and_reports_it(tmp_path: Path) -> None:
    model = tiny_cnn()
    table = _table(tmp_path, [_conv_entry(int8_us=500.0, float_us=10.0)])
    res = quantize(model, feeds_for(model, 4), preset="ort-x86-vnni",
                   latency={"mode": "table", "check": False, "table": str(table)})
    result = res.records[0].result
    convs = [n for n in res.model.graph.node if n.op_type == "Conv"]
    # both convs kept float: their weights are float initializers (no DequantizeLinear in front)
    producers = {o: n.op_type for n in res.model.graph.node for o in n.output}
    assert len(convs) == 2 and all(producers.get(c.input[1]) != "DequantizeLinear" for c in convs)
    reasons = [s.reason for s in result.skipped if s.reason.startswith("kept float for speed")]
    assert len(reasons) == 2 and "int8 500 µs" in reasons[0]
    assert any(d.startswith("latency (table): 2 of") for d in result.decisions), result.decisions
    rows = {r["node"]: r for r in result.details["latency"]["units"]}
    assert rows[convs[0].name or "Conv(c1)"]["decision"] == "float"


def test_off_quantizes_everything_and_force_overrides_the_table(tmp_path: Path) -> None:
    model = tiny_cnn()
    table = _table(tmp_path, [_conv_entry(int8_us=500.0, float_us=10.0)])
    calib = feeds_for(model, 4)
    off = quantize(model, calib, preset="ort-x86-vnni", latency={"mode": "off", "table": str(table)})
    assert "latency" not in off.records[0].result.details
    forced = quantize(model, calib, preset="ort-x86-vnni",
                      latency={"mode": "table", "check": False, "table": str(table), "force": {"op_types": ["Conv"]}})
    for res in (off, forced):
        producers = {o: n.op_type for n in res.model.graph.node for o in n.output}
        convs = [n for n in res.model.graph.node if n.op_type == "Conv"]
        assert convs and all(producers.get(c.input[1]) == "DequantizeLinear" for c in convs)
    rows = forced.records[0].result.details["latency"]["units"]
    assert all(r["decision"] == "int8" and r["forced"] for r in rows if r["op"] == "Conv")


def test_fast_int8_keeps_the_model_quantized(tmp_path: Path) -> None:
    model = tiny_cnn()
    table = _table(tmp_path, [_conv_entry(int8_us=1.0, float_us=50.0)])
    res = quantize(model, feeds_for(model, 4), preset="ort-x86-vnni",
                   latency={"mode": "table", "check": False, "table": str(table)})
    assert not [s for s in res.records[0].result.skipped if s.reason.startswith("kept float")]


def test_options_are_validated() -> None:
    with pytest.raises(RecipeError, match="latency"):
        InsertQDQ(preset="ort-x86-vnni", latency={"mode": "fast"})
    with pytest.raises(RecipeError, match="measure_seconds"):
        InsertQDQ(latency={"mode": "measure", "measure_seconds": 0})
    model = tiny_cnn()
    with pytest.raises(PassError, match="looks costs up by preset"):
        quantize(model, feeds_for(model, 2), latency={"mode": "table"})


SHUFFLE = """
<ir_version: 8, opset_import: ["" : 17]>
shuffle (float[1, 8, 8, 8] x) => (float[1, 8, 8, 8] y) {
    c1 = Conv (x, w1, b1)
    r1 = Relu (c1)
    s1 = Reshape (r1, split)
    t = Transpose <perm = [0, 2, 1, 3, 4]> (s1)
    s2 = Reshape (t, merge)
    y = Conv <group = 8, pads = [1, 1, 1, 1]> (s2, w2, b2)
}
"""


def test_a_slow_channel_shuffle_keeps_its_producer_float(tmp_path: Path) -> None:
    import numpy as np
    from insert_qdq_helpers import with_weights

    rng = np.random.default_rng(0)
    model = with_weights(SHUFFLE, {
        "w1": rng.normal(0, 0.3, (8, 8, 1, 1)).astype(np.float32), "b1": np.zeros(8, np.float32),
        "w2": rng.normal(0, 0.3, (8, 1, 3, 3)).astype(np.float32), "b2": np.zeros(8, np.float32),
        "split": np.array([1, 2, 4, 8, 8], np.int64), "merge": np.array([1, 8, 8, 8], np.int64)})

    def entry(kind: str, bucket: str, work: float, int8_us: float, float_us: float) -> dict[str, Any]:
        return {"kind": kind, "bucket": bucket, "work": work, "int8_us": int8_us, "float_us": float_us, "samples": 1}

    table = _table(tmp_path, [
        entry("Conv/dense/1x1", "c8-hw64", 512 * 8, 10.0, 12.0),
        entry("Conv/depthwise/3x3", "c8-hw64", 512 * 9, 3.0, 6.0),
        entry("Transpose/rank5", "e512", 512, 100.0, 1.0),
        entry("Reshape", "e512", 512, 1.0, 1.0),
    ])
    res = quantize(model, feeds_for(model, 4), preset="ort-x86-vnni",
                   latency={"mode": "table", "check": False, "table": str(table)})
    producers = {o: n.op_type for n in res.model.graph.node for o in n.output}
    convs = [n for n in res.model.graph.node if n.op_type == "Conv"]
    assert [producers.get(c.input[1]) for c in convs] == [None, "DequantizeLinear"]  # c1 float, the dw conv int8
    rows = {r["op"] + str(i): r for i, r in enumerate(res.records[0].result.details["latency"]["units"])}
    first = rows["Conv0"]
    # int8: 10 + shuffle on integers 102 (+ Q of x, 0.5); float: 12 + float shuffle 3 + Q of the shuffled tensor 0.5
    assert first["int8_with_conversions_us"] == pytest.approx(112.5, abs=0.1)
    assert first["float_with_conversions_us"] == pytest.approx(15.5, abs=0.1)
    skipped = [s for s in res.records[0].result.skipped if s.reason.startswith("kept float for speed")]
    assert len(skipped) == 1 and "int8 113 µs vs float 16 µs" in skipped[0].reason


def test_measure_profiles_the_model_and_reports_measured_units() -> None:
    model = tiny_cnn()
    res = quantize(model, feeds_for(model, 2), preset="ort-x86-vnni",
                   latency={"mode": "measure", "runs": 2, "measure_seconds": 5})
    result = res.records[0].result
    assert any(d.startswith("latency (measure):") for d in result.decisions), result.decisions
    rows = result.details["latency"]["units"]
    assert rows and any(r["source"] == "measured" for r in rows)
    assert all(r["decision"] in ("int8", "float") for r in rows)
    assert result.details["latency"]["quantize_ns_per_element"] > 0


@st.composite
def _graphs(draw: st.DrawFn) -> tuple[list[Cost | None], list[Edge], set[int]]:
    n = draw(st.integers(1, 7))
    us = st.floats(0.0, 100.0, allow_nan=False)
    costs: list[Cost | None] = [Cost(draw(us), draw(us), "t") for _ in range(n)]
    edges = []
    for _ in range(draw(st.integers(0, 10))):
        src = draw(st.one_of(st.none(), st.integers(0, n - 1)))
        dst = draw(st.one_of(st.none(), st.integers(0, n - 1)))
        if src is not None and src == dst:
            continue
        edges.append(Edge(src, dst, draw(us), draw(us), draw(us), draw(us)))
    forced = set(draw(st.lists(st.integers(0, n - 1), max_size=2)))
    return costs, edges, forced


@settings(max_examples=200, deadline=None)
@given(_graphs())
def test_decisions_are_locally_optimal_and_never_worse_than_all_float(
    graph: tuple[list[Cost | None], list[Edge], set[int]],
) -> None:
    costs, edges, forced = graph
    d = decide(costs, edges, forced)
    assert all(d.int8[i] for i in forced)
    for i, (q, f) in enumerate(d.local):
        if i not in forced:  # int8 only where it is not slower, float only where int8 would be slower
            assert (q <= f + 1e-9) if d.int8[i] else (f <= q + 1e-9)
    all_float = Decision([i in forced for i in range(len(costs))], [])
    assert d.total(costs, edges) <= all_float.total(costs, edges) + 1e-6


def _dynamic(model: Any) -> Any:
    """``model`` with symbolic batch/height/width on its input and no stored intermediate or output shapes (as
    Paddle's exporter writes a detector: ``p2o.DynamicDimension.k``)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    dims = out.graph.input[0].type.tensor_type.shape.dim
    for i in (0, 2, 3):
        dims[i].Clear()
        dims[i].dim_param = f"dyn{i}"
    del out.graph.value_info[:]
    for o in out.graph.output:
        for k, d in enumerate(o.type.tensor_type.shape.dim):
            d.Clear()
            d.dim_param = f"out{k}"
    return out


def test_dynamic_inputs_are_costed_at_the_calibration_shapes(tmp_path: Path) -> None:
    static = tiny_cnn()
    model = _dynamic(static)
    feeds = feeds_for(static, 4)  # the static model's sizes: what the data (and deployment) feeds
    table = _table(tmp_path, [_conv_entry(int8_us=500.0, float_us=10.0)])
    opts = {"preset": "ort-x86-vnni", "latency": {"mode": "table", "check": False, "table": str(table)}}
    result = quantize(model, feeds, **opts).records[0].result
    # without sizes the convs had no cost and stayed int8; at the sample's sizes the table keeps both float
    kept = [s for s in result.skipped if s.reason.startswith("kept float for speed")]
    assert len(kept) == 2 and "int8 500 µs" in kept[0].reason
    shape = list(feeds[0]["input"].shape) if "input" in feeds[0] else list(next(iter(feeds[0].values())).shape)
    assert any("dynamic dimensions" in d and str(shape) in d for d in result.decisions), result.decisions
    same = quantize(static, feeds, **opts).records[0].result  # static inputs: no such decision, same outcome
    assert not any("dynamic dimensions" in d for d in same.decisions)
    assert [s.reason for s in same.skipped if s.reason.startswith("kept float")] == [s.reason for s in kept]


def test_measure_says_whose_host_it_measured_when_the_recipe_targets_another_arch() -> None:
    from qgraph import Recipe
    from qgraph.runtime.kernels.cpu import host_cpu

    model = tiny_cnn()
    recipe = Recipe.from_text(
        "name: arm\ntarget: {runtime: onnxruntime, cpu: arm}\npasses:\n  - pass: insert_qdq\n    preset: ort-arm\n"
        "    latency: {mode: measure, runs: 2, measure_seconds: 5}\n")
    feeds = feeds_for(model, 2)
    result = recipe.pipeline().run(model, calibration_data=source(feeds)).records[0].result
    line = next(d for d in result.decisions if d.startswith("latency: measured on this host"))
    assert (", but the recipe targets arm" in line) == (host_cpu().arch != "arm"), line


DFL = """
<ir_version: 8, opset_import: ["" : 17]>
dfl (float[1, 64, 8, 8] x) => (float[1, 4, 64] y) {
    c0 = Conv (x, w0, b0)
    r = Reshape (c0, bins)
    t = Transpose <perm = [0, 2, 1, 3]> (r)
    s = Softmax <axis = 1> (t)
    c = Conv (s, w, b)
    y = Reshape (c, boxes)
}
"""


def test_a_conv_after_a_softmax_stays_int8_whatever_the_table_says(tmp_path: Path) -> None:
    """YOLOv8's DFL: the table prices the 1x1 Conv after the box-bin Softmax slower in int8 (with the Q of its
    input), but an int8 Conv makes onnxruntime run that Softmax 8x faster; the model cannot see it, so the Conv
    keeps int8 like a unit of unknown cost, and the decision says why."""
    import numpy as np
    from insert_qdq_helpers import with_weights

    rng = np.random.default_rng(0)
    model = with_weights(DFL, {
        "w0": rng.normal(0, 0.2, (64, 64, 1, 1)).astype(np.float32), "b0": np.zeros(64, np.float32),
        "w": np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1), "b": np.zeros(1, np.float32),
        "bins": np.array([1, 4, 16, 64], np.int64), "boxes": np.array([1, 4, 64], np.int64)})
    table = _table(tmp_path, [{"kind": "Conv/dense/1x1", "bucket": "c16-hw256", "work": 16 * 256, "int8_us": 500.0,
                               "float_us": 1.0, "samples": 1}])
    res = quantize(model, feeds_for(model, 4), preset="ort-x86-vnni",
                   latency={"mode": "table", "check": False, "table": str(table)})
    producers = {o: n.op_type for n in res.model.graph.node for o in n.output}
    dfl = next(n for n in res.model.graph.node if n.op_type == "Conv" and n.output[0] == "c")
    assert producers.get(dfl.input[1]) == "DequantizeLinear"
    result = res.records[0].result
    rows = {r["node"]: r for r in result.details["latency"]["units"]}
    assert rows["Conv(c)"]["decision"] == "int8" and rows["Conv(c)"]["forced"]
    assert "fed by Softmax 'Softmax(s)'" in rows["Conv(c)"]["blind"]
    line = next(d for d in result.decisions if d.startswith("latency (table)"))
    assert "Conv(c) fed by Softmax 'Softmax(s)'" in line, line
    # without the Softmax (the same Conv on the reshaped tensor) the table's verdict stands: float
    plain = with_weights(DFL.replace("s = Softmax <axis = 1> (t)", "s = Relu (t)"), {
        "w0": rng.normal(0, 0.2, (64, 64, 1, 1)).astype(np.float32), "b0": np.zeros(64, np.float32),
        "w": np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1), "b": np.zeros(1, np.float32),
        "bins": np.array([1, 4, 16, 64], np.int64), "boxes": np.array([1, 4, 64], np.int64)})
    res = quantize(plain, feeds_for(plain, 4), preset="ort-x86-vnni",
                   latency={"mode": "table", "check": False, "table": str(table)})
    rows = {r["node"]: r for r in res.records[0].result.details["latency"]["units"]}
    assert rows["Conv(c)"]["decision"] == "float" and "blind" not in rows["Conv(c)"]


def _pyramid(height: str = "H") -> Any:
    """A YOLO-style join on an image of any size: a stride-2 Conv, Resize x2 back up, Concat with the full-size
    branch. At 1x1 (random feeds' size for a dynamic dimension) the Resize gives 2x2 and the Concat fails."""
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1, 3, {height}, W] x) => (float[1, 16, {height}, W] y) {{
        a = Conv <pads = [1, 1, 1, 1]> (x, w1, b1)
        d = Conv <pads = [1, 1, 1, 1], strides = [2, 2]> (a, w2, b2)
        sc = Constant <value = float[4] {{1, 1, 2, 2}}> ()
        u = Resize <mode = "nearest"> (d, , sc)
        y = Concat <axis = 1> (a, u)
    }}
    """
    rng = np.random.default_rng(0)
    weights = {"w1": rng.normal(0, 0.3, (8, 3, 3, 3)), "b1": rng.normal(0, 0.1, 8),
               "w2": rng.normal(0, 0.2, (8, 8, 3, 3)), "b2": rng.normal(0, 0.1, 8)}
    return with_weights(text, {k: v.astype(np.float32) for k, v in weights.items()})


def test_measure_profiles_at_the_calibration_size_of_a_dynamic_input() -> None:
    """``latency: measure`` on an input of no fixed size profiles at the first calibration sample's size (1x1
    random feeds broke the Concat: a YOLOv8 detector failed the whole pass with onnxruntime's error)."""
    model = _pyramid()
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(2)]
    res = quantize(model, feeds, preset="ort-x86-vnni", latency={"mode": "measure", "runs": 2, "measure_seconds": 5})
    decisions = res.records[0].result.decisions
    assert any(d.startswith("latency: measured on this host") for d in decisions), decisions
    assert any(d.startswith("latency (measure):") for d in decisions), decisions


def test_measure_that_cannot_run_falls_back_to_the_table_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import qgraph.passes.insert_qdq as insert_qdq_pass
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ort_state.Fail("[ONNXRuntimeError] : 1 : FAIL : Non concat axis dimensions must match\nmore")

    monkeypatch.setattr(insert_qdq_pass, "measure_twin", broken)
    model = tiny_cnn()
    res = quantize(model, feeds_for(model, 2), preset="ort-x86-vnni", latency={"mode": "measure"})
    result = res.records[0].result
    said = [d for d in result.decisions if d.startswith("latency: measure could not run")]
    assert len(said) == 1 and "Non concat axis dimensions must match)" in said[0] and "cost table" in said[0]
    assert not any(d.startswith("latency: measured on this host") for d in result.decisions)
    assert any(d.startswith("latency (table):") for d in result.decisions), result.decisions
