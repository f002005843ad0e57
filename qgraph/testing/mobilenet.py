"""A MobileNetV2-style CNN with the real op pattern of torchvision's export (depthwise separable inverted residuals).

Per block (expansion ``t``, output channels ``c``, stride ``s``): ``Conv 1x1 (c_in -> t c_in) -> BN -> Clip(0, 6)
-> Conv 3x3 depthwise (group = t c_in, stride s) -> BN -> Clip(0, 6) -> Conv 1x1 (-> c) -> BN`` plus ``Add`` of the
block input when ``s == 1`` and ``c_in == c`` (the first block of the network has ``t == 1``: no expansion conv).
Stem ``Conv 3x3/2 -> BN -> Clip``, head ``Conv 1x1 -> BN -> Clip -> GlobalAveragePool -> Flatten -> Gemm``.
Weights are He-initialised (``std = sqrt(2 / fan_in)``, seeded); BatchNormalization statistics are seeded
near identity (``scale ~ U(0.5, 1.5)``, ``var ~ U(0.5, 1.5)``), so activations stay O(1) through the net.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.testing._common import add_initializer, add_node, check_and_return, new_model

#: torchvision's MobileNetV2 settings (t, c, n, s), width 1.0.
_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


class _Builder:
    def __init__(self, model: onnx.ModelProto, seed: int) -> None:
        self.g = model.graph
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def conv_bn(self, x: str, c_in: int, c_out: int, k: int, stride: int, group: int, clip: bool) -> str:
        """Conv (no bias, like torchvision) -> BatchNormalization [-> Clip(0, 6)]; returns the output name."""
        self.count += 1
        name = f"conv{self.count}"
        fan_in = (c_in // group) * k * k
        w = self.rng.standard_normal((c_out, c_in // group, k, k)).astype(np.float32) * np.float32(np.sqrt(2 / fan_in))
        add_initializer(self.g, f"{name}.weight", w)
        pad = k // 2
        add_node(self.g, "Conv", [x, f"{name}.weight"], [f"{name}_out"], name, kernel_shape=[k, k],
                 pads=[pad] * 4, strides=[stride, stride], group=group)
        stats = [self.rng.uniform(0.5, 1.5, c_out), self.rng.normal(0, 0.1, c_out), self.rng.normal(0, 0.1, c_out),
                 self.rng.uniform(0.5, 1.5, c_out)]
        names = [f"{name}.bn.{p}" for p in ("scale", "bias", "mean", "var")]
        for array, n in zip(stats, names, strict=True):
            add_initializer(self.g, n, array.astype(np.float32))
        add_node(self.g, "BatchNormalization", [f"{name}_out", *names], [f"{name}_bn"], f"{name}_bn", epsilon=1e-5)
        if not clip:
            return f"{name}_bn"
        add_node(self.g, "Clip", [f"{name}_bn", "relu6.min", "relu6.max"], [f"{name}_relu6"], f"{name}_relu6")
        return f"{name}_relu6"


def mobilenet_v2(*, seed: int = 0, width: float = 1.0, resolution: int = 224, classes: int = 1000) -> onnx.ModelProto:
    """Build a MobileNetV2-style model (opset 13, input ``[1, 3, resolution, resolution]``, see module docs);
    ``width`` scales every channel count (rounded to a multiple of 8, as torchvision does)."""
    model = new_model(13, "mobilenet_v2", "MobileNetV2-style inverted residuals (qgraph.testing.mobilenet)")
    b = _Builder(model, seed)
    g = model.graph
    g.input.append(helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, resolution, resolution]))
    add_initializer(g, "relu6.min", np.array(0.0, np.float32))
    add_initializer(g, "relu6.max", np.array(6.0, np.float32))

    def ch(c: int) -> int:
        return max(8, int(c * width + 4) // 8 * 8)

    c_in = ch(32)
    x = b.conv_bn("input", 3, c_in, 3, 2, 1, True)
    for t, c, n, s in _SETTINGS:
        c_out = ch(c)
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = c_in * t
            y = x if t == 1 else b.conv_bn(x, c_in, hidden, 1, 1, 1, True)
            y = b.conv_bn(y, hidden, hidden, 3, stride, hidden, True)
            y = b.conv_bn(y, hidden, c_out, 1, 1, 1, False)
            if stride == 1 and c_in == c_out:
                add_node(g, "Add", [x, y], [f"{y}_add"], f"{y}_add")
                y = f"{y}_add"
            x, c_in = y, c_out
    last = ch(1280) if width > 1.0 else 1280
    x = b.conv_bn(x, c_in, last, 1, 1, 1, True)
    add_node(g, "GlobalAveragePool", [x], ["pool"], "pool")
    add_node(g, "Flatten", ["pool"], ["flat"], "flatten", axis=1)
    fc = b.rng.standard_normal((classes, last)).astype(np.float32) * np.float32(np.sqrt(1 / last))
    add_initializer(g, "fc.weight", fc)
    add_initializer(g, "fc.bias", np.zeros(classes, np.float32))
    add_node(g, "Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], "fc", transB=1)
    g.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes]))
    return check_and_return(model)
