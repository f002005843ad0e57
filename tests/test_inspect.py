"""``qgraph inspect`` analyses: QDQ coverage, foldable BatchNorms, opset/target support, extreme ranges,
int16 saturation risk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qgraph.analysis.diff import saturation_risks
from qgraph.analysis.inspect import analyze_model, inspect_model
from qgraph.cli import main
from qgraph.errors import RecipeError
from qgraph.io.model_io import save_model
from qgraph.testing.models import conv_bn_net

BN_CASES = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y, float[1,2,4,4] c2) {
  w = Constant <value = float[2,2,1,1] {1,0,0,1}> ()
  s = Constant <value = float[2] {1,1}> ()
  b = Constant <value = float[2] {0,0}> ()
  c1 = Conv (x, w)
  ok = BatchNormalization (c1, s, b, b, s)
  r = Relu (ok)
  after_relu = BatchNormalization (r, s, b, b, s)
  c2 = Conv (after_relu, w)
  shared = BatchNormalization (c2, s, b, b, s)
  y = Add (shared, x)
}
"""


def _named(text: str) -> onnx.ModelProto:
    m = onnx.parser.parse_model(text)
    for node in m.graph.node:
        node.name = node.name or node.output[0]
    return m


def test_foldable_batchnorms_with_reasons() -> None:
    bn = analyze_model(_named(BN_CASES))["batchnorm"]
    assert (bn["total"], bn["foldable"], bn["foldable_nodes"]) == (3, 1, ["ok"])
    reasons = {b["node"]: b["reason"] for b in bn["not_foldable"]}
    assert reasons["after_relu"].startswith("follows Relu")
    assert reasons["shared"] == "Conv output 'c2' is also used elsewhere"
    real = analyze_model(conv_bn_net(opset=17))["batchnorm"]
    n_bn = sum(n.op_type == "BatchNormalization" for n in conv_bn_net(opset=17).graph.node)
    assert real["total"] == real["foldable"] == n_bn > 0


def test_ops_unsupported_at_an_opset_and_on_a_target() -> None:
    m = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[8] s, float[8] b) => (float[2,8] y) {
      n = LayerNormalization <axis = -1> (x, s, b)
      e = Erf (n)
      y = Softmax (e)
    }
    """)
    a = analyze_model(m, opset=13, target="tensorrt")
    op = a["opset"]
    assert (op["model_opset"], op["target_opset"]) == (17, 13)
    assert op["unsupported"] == [{"op": "LayerNormalization", "count": 1, "reason": "not defined at opset 13"}]
    assert a["target"]["float_ops"] == {"Erf": 1, "LayerNormalization": 1, "Softmax": 1}
    assert analyze_model(m, target="ort-x86-vnni")["target"]["float_ops"] == {"Erf": 1, "LayerNormalization": 1}
    old = onnx.parser.parse_model("""
    <ir_version: 4, opset_import: ["" : 9]>
    g (float[1,1,2,2] x, float[4] sc) => (float[1,1,4,4] y) { y = Upsample (x, sc) }
    """)
    up = analyze_model(old, opset=11)["opset"]
    assert up["unsupported"] == [{"op": "Upsample", "count": 1, "reason": "deprecated since opset 10"}]
    softmax = analyze_model(m, opset=11)["opset"]["version_changes"]
    assert {"op": "Softmax", "count": 1, "from": 13, "to": 11} in softmax
    with pytest.raises(RecipeError, match="unknown target preset 'gpu'"):
        analyze_model(m, target="gpu")


def test_extreme_weight_and_activation_ranges() -> None:
    rng = np.random.default_rng(0)
    m = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,512] x) => (float[1,512] y) {
      masked = Add (x, mask)
      h = Mul (masked, outlier)
      y = Mul (h, normal)
    }
    """)
    mask = np.zeros((1, 512), np.float32)
    mask[0, 256:] = -1e9
    outlier = rng.standard_normal((1, 512)).astype(np.float32)
    outlier[0, 3] = 500.0
    normal = rng.standard_normal((1, 512)).astype(np.float32)
    for name, value in (("mask", mask), ("outlier", outlier), ("normal", normal)):
        m.graph.initializer.append(numpy_helper.from_array(value, name))
    a = analyze_model(m)
    weights = {e["tensor"]: e for e in a["extreme_ranges"]}
    assert set(weights) == {"mask", "outlier"}
    assert "masking constant" in weights["mask"]["reason"] and weights["mask"]["min"] == -1e9
    assert weights["outlier"]["reason"].startswith("outlier-dominated") and weights["outlier"]["ratio"] > 50
    feeds = [{"x": rng.standard_normal((1, 512)).astype(np.float32)} for _ in range(3)]
    acts = {e["tensor"]: e for e in analyze_model(m, feeds=feeds)["extreme_ranges"] if e["kind"] == "activation"}
    assert set(acts) == {"masked", "h", "y"} and acts["masked"]["size"] == 3 * 512


def _qdq_matmul(codes: np.ndarray) -> onnx.ModelProto:
    m = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,2] y) {
      xq = QuantizeLinear (x, xs, xz)
      xd = DequantizeLinear (xq, xs, xz)
      wd = DequantizeLinear (wq, ws, wz)
      y = MatMul (xd, wd)
    }
    """)
    for i, node in enumerate(m.graph.node):
        node.name = f"n{i}"
    for name, value in (("xs", np.float32(0.02)), ("xz", np.uint8(0)), ("wq", codes.astype(np.int8)),
                        ("ws", np.float32(0.01)), ("wz", np.int8(0))):
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return m


def _vpmaddubsw_matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """u8 (M,K) x s8 (K,N) as AVX2 computes it: adjacent K pairs summed into saturating int16."""
    a32, w32 = a.astype(np.int32), w.astype(np.int32)
    pairs = a32[:, None, 0::2] * w32.T[None, :, 0::2] + a32[:, None, 1::2] * w32.T[None, :, 1::2]
    return np.clip(pairs, -32768, 32767).sum(axis=-1)


def test_saturation_risk_matches_the_kernel_arithmetic() -> None:
    full = np.array([[127, 3], [127, -5], [-100, 7], [20, 9]])  # first pair of column 0 can reach 64770
    reduced = np.clip(np.round(full / 2), -64, 63)  # the same weights with 7-bit codes (reduce_range)
    (risk,) = saturation_risks(_qdq_matmul(full))
    assert (risk.node, risk.op, risk.pairs, risk.overflowing_pairs, risk.worst_pair_sum, risk.max_weight_code) == (
        "n3", "MatMul", 4, 1, 255 * 254, 127)
    assert saturation_risks(_qdq_matmul(reduced)) == []
    worst = np.array([[255, 255, 0, 0]], dtype=np.uint8)
    exact = worst.astype(np.int32) @ full.astype(np.int32)
    assert _vpmaddubsw_matmul(worst, full)[0, 0] != exact[0, 0]  # the flagged layer really saturates
    rng = np.random.default_rng(0)
    acts = np.vstack([worst, rng.integers(0, 256, (64, 4), dtype=np.uint8)])
    np.testing.assert_array_equal(_vpmaddubsw_matmul(acts, reduced), acts.astype(np.int32) @ reduced.astype(np.int32))


def test_conv_pairs_follow_channels_last_order() -> None:
    m = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,4,4] x) => (float[1,1,4,3] y) {
      xq = QuantizeLinear (x, xs, xz)
      xd = DequantizeLinear (xq, xs, xz)
      wd = DequantizeLinear (wq, ws, wz)
      y = Conv (xd, wd)
    }
    """)
    codes = np.zeros((1, 2, 1, 2), np.int8)
    codes[0, :, 0, 0] = 127  # both channels at kernel position 0: adjacent in (kh, kw, c) order only
    for name, value in (("xs", np.float32(0.02)), ("xz", np.uint8(0)), ("wq", codes), ("ws", np.float32(0.01)),
                        ("wz", np.int8(0))):
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    (risk,) = saturation_risks(m)
    assert risk.op == "Conv" and risk.overflowing_pairs == 1 and risk.pairs == 2


def test_qdq_coverage_in_inspect(tmp_path: Path) -> None:
    path = save_model(_qdq_matmul(np.ones((4, 2))), tmp_path / "q.onnx")
    info = inspect_model(path)
    cov = info["analysis"]["qdq_coverage"]
    assert cov["counts"] == {"int8": 1} and cov["by_op"] == {"MatMul": {"int8": 1, "partial": 0, "float": 0}}
    assert info["nodes"] == 4 and info["analysis"]["saturation"] == []


def test_cli_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_model(conv_bn_net(opset=17), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", input=np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))
    assert main(["inspect", str(path), "--json", "--opset", "11", "--target", "ort-arm",
                 "--inputs", str(tmp_path / "d.npz")]) == 0
    data = json.loads(capsys.readouterr().out)
    a = data["analysis"]
    assert a["opset"]["target_opset"] == 11 and a["target"]["target"] == "ort-arm"
    assert a["batchnorm"]["foldable"] == a["batchnorm"]["total"] > 0
    assert data["ops"].count("Conv") == 4
    assert main(["inspect", str(path), "--opset", "11"]) == 0
    text = capsys.readouterr().out
    assert "op histogram" in text and f"BatchNormalization: {a['batchnorm']['total']} of" in text
    assert main(["inspect", str(path), "--target", "gpu"]) == 2
    assert "unknown target preset" in capsys.readouterr().err
