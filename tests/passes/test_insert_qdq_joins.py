"""Joins that keep their ranges: a detection head concatenating boxes (0..~300 px) and scores (0..1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from insert_qdq_helpers import feeds_for, quantize, run, with_weights

HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
head (float[1, 8, 6, 6] x) => (float[1, 6, 36] out) {
    box = Conv <pads = [1, 1, 1, 1]> (x, wb, bb)
    boxr = Relu (box)
    logit = Conv <pads = [1, 1, 1, 1]> (x, wc, bc)
    score = Sigmoid (logit)
    cat = Concat <axis = 1> (boxr, score)
    out = Reshape (cat, shape)
}
"""


def head(box_scale: float) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    return with_weights(HEAD, {
        "wb": (rng.normal(0, 1, (4, 8, 3, 3)) * box_scale).astype(np.float32),
        "bb": np.full(4, 2 * box_scale, np.float32),
        "wc": rng.normal(0, 0.3, (2, 8, 3, 3)).astype(np.float32),
        "bc": np.full(2, -1.0, np.float32),
        "shape": np.array([1, 6, 36], np.int64),
    })


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10((ref**2).sum() / ((ref - got) ** 2).sum()))


def _slices(model: onnx.ModelProto, q: onnx.ModelProto) -> tuple[float, float]:
    refs, gots = [], []
    for feed in feeds_for(model, 8, seed=1):
        refs.append(run(model, feed)[0])
        gots.append(run(q, feed)[0])
    ref, got = np.concatenate(refs), np.concatenate(gots)
    return _sqnr(ref[:, :4], got[:, :4]), _sqnr(ref[:, 4:], got[:, 4:])


def test_boxes_and_scores_each_keep_their_own_scale() -> None:
    model = head(box_scale=20.0)  # boxes reach a few hundred
    calib = feeds_for(model, 16)
    shared = quantize(model, calib, preset="ort-x86-vnni", elementwise="always", joins={"keep_float": False})
    kept = quantize(model, calib, preset="ort-x86-vnni", elementwise="always")
    box_shared, score_shared = _slices(model, shared.model)
    box_kept, score_kept = _slices(model, kept.model)
    assert score_shared < 20  # one scale for boxes and scores: the scores lose most of their bits
    assert score_kept > 35 and score_kept > score_shared + 20
    assert box_kept >= box_shared - 0.5  # the boxes lose nothing
    decisions = kept.records[0].result.decisions
    assert any(d.startswith("Concat(cat) left float: its inputs' ranges differ") for d in decisions), decisions
    concat_inputs = next(n for n in kept.model.graph.node if n.op_type == "Concat").input
    producers = {o: n.op_type for n in kept.model.graph.node for o in n.output}
    assert [producers[i] for i in concat_inputs] == ["DequantizeLinear", "DequantizeLinear"]
    cat_consumers = [n.op_type for n in kept.model.graph.node if "cat" in n.input]
    assert cat_consumers == ["Reshape"]  # no Q on the float join's output


@pytest.mark.parametrize("box_scale", [0.05])
def test_similar_ranges_stay_quantized(box_scale: float) -> None:
    model = head(box_scale)  # boxes about as wide as the scores: one scale serves both
    res = quantize(model, feeds_for(model, 16), preset="ort-x86-vnni", elementwise="always")
    assert not any("left float" in d for d in res.records[0].result.decisions)
    cat = next(n for n in res.model.graph.node if n.op_type == "Concat")
    assert any(n.op_type == "QuantizeLinear" and cat.output[0] in n.input for n in res.model.graph.node)


BINARY_JOINS = """
<ir_version: 8, opset_import: ["" : 17]>
joins (float[1, 8, 16, 16] x) => (float[1, 8, 16, 16] gated, float[1, 8, 16, 16] summed) {
    wide = Conv <pads = [1, 1, 1, 1]> (x, ww, bw)
    narrow = Conv <pads = [1, 1, 1, 1]> (x, wn, bn)
    gate = Sigmoid (narrow)
    small = Mul (gate, tiny)
    gated = Mul (wide, small)
    summed = Add (wide, narrow)
}
"""


def _fused_ops(model: onnx.ModelProto, tmp_path: Path) -> dict[str, onnx.NodeProto]:
    """The graph onnxruntime runs (after its QDQ fusions), by first output."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return {n.output[0]: n for n in onnx.load(so.optimized_model_filepath).graph.node}


def test_add_and_mul_keep_each_input_scale(tmp_path: Path) -> None:
    """Why joins.py leaves Add/Mul alone: unlike a Concat, onnxruntime's QLinearAdd/QLinearMul take a scale and zero
    point per input (A_scale, B_scale), so a narrow input (a gate in [0, 0.01], a small residual branch) keeps its own
    grid next to a wide one. Measured: the fused kernels exist with input scales 100x apart, and the gated output is
    as accurate as the narrow input's own grid allows, where one shared scale would round every gate to zero."""
    rng = np.random.default_rng(3)
    model = with_weights(BINARY_JOINS, {
        "ww": rng.normal(0, 3.0, (8, 8, 3, 3)).astype(np.float32), "bw": np.zeros(8, np.float32),
        "wn": rng.normal(0, 0.05, (8, 8, 3, 3)).astype(np.float32), "bn": np.zeros(8, np.float32),
        "tiny": np.array(0.01, np.float32),
    })
    res = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni", elementwise="always")
    assert not any("left float" in d for d in res.records[0].result.decisions)
    fused = _fused_ops(res.model, tmp_path)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(tmp_path / "optimized.onnx").graph.initializer}
    ratios: dict[str, float] = {}
    for node in fused.values():
        if node.op_type in ("QLinearAdd", "QLinearMul") and node.input[1] in inits and node.input[4] in inits:
            a_scale, b_scale = float(inits[node.input[1]]), float(inits[node.input[4]])
            ratios[node.op_type] = max(ratios.get(node.op_type, 0.0), max(a_scale, b_scale) / min(a_scale, b_scale))
    assert ratios.get("QLinearAdd", 0) > 50 and ratios.get("QLinearMul", 0) > 50, ratios  # own scale per input
    ref, got = [], []
    for feed in feeds_for(model, 4, seed=9):
        ref.append(run(model, feed)[0])
        got.append(run(res.model, feed)[0])
    r, g = np.concatenate(ref), np.concatenate(got)
    assert _sqnr(r, g) > 25  # a shared scale (wide's, ~100x the gate's range) would leave the gate 0 or 1 code
