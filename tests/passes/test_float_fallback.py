"""The float_fallback pass: structure, numbers in onnxruntime, idempotence, shared Q/DQ, real QDQ models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from qgraph.passes.float_fallback import FloatFallback

from qgraph import GraphHandle, NodeSelector, PassError, Pipeline, Recipe, RecipeError
from qgraph.quant.qdq_graph import is_dq, is_q, quantized_nodes
from qgraph.runtime.compare import make_session
from qgraph.testing import target_session, transformer_encoder, transformer_encoder_inputs

# x -> Q/DQ shared by mm_a and mm_b; mm_a's output t -> Q/DQ -> graph output y, also read by mm_c (quantized);
# mm_c's output r -> Q/DQ with zero point 0 (a folded Relu) -> mm_d; weight DQ wa_dq shared by mm_a and mm_d.
SHARED_QDQ = """
<ir_version: 8, opset_import: ["" : 17]>
shared (float[2,4] x) => (float[2,4] y, float[2,4] z, float[2,4] u)
<float sx = {0.02}, uint8 zx = {128}, float sw = {0.01}, int8 zw = {0}, float st = {0.03}, uint8 zt = {128},
 float sr = {0.02}, uint8 zr = {0},
 int8[4,4] wa = {10, -20, 30, -40, 50, -60, 70, -80, 90, -100, 110, -120, 5, 15, -25, 35},
 int8[4,4] wb = {-7, 14, -21, 28, -35, 42, -49, 56, -63, 70, -77, 84, -91, 98, -105, 112},
 int8[4,4] wc = {3, 60, -9, 12, -15, 18, -121, 24, 27, -30, 33, -36, 39, 100, 45, -48}>
{
  [x_q] xq = QuantizeLinear(x, sx, zx)
  [x_dq] xd = DequantizeLinear(xq, sx, zx)
  [wa_dq] wad = DequantizeLinear(wa, sw, zw)
  [wb_dq] wbd = DequantizeLinear(wb, sw, zw)
  [wc_dq] wcd = DequantizeLinear(wc, sw, zw)
  [mm_a] t = MatMul(xd, wad)
  [mm_b] z = MatMul(xd, wbd)
  [t_q] tq = QuantizeLinear(t, st, zt)
  [t_dq] y = DequantizeLinear(tq, st, zt)
  [mm_c] r = MatMul(y, wcd)
  [r_q] rq = QuantizeLinear(r, sr, zr)
  [r_dq] rd = DequantizeLinear(rq, sr, zr)
  [mm_d] u = MatMul(rd, wad)
}
"""


def _w(model: onnx.ModelProto, name: str) -> np.ndarray:
    init = next(i for i in model.graph.initializer if i.name == name)
    return onnx.numpy_helper.to_array(init).astype(np.float64) * 0.01


def _fq(x: np.ndarray, scale: float, zp: int, lo: int = 0, hi: int = 255) -> np.ndarray:
    return (np.clip(np.round(x / scale) + zp, lo, hi) - zp) * scale


def _run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    sess = make_session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {"x": x}), strict=True))


def _fall_back(model: onnx.ModelProto, **selector: object) -> tuple[onnx.ModelProto, object]:
    result = Pipeline([FloatFallback(nodes=NodeSelector(**selector))]).run(model)  # type: ignore[arg-type]
    return result.model, result.records[0].result


@pytest.fixture
def shared() -> onnx.ModelProto:
    return onnx.parser.parse_model(SHARED_QDQ)


@pytest.fixture
def x() -> np.ndarray:
    return np.random.default_rng(0).uniform(-2, 2, (2, 4)).astype(np.float32)


def test_structure_shared_pairs_stay_for_quantized_neighbours(shared: onnx.ModelProto) -> None:
    out, res = _fall_back(shared, names=("mm_a",))
    nodes = {n.name: n for n in out.graph.node}
    producer = {o: n for n in out.graph.node for o in n.output}
    # mm_a reads the float input and a float constant equal to the dequantized weight.
    assert nodes["mm_a"].input[0] == "x"
    assert nodes["mm_a"].input[1] == "wa/float" and nodes["mm_a"].input[1] not in producer
    # Its neighbours keep their (shared) pairs: mm_b still reads x's DQ, mm_d still reads wa's DQ.
    assert nodes["mm_b"].input[0] == "xd" and is_dq_node(producer["xd"])
    assert nodes["mm_d"].input[1] == "wad" and is_dq_node(producer["wad"])
    # The graph output y is float now (an Identity of t); mm_c keeps the pair on a renamed tensor.
    assert producer["y"].op_type == "Identity" and producer["y"].input[0] == "t"
    assert producer["y"].doc_string == "qgraph:float_fallback"
    assert nodes["mm_c"].input[0] == "y/dq" and is_dq_node(producer["y/dq"])
    assert [o.name for o in out.graph.output] == ["y", "z", "u"]
    assert res.rewritten == 1 and res.details["fallen_back"] == ["mm_a"]  # type: ignore[attr-defined]
    assert res.details["outputs_still_quantized_for"] == {"mm_a": ["mm_c"]}  # type: ignore[attr-defined]
    assert res.details["dequantized_weights"] == ["wa/float"]  # type: ignore[attr-defined]
    assert res.nodes_added == 1 and res.nodes_removed == 0  # type: ignore[attr-defined]
    onnx.checker.check_model(out, full_check=True)


def is_dq_node(node: onnx.NodeProto) -> bool:
    return node.op_type == "DequantizeLinear"


def test_numbers_neighbours_bit_identical_and_fallen_back_node_float(shared: onnx.ModelProto, x: np.ndarray) -> None:
    before = _run(shared, x)
    out, _ = _fall_back(shared, names=("mm_a",))
    after = _run(out, x)
    # The neighbours are still quantized and compute exactly what they computed before.
    np.testing.assert_array_equal(after["z"], before["z"])
    np.testing.assert_array_equal(after["u"], before["u"])
    # mm_a now computes in float: x @ dequantized(wa), no activation rounding on either side.
    expected_y = x.astype(np.float64) @ _w(shared, "wa")
    np.testing.assert_allclose(after["y"], expected_y, rtol=1e-5, atol=1e-6)
    assert np.abs(before["y"] - expected_y).max() > 1e-3  # it was quantized before


def test_folded_relu_is_restored_when_its_pair_goes(shared: onnx.ModelProto, x: np.ndarray) -> None:
    out, res = _fall_back(shared, names=("mm_c", "mm_d"))
    ops = [n.op_type for n in out.graph.node]
    assert "r_q" not in {n.name for n in out.graph.node}  # r's pair served only mm_d: removed
    relu = next(n for n in out.graph.node if n.op_type == "Relu")
    assert relu.name == "r/relu" and relu.input[0] == "r" and relu.doc_string == "qgraph:float_fallback"
    assert res.details["relu_restored"] == ["r"]  # type: ignore[attr-defined]
    assert ops.count("QuantizeLinear") == 2  # x and t remain
    got = _run(out, x)
    xd = _fq(x.astype(np.float64), 0.02, 128)
    t = xd @ _w(shared, "wa")  # mm_a is still quantized on its input side
    y = _fq(t, 0.03, 128)
    r = t @ _w(shared, "wc")  # mm_c reads t itself (its DQ(Q(t)) is bypassed) and the dequantized weight
    np.testing.assert_allclose(got["u"], np.maximum(r, 0.0) @ _w(shared, "wa"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["y"], y, rtol=1e-6, atol=1e-6)  # mm_a untouched
    assert (r < 0).any()  # the Relu matters on this input


def test_idempotent(shared: onnx.ModelProto) -> None:
    once, _ = _fall_back(shared, names=("mm_a", "mm_d"))
    twice, res = _fall_back(once, names=("mm_a", "mm_d"))
    assert res.rewritten == 0 and res.nodes_added == 0 and res.nodes_removed == 0  # type: ignore[attr-defined]
    assert {s.node for s in res.skipped} == {"mm_a", "mm_d"}  # type: ignore[attr-defined]
    assert once.graph.SerializeToString(deterministic=True) == twice.graph.SerializeToString(deterministic=True)


@pytest.mark.parametrize(
    ("selector", "named"),
    [
        ({"names": ("mm_a", "mm_z")}, "'mm_z'"),
        ({"op_types": ("Softmax",)}, "Softmax"),
        ({"regex": ("^enc/",)}, "^enc/"),
    ],
)
def test_selector_matching_nothing_is_an_error_naming_it(
    shared: onnx.ModelProto, selector: dict[str, tuple[str, ...]], named: str
) -> None:
    with pytest.raises(PassError) as err:
        _fall_back(shared, **selector)
    assert named in err.value.message and "match nothing" in err.value.message


def test_selector_error_from_a_recipe_via_cli(shared: onnx.ModelProto, tmp_path: Path) -> None:
    from qgraph.cli import main

    onnx.save(shared, tmp_path / "m.onnx")
    (tmp_path / "r.yaml").write_text("name: r\npasses:\n  - pass: float_fallback\n    nodes: {names: [nope]}\n")
    assert main(["run", str(tmp_path / "r.yaml"), str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "-q"]) == 1
    assert not (tmp_path / "o.onnx").exists()


def test_qdq_and_float_nodes_in_the_selection(shared: onnx.ModelProto) -> None:
    _, res = _fall_back(shared, regex=("^mm_a$", "_q$"))
    assert res.details["fallen_back"] == ["mm_a"]  # type: ignore[attr-defined]
    assert any("QuantizeLinear/DequantizeLinear node(s) in the selection were ignored" in n for n in res.notes)  # type: ignore[attr-defined]


def test_config_needs_nodes_or_auto() -> None:
    from qgraph import RecipeError

    with pytest.raises(RecipeError, match="nodes"):
        FloatFallback()
    with pytest.raises(RecipeError, match=r"<recipe>:4:20: passes\[0\].auto.target .*invalid target"):
        Recipe.from_text("name: r\npasses:\n  - pass: float_fallback\n    auto: {target: 'cosine:high'}\n")


# ----------------------------------------------------------------------------- real topology (onnxruntime QDQ)
@pytest.fixture(scope="module")
def ort_encoder(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[onnx.ModelProto, onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """A BERT-like encoder and its QDQ model from onnxruntime.quantize_static (weights kept float as Q→DQ)."""
    from qgraph.testing import ort_quantize_static

    folder = tmp_path_factory.mktemp("ff_ort")
    float_model = transformer_encoder(layers=1, d_model=32, heads=2, seq=8)
    onnx.save(float_model, folder / "f.onnx")
    calib = transformer_encoder_inputs(8, seed=1, seq=8, d_model=32)
    qdq = ort_quantize_static(folder / "f.onnx", folder / "q.onnx", calib, extra_options={"AddQDQPairToWeight": True})
    return float_model, qdq, transformer_encoder_inputs(2, seed=2, seq=8, d_model=32)


def test_real_model_everything_back_to_float_equals_float_model(ort_encoder) -> None:  # type: ignore[no-untyped-def]
    float_model, qdq, feeds = ort_encoder
    handle = GraphHandle(qdq)
    n_quantized = len(quantized_nodes(handle))
    result = Pipeline([FloatFallback(nodes=NodeSelector())]).run(qdq)
    res = result.records[0].result
    assert res.rewritten == n_quantized > 30
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in result.model.graph.node)
    # onnxruntime stores LayerNorm biases as int32 even with AddQDQPairToWeight: they come back dequantized.
    restored = {i.name: i for i in result.model.graph.initializer}
    assert res.details["dequantized_weights"] == ["layer0/attn/ln.bias_1", "layer0/ffn/ln.bias_1"]
    reference = onnx.ModelProto()
    reference.CopyFrom(float_model)
    for init in reference.graph.initializer:
        if init.name + "_1" in restored:
            init.CopyFrom(restored[init.name + "_1"])
            init.name = init.name[:-2] if init.name.endswith("_1") else init.name
    f_sess, o_sess = make_session(reference), make_session(result.model)
    for feed in feeds:
        ref, got = f_sess.run(None, feed)[0], o_sess.run(None, feed)[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_real_model_one_matmul_of_a_shared_pair(ort_encoder) -> None:  # type: ignore[no-untyped-def]
    _, qdq, _ = ort_encoder
    handle = GraphHandle(qdq)
    q_proj = handle.index.by_name["layer0/attn/q/matmul"]
    shared_dq = handle.producer(q_proj.inputs[0])
    assert shared_dq is not None and is_dq(shared_dq)
    sharing = [c.name for c in handle.consumers(shared_dq.outputs[0])]
    assert "layer0/attn/k/matmul" in sharing and "layer0/attn/v/matmul" in sharing
    result = Pipeline([FloatFallback(nodes=NodeSelector(names=("layer0/attn/q/matmul",)))]).run(qdq)
    after = GraphHandle(result.model)
    q_after = after.index.by_name["layer0/attn/q/matmul"]
    assert not any((p := after.producer(t)) is not None and is_dq(p) for t in q_after.inputs)
    for name in sharing:
        if name != "layer0/attn/q/matmul":  # each neighbour still reads the very same DQ output
            assert shared_dq.outputs[0].name in [t.name for t in after.index.by_name[name].inputs]
    assert any(is_q(c) for c in after.consumers(q_after.outputs[0]))  # its output stays quantized for the Add
    assert len(quantized_nodes(after)) == len(quantized_nodes(handle)) - 1


def test_walks_bounded(ort_encoder) -> None:  # type: ignore[no-untyped-def]
    from qgraph.remedy.fallback import fall_back

    _, qdq, _ = ort_encoder
    handle = GraphHandle(qdq)
    fall_back(handle, quantized_nodes(handle))
    assert handle.walks["index"] <= 3 and handle.walks["cleanup"] == 1 and handle.walks["toposort"] <= 1


def test_auto_mode_inside_the_pass_defaults_to_the_stripped_model(ort_encoder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, qdq, feeds = ort_encoder
    np.savez(tmp_path / "eval.npz", **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    auto = {
        "target": "sqnr:200",
        "data": str(tmp_path / "eval.npz"),
        "max_nodes": 2,
        "candidates": {"op_types": ["Softmax", "LayerNormalization"]},
    }
    result = Pipeline([FloatFallback(auto=auto)]).run(qdq)  # type: ignore[arg-type]
    res = result.records[0].result
    assert any("every Q/DQ removed" in n for n in res.notes)
    assert res.details["auto"]["target_met"] is False and len(res.details["auto"]["nodes"]) == 2
    assert res.details["fallen_back"] == res.details["auto"]["nodes"] and res.rewritten == 2
    assert any(n.startswith("auto: target NOT met") for n in res.decisions)
    assert res.unmet is not None and "not met" in res.unmet
    # why each is float (qgraph diff, the report): the search's choice, not a skip
    assert [k.node for k in res.kept_float] == res.details["fallen_back"] and not res.skipped
    assert [k.reason for k in res.kept_float] == [
        f"returned to float (auto: #{i} of the 2 node(s) chosen, ranked by latency; target sqnr >= 200 NOT met, "
        f"score {res.details['auto']['score']:.4g})" for i in (1, 2)]


def test_float_and_qdq_models_must_match(ort_encoder, shared: onnx.ModelProto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from qgraph import ModelError
    from qgraph.analysis.sensitivity.search import auto_fallback

    float_model, _, feeds = ort_encoder
    np.savez(tmp_path / "eval.npz", **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    with pytest.raises(ModelError, match="do not match"):
        auto_fallback(float_model, shared, str(tmp_path / "eval.npz"), "cosine:0.99")


def test_reference_weights_make_everything_back_to_float_the_float_model(tmp_path: Path) -> None:
    """onnxruntime QDQ with weights and biases stored as integers and Relus fused into the convs (outputs
    renamed): with the float model's weights (`ReferenceWeights`, found by output or by the integer constant's
    name) every node back in float gives the float model's outputs; with ``DQ(w_q)`` the weight rounding stays."""
    from qgraph.quant.reference_weights import ReferenceWeights
    from qgraph.remedy.fallback import fall_back
    from qgraph.testing import ort_quantize_static
    from qgraph.testing.synthetic import fragile_resnet

    model = fragile_resnet(blocks=3, fragile={1: 30.0})
    onnx.save(model, tmp_path / "f.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"input": rng.standard_normal((1, 8, 16, 16)).astype(np.float32)} for _ in range(4)]
    qdq = ort_quantize_static(tmp_path / "f.onnx", tmp_path / "q.onnx", feeds)
    outs = {}
    for label, reference in (("float", ReferenceWeights(model)), ("rounded", None)):
        handle = GraphHandle(qdq)
        outcome = fall_back(handle, quantized_nodes(handle), reference=reference)
        assert len(outcome.float_weights_restored) == (2 * 8 if reference else 0)  # 8 Conv/Gemm x (weight, bias)
        outs[label] = make_session(handle.to_onnx()).run(None, feeds[0])
    ref = make_session(model).run(None, feeds[0])
    for r, got in zip(ref, outs["float"], strict=True):
        assert np.max(np.abs(got - r)) <= 1e-5 * np.max(np.abs(r))
    assert max(np.max(np.abs(g - r)) / np.max(np.abs(r)) for r, g in zip(ref, outs["rounded"], strict=True)) > 1e-4


def test_auto_baseline_sees_the_error_made_inside_if_bodies() -> None:
    """A model quantized only inside If branches (the compute of a mode-switched net): without `auto.reference`
    the baseline strips the Q/DQ inside bodies too, so the INT8 error inside bodies is seen (it read as "the INT8
    model already meets the target" when only the top graph was stripped). The body nodes are candidates (each
    measured exactly): the target is met with them in float and the If kept; with `bodies: false` it is not met and
    they are named as not being candidates. After `specialize_inputs` the same nodes are top-level candidates."""
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.testing import mode_feeds, mode_switched_net

    model = mode_switched_net()
    data = CallableSource(lambda: mode_feeds(16), "mode-1 samples")
    qdq = get_pass("insert_qdq")(preset="ort-x86-vnni", nodes=NodeSelector(exclude=NodeSelector(names=("head",))))
    fallback = FloatFallback(auto={"target": "sqnr:80", "max_time": 60})
    result = Pipeline([qdq, fallback]).run(model, calibration_data=data)
    res = result.records[-1].result
    assert res.unmet is None and res.details["auto"]["target_met"], res.decisions
    assert 20 < res.details["auto"]["int8_score"] < 80, res.details["auto"]  # was inf: the body error unseen
    assert any(d.startswith("auto: 2 quantized node(s) inside If/Loop bodies are candidates") for d in res.decisions)
    inner = {n.name for a in next(n for n in result.model.graph.node if n.op_type == "If").attribute for n in a.g.node}
    assert res.details["fallen_back"] and set(res.details["fallen_back"]) <= inner  # body nodes, by their names
    assert all("inside switch.then_branch" in k.reason for k in res.kept_float), res.kept_float
    assert [n.op_type for n in result.model.graph.node].count("If") == 1  # still general: mode 2 still runs
    for mode in (1, 2):
        feed = mode_feeds(1, mode=mode, seed=5)[0]
        (ref,), (got,) = make_session(model).run(None, feed), make_session(result.model).run(None, feed)
        assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))  # the branch's nodes float, head excluded
    off = FloatFallback(auto={"target": "sqnr:80", "max_time": 60, "bodies": False})
    res = Pipeline([qdq, off]).run(model, calibration_data=data).records[-1].result
    body = [n for n in res.notes if "inside If/Loop bodies" in n]
    assert res.unmet is not None and body and body[0].startswith("auto: 2 quantized node(s)"), res.notes
    flat = Pipeline([get_pass("specialize_inputs")(inputs={"mode": 1}), qdq, off]).run(
        model, calibration_data=data).records[-1].result
    assert not [n for n in flat.notes if "inside If/Loop bodies" in n]
    assert flat.details["fallen_back"], flat.decisions  # the branch's nodes were candidates there


def test_manual_selection_reaches_nodes_inside_bodies_by_name() -> None:
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.testing import mode_feeds, mode_switched_net

    model = mode_switched_net()
    data = CallableSource(lambda: mode_feeds(16), "mode-1 samples")
    qdq = get_pass("insert_qdq")(preset="ort-x86-vnni")
    quantized = Pipeline([qdq]).run(model, calibration_data=data).model
    branch = next(n for n in quantized.graph.node if n.op_type == "If").attribute
    conv = next(n.name for a in branch if a.name == "then_branch" for n in a.g.node if n.op_type == "Conv")
    # the scoped form insert_qdq, inspect and diff print names the same node
    result = Pipeline([FloatFallback(nodes=NodeSelector(names=(f"switch.then_branch/{conv}", "head")))]).run(quantized)
    res = result.records[-1].result
    assert sorted(res.details["fallen_back"]) == sorted([conv, "head"]) and res.matched == 2
    then = next(a.g for a in next(n for n in result.model.graph.node if n.op_type == "If").attribute
                if a.name == "then_branch")
    producer = {o: n for n in then.node for o in n.output}
    node = next(n for n in then.node if n.name == conv)
    assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for i in node.input)
    with pytest.raises(PassError, match="'nope' matched no node"):
        Pipeline([FloatFallback(nodes=NodeSelector(names=(conv, "nope")))]).run(quantized)


@pytest.mark.parametrize("streamed", [False, True])
def test_auto_scores_a_recurrent_model_streamed_when_asked(streamed: bool) -> None:
    """With `auto.recurrent` every full evaluation feeds each model its own state (`qgraph.runtime.streaming`): the INT8
    baseline's score is the streamed one; without it, each sample with its recorded state."""

    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.runtime.streaming import OutputScore, Recurrence
    from qgraph.testing.recurrent import LEAKY_STATE, leaky_feeds, leaky_state_net

    model = leaky_state_net()
    cal = leaky_feeds(2, 32, model=model)
    data = CallableSource(lambda: cal, "2 sequences")
    # ranges tuned per sample: narrowing h costs little per sample and much streamed (test_tune_ranges.py)
    steps = [get_pass("insert_qdq")(preset="ort-x86-vnni", activations={"method": "minmax"}),
             get_pass("tune_ranges")(outputs=("y",))]
    recurrent = {"recurrent": {"state_inputs": LEAKY_STATE}} if streamed else {}
    fallback = FloatFallback(auto={"target": "sqnr:10", "latency_rounds": 0, **recurrent})
    res = Pipeline([*steps, fallback]).run(model, calibration_data=data).records[-1].result
    qdq = Pipeline(steps).run(model, calibration_data=data).model
    sessions = [target_session(m) for m in (model, qdq)]
    score = OutputScore(sessions[0], cal, Recurrence(state_inputs=LEAKY_STATE) if streamed else None)
    other = OutputScore(sessions[0], cal, None if streamed else Recurrence(state_inputs=LEAKY_STATE))
    assert res.details["auto"]["int8_score"] == pytest.approx(score.score_db(sessions[1]), abs=0.01)
    assert abs(score.score_db(sessions[1]) - other.score_db(sessions[1])) > 3  # the two ways differ here
    assert any("streamed" in n for n in res.notes) == streamed


def test_auto_recurrent_state_not_in_the_model_is_refused_naming_it() -> None:
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.testing.recurrent import leaky_feeds, leaky_state_net

    model = leaky_state_net()
    data = CallableSource(lambda: leaky_feeds(1, 4, model=model), "4 steps")
    fallback = FloatFallback(auto={"target": "sqnr:10", "recurrent": {"state_inputs": {"h0": "s_next"}}})
    # before insert_qdq calibrates (`qgraph.pipeline.preflight`)
    with pytest.raises(RecipeError, match=r"\(float_fallback\): `auto\.recurrent\.state_inputs` names graph "
                       "input 'h0'"):
        Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni"), fallback]).run(model, calibration_data=data)


def test_auto_outputs_scores_only_the_named_outputs() -> None:
    """`auto.outputs` scores only the named outputs (e.g. a recurrent model's state without its prediction, or the
    other way round): here the INT8 state output already meets 40 dB (43.7) while the prediction does not (22.6)."""
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.testing.recurrent import leaky_feeds, leaky_state_net

    model = leaky_state_net()
    feeds = leaky_feeds(4, 8)
    data = CallableSource(lambda: feeds, "32 samples")
    qdq = get_pass("insert_qdq")(preset="ort-x86-vnni", activations={"method": "minmax"})
    auto = {"target": "sqnr:40", "latency_rounds": 0}
    both = Pipeline([qdq, FloatFallback(auto=auto)]).run(model, calibration_data=data).records[-1].result
    state = Pipeline([qdq, FloatFallback(auto={**auto, "outputs": ["s_next"]})]).run(
        model, calibration_data=data).records[-1].result
    assert both.details["auto"]["nodes"] and both.details["auto"]["int8_score"] < 40
    assert state.details["auto"]["nodes"] == [] and state.details["auto"]["int8_score"] > 40
    assert any("sqnr of s_next >= 40" in d for d in state.decisions), state.decisions
    # refused before insert_qdq calibrates (`qgraph.pipeline.preflight`)
    with pytest.raises(RecipeError, match=r"`auto\.outputs` names graph output 'nope'"):
        Pipeline([qdq, FloatFallback(auto={**auto, "outputs": ["nope"]})]).run(model, calibration_data=data)


def test_float_weights_option_restores_the_float_models_weights_on_a_qdq_model(tmp_path: Path) -> None:
    """A patch applied to a QDQ model alone (no quantizing pass before it): ``float_weights`` names the float
    model, and the node back in float reads its float weights, not ``DQ(w_q)``."""
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.testing.depthwise import depthwise_net

    floats = Pipeline([get_pass("fuse_batchnorm")()]).run(depthwise_net(seed=0, spread=100.0)).model
    rng = np.random.default_rng(0)
    cal = [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(4)]
    qdq = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(
        floats, calibration_data=CallableSource(lambda: cal, "calibration")).model
    onnx.save(floats, tmp_path / "float.onnx")
    chosen = NodeSelector(names=("b1/pw",))
    plain = Pipeline([FloatFallback(nodes=chosen)]).run(qdq)
    restored = Pipeline([FloatFallback(nodes=chosen, float_weights=str(tmp_path / "float.onnx"))]).run(qdq)
    node = next(n for n in floats.graph.node if n.name == "b1/pw")
    want = next(onnx.numpy_helper.to_array(t) for t in floats.graph.initializer if t.name == node.input[1])

    def weight(model: onnx.ModelProto) -> np.ndarray:
        inits = {t.name: t for t in model.graph.initializer}
        return onnx.numpy_helper.to_array(inits[next(n for n in model.graph.node if n.name == "b1/pw").input[1]])

    np.testing.assert_array_equal(weight(restored.model), want)
    assert np.abs(weight(plain.model) - want).max() > 1e-6  # without it: the int8 grid's values
    assert any("float_weights" in n for n in restored.records[0].result.notes)


@pytest.mark.parametrize("to", ["float", "a16w16"])
def test_float_weights_from_the_model_before_batchnorm_fusion_are_not_taken(tmp_path: Path, to: str) -> None:
    """``float_weights`` (and `qgraph sensitivity FLOAT`) is usually the original float model, while the QDQ model
    had its BatchNorms fused: the fused Conv's output now carries the BatchNorm's output name, so a lookup by
    name finds the BatchNorm's scale and bias at the Conv's weight and bias positions. They do not match the
    stored codes and must not be used (the model read the BatchNorm's bias as the Conv's: SQNR 0.6 dB on
    PP-LCNet); the nodes take their dequantized codes, so the result is as close to float as the QDQ model."""
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.testing import conv_bn_net, random_feeds

    model = conv_bn_net(seed=3)
    cal = random_feeds(model, 8, seed=1)
    qdq = Pipeline([get_pass("fuse_batchnorm")(), get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(
        model, calibration_data=CallableSource(lambda: cal, "calibration")).model
    onnx.save(model, tmp_path / "float.onnx")
    chosen = NodeSelector(op_types=("Conv",))
    out = Pipeline([FloatFallback(nodes=chosen, to=to, float_weights=str(tmp_path / "float.onnx"))]).run(qdq)
    assert out.records[0].result.rewritten == 4

    def sqnr(candidate: onnx.ModelProto) -> float:
        ref = np.concatenate([make_session(model).run(None, f)[0] for f in cal])
        got = np.concatenate([make_session(candidate).run(None, f)[0] for f in cal])
        return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((got - ref).astype(np.float64) ** 2)))

    before = sqnr(qdq)
    assert 20 < before < 60
    assert sqnr(out.model) >= before - 1.0  # was 25.9 vs 42.2 dB: BatchNorm scale/bias as Conv weights


def test_auto_scores_each_part_of_an_output_a_concat_joins() -> None:
    """A YOLO-style head writes boxes (0..320 px) and class scores (0..1) into one output through a Concat. Quantized
    with one scale for the join (as onnxruntime's quantize_static does), the whole output reads > 40 dB (the boxes)
    while the scores are lost (~0 dB). Scored per part, `sqnr:30` returns the join to float; scored whole (the old
    behaviour, `output_parts: false`), the target reads as met and nothing changes."""
    import onnxruntime as ort

    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.runtime.output_parts import find_output_parts
    from qgraph.runtime.streaming import OutputScore
    from qgraph.testing import detection_feeds, detection_head

    model = detection_head()
    cal = detection_feeds(16)
    data = CallableSource(lambda: cal, "16 images")
    shared = get_pass("insert_qdq")(preset="ort-x86-vnni", elementwise="always", joins={"keep_float": False})

    def session(m: onnx.ModelProto) -> ort.InferenceSession:
        return target_session(m)

    reference = session(model)
    whole, parts = OutputScore(reference, cal), OutputScore(reference, cal, parts=find_output_parts(model))
    int8 = session(Pipeline([shared]).run(model, calibration_data=data).model)
    assert whole.score_db(int8) > 40 and parts.per_output_db(int8)[1] < 1  # the scores are invisible in the whole

    auto = {"target": "sqnr:30", "latency_rounds": 0}
    result = Pipeline([shared, FloatFallback(auto=auto)]).run(model, calibration_data=data)
    res = result.records[-1].result
    assert ("auto: output0 is scored as 2 parts (Concat on axis 1 of boxes [4] and scores [18]); the worst part "
            "decides") in res.decisions
    assert res.details["auto"]["int8_score"] == pytest.approx(parts.score_db(int8), abs=0.01)
    assert res.details["fallen_back"] == ["head_concat"]  # the shared scale of the join: ranked first, enough alone
    boxes_db, scores_db = parts.per_output_db(session(result.model))
    assert scores_db >= 30 and boxes_db >= 30 and res.details["auto"]["score"] == pytest.approx(scores_db, abs=0.01)
    assert res.details["output_parts"][0]["parts"][1]["label"] == "output0[4:22] (scores)"

    off = Pipeline([shared, FloatFallback(auto={**auto, "output_parts": False})]).run(model, calibration_data=data)
    res = off.records[-1].result
    assert res.details["auto"]["target_met"] and res.details["auto"]["nodes"] == [] and not res.rewritten
    assert res.details["auto"]["int8_score"] == pytest.approx(whole.score_db(int8), abs=0.01)
    assert any(d.startswith("auto: target met") and "already meets the target" in d for d in res.decisions)
    assert any(d.startswith("auto: output0 scored whole (output_parts: false)") for d in res.decisions)


def test_a_target_the_data_cannot_show_is_a_decision_line(tmp_path: Path) -> None:
    """top1:0.995 on the digits' 450 held-out samples: even a model agreeing everywhere has a 95 % interval reaching
    1 - 3.69 / 450 = 0.9918, so the pass says in its decisions that meeting the target there shows little."""
    digits = Path(__file__).resolve().parents[2] / "examples" / "digits"
    int8 = Recipe.from_yaml(Path(__file__).resolve().parents[2] / "recipes" / "ort-x86-vnni.yaml").pipeline().run(
        str(digits / "model.onnx"), calibration_data=str(digits / "calibration.npz"))
    fallback = FloatFallback(auto={"target": "top1:0.995", "data": str(digits / "eval.npz"),
                                   "reference": str(digits / "model.onnx"), "latency_rounds": 0})
    res = Pipeline([fallback]).run(int8.model).records[0].result
    limit = [d for d in res.decisions if d.startswith("auto: on these 450 samples even a model that agrees")]
    assert len(limit) == 1 and "reaching 0.9918" in limit[0] and "samples of this kind would" in limit[0]
    assert res.details["auto"]["data_limit"] == limit[0].removeprefix("auto: ")


def test_measured_latency_beyond_the_bound_is_an_attention_with_the_bound_that_would_hold() -> None:
    """The search bounds the modelled latency; the measured one can exceed it (YOLOv8n: modelled 0.63x, measured
    1.02x with max_latency 0.9). The check says by how much the cost table was off and which bound would hold."""
    from qgraph.passes.float_fallback import measured_latency_check

    assert measured_latency_check({}, 0.9) is None  # not timed (latency_rounds: 0)
    assert measured_latency_check({"measured_chosen": 0.85, "modelled_chosen_ratio": 0.6}, 0.9) is None
    assert measured_latency_check({"measured_chosen": 0.98, "modelled_chosen_ratio": 0.6}, None) is None
    text = measured_latency_check({"measured_chosen": 1.02, "modelled_chosen_ratio": 0.63}, 0.9)
    assert text is not None
    assert "1.02x the float reference" in text and "beyond max_latency 0.9x" in text
    assert "modelled 0.63x" in text and "by 1.62x" in text and "max_latency 0.56 would bound" in text
    unbounded = measured_latency_check({"measured_chosen": 1.2}, None)
    assert unbounded is not None and "beyond float's own latency" in unbounded and "no cost table" in unbounded

