"""``activations.through_activation``: a tensor read only by an activation is clipped where the activation is flat."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from insert_qdq_helpers import feeds_for, quantize, run, with_weights
from onnx import numpy_helper

SILU_NET = """
<ir_version: 8, opset_import: ["" : 17]>
silu (float[1, 4, 12, 12] x) => (float[1, 6, 12, 12] y) {
    c1 = Conv <pads = [1, 1, 1, 1]> (x, w1, b1)
    s1 = Sigmoid (c1)
    a1 = Mul (c1, s1)
    c2 = Conv <pads = [1, 1, 1, 1]> (a1, w2, b2)
    s2 = Sigmoid (c2)
    a2 = Mul (c2, s2)
    y = Conv (a2, w3, b3)
}
"""


def silu_net(gate_output: bool = False) -> onnx.ModelProto:
    """Conv -> SiLU -> Conv -> SiLU -> Conv; half the channels of each conv are pushed far negative (pre-activations
    in [-60, 10], as YOLOv8's), where SiLU is flat. ``gate_output``: the first Sigmoid is also a graph output."""
    rng = np.random.default_rng(0)
    text = SILU_NET
    if gate_output:
        text = text.replace("=> (float[1, 6, 12, 12] y)", "=> (float[1, 6, 12, 12] y, float[1, 8, 12, 12] s1)")
    shift = np.where(np.arange(8) % 2 == 0, -35.0, 0.5)
    return with_weights(text, {
        "w1": rng.normal(0, 0.6, (8, 4, 3, 3)).astype(np.float32), "b1": shift.astype(np.float32),
        "w2": rng.normal(0, 0.25, (8, 8, 3, 3)).astype(np.float32), "b2": shift.astype(np.float32),
        "w3": rng.normal(0, 0.4, (6, 8, 1, 1)).astype(np.float32), "b3": np.zeros(6, np.float32),
    })


def q_range(model: onnx.ModelProto, tensor: str) -> tuple[float, float]:
    """The real range of the QuantizeLinear of ``tensor``: ``[(qmin - zp) s, (qmax - zp) s]`` (uint8)."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    s, z = float(inits[q.input[1]]), int(inits[q.input[2]])
    return (0 - z) * s, (255 - z) * s


def sqnr(model: onnx.ModelProto, q: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    ref = np.concatenate([run(model, f)[0] for f in feeds])
    got = np.concatenate([run(q, f)[0] for f in feeds])
    return float(10 * np.log10((ref**2).sum() / ((ref - got) ** 2).sum()))


def test_silu_inputs_are_clipped_where_silu_is_flat_and_the_output_gains() -> None:
    model = silu_net()
    cal, ev = feeds_for(model, 16), feeds_for(model, 16, seed=7)
    on = quantize(model, cal, preset="ort-x86-vnni", activations={"method": "auto"})
    off = quantize(model, cal, preset="ort-x86-vnni", activations={"method": "auto", "through_activation": False})
    for t in ("c1", "c2"):
        lo_on, hi_on = q_range(on.model, t)
        lo_off, hi_off = q_range(off.model, t)
        assert lo_off < -20 and lo_on == pytest.approx(-6.93, abs=0.1)  # one code of slack: zp is an integer
        assert hi_on == pytest.approx(hi_off, rel=0.05)  # the side where SiLU carries the signal keeps its range
    gain = sqnr(model, on.model, ev) - sqnr(model, off.model, ev)
    assert gain > 3.0, gain
    result = on.records[0].result
    line = next(d for d in result.decisions if d.startswith("through_activation: 2 tensor(s)"))
    assert "SiLU x2" in line and "x finer" in line
    assert set(result.details["calibration"]["through_activation"]) == {"c1", "c2"}
    assert not any(d.startswith("through_activation") for d in off.records[0].result.decisions)


def test_not_clipped_where_a_reader_sees_the_tensor_otherwise() -> None:
    # the first gate is a graph output: a clipped c1 would show there, so c1 keeps its range; c2 is still clipped
    model = silu_net(gate_output=True)
    q = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni", activations={"method": "auto"})
    assert q_range(q.model, "c1")[0] < -20
    assert q_range(q.model, "c2")[0] == pytest.approx(-6.93, abs=0.1)


HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
head (float[1, 4, 8, 8] x) => (float[1, 3, 8, 8] score, float[1, 3, 8, 8] hs) {
    c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
    score = Sigmoid (c)
    d = Conv <pads = [1, 1, 1, 1]> (x, wd, bd)
    h = HardSwish (d)
    hs = Conv (h, w2, b2)
}
"""


def test_a_float_score_sigmoid_keeps_its_logit_range_and_hardswish_clips_at_minus_three() -> None:
    rng = np.random.default_rng(3)
    model = with_weights(HEAD, {
        "w": rng.normal(0, 0.5, (3, 4, 3, 3)).astype(np.float32), "b": np.full(3, -12.0, np.float32),
        "wd": rng.normal(0, 2.0, (3, 4, 3, 3)).astype(np.float32), "bd": np.full(3, -4.0, np.float32),
        "w2": rng.normal(0, 0.5, (3, 3, 1, 1)).astype(np.float32), "b2": np.zeros(3, np.float32),
    })
    q = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni", activations={"method": "auto"})
    chosen = q.records[0].result.details["calibration"]["through_activation"]
    # the score Sigmoid's output is a float graph output: clipping its logits at -6.9 would be a visible score
    # error (sigmoid(-12) = 6e-6 would read 0.001), so they keep their calibrated range
    assert "c" not in chosen and q_range(q.model, "c")[0] < -10
    # HardSwish is exactly 0 below -3: its input is clipped there, its positive side kept
    assert chosen["d"]["activation"] == "HardSwish" and chosen["d"]["range"][0] == -3.0
    assert chosen["d"]["calibrated"][0] < -20 and chosen["d"]["range"][1] == chosen["d"]["calibrated"][1] > 5


FLOAT_READER = """
<ir_version: 8, opset_import: ["" : 17]>
tail (float[1, 4, 8, 8] x) => (float[1, 3, 8, 8] y) {
    d = Conv <pads = [1, 1, 1, 1]> (x, wd, bd)
    h = HardSwish (d)
    y = Neg (h)
}
"""


def test_an_exactly_flat_activation_clips_its_input_even_where_its_output_stays_float() -> None:
    # HardSwish is exactly 0 below -3, so the clip is exact whether or not its output is quantized: here a float
    # Neg reads it (PicoDet's HardSwish before a float depthwise convolution: detection F1 0.980 -> 1.000)
    rng = np.random.default_rng(5)
    model = with_weights(FLOAT_READER, {"wd": rng.normal(0, 2.0, (3, 4, 3, 3)).astype(np.float32),
                                        "bd": np.full(3, -20.0, np.float32)})
    cal, ev = feeds_for(model, 8), feeds_for(model, 8, seed=9)
    on = quantize(model, cal, preset="ort-x86-vnni", activations={"method": "auto"})
    off = quantize(model, cal, preset="ort-x86-vnni", activations={"method": "auto", "through_activation": False})
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "h" for n in on.model.graph.node)  # h is float
    chosen = on.records[0].result.details["calibration"]["through_activation"]
    assert chosen["d"]["activation"] == "HardSwish" and chosen["d"]["calibrated"][0] < -20
    assert q_range(on.model, "d")[0] == pytest.approx(-3.0, abs=0.15) and q_range(off.model, "d")[0] < -20
    gain = sqnr(model, on.model, ev) - sqnr(model, off.model, ev)
    assert gain > 1.5, gain  # 3.7x finer steps on d; measured 2.8 dB at the output


def test_an_exactly_flat_activation_whose_output_is_a_graph_output_clips_its_input_too() -> None:
    text = FLOAT_READER.replace("=> (float[1, 3, 8, 8] y)", "=> (float[1, 3, 8, 8] y, float[1, 3, 8, 8] h)")
    rng = np.random.default_rng(5)
    model = with_weights(text, {"wd": rng.normal(0, 2.0, (3, 4, 3, 3)).astype(np.float32),
                                "bd": np.full(3, -20.0, np.float32)})
    q = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni", activations={"method": "auto"})
    assert q_range(q.model, "d")[0] == pytest.approx(-3.0, abs=0.15)
    ev = feeds_for(model, 8, seed=9)
    ref = np.concatenate([run(model, f)[1] for f in ev])
    got = np.concatenate([run(q.model, f)[1] for f in ev])
    zero = ref == 0  # d <= -3: HardSwish's exact 0, which the clipped grid keeps (its lowest code is <= -3)
    assert zero.mean() > 0.5 and float(np.mean(got[zero] == 0)) > 0.95
