"""Pipeline: Python vs YAML equivalence, provenance, determinism, verification, events."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest

from qgraph import Pipeline, PipelineEvent, Recipe, VerificationError, load_model, save_model
from qgraph.cli import main
from qgraph.io.model_io import model_fingerprint
from qgraph.runtime.compare import make_session, run


def test_python_pipeline_and_its_yaml_dump_give_identical_files(toy_passes, small_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = save_model(small_model, tmp_path / "in.onnx")
    pipeline = Pipeline([toy_passes["toy_drop_identity"]()], name="rt")
    out_py = pipeline.run(src).save(tmp_path / "py.onnx")
    recipe_path = tmp_path / "rt.yaml"
    recipe_path.write_text(pipeline.to_yaml())
    out_yaml = Recipe.from_yaml(recipe_path).pipeline().run(src).save(tmp_path / "yaml.onnx")
    assert out_py.read_bytes() == out_yaml.read_bytes()
    model = onnx.load(str(out_py))
    assert [n.op_type for n in model.graph.node] == ["Constant", "MatMul", "Relu", "Add"]


def test_provenance_and_rerun_determinism(toy_passes, small_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = save_model(small_model, tmp_path / "in.onnx")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: prov\npasses:\n  - pass: toy_drop_identity\n")
    before = src.read_bytes()
    assert main(["run", str(recipe), str(src), "-o", str(tmp_path / "a.onnx"), "-q"]) == 0
    assert main(["run", str(recipe), str(src), "-o", str(tmp_path / "b.onnx"), "-q"]) == 0
    assert src.read_bytes() == before  # input untouched
    a, b = (tmp_path / "a.onnx").read_bytes(), (tmp_path / "b.onnx").read_bytes()
    assert a == b
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "a.onnx")).metadata_props}
    assert meta["qgraph.input_sha256"] == model_fingerprint(onnx.load(str(src)))
    in_memory = Pipeline([toy_passes["toy_drop_identity"]()]).run(onnx.load(str(src))).model
    assert {p.key: p.value for p in in_memory.metadata_props}["qgraph.input_sha256"] == meta["qgraph.input_sha256"]
    rec = Recipe.from_yaml(recipe)
    assert meta["qgraph.recipe"] == rec.canonical_text()
    assert meta["qgraph.recipe_sha256"] == hashlib.sha256(rec.canonical_text().encode()).hexdigest()
    assert '"pass":"toy_drop_identity"' in meta["qgraph.passes"]
    assert '"rewritten":2' in meta["qgraph.passes"]
    assert meta["qgraph.version"]


def test_output_runs_and_matches_input(toy_passes, small_model) -> None:  # type: ignore[no-untyped-def]
    result = Pipeline([toy_passes["toy_drop_identity"]()]).run(small_model, verify=True)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    ref = run(make_session(small_model), {"x": x})["y"]
    got = run(make_session(result.model), {"x": x})["y"]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    assert result.records[0].result.rewritten == 2
    assert result.records[0].nodes_before == 6 and result.records[0].nodes_after == 4
    assert result.model.ir_version <= 10


def test_verify_names_the_pass_that_broke_float_semantics(toy_passes, small_model) -> None:  # type: ignore[no-untyped-def]
    p = Pipeline([toy_passes["toy_drop_identity"](), toy_passes["toy_scale_output"](factor=1.001)])
    with pytest.raises(VerificationError, match=r"pass #1 'toy_scale_output'.*output 'y'"):
        p.run(small_model, verify=True)
    # Below tolerance the same pass is accepted.
    ok = Pipeline([toy_passes["toy_scale_output"](factor=1.0 + 1e-7)]).run(small_model, verify=True)
    assert ok.records[0].verify is not None and ok.records[0].verify[0].relative < 1e-5


def test_events_are_emitted_in_order(toy_passes, small_model) -> None:  # type: ignore[no-untyped-def]
    events: list[PipelineEvent] = []
    p = Pipeline([toy_passes["toy_drop_identity"](), toy_passes["toy_drop_identity"]()])
    p.subscribe(events.append)
    p.run(small_model)
    kinds = [(e.kind, e.index) for e in events]
    assert kinds == [
        ("pipeline_start", None), ("pass_start", 0), ("pass_end", 0),
        ("pass_start", 1), ("pass_end", 1), ("pipeline_end", None),
    ]
    ends = [e for e in events if e.kind == "pass_end"]
    assert ends[0].result is not None and ends[0].result.rewritten == 2
    assert ends[1].result is not None and ends[1].result.rewritten == 0  # idempotent
    assert all(e.seconds is not None and e.peak_rss_mb and e.peak_rss_mb > 0 for e in ends)


def test_input_model_object_is_not_modified(toy_passes, small_model) -> None:  # type: ignore[no-untyped-def]
    before = small_model.SerializeToString()
    Pipeline([toy_passes["toy_drop_identity"]()]).run(small_model)
    assert small_model.SerializeToString() == before


def test_external_data_round_trip(toy_passes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["a"]), onnx.helper.make_node("MatMul", ["a", "w"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    src = save_model(model, tmp_path / "big" / "in.onnx", external_data=True)
    assert (tmp_path / "big" / "in.onnx.data").stat().st_size >= w.nbytes
    # Load from another working directory: external data resolves next to the model.
    result = Pipeline([toy_passes["toy_drop_identity"]()]).run(src)
    out = save_model(result.model, tmp_path / "out" / "o.onnx", external_data=True)
    reloaded = load_model(out)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(reloaded.graph.initializer[0]), w)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["o.onnx", "o.onnx.data"]  # no temp left


def test_calibration_reports_progress_with_a_total(tmp_path: Path) -> None:
    """`qgraph run` draws a calibration bar with an ETA from these events: one per batch, total known."""
    from qgraph.passes.insert_qdq import InsertQDQ

    root = Path(__file__).resolve().parents[1] / "examples" / "digits"
    data = dict(np.load(root / "calibration.npz"))
    np.savez(tmp_path / "cal.npz", input=data["input"][:10])
    events: list[PipelineEvent] = []
    Pipeline([InsertQDQ(preset="ort-x86-vnni")]).run(
        root / "model.onnx", calibration_data=tmp_path / "cal.npz", on_event=events.append
    )
    steps = [(e.pass_name, e.task, e.done, e.of) for e in events if e.kind == "pass_progress"]
    assert steps == [("insert_qdq", "calibrating", i, 10) for i in range(1, 11)]
    kinds = [e.kind for e in events]
    assert kinds.index("pass_start") < kinds.index("pass_progress") < kinds.index("pass_end")
