"""Numeric diff: the layer that introduced an error is named first; memory stays bounded by chunking."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from handmade_recipe import full_recipe, scale_weight
from onnx import numpy_helper

import qgraph.analysis.diff.numeric as numeric_mod
from qgraph import Pipeline
from qgraph.analysis.diff import numeric_diff
from qgraph.analysis.diff.render import dumps
from qgraph.errors import ModelError
from qgraph.runtime.compare import random_feeds
from qgraph.testing.models import conv_bn_relu_chain


def test_mis_scaled_conv_is_named_first() -> None:
    reference = conv_bn_relu_chain(6, channels=8, spatial=8)
    candidate = scale_weight(reference, "block3/conv", 1.5)
    n = numeric_diff(reference, candidate, random_feeds(reference, 3))
    assert n.samples == 3 and n.runs == 1 and not n.skipped
    assert len(n.layers) == 18  # conv, bn, relu outputs of 6 blocks
    first = n.first_jump
    assert first is not None and (first.node, first.op, first.tensor) == ("block3/conv", "Conv", "block3/conv_out")
    assert n.introduced()[0].node == "block3/conv"
    assert [d.node for d in n.introduced()] == ["block3/conv"]  # downstream layers only inherit the error
    # Everything upstream is exact; the culprit's SQNR is that of a 1.5x scale error: 10 log10(1 / 0.25).
    assert all(d.sqnr_db == math.inf for d in n.layers if d.order < first.order)
    assert abs(first.sqnr_db - 10 * math.log10(4)) < 1e-3 and first.drop_db == math.inf
    assert abs(first.layer_sqnr_db - first.sqnr_db) < 1e-9
    downstream = [d for d in n.layers if d.order > first.order]
    assert all(d.drop_db < 3.0 for d in downstream)
    assert n.outputs[0].tensor == "output" and n.outputs[0].sqnr_db < 20


def test_mis_scaled_layer_in_a_quantized_real_model_is_named_first(
    light_model: Callable[[str], onnx.ModelProto],
) -> None:
    """All layers carry int8 noise; the one whose weight scale is 1.5x off must still come first."""
    float_model = light_model("squeezenet")
    qdq = Pipeline(full_recipe(), name="handmade").run(float_model).model
    broken = onnx.ModelProto()
    broken.CopyFrom(qdq)
    scale = next(t for t in broken.graph.initializer if t.name == "fire5/squeeze1x1_w_0/scale")
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(1.5), scale.name))
    feeds = random_feeds(float_model, 2)

    clean = numeric_diff(float_model, qdq, feeds)
    n = numeric_diff(float_model, broken, feeds)
    culprit = n.introduced()[0]
    assert (culprit.node, culprit.op, culprit.tensor) == ("n25", "Conv", "r25")
    assert culprit.layer_sqnr_db < 10 and culprit.drop_db > 15
    # In the clean model the same layer adds only quantization noise.
    same = next(d for d in clean.layers if d.tensor == "r25")
    assert same.layer_sqnr_db > 25
    # With int8 noise everywhere, the first jump is the first quantized conv (error appears there).
    assert clean.first_jump is not None and clean.first_jump.node == "n0"
    assert clean.first_jump.input_sqnr_db == math.inf


def test_chunked_runs_bound_outputs_per_session(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = conv_bn_relu_chain(4, channels=8, spatial=8)
    candidate = scale_weight(reference, "block1/conv", 1.5)
    feeds = random_feeds(reference, 2)
    whole = numeric_diff(reference, candidate, feeds)

    outputs_per_session: list[int] = []
    real = numeric_mod.make_session

    def spy(model: onnx.ModelProto, **kw: Any) -> Any:
        outputs_per_session.append(len(model.graph.output))
        return real(model, **kw)

    monkeypatch.setattr(numeric_mod, "make_session", spy)
    one_tensor = 8 * 8 * 8 * 4  # bytes of one [1, 8, 8, 8] float activation
    chunked = numeric_diff(reference, candidate, iter(feeds), max_bytes=3 * one_tensor)
    assert chunked.runs == 4 and max(outputs_per_session) == 3  # 12 tensors, 3 per run, 2 sessions per run
    assert len(outputs_per_session) == 2 * chunked.runs
    assert [d.to_dict() for d in chunked.layers] == [d.to_dict() for d in whole.layers]
    assert chunked.samples == 2


TWO_OUTPUTS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4] x) => (float[2,4] {out}, int64[2] shape_out) {{
  a = Relu (x)
  shape_out = Shape (a)
  {out} = Mul (a, x)
}}
"""


def test_outputs_by_position_and_non_float_tensors() -> None:
    a = onnx.parser.parse_model(TWO_OUTPUTS.format(out="y"))
    b = onnx.parser.parse_model(TWO_OUTPUTS.format(out="renamed"))
    n = numeric_diff(a, b, random_feeds(a, 2))
    assert [d.tensor for d in n.layers] == ["a"]  # int64 "shape_out" is not compared as a layer
    outs = {d.tensor: d for d in n.outputs}
    assert outs["y"].candidate == "renamed" and outs["y"].sqnr_db == math.inf
    assert "shape_out" in n.skipped and n.skipped["shape_out"].startswith("not float")


def test_shape_mismatch_is_skipped_not_fatal() -> None:
    a = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4] x) => (float[2,4] y) { t = Relu (x)  y = Neg (t) }
    """)
    b = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4] x) => (float[2,4] y) { u = Transpose (x)  t = Relu (u)  v = Transpose (t)  y = Neg (v) }
    """)
    n = numeric_diff(a, b, random_feeds(a, 1))
    assert n.skipped == {"t": "shapes differ: [2, 4] vs [4, 2]"}
    assert [d.tensor for d in n.layers] == ["y"] and n.layers[0].sqnr_db == math.inf


def test_json_has_no_bare_infinities() -> None:
    reference = conv_bn_relu_chain(2, channels=4, spatial=4)
    n = numeric_diff(reference, scale_weight(reference, "block1/conv", 2.0), random_feeds(reference, 1))
    text = dumps(n.to_dict())

    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(text, parse_constant=refuse)
    assert data["layers"][0]["sqnr_db"] == "inf"
    assert data["first_jump"]["node"] == "block1/conv"


def test_models_with_different_inputs_are_refused() -> None:
    text = '<ir_version: 8, opset_import: ["" : 17]> g (float[2] {0}) => (float[2] y) {{ y = Relu ({0}) }}'
    a, b = onnx.parser.parse_model(text.format("x")), onnx.parser.parse_model(text.format("z"))
    with pytest.raises(ModelError, match=r"different inputs \(\['x'\] vs \['z'\]\)"):
        numeric_diff(a, b, random_feeds(a, 1))


def test_an_output_a_concat_joins_has_a_row_per_part(detector: dict[str, Any], tmp_path: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A detector's boxes and class scores in one output: the outputs table and JSON have the whole output and a row
    per part, each part's SQNR as numpy computes it on the same samples; the whole lies between its parts' (mediant
    inequality: never below the worst one); the part's input SQNR is its source tensor's, so the drop is the join's
    loss. `--whole-outputs` keeps the whole output only."""
    import onnxruntime as ort

    from qgraph.cli import main

    html = tmp_path / "d.html"
    args = ["diff", str(detector["float"]), str(detector["int8"]), "--eval-data", str(detector["eval"])]
    assert main([*args, "--json", "-", "--html", str(html)]) == 0
    numeric = json.loads(capsys.readouterr().out)["numeric"]
    (whole,) = numeric["outputs"]
    boxes, scores = whole["parts"]
    assert [p["tensor"] for p in whole["parts"]] == ["output0[0:4] (boxes)", "output0[4:22] (scores)"]
    assert boxes["part"]["source"] == "boxes" and scores["part_of"] == "output0"
    feed = {"images": np.load(detector["eval"])["images"][:8]}  # the diff's 8 samples
    ref, got = (ort.InferenceSession(str(detector[k]), providers=["CPUExecutionProvider"]).run(None, feed)[0]
                .astype(np.float64) for k in ("float", "int8"))

    def sqnr(r: np.ndarray, g: np.ndarray) -> float:
        return float(10 * np.log10((r**2).sum() / ((r - g) ** 2).sum()))

    assert boxes["sqnr_db"] == pytest.approx(sqnr(ref[:, :4], got[:, :4]), abs=1e-3)
    assert scores["sqnr_db"] == pytest.approx(sqnr(ref[:, 4:], got[:, 4:]), abs=1e-3)
    assert whole["sqnr_db"] == pytest.approx(sqnr(ref, got), abs=1e-3)
    low, high = sorted(p["sqnr_db"] for p in whole["parts"])
    assert low < 1 < 40 < high and low <= whole["sqnr_db"] <= high
    layers = {d["tensor"]: d for d in numeric["layers"]}
    assert scores["input_sqnr_db"] == pytest.approx(layers["scores"]["sqnr_db"])
    assert scores["input_sqnr_db"] > 25  # the scores tensor itself is fine: the join loses it
    assert scores["drop_db"] == pytest.approx(layers["scores"]["sqnr_db"] - scores["sqnr_db"])
    assert numeric["output_parts_decisions"] == [
        "output0 is scored as 2 parts (Concat on axis 1 of boxes [4] and scores [18]); the worst part decides"]
    page = html.read_text()
    assert "↳ output0[4:22] (scores)" in page and 'class="output-parts"' in page

    assert main(args) == 0
    out = capsys.readouterr().out
    assert "↳ output0[4:22] (scores)" in out and "output0 is scored as 2 parts" in " ".join(out.split())
    assert main([*args, "--whole-outputs", "--json", "-"]) == 0
    numeric = json.loads(capsys.readouterr().out)["numeric"]
    assert "parts" not in numeric["outputs"][0] and numeric["output_parts_decisions"] == []
