"""Every pass's time against one float inference pass over the calibration data (qgraph.pipeline.timing), from fake
records and from a real run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from qgraph.passes.correct_bias import CorrectBias
from qgraph.passes.insert_qdq import InsertQDQ

from qgraph import GraphHandle, PassResult, Pipeline
from qgraph.pipeline import timing
from qgraph.pipeline.timing import BUDGET, FloatInference, measure_float_inference, run_timing
from qgraph.testing import matmul_add_relu_chain, mobilenet_v2, random_feeds

sys.path.insert(0, str(Path(__file__).parent / "passes"))
from insert_qdq_helpers import feeds_for, source, tiny_cnn


@dataclass
class Record:
    name: str
    seconds: float
    result: PassResult = field(default_factory=PassResult)


def test_passes_against_the_float_pass_slowest_first_and_a_slow_calibration_fires() -> None:
    # the old yardstick was the calibration itself: a calibration 40x a float pass made every pass look cheap
    qdq = Record("insert_qdq", 5.0, PassResult(calibration_seconds=4.0))
    records = [Record("fold_constants", 0.001), qdq, Record("correct_bias", 0.6), Record("tune_ranges", 0.2)]
    t = run_timing(records, FloatInference(0.1, 8, 8))
    assert t is not None
    assert [(p.name, p.seconds, p.ratio) for p in t.passes] == [
        ("insert_qdq", 5.0, pytest.approx(50.0)), ("correct_bias", 0.6, pytest.approx(6.0)),
        ("tune_ranges", 0.2, pytest.approx(2.0)), ("fold_constants", 0.001, pytest.approx(0.01))]
    assert [p.name for p in t.over_budget] == ["insert_qdq"] and BUDGET == 10.0
    line = t.line()
    assert line.startswith("time against one float inference pass (0.10 s: the float model over 8 calibration")
    assert "insert_qdq 5.0 s (50.0x; calibration 4.0 s, 40.0x)" in line
    assert "over 10x: insert_qdq" in line
    assert line.endswith("insert_qdq dominated (86% of 5.8 s)")
    assert "(+1 more, each 0.01x or less)" in line  # fold_constants: negligible, counted
    assert t.to_dict()["dominant"] == "insert_qdq"
    fast = run_timing([Record("insert_qdq", 0.5, PassResult(calibration_seconds=0.2))], FloatInference(0.1, 8, 8))
    assert fast is not None and not fast.over_budget and "every pass within 10x" in fast.line()
    assert run_timing(records, None) is None  # no float pass measured: nothing read data


def test_the_float_pass_is_timed_on_a_capped_part_of_long_data_and_scaled() -> None:
    m = tiny_cnn()
    feeds = feeds_for(m, 10)
    whole = measure_float_inference(m, None, feeds, max_samples=64)
    part = measure_float_inference(m, None, feeds, max_samples=4)
    assert whole is not None and (whole.samples_timed, whole.samples_total) == (10, 10)
    assert part is not None and (part.samples_timed, part.samples_total) == (4, 10)
    assert "timed on 4 of 10 samples" in part.describe() and "timed on" not in whole.describe()
    assert measure_float_inference(m, None, [], max_samples=4) is None
    unsized = measure_float_inference(m, None, iter(feeds), max_samples=3)
    assert unsized is not None and (unsized.samples_timed, unsized.samples_total) == (3, 10)  # the rest counted
    # long samples: timing stops once the time cap is spent, after at least two samples, and is scaled to all
    capped = measure_float_inference(m, None, feeds, max_seconds=0.0)
    assert capped is not None and (capped.samples_timed, capped.samples_total) == (2, 10)
    assert "timed on 2 of 10 samples" in capped.describe()


def test_a_real_run_measures_the_float_pass_apart_from_every_pass() -> None:
    m = tiny_cnn()
    res = Pipeline([InsertQDQ(preset="ort-x86-vnni"), CorrectBias()]).run(m, calibration_data=source(feeds_for(m, 16)))
    fi = res.float_inference
    assert fi is not None and fi.samples_total == 16 and fi.seconds > 0
    t = run_timing(res.records, fi)
    assert t is not None and {p.name for p in t.passes} == {"insert_qdq", "correct_bias"}
    bias = next(p for p in t.passes if p.name == "correct_bias")
    assert bias.ratio == pytest.approx(res.records[1].seconds / fi.seconds)
    qdq = next(p for p in t.passes if p.name == "insert_qdq")
    assert qdq.calibration == res.records[0].result.calibration_seconds
    assert t.to_dict()["passes"][0]["x_float_inference"] == max(p.ratio for p in t.passes)
    assert np.isfinite(fi.seconds)
    alone = Pipeline([InsertQDQ(preset="ort-x86-vnni")]).run(m, calibration_data=source(feeds_for(m, 4)))
    assert alone.float_inference is not None and alone.float_inference.samples_total == 4  # no float reference kept
    dynamic = Pipeline([InsertQDQ(mode="dynamic")]).run(m, calibration_data=source(feeds_for(m, 4)))
    assert dynamic.float_inference is None  # no pass calibrated from the data: no yardstick, no time line


def test_calibration_data_that_does_not_fit_a_shapeless_input_is_a_data_error(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]
                                                                              ) -> None:
    """#31 item 12: an input without a declared shape takes 0-d samples, and the model fails inside a MatMul. The
    float yardstick runs the input model on the data before any pass: exit 2, the batch's shapes named, no output
    and no traceback."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from qgraph.cli import main

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                               helper.make_node("MatMul", ["r", "W"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "scalars.npz", x=np.full((8,), 3.0, np.float32))  # eight 0-d samples
    out = tmp_path / "out.onnx"
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "ort-x86-vnni.yaml"
    code = main(["run", str(recipe), str(tmp_path / "m.onnx"), "--calibration-data", str(tmp_path / "scalars.npz"),
                 "-o", str(out), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "the input model cannot run on the calibration data (a batch: x: float32[1])" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("runs", [1, 3])
def test_the_float_pass_runs_as_the_passes_do_and_says_so(runs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QGRAPH_THREADS", str(runs))
    m = tiny_cnn()
    measured = measure_float_inference(m, None, feeds_for(m, 6), max_samples=64, max_seconds=600.0)  # any load
    assert measured is not None and (measured.samples_timed, measured.samples_total, measured.runs) == (6, 6, runs)
    assert ("3 at a time" in measured.describe()) == (runs == 3)


def test_the_float_pass_is_optimized_as_a_users_session_unless_the_weights_are_large(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = mobilenet_v2(width=0.5, resolution=64, seed=2)
    model, held = GraphHandle(m).weightless_export()
    weights = {n: v for n, (v, _) in held.items()}
    assert weights  # its larger weights are placeholders of the export
    feeds = random_feeds(m, n=4, seed=1)
    small = measure_float_inference(model, weights, feeds)
    assert small is not None and small.optimized and "without graph optimizations" not in small.describe()
    monkeypatch.setattr(timing, "OPTIMIZED_UP_TO_BYTES", 0)
    large = measure_float_inference(model, weights, feeds)
    assert large is not None and not large.optimized and "without graph optimizations" in large.describe()


def test_a_long_graph_is_timed_in_slices_each_built_once_before_the_timed_span(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # one session over a long graph takes more than linear time to build (the 100k-node chain: 26 s against 8 s)
    from qgraph.runtime import sliced

    monkeypatch.setattr(sliced, "SLICE_ABOVE", 30)
    monkeypatch.setattr(sliced, "SLICE_NODES", 10)
    built: list[int] = []
    real = timing.make_session

    def counting(model: Any, **kw: Any) -> Any:
        built.append(len(model.graph.node))
        return real(model, **kw)

    monkeypatch.setattr(timing, "make_session", counting)
    m = matmul_add_relu_chain(12)  # 36 nodes
    # no time cap: on a loaded host the 1 s cap could stop the timing after 2 samples
    fi = measure_float_inference(m, None, random_feeds(m, 6, seed=0), max_seconds=float("inf"))
    assert fi is not None and fi.optimized and fi.slices == 4 and (fi.samples_timed, fi.samples_total) == (6, 6)
    assert sorted(built) == [6, 10, 10, 10]  # every slice built once, all on the untimed first run
    assert fi.describe().endswith(", in 4 slices")
    built.clear()
    short = measure_float_inference(matmul_add_relu_chain(8), None, random_feeds(m, 2, seed=0))
    assert short is not None and short.slices == 1 and built == [24] and "slices" not in short.describe()
