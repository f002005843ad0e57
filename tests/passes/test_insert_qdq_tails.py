"""``elementwise: integer_fed``: an elementwise unit is quantized only where a quantized op reads its output."""

from __future__ import annotations

import numpy as np
from insert_qdq_helpers import feeds_for, quantize, with_weights
from qgraph.passes.insert_qdq.tails import AFFINE_WHY, WHY

RESIDUAL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 8, 6, 6] x) => (float[1, 8, 6, 6] y) {
    c1 = Conv <pads = [1, 1, 1, 1]> (x, w1)
    a1 = Add(c1, x)
    r = Relu(a1)
    c2 = Conv <pads = [1, 1, 1, 1]> (r, w2)
    a2 = Add(c2, r)
    t = Transpose <perm = [0, 1, 3, 2]> (a2)
    y = Sigmoid(t)
}
"""


def _model():  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    return with_weights(RESIDUAL, {k: rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32) for k in ("w1", "w2")})


def _quantized_ops(model) -> dict[str, bool]:  # type: ignore[no-untyped-def]
    """Node output -> whether the node runs on integers: it reads DequantizeLinear outputs and its output goes to
    a QuantizeLinear (directly, or through the Relu that onnxruntime drops)."""
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    readers: dict[str, list[str]] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    outputs = {n.output[0]: n for n in model.graph.node}

    def quantized_out(t: str) -> bool:
        ops = readers.get(t, [])
        return "QuantizeLinear" in ops or any(
            quantized_out(outputs[k].output[0]) for k in outputs if outputs[k].op_type == "Relu"
            and t in outputs[k].input)

    return {n.output[0]: any(producers.get(i) == "DequantizeLinear" for i in n.input) and quantized_out(n.output[0])
            for n in model.graph.node if n.op_type in ("Conv", "Add", "Sigmoid")}


def test_only_elementwise_ops_feeding_integer_ops_are_quantized() -> None:
    model = _model()
    res = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni")
    got = _quantized_ops(res.model)
    # a1 feeds c2 (through the absorbed Relu); a2 and the Sigmoid only reach the graph output (through a Transpose).
    assert got == {"c1": True, "a1": True, "c2": True, "a2": False, "y": False}
    skipped = {s.node: s.reason for s in res.records[0].result.skipped}
    assert sum(reason == WHY for reason in skipped.values()) == 2


def test_always_quantizes_every_elementwise_op() -> None:
    model = _model()
    res = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni", elementwise="always")
    assert all(_quantized_ops(res.model).values())
    assert not any(s.reason == WHY for s in res.records[0].result.skipped)


# PP-LCNetV3's learnable affine blocks: a float HardSwish scaled and shifted by constants before a Conv (y); and
# the same scale/shift after a Conv, an integer producer (z), which keeps its integer Mul/Add.
AFFINE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 8, 12, 12] x) => (float[1, 8, 12, 12] y, float[1, 8, 12, 12] z) {
    h = HardSwish(x)
    m = Mul(h, k)
    a = Add(m, c)
    y = Conv <pads = [1, 1, 1, 1]> (a, w1)
    c2 = Conv <pads = [1, 1, 1, 1]> (x, w2)
    m2 = Mul(c2, k)
    a2 = Add(m2, c)
    r = Relu(a2)
    z = Conv <pads = [1, 1, 1, 1]> (r, w1)
}
"""


def _affine_model():  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    weights = {k: rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32) for k in ("w1", "w2")}
    return with_weights(AFFINE, {**weights, "k": np.array(0.37, np.float32), "c": np.array(-0.61, np.float32)})


def test_scale_shift_of_a_float_tensor_stays_float_and_rounds_once() -> None:
    from qgraph.runtime.compare import compare_models

    model = _affine_model()
    rng = np.random.default_rng(1)
    cal = [{"x": rng.normal(0, 3, (1, 8, 12, 12)).astype(np.float32)} for _ in range(16)]
    ev = [{"x": rng.normal(0, 3, (1, 8, 12, 12)).astype(np.float32)} for _ in range(4)]
    res = quantize(model, cal, preset="ort-x86-vnni")
    skipped = {s.node: s.reason for s in res.records[0].result.skipped}
    assert sorted(n for n, why in skipped.items() if why == AFFINE_WHY) == ["Add(a)", "Mul(m)"]
    readers = {i: n.op_type for n in res.model.graph.node for i in n.input}
    producers = {o: n for n in res.model.graph.node for o in n.output}
    # h and m are not rounded (no QuantizeLinear reads them), a is, once, for the Conv; m2/a2 after the integer
    # Conv c2 stay integer ops (the no-op case: the Conv's output is quantized anyway)
    assert readers["h"] == "Mul" and readers["m"] == "Add" and readers["a"] == "QuantizeLinear"
    assert all(producers[i].op_type == "DequantizeLinear" for i in producers["m2"].input)
    assert all(producers[i].op_type == "DequantizeLinear" for i in producers["a2"].input)
    always = quantize(model, cal, preset="ort-x86-vnni", elementwise="always")
    got = {d.name: d.sqnr_db for d in compare_models(model, res.model, ev)}
    before = {d.name: d.sqnr_db for d in compare_models(model, always.model, ev)}
    # two fewer roundings of y's input; measured 35.0 -> 36.3 dB (the weights' rounding stays)
    assert got["y"] > before["y"] + 1.0, (before, got)
    assert abs(got["z"] - before["z"]) < 0.01, (before, got)  # the integer-fed branch is unchanged


# A transformer FFN: MatMul (float output in onnxruntime's QDQ form) -> bias Add -> erf GELU -> MatMul. Every
# elementwise op of the GELU reads a float-computed tensor; the residual join r reads x, which the first MatMul
# quantizes anyway, and the second MatMul's output (float): off the grid too.
FFN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 32, 16] x) => (float[1, 32, 16] y) {
    h = MatMul(x, w1)
    hb = Add(h, b1)
    d = Div(hb, sqrt2)
    e = Erf(d)
    e1 = Add(e, one)
    g1 = Mul(hb, e1)
    g2 = Mul(g1, half)
    o = MatMul(g2, w2)
    y = Add(o, x)
}
"""


def _ffn_model():  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.3, (16, 64)).astype(np.float32)
    w1[:, :4] *= 6.0  # a few hidden units with 6x the range, as real FFNs have
    consts = {"w1": w1, "w2": rng.normal(0, 0.2, (64, 16)).astype(np.float32),
              "b1": rng.normal(0, 0.1, 64).astype(np.float32), "sqrt2": np.array(2**0.5, np.float32),
              "one": np.array(1.0, np.float32), "half": np.array(0.5, np.float32)}
    return with_weights(FFN, consts)


def test_on_grid_leaves_elementwise_ops_reading_float_tensors_float() -> None:
    from qgraph.passes.insert_qdq.tails import GRID_WHY

    from qgraph.runtime.compare import compare_models

    model = _ffn_model()
    rng = np.random.default_rng(1)
    cal = [{"x": rng.normal(0, 1, (1, 32, 16)).astype(np.float32)} for _ in range(16)]
    ev = [{"x": rng.normal(0, 1, (1, 32, 16)).astype(np.float32)} for _ in range(8)]
    fed = quantize(model, cal, preset="ort-x86-vnni")
    grid = quantize(model, cal, preset="ort-x86-vnni", elementwise="on_grid")
    skipped = {s.node: s.reason for s in grid.records[0].result.skipped}
    assert {n for n, why in skipped.items() if why == GRID_WHY} == {"Mul(g1)", "Mul(g2)", "Add(y)"}
    # integer_fed quantizes the GELU product (Mul(g1) rounds hb and e1 first); on_grid rounds g2 once, for the MatMul
    q_inputs = {i for n in grid.model.graph.node if n.op_type == "QuantizeLinear" for i in n.input[:1]}
    assert q_inputs == {"x", "g2"}, q_inputs
    fed_q = {i for n in fed.model.graph.node if n.op_type == "QuantizeLinear" for i in n.input[:1]}
    assert {"hb", "e1"} <= fed_q
    got = {d.name: d.sqnr_db for d in compare_models(model, grid.model, ev)}
    before = {d.name: d.sqnr_db for d in compare_models(model, fed.model, ev)}
    assert got["y"] > before["y"] + 1.0, (before, got)  # measured 30.6 -> 33.9 dB


def test_on_grid_is_integer_fed_where_every_input_is_integer() -> None:
    model = _model()  # Conv outputs and the input the Convs quantize anyway: every elementwise input is integer
    fed = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni")
    grid = quantize(model, feeds_for(model, 8), preset="ort-x86-vnni", elementwise="on_grid")
    assert _quantized_ops(grid.model) == _quantized_ops(fed.model)
    assert [n.op_type for n in grid.model.graph.node] == [n.op_type for n in fed.model.graph.node]
