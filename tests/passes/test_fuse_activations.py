"""``fuse_activations``: spelled-out HardSwish/HardSigmoid become one op, with the same float results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import helper, numpy_helper
from qgraph.passes.fuse_activations import FuseActivations

from qgraph import Pipeline

SPELLED = """
<ir_version: 8, opset_import: ["" : {opset}]>
g (float[1, 4, 6, 6] x) => (float[1, 4, 6, 6] y, float[1, 4, 6, 6] z) {{
    three = Constant <value = float {{3.0}}> ()
    zero = Constant <value = float {{0.0}}> ()
    six = Constant <value = float {{6.0}}> ()
    a = Add(x, three)
    c = Clip(a, zero, six)
    m = Mul(x, c)
    y = Div(m, six)
    a2 = Add(y, three)
    c2 = Clip(a2, zero, six)
    z = Div(c2, six)
}}
"""


def _model(opset: int) -> onnx.ModelProto:
    return onnx.parser.parse_model(SPELLED.format(opset=opset))


def _feed() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).uniform(-6, 6, (1, 4, 6, 6)).astype(np.float32)}


def test_hardswish_and_hardsigmoid_are_fused(prep: Any) -> None:
    model = _model(14)
    out, (res,), _ = prep.apply(model, FuseActivations())
    assert {k: v for k, v in prep.ops(out).items() if k != "Constant"} == {"HardSwish": 1, "HardSigmoid": 1}
    assert res.rewritten == 2 and res.details["fused"] == {"HardSwish": 1, "HardSigmoid": 1}
    assert prep.relative_error(model, out, _feed()) < 1e-6
    # A second run finds nothing left to fuse.
    _, (again,), _ = prep.apply(out, FuseActivations())
    assert again.rewritten == 0


@pytest.mark.parametrize(("opset", "keep"), [(13, "keep"), (13, "raise")])
def test_old_opsets_raise_or_keep_two_nodes(prep: Any, opset: int, keep: str) -> None:
    model = _model(opset)
    result = Pipeline([FuseActivations(opset=keep)]).run(model)
    ops = {k: v for k, v in prep.ops(result.model).items() if k != "Constant"}
    res = result.records[0].result
    if keep == "keep":
        assert ops == {"HardSigmoid": 2, "Mul": 1} and result.model.opset_import[0].version == 13
        assert any("Mul(x, HardSigmoid(x))" in d for d in res.decisions)
    else:
        assert ops == {"HardSwish": 1, "HardSigmoid": 1} and result.model.opset_import[0].version == 14
        assert any("opset raised 13 -> 14" in d for d in res.decisions)
    assert prep.relative_error(model, result.model, _feed()) < 1e-6


def test_a_shared_intermediate_is_left_alone(prep: Any) -> None:
    text = SPELLED.format(opset=14).replace("=> (float[1, 4, 6, 6] y, float[1, 4, 6, 6] z)",
                                            "=> (float[1, 4, 6, 6] y, float[1, 4, 6, 6] z, float[1, 4, 6, 6] c)")
    model = onnx.parser.parse_model(text)
    out, (_res,), _ = prep.apply(model, FuseActivations())
    ops = prep.ops(out)
    assert ops["HardSigmoid"] == 1 and "HardSwish" not in ops and ops["Clip"] == 1  # c is a graph output


def _spell_out_relus(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every Relu of a real topology replaced by a spelled-out HardSwish (as Paddle exports it)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("k3", 3), ("k0", 0), ("k6", 6))]
    for node in out.graph.node:
        if node.op_type != "Relu":
            nodes.append(node)
            continue
        x, y, n = node.input[0], node.output[0], node.name
        nodes += [helper.make_node("Add", [x, "k3"], [f"{n}/a"], name=f"{n}/add"),
                  helper.make_node("Clip", [f"{n}/a", "k0", "k6"], [f"{n}/c"], name=f"{n}/clip"),
                  helper.make_node("Mul", [x, f"{n}/c"], [f"{n}/m"], name=f"{n}/mul"),
                  helper.make_node("Div", [f"{n}/m", "k6"], [y], name=f"{n}/div")]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(consts)
    return out


def test_real_topology_keeps_float_results(light_model: Callable[[str], onnx.ModelProto], prep: Any) -> None:
    from qgraph.passes.lower_opset.raising import raise_model

    base = raise_model(light_model("squeezenet"), 14).model
    relus = sum(n.op_type == "Relu" for n in base.graph.node)
    spelled = _spell_out_relus(base)
    out, (res,), _ = prep.apply(spelled, FuseActivations())
    assert res.rewritten == relus == prep.ops(out)["HardSwish"] and "Clip" not in prep.ops(out)
    feed = {spelled.graph.input[0].name: np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    assert prep.relative_error(spelled, out, feed) < 1e-5
