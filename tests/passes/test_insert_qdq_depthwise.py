"""insert_qdq ``depthwise: auto``: a depthwise conv whose input channels differ ~30x in range stays float (and the
output SQNR improves), balanced channels stay int8 (no-op), the latency model can forbid it, an int8 producer makes
float pointless, and the loss formula's limits (hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from insert_qdq_helpers import quantize, with_weights
from qgraph.passes.insert_qdq.depthwise import spread_loss

from qgraph.errors import RecipeError
from qgraph.runtime.latency import SHIPPED_TABLE
from qgraph.testing.runtime import make_session

C = 16
DW_TEXT = f"""
<ir_version: 8, opset_import: ["" : 17]>
dw (float[1,{C},16,16] x) => (float[1,8,16,16] y) {{
  d = Conv<group={C}, pads=[1,1,1,1]>(x, wd, bd)
  h = HardSwish(d)
  y = Conv(h, wp, bp)
}}
"""
# The same depthwise conv behind an int8 pointwise conv + Relu (absorbed): its input is a DequantizeLinear.
RELU_TEXT = f"""
<ir_version: 8, opset_import: ["" : 17]>
dwr (float[1,{C},16,16] x) => (float[1,8,16,16] y) {{
  a = Conv(x, wa, ba)
  r = Relu(a)
  d = Conv<group={C}, pads=[1,1,1,1]>(r, wd, bd)
  h = HardSwish(d)
  y = Conv(h, wp, bp)
}}
"""


def _scales(spread: float) -> np.ndarray:
    """Per-channel input magnitudes, log-spaced over ``spread`` (a BN-folded activation of a trained net)."""
    return np.geomspace(1.0, spread, C).astype(np.float32)


def _model(spread: float, text: str = DW_TEXT, seed: int = 0) -> onnx.ModelProto:
    """Depthwise weights undo the channel scales, so every output channel matters alike (as after BN folding)."""
    rng = np.random.default_rng(seed)
    wd = rng.normal(0, 0.4, (C, 1, 3, 3)) / _scales(spread)[:, None, None, None]
    w = {"wd": wd, "bd": rng.normal(0, 0.1, C), "wp": rng.normal(0, 0.3, (8, C, 1, 1)), "bp": rng.normal(0, 0.1, 8)}
    if text is RELU_TEXT:
        w |= {"wa": rng.normal(0, 0.3, (C, C, 1, 1)) * _scales(spread)[:, None, None, None], "ba": np.zeros(C)}
    return with_weights(text, {k: v.astype(np.float32) for k, v in w.items()})


def _feeds(n: int, seed: int, spread: float) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    s = _scales(spread)[None, :, None, None]
    return [{"x": (rng.standard_normal((1, C, 16, 16)) * s).astype(np.float32)} for _ in range(n)]


def _sqnr(ref: onnx.ModelProto, test: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    sa, sb = make_session(ref), make_session(test)
    a = np.concatenate([sa.run(None, f)[0].ravel() for f in feeds]).astype(np.float64)
    b = np.concatenate([sb.run(None, f)[0].ravel() for f in feeds]).astype(np.float64)
    return float(10 * np.log10(np.sum(a * a) / np.sum((a - b) ** 2)))


def _dw_input_producer(model: onnx.ModelProto) -> str:
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    dw = next(n for n in model.graph.node if any(a.name == "group" and a.i > 1 for a in n.attribute))
    return producers.get(dw.input[0], "graph input")


def _auto(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], **options: object) -> tuple[onnx.ModelProto,
                                                                                                  list[str]]:
    res = quantize(model, feeds, preset="ort-x86-vnni", depthwise="auto", **options)
    return res.model, res.records[-1].result.decisions


def test_auto_keeps_a_spread_depthwise_conv_float_and_the_output_sqnr_improves() -> None:
    model, cal, ev = _model(30.0), _feeds(8, 0, 30.0), _feeds(8, 1, 30.0)
    q, decisions = _auto(model, cal)
    assert _dw_input_producer(q) == "graph input"  # the depthwise conv reads the float input, no Q/DQ
    line = next(d for d in decisions if d.startswith("depthwise auto: Conv(d) "))
    assert "kept float" in line and "modelled latency" in line, decisions
    loss = float(line.split("loses ")[1].split(" dB")[0])
    assert loss > 10.0  # 16 channels 1..30x apart, weights undoing them
    int8 = quantize(model, cal, preset="ort-x86-vnni").model
    before, after = _sqnr(model, int8, ev), _sqnr(model, q, ev)
    # Measured: 21.4 -> 34.4 dB (the smallest channels kept ~8 of 256 codes).
    assert after > before + 8.0, (before, after)
    float_all = quantize(model, cal, preset="ort-x86-vnni", depthwise="float").model
    assert _sqnr(model, float_all, ev) == pytest.approx(after, abs=1e-6)  # the same model as `float` here


def test_auto_is_a_no_op_on_balanced_channels() -> None:
    model, cal = _model(1.0), _feeds(8, 0, 1.0)
    q, decisions = _auto(model, cal)
    int8 = quantize(model, cal, preset="ort-x86-vnni").model
    assert q.graph.SerializeToString() == int8.graph.SerializeToString()
    assert any("0 of 1 depthwise convs float (1 below min_loss_db" in d for d in decisions), decisions


def _slow_float_table(tmp_path: Path, factor: float) -> Path:
    """The shipped table with every float depthwise conv ``factor`` x its int8 time."""
    table = json.loads(SHIPPED_TABLE.read_text())
    for entry in table["presets"]["ort-x86-vnni"]["entries"]:
        if entry["kind"].startswith("Conv/depthwise/"):
            entry["float_us"] = entry["int8_us"] * factor
    path = tmp_path / f"slow_float_dw_{factor:g}.json"
    path.write_text(json.dumps(table))
    return path


def test_latency_forbids_float_when_the_table_says_float_is_slower(tmp_path: Path) -> None:
    path = _slow_float_table(tmp_path, 100.0)
    model, cal = _model(30.0), _feeds(8, 0, 30.0)
    q, decisions = _auto(model, cal, latency={"mode": "off", "table": str(path)})
    line = next(d for d in decisions if "kept int8" in d)
    assert "float would add" in line and "max_latency_growth" in line, decisions
    assert _dw_input_producer(q) == "DequantizeLinear"
    # A budget that covers the extra time lets it through.
    _, allowed = _auto(model, cal, latency={"mode": "off", "table": str(_slow_float_table(tmp_path, 2.0))},
                       depthwise_auto={"max_latency_growth": 1.0})
    assert any("kept float" in d for d in allowed), allowed


def test_auto_keeps_int8_where_an_int8_producer_would_make_float_pointless() -> None:
    model, cal = _model(30.0, RELU_TEXT), _feeds(8, 0, 1.0)
    q, decisions = _auto(model, cal, latency={"mode": "off"})
    line = next(d for d in decisions if "kept int8" in d)
    assert "input comes from int8" in line, decisions
    int8 = quantize(model, cal, preset="ort-x86-vnni", latency={"mode": "off"}).model
    assert q.graph.SerializeToString() == int8.graph.SerializeToString()


def test_depthwise_auto_options_are_validated() -> None:
    with pytest.raises((RecipeError, ValueError)):
        quantize(_model(1.0), None, preset="ort-x86-vnni", depthwise_auto={"min_loss": 3})
    with pytest.raises((RecipeError, ValueError)):
        quantize(_model(1.0), None, preset="ort-x86-vnni", depthwise_auto={"max_latency_growth": -1})


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 64), st.floats(0.01, 100.0), st.booleans())
def test_loss_is_zero_for_equal_ranges_and_10log10_c_for_one_live_channel(c: int, r: float, sym: bool) -> None:
    w = np.ones((c, 1, 3, 3), np.float32)
    lo, hi = np.full(c, -r / 3), np.full(c, r)
    assert spread_loss(lo, hi, w, sym)[0] == pytest.approx(0.0, abs=1e-9)
    lo, hi = np.zeros(c), np.zeros(c)
    hi[0] = r
    assert spread_loss(lo, hi, w, sym)[0] == pytest.approx(10 * np.log10(c), rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 100.0), min_size=2, max_size=32), st.integers(1, 3), st.booleans())
def test_loss_is_non_negative_and_weights_with_a_multiplier_group_per_channel(ranges: list[float], m: int,
                                                                              sym: bool) -> None:
    hi = np.array(ranges)
    w = np.random.default_rng(len(ranges)).normal(0, 1, (hi.size * m, 1, 3, 3))
    loss, spread = spread_loss(-hi / 4, hi, w, sym)
    assert loss >= -1e-9 and spread >= 1.0 - 1e-9
    # Scaling every range together changes nothing (the loss is a ratio).
    assert spread_loss(-hi / 2, 2 * hi, w, sym)[0] == pytest.approx(loss, abs=1e-9)
