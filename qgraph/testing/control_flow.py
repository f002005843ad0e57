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


def level_switched_net(seed: int = 0) -> onnx.ModelProto:
    """A model whose output needs a narrower activation range than the tensor-optimal one, inside
    ``If(mode == 1)``: ``y = Tanh(Conv1d(Relu(Conv1d(x, W1, b1)), W2, b2))`` where channel 0 of the hidden
    tensor ``h`` is 50x louder than the others but W2 reads it at 1/100: its values set ``h``'s range (and
    dominate ``h``'s own quantization error) yet barely reach ``y``, while the other channels get few levels.
    Inputs ``x`` [1, 4, 32] (`level_feeds`) and ``mode``; output ``y`` [1, 8, 32]."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 0.5, (16, 4, 3)).astype(np.float32)
    w2 = rng.normal(0, 0.25, (8, 16, 3)).astype(np.float32)
    w1[0] *= 50
    w2[:, 0] /= 100
    nodes = [helper.make_node("Conv", ["x", "lw1", "lb1"], ["c1"], pads=[1, 1], name="then/conv1"),
             helper.make_node("Relu", ["c1"], ["h"], name="then/relu"),
             helper.make_node("Conv", ["h", "lw2", "lb2"], ["c2"], pads=[1, 1], name="then/conv2"),
             helper.make_node("Tanh", ["c2"], ["y_then"], name="then/tanh")]
    then = helper.make_graph(nodes, "then", [], [helper.make_tensor_value_info("y_then", 1, None)])
    other = helper.make_graph([helper.make_node("Tanh", ["x8"], ["y_else"], name="else/tanh")], "else", [],
                              [helper.make_tensor_value_info("y_else", 1, None)])
    graph = helper.make_graph(
        [helper.make_node("Equal", ["mode", "one"], ["is_one"], name="eq"),
         helper.make_node("Tile", ["x", "two"], ["x8"], name="tile"),
         helper.make_node("If", ["is_one"], ["y"], name="switch", then_branch=then, else_branch=other)],
        "levels", [helper.make_tensor_value_info("x", 1, [1, 4, 32]), helper.make_tensor_value_info("mode", 7, [])],
        [helper.make_tensor_value_info("y", 1, [1, 8, 32])],
        [numpy_helper.from_array(w1, "lw1"), numpy_helper.from_array(w2, "lw2"),
         numpy_helper.from_array(rng.normal(0, 0.1, 16).astype(np.float32), "lb1"),
         numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "lb2"),
         numpy_helper.from_array(np.array(1, np.int64), "one"),
         numpy_helper.from_array(np.array([1, 2, 1], np.int64), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def level_feeds(n: int, seed: int = 1, mode: int = 1) -> list[dict[str, np.ndarray]]:
    """``n`` feeds of `level_switched_net` (standard normal ``x``)."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 4, 32)).astype(np.float32), "mode": np.array(mode, np.int64)}
            for _ in range(n)]


#: Iterations of `loop_net`'s Loop.
LOOP_TRIPS = 3


def loop_net() -> onnx.ModelProto:
    """``h <- Relu(h @ W + b)`` three times in a Loop (``W``, ``b`` outer initializers), then a MatMul head outside.
    Input ``x`` float [1, 16]; output ``y`` [1, 4]."""
    rng = np.random.default_rng(0)
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "w"], ["mm"], name="body/matmul"),
         helper.make_node("Add", ["mm", "b"], ["pre"], name="body/add"),
         helper.make_node("Relu", ["pre"], ["h_out"], name="body/relu"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body/cond")],
        "body",
        [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", onnx.TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", onnx.TensorProto.FLOAT, [1, 16])])
    inits = [numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.35).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "b"),
             numpy_helper.from_array((rng.standard_normal((16, 4)) * 0.3).astype(np.float32), "head_w"),
             numpy_helper.from_array(np.array(LOOP_TRIPS, np.int64), "trips"),
             numpy_helper.from_array(np.array(True), "yes")]
    nodes = [helper.make_node("Loop", ["trips", "yes", "x"], ["h"], body=body, name="loop"),
             helper.make_node("MatMul", ["h", "head_w"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "looped", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def nested_switched_net(seed: int = 0) -> onnx.ModelProto:
    """An If inside an If branch: ``y = If(mode) {h = Relu(Conv(x, W1)); If(deep) {Conv(h, W2)} else {Relu(h)}}
    else {Conv(x, W3)}``. Inputs ``x`` float [1, 3, 8, 8], ``mode`` and ``deep`` bool scalars (`nested_feeds`);
    output ``y`` [1, 8, 8, 8]."""
    rng = np.random.default_rng(seed)

    def out(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)

    inner_then = helper.make_graph([helper.make_node("Conv", ["h1", "nw2"], ["c2"], pads=[1, 1, 1, 1],
                                                     name="inner/conv")], "inner_then", [], [out("c2")])
    inner_else = helper.make_graph([helper.make_node("Relu", ["h1"], ["r2"], name="inner/relu")], "inner_else", [],
                                   [out("r2")])
    outer_then = helper.make_graph([
        helper.make_node("Conv", ["x", "nw1"], ["c1"], pads=[1, 1, 1, 1], name="outer/conv"),
        helper.make_node("Relu", ["c1"], ["h1"], name="outer/relu"),
        helper.make_node("If", ["deep"], ["d"], name="inner", then_branch=inner_then, else_branch=inner_else)],
        "outer_then", [], [out("d")])
    outer_else = helper.make_graph([helper.make_node("Conv", ["x", "nw3"], ["c3"], pads=[1, 1, 1, 1],
                                                     name="else/conv")], "outer_else", [], [out("c3")])
    inits = [numpy_helper.from_array(rng.normal(0, 0.4, s).astype(np.float32), n)
             for n, s in (("nw1", (8, 3, 3, 3)), ("nw2", (8, 8, 3, 3)), ("nw3", (8, 3, 3, 3)))]
    graph = helper.make_graph(
        [helper.make_node("If", ["mode"], ["y"], name="outer", then_branch=outer_then, else_branch=outer_else)],
        "nested", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8]),
                   helper.make_tensor_value_info("mode", onnx.TensorProto.BOOL, []),
                   helper.make_tensor_value_info("deep", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def nested_feeds(n: int, mode: bool = True, deep: bool = True, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """``n`` feeds of `nested_switched_net` (standard normal ``x``) with both conditions fixed."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32), "mode": np.array(mode),
             "deep": np.array(deep)} for _ in range(n)]


__all__ = ["LOOP_TRIPS", "level_feeds", "level_switched_net", "loop_net", "mode_feeds", "mode_switched_net",
           "nested_feeds", "nested_switched_net"]
