"""``tune_ranges``: output-aware activation ranges after ``insert_qdq`` (on a model whose compute sits in an If
branch, specialized first)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qgraph import PassError, Pipeline, PipelineResult, Recipe, RecipeError
from qgraph.data import CallableSource
from qgraph.pipeline.pass_api import get_pass
from qgraph.runtime.streaming import OutputScore, Recurrence
from qgraph.testing import level_feeds, level_switched_net, target_session
from qgraph.testing.recurrent import LEAKY_STATE, leaky_feeds, leaky_state_net

MINMAX = {"preset": "ort-x86-vnni", "activations": {"method": "minmax"}}


def _quantize(*after: Any, specialize: bool = True) -> PipelineResult:
    data = CallableSource(lambda: level_feeds(64), "64 samples, mode 1")
    first = [get_pass("specialize_inputs")(inputs={"mode": 1})] if specialize else []
    return Pipeline([*first, get_pass("insert_qdq")(**MINMAX), *after]).run(level_switched_net(),
                                                                           calibration_data=data)


def _outputs(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    s = target_session(model)
    names = {i.name for i in s.get_inputs()}
    return np.concatenate([s.run(None, {k: v for k, v in f.items() if k in names})[0] for f in feeds])


def _sqnr(model: onnx.ModelProto) -> float:
    held_out = level_feeds(64, seed=7)
    ref = _outputs(level_switched_net(), held_out).astype(np.float64)
    return float(10 * np.log10((ref**2).sum() / ((ref - _outputs(model, held_out)) ** 2).sum()))


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _node(model: onnx.ModelProto, op: str, first_input: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == op and n.input[0] == first_input)


def test_narrowing_the_loud_hidden_range_lowers_the_output_error() -> None:
    """h's range is set by a channel the next layer barely reads: the output wants it clipped (module docstring
    of `qgraph.testing.control_flow.level_switched_net`)."""
    plain, tuned = _quantize(), _quantize(get_pass("tune_ranges")())
    result = tuned.records[-1].result
    assert result.details["factors"]["h"] <= 0.35, result.details
    assert result.details["score_after_db"] > result.details["score_before_db"] + 3
    assert _sqnr(tuned.model) > _sqnr(plain.model) + 5  # held-out: 12.4 -> 19.8 dB when written


def test_pair_shares_its_new_scale_and_the_reading_bias_follows() -> None:
    plain, tuned = _quantize(), _quantize(get_pass("tune_ranges")())
    f = tuned.records[-1].result.details["factors"]["h"]
    a, b = _inits(plain.model), _inits(tuned.model)
    q_a, q_b = _node(plain.model, "QuantizeLinear", "h"), _node(tuned.model, "QuantizeLinear", "h")
    dq_b = _node(tuned.model, "DequantizeLinear", q_b.output[0])
    assert dq_b.input[1] == q_b.input[1] and q_b.input[2] == q_a.input[2]  # one scale, zero point kept
    np.testing.assert_allclose(b[q_b.input[1]], a[q_a.input[1]] * np.float32(f), rtol=1e-6)
    values = []
    for m, inits in ((plain.model, a), (tuned.model, b)):
        conv = next(n for n in m.graph.node if n.name == "then/conv2")
        producer = {o: n for n in m.graph.node for o in n.output}
        bias_dq, w_dq, x_dq = (producer[conv.input[i]] for i in (2, 1, 0))
        bias_scale = inits[bias_dq.input[1]]
        np.testing.assert_allclose(bias_scale, inits[x_dq.input[1]] * inits[w_dq.input[1]], rtol=1e-6)  # s_x s_w
        values.append((inits[bias_dq.input[0]].astype(np.float64) * bias_scale, bias_scale))
    (before, _), (after, step) = values
    assert np.all(np.abs(after - before) <= step)  # the same bias on the new grid


def test_nothing_to_gain_changes_nothing() -> None:
    """Factors above 1 only widen ranges here (no clipping happens at minmax): no pair is changed, and the model
    is the one insert_qdq wrote."""
    plain, tuned = _quantize(), _quantize(get_pass("tune_ranges")(factors=(1.5, 2.0)))
    result = tuned.records[-1].result
    assert result.rewritten == 0 and not result.details["factors"] and not tuned.records[-1].changed
    assert _inits(plain.model).keys() == _inits(tuned.model).keys()


def test_pairs_inside_bodies_are_tuned_in_place_and_the_if_kept() -> None:
    """The same model without specialize_inputs: h's pair sits in the then-branch; it is found there, narrowed as
    in the flat graph, its reading bias follows, and the model keeps its If (mode 2 still runs its branch)."""
    plain, tuned = _quantize(specialize=False), _quantize(get_pass("tune_ranges")(), specialize=False)
    result = tuned.records[-1].result
    assert result.details["factors"].get("h", 1.0) <= 0.35, result.details
    assert any("inside If/Loop bodies: tuned in place" in d for d in result.decisions), result.decisions
    assert _sqnr(tuned.model) > _sqnr(plain.model) + 5
    assert [n.op_type for n in tuned.model.graph.node].count("If") == 1
    then = next(a.g for n in tuned.model.graph.node if n.op_type == "If" for a in n.attribute
                if a.name == "then_branch")
    inits = {**_inits(tuned.model), **{t.name: numpy_helper.to_array(t) for t in then.initializer}}
    producer = {o: n for n in then.node for o in n.output}
    conv = next(n for n in then.node if n.name == "then/conv2")
    bias_dq, w_dq, x_dq = (producer[conv.input[i]] for i in (2, 1, 0))
    np.testing.assert_allclose(inits[bias_dq.input[1]], inits[x_dq.input[1]] * inits[w_dq.input[1]], rtol=1e-6)
    mode2 = [{**f, "mode": np.array(2, np.int64)} for f in level_feeds(4, seed=3)]
    assert np.all(np.isfinite(_outputs(tuned.model, mode2)))


def test_needs_insert_qdq_first_and_sane_factors() -> None:
    data = CallableSource(lambda: level_feeds(4), "4 samples")
    with pytest.raises(PassError, match="after `insert_qdq`"):
        Pipeline([get_pass("tune_ranges")()]).run(level_switched_net(), calibration_data=data)
    with pytest.raises(RecipeError, match="each factor must be in"):  # when the recipe loads, not after quantizing
        get_pass("tune_ranges")(factors=(0.5, 3.0))
    where = r"<recipe>:4:14: passes\[0\].factors .*each factor must be in \(0, 2\], got \[3.0, 0.0\]"
    with pytest.raises(RecipeError, match=where):
        Recipe.from_text("name: r\npasses:\n  - pass: tune_ranges\n    factors: [3.0, 0]\n")


def test_a_second_sweep_never_loses_and_costs_one_more_pass() -> None:
    one, two = (_quantize(get_pass("tune_ranges")(sweeps=k)).records[-1].result.details for k in (1, 2))
    assert two["score_after_db"] >= one["score_after_db"]
    assert two["evaluations"] == one["evaluations"] + one["pairs"] * 4  # each pair: the 4 other factors of 5


# ------------------------------------------------------------------------------ recurrent models, scored streamed
def _leaky(**tune: Any) -> tuple[PipelineResult, list[dict[str, np.ndarray]]]:
    model = leaky_state_net()
    data = CallableSource(lambda: leaky_feeds(4, 32, seed=1, model=model), "4 sequences of 32 steps")
    res = Pipeline([get_pass("insert_qdq")(**MINMAX), get_pass("tune_ranges")(**{"outputs": ("y",), **tune})]).run(
        model, calibration_data=data)
    return res, leaky_feeds(4, 32, seed=9, model=model)


def _streamed_sqnr(model: onnx.ModelProto, held_out: list[dict[str, np.ndarray]]) -> float:
    """SQNR of ``y`` against the float model, each fed its own state (held-out sequences)."""
    score = OutputScore(target_session(leaky_state_net()),
                        held_out, Recurrence(state_inputs=LEAKY_STATE), outputs=["y"])
    assert score.starts == [0, 32, 64, 96]
    return score.score_db(target_session(model))


def test_streamed_tuning_beats_chunk_wise_tuning_on_the_streamed_score() -> None:
    """Clipping the loud channel the state integrates helps each step with the recorded state, and hurts once the
    error accumulates through the model's own state (`qgraph.testing.recurrent.leaky_state_net`)."""
    chunk, held_out = _leaky()
    streamed, _ = _leaky(recurrent={"state_inputs": LEAKY_STATE})
    by_chunk, by_stream = chunk.records[-1].result, streamed.records[-1].result
    assert by_chunk.details["factors"].get("h", 1.0) < 1 and not by_chunk.details["streamed"]
    assert by_stream.details["streamed"] and by_stream.details["sequences"] == 4
    assert by_stream.details["factors"].get("h", 1.0) == 1.0, by_stream.details
    assert any("streamed over 4 sequence(s) of 128 samples" in d for d in by_stream.decisions)
    # held-out, streamed: 19.1 dB after chunk-wise tuning vs 24.6 dB after streamed tuning when written
    assert _streamed_sqnr(streamed.model, held_out) > _streamed_sqnr(chunk.model, held_out) + 3


def test_without_recurrent_the_score_is_the_chunk_wise_one() -> None:
    """No `recurrent`: every sample with its recorded state, as before the option existed."""
    model = leaky_state_net()
    cal = leaky_feeds(4, 32, seed=1, model=model)
    qdq = Pipeline([get_pass("insert_qdq")(**MINMAX)]).run(model, calibration_data=CallableSource(lambda: cal, "cal"))
    session = target_session(model)
    expected = OutputScore(session, cal, outputs=["y"]).score_db(
        target_session(qdq.model))
    plain = _leaky()[0].records[-1].result
    assert plain.details["score_before_db"] == pytest.approx(expected, abs=1e-4)
    assert not plain.details["streamed"] and plain.details["sequences"] == 128
    assert any("chunk-wise on 128 samples" in d for d in plain.decisions)


@pytest.mark.parametrize(("tune", "message"), [
    ({"recurrent": {"state_inputs": {"state": "s_next"}}},
     r"`recurrent.state_inputs` names graph input 'state', which the input model does not take"),
    ({"recurrent": {"state_inputs": {"s": "stateN"}}}, r"`recurrent.state_inputs` names graph output 'stateN'"),
    ({"outputs": ("prob",)}, r"`outputs` names graph output 'prob', which the input model does not produce"),
])
def test_bad_recurrent_config_is_refused_naming_the_tensor(tune: dict[str, Any], message: str) -> None:
    """Before any pass runs (insert_qdq's calibration included: `qgraph.pipeline.preflight`)."""
    with pytest.raises(RecipeError, match=r"\(tune_ranges\): " + message):
        _leaky(**tune)


def test_the_score_is_the_worst_part_of_an_output_a_concat_joins() -> None:
    """A YOLO-style head (boxes 0..320 px and class scores 0..1 in one output through a Concat, the join left float
    by insert_qdq and the Sigmoid outputs quantized on [0, 1]): scored per part, the score is the scores' SQNR and
    narrowing the class ranges buys > 3 dB there; scored whole (`output_parts: false`), the boxes decide and no
    range is worth narrowing."""
    from qgraph.runtime.output_parts import find_output_parts
    from qgraph.testing import detection_feeds, detection_head

    model = detection_head()
    cal = detection_feeds(16)
    data = CallableSource(lambda: cal, "16 images")
    qdq = get_pass("insert_qdq")(preset="ort-x86-vnni", elementwise="always")
    int8 = Pipeline([qdq]).run(model, calibration_data=data).model
    sessions = [target_session(m) for m in (model, int8)]
    boxes_db, scores_db = OutputScore(sessions[0], cal, parts=find_output_parts(model)).per_output_db(sessions[1])
    whole_db = OutputScore(sessions[0], cal).score_db(sessions[1])
    assert scores_db < 35 < boxes_db and whole_db == pytest.approx(boxes_db, abs=0.1)

    res = Pipeline([qdq, get_pass("tune_ranges")()]).run(model, calibration_data=data).records[-1].result
    assert res.decisions[0] == ("output0 is scored as 2 parts (Concat on axis 1 of boxes [4] and scores [18]); the "
                                "worst part decides")
    assert res.details["score_before_db"] == pytest.approx(scores_db, abs=0.01)
    assert res.details["scored_db_before"] == pytest.approx({"output0[0:4] (boxes)": boxes_db,
                                                             "output0[4:22] (scores)": scores_db}, abs=0.01)
    after = res.details["scored_db_after"]
    assert res.details["score_after_db"] == min(after.values()) > scores_db + 3
    assert after["output0[0:4] (boxes)"] >= boxes_db - 0.5 and set(res.details["factors"]) <= {"cls_logit", "cls_prob"}
    assert "min SQNR over the parts of every output" in res.decisions[1]

    whole = Pipeline([qdq, get_pass("tune_ranges")(output_parts=False)]).run(model, calibration_data=data)
    res = whole.records[-1].result
    assert res.details["score_before_db"] == pytest.approx(whole_db, abs=0.01) and res.details["factors"] == {}
    assert res.decisions[0].startswith("output0 scored whole (output_parts: false)")


def test_a_task_metric_decides_first_and_never_gets_worse() -> None:
    """``metric: detection.f1(...)``: a factor is kept only when the detections agree at least as well with float's,
    SQNR breaking ties; the metric before/after is in the details and a decision line, and a bad metric name is a
    recipe error at the field."""
    from qgraph.metrics import builtin_metric
    from qgraph.testing import detection_feeds, detection_head

    model = detection_head()
    cal = detection_feeds(16)
    data = CallableSource(lambda: cal, "16 images")
    qdq = get_pass("insert_qdq")(preset="ort-x86-vnni", elementwise="always")
    metric = "detection.f1(layout=yolov8, score=0.1)"
    res = Pipeline([qdq, get_pass("tune_ranges")(metric=metric)]).run(model, calibration_data=data)
    record = res.records[-1].result
    before, after = record.details["metric_before"], record.details["metric_after"]
    assert 0.0 <= before <= after <= 1.0
    assert any(d.startswith(f"task metric {metric} decided first: ") for d in record.decisions)
    outs = [_outputs(m, cal)[None] for m in (model, res.model)]  # [1, S, ...]: one output, samples on axis 0
    assert builtin_metric(metric)([outs[1][0]], [outs[0][0]]) == pytest.approx(after)
    with pytest.raises(RecipeError, match=r"tune_ranges.*has no field 'f2'"):
        Recipe.from_dict({"name": "r", "passes": [{"pass": "tune_ranges", "metric": "detection.f2"}]})
