"""``qgraph.runtime.output_parts``: outputs a final Concat joins are found, cut and measured part by part."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper, parser

from qgraph.runtime.output_parts import OutputPart, OutputParts, PartDiffs, find_output_parts, output_parts_of
from qgraph.runtime.streaming import OutputScore
from qgraph.testing.detection import detection_feeds, detection_head

# YOLOv8's head in small: boxes [1, 4, N] and sigmoid scores [1, 18, N] joined on axis 1 (N symbolic, the anchor
# count), a plain output beside it, and a Concat whose second input has a data-dependent size on the axis.
HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
head (float[1, 8, N] x) => (float[1, 22, N] output0, float[1, 8, N] plain, float[1, ?, N] dynamic) {
    b = Slice(x, i0, i4, ax1)
    boxes = Mul(b, k)
    wide = Concat<axis = 1>(x, x, x)
    s = Sigmoid(wide)
    scores = Slice(s, i0, i18, ax1)
    output0 = Concat<axis = -2>(boxes, scores)
    plain = Relu(x)
    nz = NonZero(x)
    count = Shape(nz)
    rows = Slice(count, i1, i2)
    new_shape = Concat<axis = 0>(one, rows, minus_one)
    reshaped = Reshape(x, new_shape)
    dynamic = Concat<axis = 1>(x, reshaped)
}
"""


def _head() -> onnx.ModelProto:
    model = parser.parse_model(HEAD)
    consts = {"i0": [0], "i4": [4], "i18": [18], "ax1": [1], "i1": [1], "i2": [2], "one": [1], "minus_one": [-1]}
    model.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in consts.items())
    model.graph.initializer.append(numpy_helper.from_array(np.array(3.0, np.float32), "k"))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_concat_of_boxes_and_scores_gets_two_parts_with_their_offsets() -> None:
    parts = find_output_parts(_head())
    assert parts.names == ["output0", "plain", "dynamic"]
    split = parts.outputs[0]
    assert split.split and split.reason is None
    assert [(p.source, p.axis, p.start, p.stop, p.length) for p in split.parts] == [
        ("boxes", 1, 0, 4, 22), ("scores", 1, 4, 22, 22)]  # axis -2 of a rank-3 output is axis 1
    assert [p.label for p in split.parts] == ["output0[0:4] (boxes)", "output0[4:22] (scores)"]
    assert split.describe() == ("output0 is scored as 2 parts (Concat on axis 1 of boxes [4] and scores [18]); "
                                "the worst part decides")


def test_a_plain_output_is_one_part_and_a_dynamic_concat_stays_whole_with_the_reason() -> None:
    parts = find_output_parts(_head())
    plain, dynamic = parts.outputs[1], parts.outputs[2]
    assert [p.whole for p in plain.parts] == [True] and plain.reason is None and plain.describe() is None
    assert len(dynamic.parts) == 1 and dynamic.parts[0].whole
    assert dynamic.reason is not None and "not static (x [8], reshaped [?])" in dynamic.reason
    assert parts.decisions() == [parts.outputs[0].describe(), f"dynamic is scored whole: {dynamic.reason}"]
    assert [p.label for p in parts.parts] == ["output0[0:4] (boxes)", "output0[4:22] (scores)", "plain", "dynamic"]
    assert [p.label for p in parts.without_parts().parts] == ["output0", "plain", "dynamic"]


def test_a_quantized_join_is_found_behind_its_pairs_and_named_by_the_float_tensors(tmp_path: object) -> None:
    """The QDQ model made by a shared-scale quantizer: DQ(Q(boxes)), DQ(Q(scores)) -> Concat -> Q -> DQ -> out."""
    from qgraph import Pipeline
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass

    model = detection_head()
    data = CallableSource(lambda: detection_feeds(4), "4 images")
    qdq = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni", elementwise="always",
                                           joins={"keep_float": False})]).run(model, calibration_data=data).model
    producer = {o: n.op_type for n in qdq.graph.node for o in n.output}
    assert producer["output0"] == "DequantizeLinear"
    assert find_output_parts(qdq) == find_output_parts(model)
    assert [p.label for p in find_output_parts(model).parts] == ["output0[0:4] (boxes)", "output0[4:22] (scores)"]
    assert output_parts_of(model, enabled=False).parts == [OutputPart("output0", "output0")]


def test_cut_takes_the_part_of_one_sample_or_of_samples_joined_on_axis_0() -> None:
    part = OutputPart("o", "scores", 1, 4, 22, 22)
    x = np.arange(3 * 22 * 5).reshape(3, 22, 5)
    np.testing.assert_array_equal(part.cut(x), x[:, 4:22])
    rows = OutputPart("o", "b", 0, 1, 3, 4)  # a Concat on axis 0: 2 samples of 4 rows joined on axis 0
    y = np.arange(8 * 2).reshape(8, 2)
    np.testing.assert_array_equal(rows.cut(y), np.concatenate([y[1:3], y[5:7]]))
    with pytest.raises(ValueError, match=r"has 21 elements along axis 1, the model's Concat writes 22"):
        part.cut(np.zeros((1, 21, 5)))


def test_part_diffs_the_worst_part_is_at_most_the_whole_and_the_whole_lies_between() -> None:
    """Boxes with a small relative error, scores with a large one: the whole output's SQNR is the boxes', never
    below the worst part's (mediant inequality) and never above the best part's."""
    rng = np.random.default_rng(0)
    parts = OutputParts((find_output_parts(detection_head()).outputs[0],))
    diffs = PartDiffs(parts)
    for _ in range(4):
        ref = np.concatenate([rng.uniform(0, 320, (1, 4, 64)), rng.uniform(0, 0.5, (1, 18, 64))], axis=1)
        got = ref + np.concatenate([rng.normal(0, 0.3, (1, 4, 64)), rng.normal(0, 0.02, (1, 18, 64))], axis=1)
        diffs.add([ref], [got])
    (whole,) = diffs.whole()
    boxes, scores = diffs.scored()
    assert boxes.part is not None and boxes.name == "output0[0:4] (boxes)" and boxes.output == "output0"
    # by construction: 10 log10((320²/3) / 0.3²) = 55.8 dB and 10 log10((0.5²/3) / 0.02²) = 23.2 dB
    assert boxes.sqnr_db == pytest.approx(55.8, abs=0.5) and scores.sqnr_db == pytest.approx(23.2, abs=0.5)
    assert scores.sqnr_db <= whole.sqnr_db <= boxes.sqnr_db
    assert whole.sqnr_db == pytest.approx(boxes.sqnr_db, abs=0.2)  # the scores are invisible in the whole
    assert scores.to_dict()["part"] == {"output": "output0", "label": "output0[4:22] (scores)", "source": "scores",
                                        "axis": 1, "start": 4, "stop": 22}


def test_output_score_is_the_worst_part() -> None:
    import onnxruntime as ort

    from qgraph import Pipeline
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass

    model = detection_head()
    feeds = detection_feeds(8)
    qdq = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni", elementwise="always", joins={"keep_float": False})]
                   ).run(model, calibration_data=CallableSource(lambda: feeds, "8 images")).model
    ref, cand = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (model, qdq))
    whole, split = OutputScore(ref, feeds), OutputScore(ref, feeds, parts=find_output_parts(model))
    assert split.labels == ["output0[0:4] (boxes)", "output0[4:22] (scores)"] and whole.labels == ["output0"]
    boxes_db, scores_db = split.per_output_db(cand)
    assert whole.score_db(cand) > 40 > 10 > scores_db == split.score_db(cand)  # shared scale: scores lost
    assert whole.score_db(cand) == pytest.approx(boxes_db, abs=0.2)
