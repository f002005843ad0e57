"""Models that already use the names qgraph's analysis helpers used to take without a check (issue #29): the range
statistics' ``qgraph_stats/<k>/...``, the sensitivity probe's ``qgraph_local/...``, the diff probe's
``<tensor>/qgraph_probe/...``. Each analysis gives the same numbers on the model with those names occupied
(`qgraph.testing.names.occupied`) as on the plain one: its helpers move to a free namespace
(`qgraph.graph.ProtoNames`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from qgraph import Recipe
from qgraph.analysis.diff import attribute
from qgraph.analysis.sensitivity.probe import local_errors
from qgraph.analysis.sensitivity.stats import range_stats
from qgraph.testing.names import occupied

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"


@pytest.fixture(scope="module")
def digits() -> tuple[onnx.ModelProto, onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """The float digits CNN as the quantizer saw it (BN fused), its INT8 model, and six evaluation samples."""
    pipeline = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").pipeline()
    k = next(i for i, p in enumerate(pipeline.passes) if p.name == "insert_qdq")
    calib = DIGITS / "calibration.npz"
    from qgraph import Pipeline

    float_model = Pipeline(pipeline.passes[:k]).run(DIGITS / "model.onnx", calibration_data=calib).model
    qdq = pipeline.run(DIGITS / "model.onnx", calibration_data=calib).model
    with np.load(DIGITS / "eval.npz") as z:
        feeds = [{"input": z["input"][i : i + 1].astype(np.float32)} for i in range(6)]
    return float_model, qdq, feeds


def _layers(qdq: onnx.ModelProto) -> list[str]:
    return [n.name for n in qdq.graph.node if n.op_type in ("Conv", "Gemm")]


def test_range_statistics(digits: tuple[onnx.ModelProto, onnx.ModelProto, list[dict[str, np.ndarray]]]) -> None:
    _, qdq, feeds = digits
    tags = ("x", "lo", "hi", "x32", "fq32", "e", "below", "above", "outside", "outside_f", "size", "min", "max",
            "sig", "err", "clip")
    taken = occupied(qdq, [f"qgraph_stats/{k}/{t}" for k in range(12) for t in tags])
    clean, squatted = range_stats(qdq, feeds, _layers(qdq)), range_stats(taken, feeds, _layers(qdq))
    assert len(clean) == len(_layers(qdq)) >= 4
    assert squatted == clean


def test_sensitivity_probe(digits: tuple[onnx.ModelProto, onnx.ModelProto, list[dict[str, np.ndarray]]]) -> None:
    _, qdq, feeds = digits
    old = sorted({f"qgraph_local/{t}" for n in qdq.graph.node for t in (n.name, *n.output)})  # node = output names
    old += [f"qgraph_local/{k}/0/{t}" for k in range(12) for t in ("c", "r", "e", "err", "sig")]
    old += [f"qgraph_local/power/{k}" for k in range(12)]
    clean, skipped, _ = local_errors(qdq, feeds, _layers(qdq))
    # declared outputs, so the float model's cleanup keeps them (its graph outputs come after the model's own)
    squatted, skipped_too, _ = local_errors(occupied(qdq, old, as_outputs=True), feeds, _layers(qdq))
    assert not skipped and not skipped_too and len(clean) == len(_layers(qdq))
    n_out = len(qdq.graph.output)
    assert {n: (e.err, e.sig, e.weights[:n_out]) for n, e in squatted.items()} == \
        {n: (e.err, e.sig, e.weights) for n, e in clean.items()}
    assert all(e.err > 0 for e in clean.values())


def test_diff_probe(digits: tuple[onnx.ModelProto, onnx.ModelProto, list[dict[str, np.ndarray]]]) -> None:
    a, b, feeds = digits
    old = [f"{t}/qgraph_probe/{s}" for n in a.graph.node for t in n.output
           for s in ("s", "z", "lo", "hi", "div", "round", "add", "clip", "sub", "fq")]
    clean = attribute(a, b, feeds, exact_top=3, extend_seconds=0)
    squatted = attribute(occupied(a, old), b, feeds, exact_top=3, extend_seconds=0)
    measured = [(c.point.tensor, c.output_noise) for c in clean.culprits if c.output_noise is not None]
    assert len(measured) == 3 and any(c.point.kind == "activation" for c in clean.culprits[:3])
    assert [(c.point.tensor, c.output_noise) for c in squatted.culprits if c.output_noise is not None] == measured
