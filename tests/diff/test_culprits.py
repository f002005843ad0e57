"""Attribution of quantization error to Q/DQ pairs, on the trained digits CNN with three planted defects.

The defects (each a real failure users meet): an activation pair whose scale is 25× too wide (a range taken from
a wrong layer), one channel of a per-channel weight scale 20× too small (a corrupted or mis-transposed scale),
and an activation range cut to a tenth (a too-aggressive percentile). `diff --eval-data` and `run --report` must
name exactly those three pairs first, each with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from onnx import numpy_helper

from qgraph import Pass, PassConfig, PassContext, PassResult, Pipeline, Recipe
from qgraph.analysis.diff import attribute, feeds_for
from qgraph.analysis.diff.protos import ModelIndex
from qgraph.analysis.diff.quant_points import PointStats, QuantPoint
from qgraph.analysis.report import build_report
from qgraph.cli import main
from qgraph.graph import GraphHandle, const_value, set_const
from qgraph.quant.math import QuantDtype
from qgraph.runtime.evaluation import Evaluation

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"
RECIPE = ROOT / "recipes" / "ort-x86-vnni.yaml"
MISSCALED = "/features/features.2/Relu_output_0"  # activation scale × 25
CLIPPED = "/features/features.9/Relu_output_0"  # activation scale × 0.1: clips
WEIGHT = "features.3.weight"  # per-channel scale of channel 5 × 0.05
DEFECTS = {MISSCALED: 25.0, CLIPPED: 0.1}


class PlantDefectsConfig(PassConfig):
    """No options: the defects are fixed."""


class PlantDefects(Pass[PlantDefectsConfig]):
    """Corrupt three Q/DQ pairs of a QDQ model (see the module docs)."""

    name = "test_plant_defects"
    config_class = PlantDefectsConfig

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        res = PassResult()
        for node in graph.graph.nodes:
            if node.op != "QuantizeLinear" and not (node.op == "DequantizeLinear" and node.name == f"{WEIGHT}/dq"):
                continue
            scale = node.inputs[1]
            value = const_value(scale)
            assert value is not None
            tensor = node.inputs[0].name
            if tensor in DEFECTS:
                set_const(scale, (value * DEFECTS[tensor]).astype(np.float32))
                res.rewritten += 1
            elif node.op == "DequantizeLinear":
                new = value.copy()
                new[5] *= 0.05
                set_const(scale, new.astype(np.float32))
                res.rewritten += 1
        assert res.rewritten == 3, res.rewritten
        return res


def _is_one_of_the_defects(c: dict[str, Any]) -> bool:
    if c["tensor"] == CLIPPED:
        return c["reason"].startswith("clips ") and c["clip_fraction"] > 0.2
    if c["tensor"] == MISSCALED:
        return " wider than the observed" in c["reason"] and c["coarseness"] > 15
    if c["tensor"] == WEIGHT:
        return c["reason"].startswith("channel 5: clips") and c["channel"] == 5
    return False


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The float model the quantizer saw (BN fused), a clean INT8 model and the one with planted defects."""
    folder = tmp_path_factory.mktemp("culprits")
    passes = Recipe.from_yaml(RECIPE).pipeline().passes
    k = next(i for i, p in enumerate(passes) if p.name == "insert_qdq")
    calib = str(DIGITS / "calibration.npz")
    Pipeline(passes[:k]).run(str(DIGITS / "model.onnx"), calibration_data=calib).save(folder / "float.onnx")
    Pipeline(passes).run(str(DIGITS / "model.onnx"), calibration_data=calib).save(folder / "clean.onnx")
    Pipeline([*passes, PlantDefects()]).run(str(DIGITS / "model.onnx"), calibration_data=calib).save(
        folder / "broken.onnx")
    return {"float": folder / "float.onnx", "clean": folder / "clean.onnx", "broken": folder / "broken.onnx"}


def test_diff_names_the_three_planted_defects_first(quantized: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["diff", str(quantized["float"]), str(quantized["broken"]), "--eval-data",
                 str(DIGITS / "eval.npz"), "--samples", "64", "--json", "-"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    culprits = data["culprits"]
    assert {c["tensor"] for c in culprits[:3]} == {MISSCALED, CLIPPED, WEIGHT}
    assert all(_is_one_of_the_defects(c) for c in culprits[:3]), [c["reason"] for c in culprits[:3]]
    for c in culprits[:3]:
        assert {"tensor", "node", "scale", "clip_fraction", "contribution", "reason"} <= set(c)
        assert c["measured"] and c["contribution"] > 0.005
    # The clipped ReLU output dominates: alone it costs most of the output error; healthy pairs cost ~nothing.
    assert culprits[0]["tensor"] == CLIPPED and culprits[0]["contribution"] > 0.5
    assert all(c["alone_sqnr_db"] > 35 for c in culprits[3:] if c["measured"])
    assert data["attribution"]["headline"].startswith(f"most output error comes from the Q/DQ pair on activation "
                                                      f"{CLIPPED}")
    assert data["numeric"]["evaluation"]["data"].endswith(
        "labels " + str(DIGITS / "eval.npz") + ":labels (the first 64 of 450, as --samples cut the data)")


def test_run_report_names_the_same_three_pairs_on_held_out_data(quantized: dict[str, Path]) -> None:
    passes = Recipe.from_yaml(RECIPE).pipeline().passes
    recipe = Recipe.from_yaml(RECIPE)
    result = Pipeline([*passes, PlantDefects()]).run(str(DIGITS / "model.onnx"), keep_stages=True,
                                                     calibration_data=str(DIGITS / "calibration.npz"))
    assert result.input_model is not None
    evaluation = Evaluation.open(result.input_model, DIGITS / "eval.npz", metric=f"{DIGITS / 'metric.py'}:top1",
                                 samples=64)
    report = build_report(recipe, result, evaluation).to_dict()
    assert {c["tensor"] for c in report["culprits"][:3]} == {MISSCALED, CLIPPED, WEIGHT}
    assert all(_is_one_of_the_defects(c) for c in report["culprits"][:3])
    assert report["data"].startswith("64 of 450 sample(s) of") and "metric" in report["data"]
    final = next(r for r in report["fidelity"] if r["stage"] == "final")
    original = next(r for r in report["fidelity"] if r["stage"] == "float original")
    import onnxruntime as ort

    with np.load(DIGITS / "eval.npz") as npz:
        x, labels = npz["input"][:64].astype(np.float32), npz["labels"][:64]
    logits = ort.InferenceSession(str(DIGITS / "model.onnx")).run(None, {"input": x})[0]
    assert original["metric"] == pytest.approx(float(np.mean(logits.argmax(axis=1) == labels)))
    assert final["metric"] < original["metric"]  # the broken model loses top-1 on held-out data


def test_clean_model_has_no_defect_reason_and_small_contributions(quantized: dict[str, Path]) -> None:
    a, b = onnx.load(quantized["float"]), onnx.load(quantized["clean"])
    att = attribute(a, b, list(feeds_for(a, DIGITS / "eval.npz", 32)))
    assert len(att.culprits) == 15  # 7 activation pairs, 4 weights and their 4 int32 biases
    assert not any(_is_one_of_the_defects(c.to_dict()) for c in att.culprits)
    assert all(c.stats.clip_fraction() < 0.01 for c in att.culprits)
    assert att.output_noise is not None and att.output_noise < 1e-3  # the clean INT8 is > 30 dB


def test_weights_whose_float_is_not_in_the_reference_are_read_from_their_codes(quantized: dict[str, Path]) -> None:
    original = onnx.load(DIGITS / "model.onnx")  # before BatchNorm fusion: its Conv weights are not the quantized ones
    att = attribute(original, onnx.load(quantized["broken"]), list(feeds_for(original, DIGITS / "eval.npz", 16)))
    codes_only = [c for c in att.culprits if c.stats.codes_only]
    assert {c.point.tensor for c in codes_only} >= {"features.0.weight", "features.3.weight", "features.7.weight"}
    assert any("analysed from the codes" in n for n in att.notes)
    # Activations are still measured against the reference: the two activation defects still lead.
    assert {c.point.tensor for c in att.culprits[:2]} == {MISSCALED, CLIPPED}


# --------------------------------------------------------------------------------------------- the math
def _point(scale: np.ndarray, zero_point: np.ndarray, axis: int | None, dtype: QuantDtype) -> QuantPoint:
    return QuantPoint("x", "n", "activation", "dq", "q", scale.astype(np.float32), zero_point, dtype, axis)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.05, 50.0), st.sampled_from([QuantDtype.INT8, QuantDtype.UINT8]))
def test_point_stats_match_a_direct_numpy_reference(seed: int, spread: float, dtype: QuantDtype) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 3, 5)) * spread).astype(np.float32)
    if dtype == QuantDtype.UINT8:
        x = np.abs(x)
    qmin, qmax = (-128, 127) if dtype == QuantDtype.INT8 else (0, 255)
    zp = np.asarray(0, dtype.numpy_dtype)  # symmetric int8 or non-negative uint8 data: zero point 0
    scale = np.asarray(np.abs(x).max() / 127 / 2.5, np.float32)  # a range 2.5x too narrow: clips
    stats = PointStats(1)
    p = _point(scale, zp, None, dtype)
    stats.add(p, x)
    q = np.clip(np.rint(x / scale) + float(zp), qmin, qmax)
    err = (q - float(zp)) * float(scale) - x.astype(np.float64)
    clipped = (np.rint(x / scale) + float(zp) < qmin) | (np.rint(x / scale) + float(zp) > qmax)
    assert stats.clip_fraction() == pytest.approx(clipped.mean())
    assert stats.noise_ratio() == pytest.approx((err**2).sum() / (x.astype(np.float64) ** 2).sum(), rel=1e-6)
    assert float(stats.clipping.sum()) == pytest.approx(float((err[clipped] ** 2).sum()), rel=1e-6, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1.0, 100.0))
def test_coarseness_is_the_factor_a_scale_is_too_wide(seed: int, factor: float) -> None:
    rng = np.random.default_rng(seed)
    x = np.abs(rng.standard_normal((8, 16))).astype(np.float32) + 0.01
    exact = np.float32(x.max() / 255)
    p = _point(np.asarray(exact * factor, np.float32), np.asarray(0, np.uint8), None, QuantDtype.UINT8)
    stats = PointStats(1)
    stats.add(p, x)
    assert float(stats.coarseness(p)[0]) == pytest.approx(factor, rel=1e-3)
    assert stats.clip_fraction() == 0.0


def test_per_channel_points_report_the_worst_channel() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    scale = (np.abs(w).reshape(6, -1).max(axis=1) / 127).astype(np.float32)
    scale[4] *= 30.0  # channel 4 rounds to a handful of levels
    p = QuantPoint("w", "conv", "weight", "dq", None, scale, np.zeros(6, np.int8), QuantDtype.INT8, 0)
    stats = PointStats(6)
    stats.add(p, w)
    from qgraph.analysis.diff.culprits import explain

    reason, channel = explain(p, stats)
    assert channel == 4 and reason.startswith("channel 4: step") and "30× wider" in reason


def test_points_are_found_whatever_the_names(quantized: dict[str, Path]) -> None:
    b = onnx.load(quantized["clean"])
    for i, node in enumerate(b.graph.node):  # rename every node: detection follows Q -> DQ edges, not names
        node.name = f"n{i}"
    from qgraph.analysis.diff.quant_points import find_points

    points, notes = find_points(ModelIndex.build(onnx.load(quantized["float"])), ModelIndex.build(b))
    kinds = sorted(p.kind for p in points)
    assert kinds.count("activation") == 7 and kinds.count("weight") == 4 and kinds.count("bias") == 4 and not notes
    weight = next(p for p in points if p.tensor == WEIGHT)
    assert weight.axis == 0 and weight.channels == 32 and weight.codes is not None
    scale = numpy_helper.to_array(next(t for t in b.graph.initializer if t.name == f"{WEIGHT}/scale"))
    assert np.array_equal(weight.scale, scale)


def test_codes_only_all_zero_channel_is_exact_not_the_worst() -> None:
    # silero-vad's STFT basis has an all-zero row (the sine at frequency 0), stored with the placeholder scale
    # 1.0: read from the codes it must not be the worst channel with an infinite noise ratio and range [0, 0].
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, size=(6, 4, 3)).astype(np.int8)
    codes[2] = 0
    scale = np.full(6, 0.01, np.float32)
    scale[2] = 1.0
    p = QuantPoint("w", "conv", "weight", "dq", None, scale, np.zeros(6, np.int8), QuantDtype.INT8, 0,
                   codes=codes, in_reference=False)
    stats = PointStats(6)
    stats.add_codes(p, codes)
    from qgraph.analysis.diff.culprits import explain

    assert stats.channel_noise_ratio()[2] == 0.0
    assert np.isfinite(stats.noise_ratio())
    _, channel = explain(p, stats)
    assert channel != 2


def test_observed_range_covers_every_evaluation_sample(tmp_path: Path) -> None:
    # Sample 0 is silence (all zeros): the observed range and clip fraction of every activation pair must be
    # over all samples, equal to the min/max of the reference's values over the whole evaluation set.
    from qgraph.analysis.diff import diff_files
    from qgraph.analysis.diff.numeric import stream_tensors
    from qgraph.testing.synthetic import conv_bn_relu_chain

    model = conv_bn_relu_chain(2, channels=4, spatial=6, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 1, 4, 6, 6)).astype(np.float32)
    cal = rng.standard_normal((6, 1, 4, 6, 6)).astype(np.float32)
    x[0] = 0.0
    onnx.save(model, tmp_path / "f.onnx")
    np.savez(tmp_path / "eval.npz", input=x)
    np.savez(tmp_path / "cal.npz", input=cal)
    recipe = Recipe.from_dict({"name": "t", "passes": [{"pass": "fuse_batchnorm"},
                                                        {"pass": "insert_qdq", "preset": "ort-x86-vnni"}]})
    onnx.save(recipe.pipeline().run(tmp_path / "f.onnx", calibration_data=tmp_path / "cal.npz").model,
              tmp_path / "q.onnx")
    _, numeric = diff_files(tmp_path / "f.onnx", tmp_path / "q.onnx", inputs=tmp_path / "eval.npz")
    assert numeric is not None and numeric.attribution is not None and numeric.attribution.samples == 6
    acts = [c for c in numeric.attribution.culprits if c.point.kind == "activation"]
    assert acts
    names = [c.point.tensor for c in acts if c.point.tensor != "input"]
    values: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for _, got in stream_tensors(model, [names], [{"input": s} for s in x]):
        for n, v in got.items():
            values[n].append(v)
    for c in acts:
        d = c.to_dict()
        every = x if c.point.tensor == "input" else np.stack(values[c.point.tensor])
        assert d["observed_range"] == pytest.approx([float(every.min()), float(every.max())], rel=1e-6)
        assert c.stats.count.sum() == every.size


def _amplified_pair_model() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(float A, QDQ B): pair ``a`` is coarse (low local SQNR) but its output barely cares; pair ``h`` is fine
    (high local SQNR) but the output is the small difference of its two large columns, so it carries the error."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.zeros((16, 2), np.float32)
    w[:, 0] = 1.0
    w[:, 1] = 1.0
    w[0, 1] = 1.02  # h1 - h0 = 0.02 x0: the signal of out_h
    diff = np.array([[-1.0], [1.0]], np.float32)

    def build(quantized: bool) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(diff, "d"),
                 numpy_helper.from_array(np.array(0.25, np.float32), "sa"),
                 numpy_helper.from_array(np.array(0, np.uint8), "za"),
                 numpy_helper.from_array(np.array(0.2, np.float32), "sh"),
                 numpy_helper.from_array(np.array(0, np.uint8), "zh")]
        nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
                 helper.make_node("MatMul", ["x", "w"], ["h"], name="mm")]
        a, h = "a", "h"
        if quantized:
            nodes += [helper.make_node("QuantizeLinear", ["a", "sa", "za"], ["a_q"], name="a/q"),
                      helper.make_node("DequantizeLinear", ["a_q", "sa", "za"], ["a_dq"], name="a/dq"),
                      helper.make_node("QuantizeLinear", ["h", "sh", "zh"], ["h_q"], name="h/q"),
                      helper.make_node("DequantizeLinear", ["h_q", "sh", "zh"], ["h_dq"], name="h/dq")]
            a, h = "a_dq", "h_dq"
        nodes += [helper.make_node("Abs", [a], ["out_a"], name="abs"),
                  helper.make_node("MatMul", [h, "d"], ["out_h"], name="cancel")]
        graph = helper.make_graph(nodes, "amplified", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                                  [helper.make_tensor_value_info("out_a", TensorProto.FLOAT, [4, 16]),
                                   helper.make_tensor_value_info("out_h", TensorProto.FLOAT, [4, 1])], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])

    return build(False), build(True)


def test_group_screening_finds_a_pair_that_local_noise_ranks_last() -> None:
    """Local noise ranks the coarse pair first; the output error comes from the fine pair later layers amplify.
    Measuring only the first by local noise names the wrong pair; group screening finds the right one."""
    from qgraph.analysis.diff.culprits import attribute

    a, b = _amplified_pair_model()
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(2.0, 3.0, (4, 16)).astype(np.float32)} for _ in range(4)]
    local_only = attribute(a, b, feeds, exact_top=1, extend_seconds=0)
    assert local_only.culprits[0].point.tensor == "a"  # the only one measured
    assert local_only.culprits[0].local_sqnr_db < local_only.culprits[1].local_sqnr_db
    screened = attribute(a, b, feeds, exact_top=1, extend_seconds=30)
    top = screened.culprits[0]
    assert top.point.tensor == "h" and top.contribution is not None and top.contribution > 0.9
    assert screened.culprits[1].contribution is not None and screened.culprits[1].contribution < 0.1
    # the counts add up (it read "2 of 2 measured alone, 1 more screened": the screened one is one of the 2)
    assert screened.notes[0].startswith("2 of 2 Q/DQ pairs measured alone: the 1 with the most local noise, then 1 "
                                        "of the 1 others screened in groups of 8")


def test_culprits_of_an_output_a_concat_joins_are_ranked_on_its_worst_part(detector: dict[str, Path]) -> None:
    """Boxes and class scores joined in one output, quantized with one scale (the join's output pair: step 1.25 px,
    the scores' whole range). Measured on the whole output, that pair costs ~nothing next to the boxes' own error;
    measured on the worst part (the scores), it is the culprit, ~100% of the error, and the sentence says where."""
    a, b = onnx.load(str(detector["float"])), onnx.load(str(detector["int8"]))
    feeds = list(feeds_for(a, str(detector["eval"]), 8))
    parts = attribute(a, b, feeds, extend_seconds=5)
    top = parts.culprits[0]
    assert top.point.tensor == "output0" and top.contribution == pytest.approx(1.0, abs=0.05)
    assert top.alone_sqnr_db is not None and top.alone_sqnr_db < 1
    assert [p.label if p else None for p in parts.scored] == ["output0[4:22] (scores)"]
    assert parts.headline() is not None and parts.headline().endswith(  # type: ignore[union-attr]
        f"alone it gives {top.alone_sqnr_db:.1f} dB output SQNR on output0[4:22] (scores), the worst part of "
        f"output0, {top.contribution:.0%} of its error.")
    assert parts.to_dict()["measured_on"][0]["label"] == "output0[4:22] (scores)"

    whole = attribute(a, b, feeds, extend_seconds=5, whole_outputs=True)
    join = next(c for c in whole.culprits if c.point.tensor == "output0")
    assert whole.scored == [] and "worst part" not in (whole.headline() or "")
    assert join.contribution is not None and join.contribution < 0.5  # the boxes' error hides what the join does
    assert whole.output_noise is not None and parts.output_noise is not None
    assert parts.output_noise > 1e3 * whole.output_noise
