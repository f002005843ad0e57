"""Automatic float fallback and ``qgraph sensitivity``: transformer cosine target, digits top-1, unmet target,
interrupted run, recipe patch round trip, worker processes, qgraph's own insert_qdq output."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from qgraph import Pipeline, RecipeError
from qgraph.analysis.sensitivity.evaluate import Evaluator
from qgraph.analysis.sensitivity.options import SearchOptions
from qgraph.analysis.sensitivity.search import auto_fallback
from qgraph.analysis.sensitivity.stats import matmul_flops
from qgraph.analysis.sensitivity.targets import parse_target
from qgraph.cli import main
from qgraph.runtime.compare import compare_models
from qgraph.testing import transformer_encoder, transformer_encoder_inputs

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"


def _ort_qdq(float_path: Path, out: Path, feeds: list[dict[str, np.ndarray]], **options: object) -> onnx.ModelProto:
    from qgraph.testing import ort_quantize_static

    return ort_quantize_static(float_path, out, feeds, **options)


def _stack(feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """BERT-like encoder (additive -10000 attention mask), INT8 by onnxruntime, eval data: in one folder."""
    folder = tmp_path_factory.mktemp("ff_auto")
    onnx.save(transformer_encoder(layers=1, d_model=64, heads=4, seq=16), folder / "float.onnx")
    _ort_qdq(folder / "float.onnx", folder / "qdq.onnx", transformer_encoder_inputs(16, seed=1))
    np.savez(folder / "eval.npz", **_stack(transformer_encoder_inputs(8, seed=2)))
    return folder


def _cos(a: onnx.ModelProto, b: onnx.ModelProto, data: Path) -> float:
    with np.load(data) as z:
        feeds = [{k: z[k][i : i + 1] for k in z.files} for i in range(len(z[z.files[0]]))]
    return min(d.cosine for d in compare_models(a, b, feeds))


def test_transformer_reaches_cosine_keeping_matmuls_int8_and_patch_reproduces(encoder: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    ref, qdq = onnx.load(encoder / "float.onnx"), onnx.load(encoder / "qdq.onnx")
    args = [
        "sensitivity",
        str(encoder / "float.onnx"),
        str(encoder / "qdq.onnx"),
        "--data",
        str(encoder / "eval.npz"),
        "--target",
        "cosine:0.99",
        "-o",
        str(encoder / "best.onnx"),
        "--patch",
        str(encoder / "patch.yaml"),
        "--json",
        str(encoder / "r.json"),
        "--plot",
        str(encoder / "r.svg"),
        "-q",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    report = json.loads((encoder / "r.json").read_text())
    best = onnx.load(encoder / "best.onnx")
    int8_cos, best_cos = _cos(ref, qdq, encoder / "eval.npz"), _cos(ref, best, encoder / "eval.npz")
    assert int8_cos < 0.99 <= best_cos
    assert report["target_met"] and report["int8_score"] == pytest.approx(int8_cos, abs=1e-6)
    chosen = report["nodes"]
    assert 1 <= len(chosen) <= 4 and all("softmax" in n for n in chosen)
    ranked = report["sensitivity"]["nodes"]
    assert len(ranked) > 30 and ranked[0]["name"] in chosen and ranked[0]["sensitivity"] > 0.01
    flops = [
        r for r in matmul_flops(best, {"embeddings": (1, 16, 64), "attention_mask": (1, 16)}) if r["op"] == "MatMul"
    ]
    assert sum(r["flops"] for r in flops if r["int8"]) / sum(r["flops"] for r in flops) > 0.5  # here: all of them
    assert "MatMul/Gemm FLOPs in INT8" in captured.err and "target met" in captured.err
    assert "- pass: float_fallback" in captured.out and chosen[0] in captured.out  # the patch, on stdout
    assert (encoder / "r.svg").read_text().startswith("<svg")
    # The patch is a recipe on its own and a --patch for another recipe: both rebuild the same graph.
    for extra in ([], ["--patch", str(encoder / "patch.yaml")]):
        out = encoder / f"rerun{len(extra)}.onnx"
        assert main(["run", str(encoder / "patch.yaml"), str(encoder / "qdq.onnx"), "-o", str(out), "-q", *extra]) == 0
        assert onnx.load(out).graph.SerializeToString(deterministic=True) == best.graph.SerializeToString(
            deterministic=True
        )


def test_unmet_target_returns_best_model_and_says_so(encoder: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out, patch = encoder / "unmet.onnx", encoder / "unmet.yaml"
    args = [
        "sensitivity",
        str(encoder / "float.onnx"),
        str(encoder / "qdq.onnx"),
        "--data",
        str(encoder / "eval.npz"),
        "--target",
        "sqnr:60",
        "--max-nodes",
        "1",
        "-o",
        str(out),
        "--patch",
        str(patch),
        "-q",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "target NOT met" in err and "max_nodes (1) reached" in err and f"wrote {out}" in err
    best = onnx.load(out)
    ref, qdq = onnx.load(encoder / "float.onnx"), onnx.load(encoder / "qdq.onnx")
    assert _cos(ref, best, encoder / "eval.npz") > _cos(ref, qdq, encoder / "eval.npz")  # better than INT8
    assert "Target NOT met" in patch.read_text() and patch.read_text().count("    - ") == 1


def test_interrupted_run_leaves_no_output(encoder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    original = Evaluator.measure

    def flaky(self: Evaluator, nodes: tuple[str, ...]) -> object:
        calls["n"] += 1
        if calls["n"] == 5:  # in the middle of the sensitivity pass
            raise KeyboardInterrupt
        return original(self, nodes)

    monkeypatch.setattr(Evaluator, "measure", flaky)
    outputs = [tmp_path / "o.onnx", tmp_path / "p.yaml", tmp_path / "r.json", tmp_path / "r.svg"]
    args = [
        "sensitivity",
        str(encoder / "float.onnx"),
        str(encoder / "qdq.onnx"),
        "--data",
        str(encoder / "eval.npz"),
        "--target",
        "cosine:0.99",
        "-o",
        str(outputs[0]),
        "--patch",
        str(outputs[1]),
        "--json",
        str(outputs[2]),
        "--plot",
        str(outputs[3]),
        "-q",
    ]
    assert main(args) == 130
    assert calls["n"] == 5 and list(tmp_path.iterdir()) == []  # not even a temporary file


def test_worker_processes_give_the_same_table(encoder: Path) -> None:
    ref, qdq = onnx.load(encoder / "float.onnx"), onnx.load(encoder / "qdq.onnx")
    kwargs = {"report_only": True, "samples": 2, "candidates": None, "exact_top": 12}
    from qgraph import NodeSelector

    kwargs["candidates"] = NodeSelector(regex=("^layer0/attn/",))
    one = auto_fallback(ref, qdq, str(encoder / "eval.npz"), "cosine:0.99", SearchOptions(
        jobs=1, **kwargs))  # type: ignore[arg-type]
    two = auto_fallback(ref, qdq, str(encoder / "eval.npz"), "cosine:0.99", SearchOptions(
        jobs=2, **kwargs))  # type: ignore[arg-type]
    assert one.sensitivity is not None and two.sensitivity is not None
    rows1 = {r.name: r.sensitivity for r in one.sensitivity.rows if r.measured}
    rows2 = {r.name: r.sensitivity for r in two.sensitivity.rows if r.measured}
    assert len(rows1) >= 10 and rows1 == rows2


def test_candidate_selector_matching_nothing(encoder: Path) -> None:
    from qgraph import NodeSelector, PassError

    ref, qdq = onnx.load(encoder / "float.onnx"), onnx.load(encoder / "qdq.onnx")
    with pytest.raises(PassError, match="nope"):
        auto_fallback(ref, qdq, str(encoder / "eval.npz"), "sqnr:90", SearchOptions(
            candidates=NodeSelector(names=("nope",))))


def test_targets_parse() -> None:
    t = parse_target("cosine:0.99")
    assert (t.kind, t.goal, t.threshold(1.0), t.met(0.995, 0.99)) == ("cosine", 0.99, 0.99, True)
    m = parse_target("x.y:top1>=float-0.5%", load=False)
    assert m.kind == "metric" and m.threshold(0.9889) == pytest.approx(0.9889 * 0.995)
    assert parse_target("x.y:err<=float+0.01", load=False).threshold(0.1) == pytest.approx(0.11)
    assert not parse_target("x.y:err<=0.2", load=False).met(0.3, 0.2)
    for bad in ("cosine:high", "accuracy", "x.y:f>=float*2", "cosine:1.5"):
        with pytest.raises(RecipeError, match="invalid target"):
            parse_target(bad, load=False)
    with pytest.raises(RecipeError, match="cannot import"):
        parse_target("no_such_module_xyz:f>=1")


# ----------------------------------------------------------------------------- trained digits CNN, top-1 metric
METRIC_MODULE = f"""
import sys
sys.path.insert(0, {str(DIGITS)!r})
import metric as digits

_, LABELS = digits.load_eval()


def top1(outputs, references):
    return digits.top1(outputs[0], LABELS)
"""


@pytest.mark.skipif(not (DIGITS / "model.onnx").exists(), reason="examples/digits not built")
def test_digits_top1_within_half_percent_of_float(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxruntime.quantization import CalibrationMethod

    sys.path.insert(0, str(DIGITS))
    import metric as digits

    (tmp_path / "digits_top1.py").write_text(METRIC_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    calib = digits.calibration_feeds(batch_size=1)
    # Percentile calibration clips hard enough to lose accuracy (the usual INT8 model already meets the goal).
    qdq = _ort_qdq(
        DIGITS / "model.onnx",
        tmp_path / "qdq.onnx",
        calib,
        calibrate_method=CalibrationMethod.Percentile,
        extra_options={"CalibPercentile": 99.0},
    )
    float_top1, int8_top1 = digits.evaluate(DIGITS / "model.onnx"), digits.evaluate(tmp_path / "qdq.onnx")
    assert int8_top1 < float_top1 * 0.995
    result = auto_fallback(
        onnx.load(DIGITS / "model.onnx"), qdq, str(DIGITS / "eval.npz"), "digits_top1:top1>=float-0.5%"
    )
    assert result.target_met and 1 <= len(result.nodes) <= 3
    assert result.float_score == pytest.approx(float_top1) and result.int8_score == pytest.approx(int8_top1)
    assert digits.evaluate(result.model.SerializeToString()) == pytest.approx(result.score)
    assert result.score >= float_top1 * 0.995
    standard = _ort_qdq(DIGITS / "model.onnx", tmp_path / "minmax.onnx", calib)
    already = auto_fallback(
        onnx.load(DIGITS / "model.onnx"), standard, str(DIGITS / "eval.npz"), "digits_top1:top1>=float-0.5%"
    )
    assert already.target_met and already.nodes == [] and already.stop_reason.startswith("the INT8 model already")


# ----------------------------------------------------------------------------- qgraph's own QDQ output
@pytest.mark.skipif(not (DIGITS / "model.onnx").exists(), reason="examples/digits not built")
def test_on_insert_qdq_output_inside_a_recipe(tmp_path: Path) -> None:
    from qgraph import Recipe

    pytest.importorskip("qgraph.passes.insert_qdq")
    with np.load(DIGITS / "calibration.npz") as z:
        np.savez(tmp_path / "calib.npz", input=z["input"][:64])
    recipe = Recipe.from_text(
        "name: digits-int8\npasses:\n  - pass: insert_qdq\n  - pass: float_fallback\n"
        "    nodes: {names: [/classifier/Gemm]}\n"
        f"    auto: {{target: 'sqnr:40', reference: {str(DIGITS / 'model.onnx')!r}, samples: 64}}\n"
    )
    result = Pipeline(recipe.passes, recipe=recipe).run(DIGITS / "model.onnx", calibration_data=tmp_path / "calib.npz")
    res = result.records[1].result
    assert res.details["fallen_back"][0] == "/classifier/Gemm" and res.details["auto"]["target_met"]
    quantized = Pipeline(recipe.passes[:1]).run(DIGITS / "model.onnx", calibration_data=tmp_path / "calib.npz").model
    with np.load(DIGITS / "eval.npz") as z:
        feeds = [{"input": z["input"][i : i + 8]} for i in range(0, 64, 8)]
    ref = onnx.load(DIGITS / "model.onnx")
    before = compare_models(ref, quantized, feeds)[0].sqnr_db
    after = compare_models(ref, result.model, feeds)[0].sqnr_db
    assert before < 40 <= after


@pytest.mark.skipif(not (DIGITS / "model.onnx").exists(), reason="examples/digits not built")
def test_run_exits_1_and_keeps_the_best_model_when_the_target_is_not_met(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with np.load(DIGITS / "calibration.npz") as z:
        np.savez(tmp_path / "calib.npz", input=z["input"][:16])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: unreachable\npasses:\n  - pass: insert_qdq\n    preset: ort-x86-vnni\n  - pass: float_fallback\n"
        f"    auto: {{target: 'sqnr:300', reference: {str(DIGITS / 'model.onnx')!r}, samples: 16, max_nodes: 1}}\n"
    )
    out = tmp_path / "o.onnx"
    code = main(["run", str(recipe), str(DIGITS / "model.onnx"), "-o", str(out), "--calibration-data",
                 str(tmp_path / "calib.npz")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1
    assert out.exists()  # the best model found is kept
    assert "not met (search stopped: max_nodes" in err
    assert "decision: auto: target NOT met" in err
    assert "Traceback" not in err


def test_sensitivity_to_a16w8_writes_a_16bit_model_and_a_patch_that_rebuilds_it(encoder: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--to a16w8``: the chosen nodes keep their int8 weights and read 16-bit activations; the patch says so."""
    from qgraph.analysis.sensitivity.evaluate import build_model

    ref, qdq = onnx.load(encoder / "float.onnx"), onnx.load(encoder / "qdq.onnx")
    int8_cos = _cos(ref, qdq, encoder / "eval.npz")
    every = [n.name for n in qdq.graph.node if "Quantize" not in n.op_type]
    all16_cos = _cos(ref, build_model(qdq, every, remedy="a16w8"), encoder / "eval.npz")
    # The -10000 attention mask keeps a 16-bit grid coarse on the scores: all nodes widened recover part of the loss.
    assert all16_cos > int8_cos + 0.01
    goal = (int8_cos + all16_cos) / 2
    best, patch = encoder / "a16.onnx", encoder / "a16.yaml"
    args = ["sensitivity", str(encoder / "float.onnx"), str(encoder / "qdq.onnx"), "--data", str(encoder / "eval.npz"),
            "--target", f"cosine:{goal:.6f}", "--to", "a16w8", "-o", str(best), "--patch", str(patch), "-q"]
    assert main(args) == 0
    model = onnx.load(best)
    assert _cos(ref, model, encoder / "eval.npz") >= goal - 1e-6 > int8_cos
    sixteen = [t for t in model.graph.initializer if t.data_type in (onnx.TensorProto.UINT16, onnx.TensorProto.INT16)]
    assert sixteen and not any(n.op_type == "MatMul" and n.input[1] in {t.name for t in model.graph.initializer}
                               for n in model.graph.node)  # weights still come through their int8 DQ
    assert "to: a16w8" in patch.read_text()
    rerun = encoder / "a16_rerun.onnx"
    assert main(["run", str(patch), str(encoder / "qdq.onnx"), "-o", str(rerun), "-q", "--no-check"]) == 0
    assert onnx.load(rerun).graph.SerializeToString(deterministic=True) == model.graph.SerializeToString(
        deterministic=True)
    capsys.readouterr()
    assert main([*args[:-1], "--cost", "latency", "-q"]) == 2
    assert "use --cost error" in capsys.readouterr().err
    swapped = [*args[:2], str(encoder / "float.onnx"), *args[3:]]  # the float model given as the QDQ one
    assert main(swapped) == 2
    assert "no QuantizeLinear/DequantizeLinear and no integer op in it" in capsys.readouterr().err


def test_sensitivity_reaches_nodes_inside_if_bodies(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A model quantized only inside If branches: the command's candidates are the body nodes (each measured
    exactly), the target is met with them in float and the If is kept."""
    from qgraph import NodeSelector
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.testing import mode_feeds, mode_switched_net

    model = mode_switched_net()
    feeds = mode_feeds(16)
    insert = get_pass("insert_qdq")(preset="ort-x86-vnni", nodes=NodeSelector(exclude=NodeSelector(names=("head",))))
    qdq = Pipeline([insert]).run(model, calibration_data=CallableSource(lambda: feeds, "cal")).model
    onnx.save(model, tmp_path / "float.onnx")
    onnx.save(qdq, tmp_path / "qdq.onnx")
    np.savez(tmp_path / "eval.npz", x=np.concatenate([f["x"] for f in mode_feeds(8, seed=4)]),
             mode=np.ones(8, np.int64))
    best, report = tmp_path / "best.onnx", tmp_path / "r.json"
    code = main(["sensitivity", str(tmp_path / "float.onnx"), str(tmp_path / "qdq.onnx"), "--data",
                 str(tmp_path / "eval.npz"), "--target", "sqnr:40", "-o", str(best), "--json", str(report), "-q"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "target met" in err and "max_time reached" not in err
    chosen = json.loads(report.read_text())["nodes"]
    assert chosen and set(chosen) <= {"then/conv", "then/relu"}, chosen
    assert [n.op_type for n in onnx.load(best).graph.node].count("If") == 1


def test_nodes_back_in_float_take_the_float_models_weights(encoder: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--to float` (the default): a node put back in float reads the FLOAT model's weights where they match the
    QDQ model's codes, as the patch rebuilds it (`float_weights`), not its int8-rounded weights: with every node
    in float the model is the float model (it was 'every candidate is in float' at a weight-rounding SQNR)."""
    out, patch = encoder / "all_float.onnx", encoder / "all_float.yaml"
    args = ["sensitivity", str(encoder / "float.onnx"), str(encoder / "qdq.onnx"), "--data", str(encoder / "eval.npz"),
            "--target", "sqnr:200", "-o", str(out), "--patch", str(patch), "-q"]
    assert main(args) == 1  # 200 dB is out of reach: the best model keeps every candidate in float
    err = " ".join(capsys.readouterr().err.split())
    assert "every candidate is in float" in err
    # scores in dB to 0.1 (it read "float inf, full INT8 40.8238, best 40.8238")
    assert "float inf" not in err and re.search(r"full INT8 \d+\.\d dB, best \d+\.\d dB with \d+ node", err), err
    assert re.search(r"Target NOT met: sqnr >= 200; full INT8 \d+\.\d dB", patch.read_text())
    ref, best = onnx.load(encoder / "float.onnx"), onnx.load(out)
    with np.load(encoder / "eval.npz") as z:
        feeds = [{k: z[k][i : i + 1] for k in z.files} for i in range(len(z[z.files[0]]))]
    assert min(d.sqnr_db for d in compare_models(ref, best, feeds)) > 100  # was ~40 dB: int8 weights left
    assert f"float_weights: {(encoder / 'float.onnx').resolve()}" in " ".join(patch.read_text().split())
    rebuilt = encoder / "all_float_rebuilt.onnx"
    assert main(["run", str(patch), str(encoder / "qdq.onnx"), "-o", str(rebuilt), "-q"]) == 0
    assert onnx.load(rebuilt).graph.SerializeToString(deterministic=True) == best.graph.SerializeToString(
        deterministic=True)


def test_sensitivity_scores_each_part_of_an_output_a_concat_joins(detector: dict[str, Path], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Boxes and class scores joined in one output, the join quantized with one scale: `--target sqnr:30` on the
    parts needs the join in float (the scores part then meets it, measured by numpy on the same data); with
    `--whole-outputs` the INT8 model already "meets" it (the boxes decide) and nothing changes."""
    import onnxruntime as ort

    args = ["sensitivity", str(detector["float"]), str(detector["int8"]), "--data", str(detector["eval"]),
            "--target", "sqnr:30", "-q", "--exact-top", "0", "--cost", "error"]
    best, report = tmp_path / "best.onnx", tmp_path / "s.json"
    assert main([*args, "-o", str(best), "--json", str(report)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "output0 is scored as 2 parts (Concat on axis 1 of boxes [4] and scores [18]); the worst part decides" in err
    result = json.loads(report.read_text())
    assert result["nodes"] == ["head_concat"] and result["int8_score"] < 1 <= 30 <= result["score"]
    assert result["output_parts"][0]["parts"][1]["label"] == "output0[4:22] (scores)"
    images = np.load(detector["eval"])["images"]
    ref, got = (ort.InferenceSession(str(m), providers=["CPUExecutionProvider"]).run(None, {"images": images})[0]
                .astype(np.float64) for m in (detector["float"], best))
    scores_db = 10 * np.log10((ref[:, 4:] ** 2).sum() / ((ref[:, 4:] - got[:, 4:]) ** 2).sum())
    assert scores_db == pytest.approx(result["score"], abs=0.01)

    assert main([*args, "--whole-outputs", "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["nodes"] == [] and result["int8_score"] > 40 and result["output_parts"] == []
    assert "scored as 2 parts" not in capsys.readouterr().err


@pytest.mark.skipif(not (DIGITS / "model.onnx").exists(), reason="examples/digits not built")
def test_a_builtin_metric_target_reports_the_interval_of_its_score(tmp_path: Path) -> None:
    """The chosen model's score comes with its 95 % bootstrap interval over the evaluation samples, and the message
    says when the threshold lies inside it (the target may not hold on the next samples)."""
    sys.path.insert(0, str(DIGITS))
    import metric as digits
    from onnxruntime.quantization import CalibrationMethod

    qdq = _ort_qdq(DIGITS / "model.onnx", tmp_path / "qdq.onnx", digits.calibration_feeds(batch_size=1),
                   calibrate_method=CalibrationMethod.Percentile, extra_options={"CalibPercentile": 99.0})
    result = auto_fallback(onnx.load(DIGITS / "model.onnx"), qdq, str(DIGITS / "eval.npz"), "top1:0.995")
    iv = result.interval
    assert result.target_met and iv is not None and iv.samples == 450
    assert iv.low <= result.score <= iv.high
    message = result.message()
    assert f"The score's {iv.describe()}" in message
    assert ("the threshold lies within it" in message) == (iv.low < result.threshold)
    assert result.to_dict()["interval"] == iv.to_dict()
    # 450 samples cannot show 0.995: all agreeing, the rule of three reaches 1 - 3.69 / 450 = 0.9918; 738 could
    limit = result.data_limit
    assert limit is not None and limit.startswith("on these 450 samples") and "reaching 0.9918" in limit
    assert any(f"about {n} samples" in limit for n in (738, 739))
