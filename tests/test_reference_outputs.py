"""`qgraph.recovery.reference_outputs`: calibration keeps the float reference's outputs for the fidelity guard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

import qgraph.recovery.reference_outputs as ro
from qgraph import GraphHandle, PassContext, Pipeline, Recipe, get_pass
from qgraph.data import CallableSource
from qgraph.testing import mobilenet_v2, random_feeds

ROOT = Path(__file__).resolve().parents[1]
KEPT = "the float reference's outputs kept from calibration"


def _guard_line(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], batch: int = 1) -> tuple[str, bytes]:
    recipe = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml")
    pipeline = recipe.pipeline()
    pipeline.calibration = pipeline.calibration.model_copy(update={"batch_size": batch})
    out = pipeline.run(model, calibration_data=CallableSource(lambda: iter(feeds), "feeds"))
    record = next(r for r in out.records if r.name == "correct_bias")
    line = next(d for d in record.result.decisions if d.startswith("bias correction"))
    return line, out.model.graph.SerializeToString()


def _scores(line: str) -> tuple[float, float]:
    before, after = line.rsplit(" dB", 1)[0].rsplit(" ", 3)[-3::2]
    return float(before), float(after)


@pytest.mark.parametrize("opset", [13, 12])
def test_the_guard_scores_against_calibrations_outputs_with_the_same_result(opset: int,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """MobileNetV2 (opset 13, and converted to 12: insert_qdq raises it back, a float-preserving edit): the guard
    reuses the outputs calibration fetched, and scores and writes what it did when it ran the reference itself."""
    model = mobilenet_v2(width=0.25, seed=4)
    if opset == 12:
        model = Pipeline([get_pass("lower_opset")(opset=12)]).run(model).model
    feeds = random_feeds(model, n=6, seed=5)
    reused, graph = _guard_line(model, feeds)
    assert KEPT in reused
    monkeypatch.setattr(ro, "MAX_BYTES", 16)  # over the limit: nothing kept, the guard runs the reference
    own, own_graph = _guard_line(model, feeds)
    assert KEPT not in own
    assert _scores(reused) == pytest.approx(_scores(own), abs=0.01) and np.isfinite(_scores(own)).all()
    assert graph == own_graph


def test_batched_calibration_keeps_nothing() -> None:
    """Two samples per calibration run: a calibration row is not a guard sample, so the guard runs the reference."""
    model = mobilenet_v2(width=0.25, seed=4, resolution=64)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"  # a batch axis of any size
    line, _ = _guard_line(model, random_feeds(model, n=4, seed=5), batch=2)
    assert KEPT not in line and "output SQNR on 4 calibration sample(s)" in line


def test_the_reference_holds_until_the_graph_changes_other_than_float_preserving() -> None:
    model = mobilenet_v2(width=0.25, seed=4)
    graph = GraphHandle(model)
    ctx = PassContext()
    assert not ctx.is_float_reference(graph)
    ctx.set_float_reference(graph.to_onnx(), graph=graph)
    assert ctx.is_float_reference(graph)
    graph.graph.nodes.reverse()
    with ctx.float_preserving(graph):
        graph.toposort()  # reordered back: the same values
    assert ctx.is_float_reference(graph) and not ctx.is_float_reference(GraphHandle(model))
    graph.changed()  # any other edit
    assert not ctx.is_float_reference(graph)
    with ctx.float_preserving(graph):  # not the reference before: not after either
        graph.toposort()
    assert not ctx.is_float_reference(graph)


def test_kept_outputs_are_copies_of_the_first_samples_only() -> None:
    model = mobilenet_v2(width=0.25, seed=4)
    graph = GraphHandle(model)
    ctx = PassContext()
    ctx.set_float_reference(graph.to_onnx(), graph=graph)
    observers = ro.keep_reference_outputs(ctx, graph)
    assert list(observers) == ["logits"]
    arena = np.arange(40, dtype=np.float32)
    values: list[Any] = [arena[i:i + 4] for i in range(0, 40, 4)]  # views of one buffer, like an arena's
    for i, v in enumerate(values):
        observers["logits"].update(v, i)
    got = ro.reference_outputs(ctx, ["logits"], 10)
    assert got is not None and len(got) == 10
    assert all(row[0].base is None and np.array_equal(row[0], v) for row, v in zip(got, values, strict=True))
    assert ro.reference_outputs(ctx, ["logits"], 11) is None  # more samples than kept
    assert ro.reference_outputs(ctx, ["other"], 2) is None
