"""The natural .npz (axis 0 indexes samples) fits scalar inputs, recurrent state without a leading batch axis and
batch-less audio; the rule is unambiguous, reported, and can be forced (issue #12 item 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qgraph.cli import main
from qgraph.data import InputSpec, decide_layout, open_data_source
from qgraph.errors import DataError

PREP = "name: prep\npasses:\n  - pass: fold_constants\n  - pass: cleanup\n"


def vad_like(audio_shape: list[int | str]) -> onnx.ModelProto:
    """out = mean(audio) + mean(state) * float(sr): a voice-activity model's input signature."""
    nodes = [
        helper.make_node("ReduceMean", ["audio"], ["ma"], keepdims=0, name="mean_audio"),
        helper.make_node("ReduceMean", ["state"], ["ms"], keepdims=0, name="mean_state"),
        helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Mul", ["ms", "srf"], ["p"], name="mul"),
        helper.make_node("Add", ["ma", "p"], ["out"], name="add"),
    ]
    inputs = [helper.make_tensor_value_info("audio", TensorProto.FLOAT, audio_shape),
              helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", 128]),
              helper.make_tensor_value_info("sr", TensorProto.INT64, [])]
    graph = helper.make_graph(nodes, "vad", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _natural(n: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"audio": rng.standard_normal((n, 512)).astype(np.float32),
            "state": rng.standard_normal((n, 2, 128)).astype(np.float32),
            "sr": np.full(n, 16000, np.int64)}


@pytest.mark.parametrize("audio_shape", [["batch", "samples"], ["samples"]], ids=["batched-audio", "batchless"])
def test_natural_npz_feeds_every_input(audio_shape: list[int | str]) -> None:
    source = open_data_source_from(_natural(), vad_like(audio_shape))
    feeds = list(source)
    assert len(feeds) == 4
    assert feeds[0]["state"].shape == (2, 1, 128)  # batch axis inserted where the model has it
    assert feeds[0]["sr"].shape == ()
    assert feeds[0]["audio"].shape == ((1, 512) if len(audio_shape) == 2 else (512,))
    np.testing.assert_array_equal(feeds[2]["state"][:, 0], _natural()["state"][2])
    notes = source.notes()
    assert any("state: (4, 2, 128) read as 4 samples, batch axis of size 1 inserted at axis 1" in n for n in notes)


def open_data_source_from(arrays: dict[str, np.ndarray], model: onnx.ModelProto, layout: str = "auto"):  # type: ignore[no-untyped-def]
    import tempfile

    folder = Path(tempfile.mkdtemp())
    np.savez(folder / "d.npz", **arrays)
    return open_data_source(folder / "d.npz", layout=layout).bind(model)  # type: ignore[arg-type]


def test_state_with_its_batch_axis_is_read_as_is() -> None:
    arrays = {**_natural(), "state": np.zeros((4, 2, 1, 128), np.float32)}
    source = open_data_source_from(arrays, vad_like(["batch", "samples"]))
    assert next(iter(source))["state"].shape == (2, 1, 128)
    assert not any("state" in n for n in source.notes())


def test_forcing_a_layout() -> None:
    model = vad_like(["batch", "samples"])
    samples = open_data_source_from(_natural(), model, "samples")
    assert next(iter(samples))["audio"].shape == (1, 512)
    with pytest.raises(DataError, match="cannot be read as batches of one for state"):
        open_data_source_from(_natural(), model, "batched")


@pytest.mark.parametrize(
    ("array", "input_shape", "layout", "expected"),
    [((4, 512), ("batch", 512), "auto", ("batched", None)),
     ((4, 1, 512), ("batch", 512), "auto", ("samples", None)),
     ((4, 2, 128), (2, "b", 128), "auto", ("samples", 1)),
     ((4,), (), "auto", ("samples", None)),
     ((), (), "auto", ("single", None)),
     ((4, 512), ("batch", 512), "samples", ("samples", 0))],
)
def test_layout_rule(array: tuple[int, ...], input_shape: tuple[int | str, ...], layout: str,
                     expected: tuple[str, int | None]) -> None:
    spec = InputSpec("x", np.dtype("f4"), input_shape)
    choice = decide_layout(array, spec, layout, "d.npz")  # type: ignore[arg-type]
    assert (choice.layout, choice.inserted_axis) == expected


def test_cli_run_reports_the_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    onnx.save(vad_like(["batch", "samples"]), tmp_path / "vad.onnx")
    np.savez(tmp_path / "d.npz", **_natural())
    (tmp_path / "prep.yaml").write_text(PREP)
    code = main(["run", str(tmp_path / "prep.yaml"), str(tmp_path / "vad.onnx"), "-o", str(tmp_path / "o.onnx"),
                 "--calibration-data", str(tmp_path / "d.npz"), "--verify"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0, err
    assert "data: state: (4, 2, 128) read as 4 samples, batch axis of size 1 inserted at axis 1" in err
    code = main(["run", str(tmp_path / "prep.yaml"), str(tmp_path / "vad.onnx"), "-o", str(tmp_path / "o2.onnx"),
                 "--calibration-data", str(tmp_path / "d.npz"), "--data-layout", "batched"])
    assert code == 2
    assert "--data-layout" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    ("shape", "hint"),
    [
        (("batch", 1, 8, 8), "Store it as (N, 1, 8, 8): the model's shape with N samples on its batch axis 0;"),
        ((2, "batch", 128), "Store it as (N, 2, 1, 128): N samples along axis 0, each the model's shape with its "
                            "batch axis 1 of size 1;"),
        ((None, None, 4), "Store it as (N, ?, 4) (? = any size): the model's shape with N samples on its batch"),
    ],
)
def test_wrong_shape_advice_is_a_concrete_shape(shape: tuple[int | str | None, ...], hint: str) -> None:
    spec = InputSpec("x", np.dtype("f4"), shape)
    with pytest.raises(DataError) as err:
        decide_layout((4, 3, 3, 3, 3, 3), spec, "auto", "data.npz")
    assert hint in str(err.value)
