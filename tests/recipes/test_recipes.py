"""Every recipe in recipes/ validates and runs end to end (`qgraph run ... --calibration-data`) on a test model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from qgraph import Recipe
from qgraph.cli import app
from qgraph.quant.qdq import ort_fusion_report
from qgraph.testing import target_session, transformer_encoder, transformer_encoder_inputs

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
DIGITS = ROOT / "examples" / "digits"
CNN_RECIPES = ["ort-x86-vnni", "ort-x86-avx2", "ort-arm", "tensorrt"]


def _top1(model_path: Path) -> float:
    with np.load(DIGITS / "eval.npz") as data:
        images, labels = data["input"].astype(np.float32), data["labels"]
    sess = target_session(model_path)  # as it deploys on the CPU the recipe makes it for, on any host
    logits = sess.run(None, {"input": images})[0]
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["run", *args, "--quiet"])
    try:
        err = result.stderr
    except ValueError:  # older click: stderr mixed into output
        err = ""
    return result.exit_code, result.output + err


def test_every_preset_has_a_recipe_named_after_it() -> None:
    from qgraph.passes.insert_qdq.config import PRESETS

    static = [p.stem for p in RECIPES.glob("*.yaml") if any(q.name == "insert_qdq" for q in Recipe.from_yaml(p).passes)]
    assert sorted(static) == sorted(PRESETS)
    for name in PRESETS:
        recipe = Recipe.from_yaml(RECIPES / f"{name}.yaml")
        quantizer = next(p for p in recipe.passes if p.name == "insert_qdq")
        assert recipe.name == name and quantizer.config.preset == name  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", CNN_RECIPES)
def test_cnn_recipe_runs_on_the_trained_digits_cnn(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.onnx"
    code, text = _run(
        str(RECIPES / f"{name}.yaml"),
        str(DIGITS / "model.onnx"),
        "-o",
        str(out),
        "--calibration-data",
        str(DIGITS / "calibration.npz"),
    )
    assert code == 0, text
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert "BatchNormalization" not in {n.op_type for n in model.graph.node}
    assert _top1(out) >= _top1(DIGITS / "model.onnx") - 0.005
    if name in ("ort-x86-vnni", "ort-x86-avx2"):
        rep = ort_fusion_report(model)
        assert rep.ops["QLinearConv"] == 3 and rep.quantize == 1 and rep.dequantize == 0


def test_cnn_recipe_without_data_says_to_pass_calibration_data(tmp_path: Path) -> None:
    args = ["run", str(RECIPES / "ort-x86-vnni.yaml"), str(DIGITS / "model.onnx"), "-o", str(tmp_path / "o.onnx")]
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from qgraph.cli import main; sys.exit(main())", *args, "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )
    # caught before the first pass (a DataError: exit 2), nothing written
    assert proc.returncode == 2 and "--calibration-data" in proc.stdout + proc.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_transformer_recipe_runs_on_an_encoder(tmp_path: Path) -> None:
    model = transformer_encoder(17, layers=2, d_model=64, heads=4, seq=32)
    src = tmp_path / "encoder.onnx"
    onnx.save(model, str(src))
    feeds = transformer_encoder_inputs(8, seq=32, d_model=64, seed=3)
    data = tmp_path / "calib.npz"
    np.savez(data, **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    out = tmp_path / "encoder.int8.onnx"
    code, text = _run(
        str(RECIPES / "transformer-ort-x86-vnni.yaml"), str(src), "-o", str(out), "--calibration-data", str(data)
    )
    assert code == 0, text
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    ref, sess = target_session(src), target_session(out)
    a = np.concatenate([ref.run(None, f)[0].ravel() for f in feeds])
    b = np.concatenate([sess.run(None, f)[0].ravel() for f in feeds])
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.99
    assert "MatMulInteger" in {n.op_type for n in q.graph.node}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
