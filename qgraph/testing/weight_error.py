"""Models whose INT8 error comes from weight rounding, for the weight-correction passes (``correct_bias``,
``optimize_rounding``) and their benchmarks.

`depthwise_net`: a depthwise-separable stack whose depthwise channels have magnitudes spread over two decades.
Quantized *per tensor*, the small channels get a handful of codes, and their rounding errors do not average out
over a 3x3 kernel: each channel's output mean shifts (what bias correction removes) and the output error depends
on which way each weight rounds (what adaptive rounding optimizes). Inputs have a non-zero mean, as after a ReLU.

`on_grid_net`: the same topology with every weight already on its per-tensor int8 grid and biases on their int32
grid (nothing for either pass to improve).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ._common import add_initializer, add_node, check_and_return, new_model

__all__ = ["depthwise_feeds", "depthwise_net", "on_grid_net"]


def _weights(rng: np.random.Generator, channels: int, classes: int) -> dict[str, np.ndarray]:
    spread = np.exp(rng.uniform(np.log(0.02), np.log(2.0), channels)).astype(np.float32)
    return {
        "dw1": rng.normal(0, 1, (channels, 1, 3, 3)).astype(np.float32) * spread[:, None, None, None],
        "b_dw1": rng.normal(0, 0.05, channels).astype(np.float32),
        "pw1": rng.normal(0, 0.4, (channels, channels, 1, 1)).astype(np.float32),
        "b_pw1": rng.normal(0, 0.05, channels).astype(np.float32),
        "dw2": rng.normal(0, 1, (channels, 1, 3, 3)).astype(np.float32) * spread[::-1, None, None, None],
        "b_dw2": rng.normal(0, 0.05, channels).astype(np.float32),
        "fc": rng.normal(0, 0.3, (classes, channels)).astype(np.float32),
        "b_fc": rng.normal(0, 0.05, classes).astype(np.float32),
    }


def _build(weights: dict[str, np.ndarray], channels: int, size: int, classes: int, opset: int) -> onnx.ModelProto:
    model = new_model(opset, "depthwise_net", "depthwise-separable stack with spread channel magnitudes")
    g = model.graph
    g.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels, size, size]))
    g.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", classes]))
    for name, value in weights.items():
        add_initializer(g, name, value)
    pads = [1, 1, 1, 1]
    add_node(g, "Conv", ["x", "dw1", "b_dw1"], ["dw1_out"], "dw1", group=channels, pads=pads)
    add_node(g, "Relu", ["dw1_out"], ["r1"], "relu1")
    add_node(g, "Conv", ["r1", "pw1", "b_pw1"], ["pw1_out"], "pw1")
    add_node(g, "Relu", ["pw1_out"], ["r2"], "relu2")
    add_node(g, "Conv", ["r2", "dw2", "b_dw2"], ["dw2_out"], "dw2", group=channels, pads=pads)
    add_node(g, "Relu", ["dw2_out"], ["r3"], "relu3")
    add_node(g, "GlobalAveragePool", ["r3"], ["gap"], "gap")
    add_node(g, "Flatten", ["gap"], ["flat"], "flatten")
    add_node(g, "Gemm", ["flat", "fc", "b_fc"], ["y"], "fc", transB=1)
    return check_and_return(model)


def depthwise_net(seed: int = 0, channels: int = 16, size: int = 12, classes: int = 10,
                  opset: int = 17) -> onnx.ModelProto:
    """The depthwise-separable test model (module docstring)."""
    return _build(_weights(np.random.default_rng(seed), channels, classes), channels, size, classes, opset)


def on_grid_net(seed: int = 0, channels: int = 16, size: int = 12, classes: int = 10,
                opset: int = 17) -> onnx.ModelProto:
    """`depthwise_net` with each weight snapped to its symmetric per-tensor int8 grid (``max|w| / 127``) and each
    bias to zero (so every layer's int32 bias is exact whatever the activation scales)."""
    weights = _weights(np.random.default_rng(seed), channels, classes)
    for name, w in weights.items():
        if name.startswith("b_"):
            weights[name] = np.zeros_like(w)
            continue
        step = np.float32(np.abs(w).max() / 127.0)
        weights[name] = (np.rint(w / step) * step).astype(np.float32)
    return _build(weights, channels, size, classes, opset)


def depthwise_feeds(n: int, seed: int = 0, channels: int = 16, size: int = 12) -> list[dict[str, np.ndarray]]:
    """``n`` single-sample feeds: ``|N(0.5, 1)|`` images (non-negative, non-zero mean)."""
    rng = np.random.default_rng(seed)
    return [{"x": np.abs(rng.normal(0.5, 1.0, (1, channels, size, size))).astype(np.float32)} for _ in range(n)]
