"""The README's main job on the bundled example: provenance, byte-identical re-runs, INT8 accuracy measured as it
deploys on this host (the host recipe picks this host's preset; `qgraph.runtime.kernels`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx

from qgraph import Recipe
from qgraph.cli import main
from qgraph.runtime.kernels.measure import choose, model_target

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
RECIPE = ROOT / "recipes" / "ort-cpu.yaml"


def _top1(model: onnx.ModelProto | str) -> float:
    data = np.load(DIGITS / "eval.npz")
    sess = choose(model_target(model)).kernels.session(model)  # this host's kernels for the CPU it is made for
    name = sess.get_inputs()[0].name
    logits = sess.run(None, {name: data[name]})[0]
    return float(np.mean(np.argmax(logits, axis=1) == data["labels"]))


def test_readme_main_job(tmp_path: Path) -> None:
    args = ["run", str(RECIPE), str(DIGITS / "model.onnx"), "--calibration-data",
            str(DIGITS / "calibration.npz"), "--verify", "-q"]
    model_before = (DIGITS / "model.onnx").read_bytes()
    assert main([*args, "-o", str(tmp_path / "a.onnx")]) == 0
    assert main([*args, "-o", str(tmp_path / "b.onnx")]) == 0
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert (DIGITS / "model.onnx").read_bytes() == model_before
    out = onnx.load(str(tmp_path / "a.onnx"))
    onnx.checker.check_model(out, full_check=True)
    meta = {p.key: p.value for p in out.metadata_props}
    assert meta["qgraph.recipe"] == Recipe.from_yaml(RECIPE).canonical_text()
    assert meta["qgraph.target_cpu"] == choose(None).kernels.host.family  # made for this host
    stats = json.loads(meta["qgraph.passes"])
    assert [s["pass"] for s in stats] == ["fold_constants", "fuse_activations", "fuse_affine", "fuse_batchnorm",
                                          "cleanup", "equalize_weights", "smooth_quant", "insert_qdq", "correct_bias"]
    assert stats[3]["rewritten"] == 3  # the three BatchNormalization nodes
    ops = [n.op_type for n in out.graph.node]
    assert "BatchNormalization" not in ops and ops.count("QuantizeLinear") >= 4
    float_top1, int8_top1 = _top1(str(DIGITS / "model.onnx")), _top1(out)
    assert float_top1 >= 0.95
    assert int8_top1 >= float_top1 - 0.005, (float_top1, int8_top1)
