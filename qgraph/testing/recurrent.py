"""A state-carrying model whose quantization error grows through its state (streamed use), and its data."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

#: The feedback of `leaky_state_net`: model input -> the output that feeds it at the next step.
LEAKY_STATE = {"s": "s_next"}


def leaky_state_net(seed: int = 0, leak: float = 0.95) -> onnx.ModelProto:
    """``h = Relu(x W1 + b1)``, ``s_next = leak · s + h Ws``, ``y = h Wy + s_next Wr``: a leaky integrator.

    Channel 0 of the hidden ``h`` is 40x louder than the others and always on: it sets ``h``'s range. ``y`` reads
    it at 1/100 directly, but the state integrates it (``Ws`` reads only channel 0). Narrowing ``h``'s range
    clips channel 0, an error of one sign every step: per step (the state as the data gives it) it is small next
    to the finer steps the other channels get, while streamed (the model's own state) it accumulates about
    ``1 / (1 - leak)`` times. Inputs ``x`` [1, 4], ``s`` [1, 8]; outputs ``y`` [1, 8], ``s_next`` [1, 8]."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 0.5, (4, 16)).astype(np.float32)
    b1 = np.abs(rng.normal(0, 0.2, 16)).astype(np.float32)
    w1[:, 0] *= 0.2  # channel 0: large and steady (its bias), so clipping it is a consistent error
    b1[0] = 40.0
    ws = np.zeros((16, 8), np.float32)
    ws[0] = rng.normal(0, 0.001, 8)
    wy = rng.normal(0, 0.5, (16, 8)).astype(np.float32)
    wy[0] /= 100
    wr = rng.normal(0, 0.5, (8, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["xw"], name="fc1"),
             helper.make_node("Add", ["xw", "b1"], ["pre"], name="fc1/bias"),
             helper.make_node("Relu", ["pre"], ["h"], name="relu"),
             helper.make_node("MatMul", ["h", "ws"], ["hs"], name="state_in"),
             helper.make_node("Mul", ["s", "leak"], ["kept"], name="leak"),
             helper.make_node("Add", ["kept", "hs"], ["s_next"], name="integrate"),
             helper.make_node("MatMul", ["h", "wy"], ["hy"], name="read_h"),
             helper.make_node("MatMul", ["s_next", "wr"], ["sy"], name="read_s"),
             helper.make_node("Add", ["hy", "sy"], ["y"], name="out")]
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("w1", w1), ("b1", b1), ("ws", ws), ("wy", wy), ("wr", wr), ("leak", np.array(leak, np.float32)))]
    graph = helper.make_graph(
        nodes, "leaky_state",
        [helper.make_tensor_value_info("x", 1, [1, 4]), helper.make_tensor_value_info("s", 1, [1, 8])],
        [helper.make_tensor_value_info("y", 1, [1, 8]), helper.make_tensor_value_info("s_next", 1, [1, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def leaky_feeds(sequences: int, length: int, seed: int = 1, model: onnx.ModelProto | None = None
                ) -> list[dict[str, np.ndarray]]:
    """``sequences`` x ``length`` feeds of `leaky_state_net` in order, the state recorded by streaming the float
    model (onnxruntime) from zeros at each sequence start, as a recurrent model's calibration data is recorded."""
    import onnxruntime as ort

    session = ort.InferenceSession((model or leaky_state_net()).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds: list[dict[str, np.ndarray]] = []
    for _ in range(sequences):
        state = np.zeros((1, 8), np.float32)
        for _ in range(length):
            x = rng.standard_normal((1, 4)).astype(np.float32)
            feeds.append({"x": x, "s": state})
            state = session.run(["s_next"], {"x": x, "s": state})[0]
    return feeds


__all__ = ["LEAKY_STATE", "leaky_feeds", "leaky_state_net"]
