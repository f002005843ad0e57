"""Calibration data sources: npz, folder, callable; validation happens before any work."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from qgraph import DataError
from qgraph.data import batched, open_data_source

MODEL = onnx.parser.parse_model(
    '<ir_version: 8, opset_import: ["" : 17]> g (float[N,3] x, int64[N] ids) => (float[N,3] y) { y = Relu(x) }'
)


def test_npz_slices_samples_and_keeps_batch_axis(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.arange(15, dtype=np.float32).reshape(5, 3), ids=np.arange(5))
    src = open_data_source(tmp_path / "d.npz", samples=4).bind(MODEL)
    feeds = list(src)
    assert len(feeds) == 4 and len(src) == 4  # type: ignore[arg-type]
    assert feeds[1]["x"].shape == (1, 3) and feeds[1]["x"].tolist() == [[3, 4, 5]]
    assert feeds[3]["ids"].tolist() == [3]
    batches = list(batched(src, 3))
    assert [b["x"].shape[0] for b in batches] == [3, 1]
    assert src.fingerprint() == open_data_source(tmp_path / "d.npz", samples=4).bind(MODEL).fingerprint()


def test_folder_of_npz(tmp_path: Path) -> None:
    for i in range(3):
        np.savez(tmp_path / f"s{i}.npz", x=np.full((3,), i, np.float32), ids=np.array(i))
    feeds = list(open_data_source(tmp_path).bind(MODEL))
    assert [f["x"].shape for f in feeds] == [(1, 3)] * 3
    assert [float(f["x"][0, 0]) for f in feeds] == [0.0, 1.0, 2.0]


def test_callable_source_is_reiterable(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "mydata.py").write_text(
        "import numpy as np\n"
        "def feeds():\n"
        "    for i in range(3):\n"
        "        yield {'x': np.full((2, 3), i, np.float32), 'ids': np.zeros(2, np.int64)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    src = open_data_source("mydata:feeds").bind(MODEL)
    assert len(list(src)) == 3 and len(list(src)) == 3
    sys.modules.pop("mydata", None)


def test_errors_name_the_sample_and_input(tmp_path: Path) -> None:
    x = np.zeros((4, 3), np.float32)
    x[2, 1] = np.inf
    np.savez(tmp_path / "d.npz", x=x, ids=np.arange(4))
    with pytest.raises(DataError, match="sample 2, input 'x': contains Inf"):
        open_data_source(tmp_path / "d.npz").bind(MODEL)
    with pytest.raises(DataError, match="cannot import module"):
        open_data_source("no_such_module_xyz:feeds")
    with pytest.raises(DataError, match="not found"):
        open_data_source(tmp_path / "missing.npz")


def test_data_in_memory_a_list_of_feeds_or_stacked_arrays_as_an_npz(tmp_path: Path) -> None:
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    np.savez(tmp_path / "d.npz", x=x, ids=np.arange(5))
    from_file = list(open_data_source(tmp_path / "d.npz").bind(MODEL))
    stacked = open_data_source({"x": x, "ids": np.arange(5)}, samples=4).bind(MODEL)
    assert len(stacked) == 4 and "arrays in memory" in stacked.description  # type: ignore[arg-type]
    assert [f["x"].tolist() for f in stacked] == [f["x"].tolist() for f in from_file[:4]]
    feeds = [{"x": x[i : i + 1], "ids": np.array([i])} for i in range(5)]
    listed = open_data_source(feeds).bind(MODEL)
    assert [f["x"].tolist() for f in listed] == [f["x"].tolist() for f in from_file]
    assert len(list(listed)) == 5  # read again: each pass over the data sees every sample
    assert open_data_source(tuple(feeds), samples=2).bind(MODEL).samples == 2


def test_data_of_a_wrong_type_is_a_data_error_naming_it() -> None:
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(DataError, match=r"type generator \(an iterator is read once"):
        open_data_source({"x": x} for _ in range(2))  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"type int: give an \.npz path"):
        open_data_source(3)  # type: ignore[arg-type]
    with pytest.raises(DataError, match="key 0 is not an input name"):
        open_data_source({0: x})
    with pytest.raises(DataError, match="the mapping is empty"):
        open_data_source({})
    with pytest.raises(DataError, match="sample 1: expected a dict"):
        open_data_source([{"x": x[:1], "ids": np.zeros(1, np.int64)}, x]).bind(MODEL)  # type: ignore[list-item]
    with pytest.raises(DataError, match="disagree on the number of samples"):
        open_data_source({"x": x, "ids": np.zeros(3, np.int64)}).bind(MODEL)


def test_a_pipeline_calibrates_the_same_from_a_list_of_feeds_as_from_an_npz(tmp_path: Path) -> None:
    from qgraph import Recipe
    from qgraph.testing.synthetic import matmul_add_relu_chain

    model = matmul_add_relu_chain(3)
    x = np.random.default_rng(0).standard_normal((6, 1, 16)).astype(np.float32)
    np.savez(tmp_path / "cal.npz", input=x)
    recipe = Recipe.from_text("name: t\npasses:\n  - pass: insert_qdq\n    activations: {method: minmax}\n")
    from_file = recipe.pipeline().run(model, calibration_data=tmp_path / "cal.npz").model
    from_list = recipe.pipeline().run(model, calibration_data=[{"input": s} for s in x]).model
    scales = [t for t in from_file.graph.initializer if t.name.endswith("scale")]
    assert len(scales) >= 6
    assert {t.name: t.raw_data for t in from_list.graph.initializer} == {t.name: t.raw_data for t in
                                                                        from_file.graph.initializer}
