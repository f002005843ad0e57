"""``qgraph check`` gates on the target CPU's arithmetic: a model whose u8×s8 pair sums exceed int16 fails for an
AVX2 target (on any host: the AVX2 arithmetic is emulated where the host is not one), the AVX2 recipe's model
passes, and the output names the layer and the Q/DQ pair that saturate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from qgraph import Recipe
from qgraph.cli import main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ReLU + linear head whose adjacent weights share a sign near the channel maximum and whose activations
    often sit near the top of their range: 8-bit codes make pair sums far beyond int16."""
    tmp = tmp_path_factory.mktemp("saturation")
    rng = np.random.default_rng(0)
    k, n = 64, 10
    w = rng.uniform(0.6, 1.0, (k, n)).astype(np.float32)
    w *= np.repeat(rng.choice([-1.0, 1.0], (k // 2, n)), 2, axis=0).astype(np.float32)
    graph = h.make_graph(
        [h.make_node("Relu", ["x"], ["r"], name="relu"), h.make_node("MatMul", ["r", "w"], ["y"], name="head")],
        "head", [h.make_tensor_value_info("x", T.FLOAT, ["N", k])], [h.make_tensor_value_info("y", T.FLOAT, ["N", n])],
        [nh.from_array(w, "w")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp / "float.onnx")
    x = rng.uniform(0, 1, (300, k)).astype(np.float32)
    x[:, :8] = rng.uniform(0.8, 1.0, (300, 8))
    np.savez(tmp / "calib.npz", x=x[:100])
    np.savez(tmp / "eval.npz", x=x[100:])
    for recipe in ("ort-x86-vnni", "ort-x86-avx2"):
        Recipe.from_yaml(RECIPES / f"{recipe}.yaml").pipeline().run(
            tmp / "float.onnx", calibration_data=str(tmp / "calib.npz")).save(tmp / f"{recipe}.onnx")
    return tmp


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    code = main(["check", *args, "--json", "-"])
    return code, json.loads(capsys.readouterr().out)


def test_the_vnni_model_fails_an_avx2_gate_and_the_saturating_pair_is_named(
        head: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _check(capsys, str(head / "float.onnx"), str(head / "ort-x86-vnni.onnx"), "--data",
                        str(head / "eval.npz"), "--target-cpu", "x86-avx2")
    assert code == 1 and data["passed"] is False
    stage = data["stages"][1]
    assert stage["kernels"]["kernels"]["family"] == "x86-avx2" and stage["sqnr_db"] < 20
    (sat,) = stage["saturation"]
    assert (sat["node"], sat["weight"]) == ("head", "w/q") and sat["activation"].endswith("/q")
    assert sat["fraction"] > 0.05 and sat["channels_at_risk"] == 10
    # the same model judged for its own CPU (VNNI) passes: nothing saturates there
    code, data = _check(capsys, str(head / "float.onnx"), str(head / "ort-x86-vnni.onnx"), "--data",
                        str(head / "eval.npz"))
    assert code == 0 and data["stages"][1]["saturation"] == [] and data["stages"][1]["sqnr_db"] > 40


def test_the_avx2_recipe_passes_the_avx2_gate(head: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _check(capsys, str(head / "float.onnx"), str(head / "ort-x86-avx2.onnx"), "--data",
                        str(head / "eval.npz"))
    assert code == 0, data["verdict"]
    stage = data["stages"][1]
    assert stage["kernels"]["kernels"]["family"] == "x86-avx2"  # read from the model's provenance
    assert stage["saturation"] == [] and stage["sqnr_db"] > 40


def test_the_terminal_says_what_was_measured_and_where_it_saturates(
        head: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", str(head / "float.onnx"), str(head / "ort-x86-vnni.onnx"), "--data", str(head / "eval.npz"),
                 "--target-cpu", "x86-avx2"])
    out = capsys.readouterr().out
    assert code == 1
    measured = next(line for line in out.splitlines() if line.startswith("measured (") and "candidate 1" in line)
    assert "x86-avx2 arithmetic emulated" in measured or "on this host x86-avx2" in measured
    assert "candidate 1: int16 saturation in head:" in out and "× weight w/q" in out
