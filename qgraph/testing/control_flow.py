"""Models whose compute sits in ``If`` branches chosen by an input (a sample rate, a mode flag), as voice-activity
and multi-rate audio models are exported."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _branch(name: str, weight: str) -> onnx.GraphProto:
    conv = helper.make_node("Conv", ["x", weight], [f"{name}_c"], pads=[1, 1, 1, 1], name=f"{name}/conv")
    relu = helper.make_node("Relu", [f"{name}_c"], [f"{name}_y"], name=f"{name}/relu")
    return helper.make_graph([conv, relu], name, [], [helper.make_tensor_value_info(f"{name}_y", 1, None)])


def mode_switched_net(seed: int = 0) -> onnx.ModelProto:
    """``y = Conv(If(mode == 1) {Relu(Conv(x, W1))} else {Relu(Conv(x, W2))}, W3)``: the compute sits in branches.
    Inputs ``x`` float [1, 3, 8, 8] and ``mode`` int64 scalar; output ``y`` [1, 4, 8, 8]."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.normal(0, 0.4, s).astype(np.float32), n)
             for n, s in (("w1", (8, 3, 3, 3)), ("w2", (8, 3, 3, 3)), ("w3", (4, 8, 3, 3)))]
    inits.append(numpy_helper.from_array(np.array(1, np.int64), "one"))
    nodes = [
        helper.make_node("Equal", ["mode", "one"], ["is_one"], name="eq"),
        helper.make_node("If", ["is_one"], ["h"], name="switch", then_branch=_branch("then", "w1"),
                         else_branch=_branch("else", "w2")),
        helper.make_node("Conv", ["h", "w3"], ["y"], pads=[1, 1, 1, 1], name="head"),
    ]
    graph = helper.make_graph(nodes, "switched", [
        helper.make_tensor_value_info("x", 1, [1, 3, 8, 8]), helper.make_tensor_value_info("mode", 7, [])],
        [helper.make_tensor_value_info("y", 1, [1, 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def mode_feeds(n: int, mode: int = 1, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """``n`` feeds of `mode_switched_net` (standard normal ``x``) with ``mode`` fixed."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32), "mode": np.array(mode, np.int64)}
            for _ in range(n)]


__all__ = ["mode_feeds", "mode_switched_net"]
