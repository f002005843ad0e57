"""`qgraph.runtime.latency.profile_kernels`: per-node medians, and no profile file left behind, even on failure."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qgraph.runtime.compare import ORT_ERRORS
from qgraph.runtime.latency import profile_kernels


def _relu(n: int) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_profiles_every_model_and_removes_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = profile_kernels({"a": _relu(64), "b": _relu(64)}, {"x": np.ones((1, 64), np.float32)}, runs=3)
    assert set(out) == {"a", "b"} and all("relu" in per_node and per_node["relu"] >= 0 for per_node in out.values())
    assert list(tmp_path.iterdir()) == []


def test_a_failing_run_raises_and_leaves_no_profile_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ORT_ERRORS):  # onnxruntime's InvalidArgument: the feed has the wrong shape
        profile_kernels({"a": _relu(64), "b": _relu(64)}, {"x": np.ones((1, 8), np.float32)}, runs=3)
    assert list(tmp_path.iterdir()) == []
