"""insert_qdq with ``activations.method: auto`` and ``fixed_ranges`` (known ranges of bounded ops)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from insert_qdq_helpers import feeds_for, quantize, run, with_weights

from qgraph import Recipe
from qgraph.errors import RecipeError

MIX = """
<ir_version: 8, opset_import: ["" : 17]>
mix (float[1, 4096, 16] a, float[1, 4096, 16] b, float[1, 4096, 16] c)
    => (float[1, 4096, 8] ya, float[1, 4096, 8] yb, float[1, 4096, 8] yc) {
    ya = MatMul (a, wa)
    yb = MatMul (b, wb)
    yc = MatMul (c, wc)
}
"""


def _mix_feed(seed: int) -> dict[str, np.ndarray]:
    """Three tensors needing three methods: a skewed one (bulk at -1, long right tail: shrinking both sides
    together, as MSE does, hurts), a bounded uniform one (nothing to clip) and a Laplace one (minmax wastes levels
    on its tails)."""
    r = np.random.default_rng(seed)
    shape = (1, 4096, 16)
    return {"a": (r.exponential(1.0, shape) - 1.0).astype(np.float32),
            "b": r.uniform(-1, 1, shape).astype(np.float32),
            "c": r.laplace(0, 0.6, shape).astype(np.float32)}


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10((ref.astype(np.float64) ** 2).sum() / ((ref - got).astype(np.float64) ** 2).sum()))


def _outputs(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], index: int | None = None) -> np.ndarray:
    outs = [run(model, f) for f in feeds]
    return np.concatenate([np.ravel(o) for r in outs for o in (r if index is None else [r[index]])])


def test_auto_beats_every_single_method_on_held_out_data() -> None:
    rng = np.random.default_rng(0)
    model = with_weights(MIX, {k: rng.normal(0, 0.3, (16, 8)).astype(np.float32) for k in ("wa", "wb", "wc")})
    calib, held_out = [_mix_feed(i) for i in range(8)], [_mix_feed(100 + i) for i in range(6)]
    ref = _outputs(model, held_out)
    sqnr = {}
    for method in ("minmax", "percentile", "entropy", "mse", "auto"):
        res = quantize(model, calib, preset="ort-x86-vnni", activations={"method": method})
        sqnr[method] = _sqnr(ref, _outputs(res.model, held_out))
    assert sqnr["auto"] >= max(v for k, v in sqnr.items() if k != "auto"), sqnr
    assert sqnr["auto"] > sqnr["minmax"] + 0.5, sqnr
    result = res.records[0].result
    auto = result.details["calibration"]["auto"]
    assert sum(auto["methods"].values()) == 3 and len(auto["methods"]) >= 2  # the tensors chose differently
    picked = {r["tensor"]: r["method"] for r in auto["mattered_most"]}
    assert picked["b"] == "minmax" and picked["c"] != "minmax" and picked["a"] != "mse"
    assert any(d.startswith("calibration method auto chose") for d in result.decisions)


HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
head (float[1, 8, 16, 16] x) => (float[1, 2, 16, 16] score, float[1, 4, 16, 16] box) {
    logit = Conv <pads = [1, 1, 1, 1]> (x, wc, bc)
    score = Sigmoid (logit)
    box = Conv <pads = [1, 1, 1, 1]> (x, wb, bb)
}
"""


def _head() -> onnx.ModelProto:
    """A detection head: scores are mostly near 0 and rarely near 1 (the detections), boxes are a plain conv."""
    rng = np.random.default_rng(1)
    return with_weights(HEAD, {
        "wc": rng.normal(0, 0.3, (2, 8, 3, 3)).astype(np.float32), "bc": np.full(2, -7.0, np.float32),
        "wb": rng.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32), "bb": np.zeros(4, np.float32),
    })


def _score_sqnr(method: str, options: dict[str, float], fixed: bool) -> tuple[float, onnx.ModelProto, list[str]]:
    model = _head()
    calib, held_out = feeds_for(model, 8, seed=0), feeds_for(model, 8, seed=5)
    ref = _outputs(model, held_out, 0)
    assert 0 < (ref > 0.5).mean() < 5e-3  # a handful of detections among near-zero scores
    res = quantize(model, calib, preset="ort-x86-vnni", elementwise="always",  # the scores are graph outputs
                   activations={"method": method, "method_options": options, "fixed_ranges": fixed})
    result = res.records[0].result
    assert ("fixed_ranges" in result.details["calibration"]) == fixed
    return _sqnr(ref, _outputs(res.model, held_out, 0)), res.model, result.decisions


@pytest.mark.parametrize(("method", "options"), [("entropy", {}), ("percentile", {"percentile": 99.0})])
def test_fixed_ranges_keep_the_rare_confident_scores(method: str, options: dict[str, float]) -> None:
    """Entropy and low percentiles clip the few confident scores (the detections); [0, 1] keeps them."""
    before, _, _ = _score_sqnr(method, options, fixed=False)
    after, _, decisions = _score_sqnr(method, options, fixed=True)
    assert before < 20 and after > before + 8, (before, after)
    assert any(d.startswith("fixed ranges: 1 outputs of bounded ops (Sigmoid x1)") for d in decisions), decisions


@pytest.mark.parametrize("method", ["minmax", "auto"])
def test_fixed_ranges_cost_under_a_bit_where_nothing_was_clipped(method: str) -> None:
    """minmax, and auto (clipping a confident score costs its squared distance, so it keeps them), reach 0.8 of the
    bound: [0, 1] costs log2(1 / 0.8) = 0.3 bit on the calibration data, about 1 dB."""
    before, _, _ = _score_sqnr(method, {}, fixed=False)
    after, _, _ = _score_sqnr(method, {}, fixed=True)
    assert before > 28 and before - 1.5 < after <= before, (before, after)


def test_fixed_ranges_leave_a_far_from_its_bound_softmax_alone() -> None:
    """A 1000-way softmax whose largest probability is ~0.01: [0, 1] would cost 6 bits, the calibrated range stays."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    cls (float[1, 64] x) => (float[1, 1000] p) {
        l = Gemm <transB = 1> (x, w, b)
        p = Softmax <axis = 1> (l)
    }
    """
    rng = np.random.default_rng(2)
    model = with_weights(text, {"w": rng.normal(0, 0.02, (1000, 64)).astype(np.float32),
                                "b": np.zeros(1000, np.float32)})
    res = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni", elementwise="always")
    assert "fixed_ranges" not in res.records[0].result.details.get("calibration", {})


def test_recipe_options_are_validated_with_their_location(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: t\npasses:\n  - pass: insert_qdq\n    activations:\n      method: auto\n"
                      "      fixed_range: false\n")
    with pytest.raises(RecipeError, match=r"r\.yaml:6:7: .*fixed_range.*Did you mean 'fixed_ranges'"):
        Recipe.from_yaml(recipe)
    recipe.write_text("name: t\npasses:\n  - pass: insert_qdq\n    activations:\n      method: auto\n"
                      "      method_options: {percentile: 99.9}\n")
    with pytest.raises(RecipeError, match=r"r\.yaml:\d+:\d+: .*invalid options for calibration method 'auto'"):
        Recipe.from_yaml(recipe)
    recipe.write_text("name: t\npasses:\n  - pass: insert_qdq\n    activations:\n      method: automatic\n")
    with pytest.raises(RecipeError, match=r"r\.yaml:5:15: .*'auto'"):
        Recipe.from_yaml(recipe)
    recipe.write_text("name: t\npasses:\n  - pass: insert_qdq\n    activations:\n      method: auto\n"
                      "      method_options: {percentiles: [99.9, 99.99], min_gain: 0.02}\n")
    assert Recipe.from_yaml(recipe).passes[0].config.activations.method == "auto"
