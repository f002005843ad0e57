"""A MobileNet-style depthwise-separable CNN with BatchNorm whose folded channel ranges differ widely."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.testing._common import add_initializer, add_node, new_model


class _Builder:
    def __init__(self, model: onnx.ModelProto, seed: int, spread: float) -> None:
        self.graph = model.graph
        self.rng = np.random.default_rng(seed)
        self.spread = spread

    def conv(self, name: str, x: str, c_in: int, c_out: int, k: int, stride: int = 1, group: int = 1) -> str:
        fan_in = c_in // group * k * k
        w = self.rng.standard_normal((c_out, c_in // group, k, k), dtype=np.float32) * np.float32(np.sqrt(2 / fan_in))
        add_initializer(self.graph, f"{name}.weight", w)
        pad = k // 2
        add_node(self.graph, "Conv", [x, f"{name}.weight"], [f"{name}_out"], name, kernel_shape=[k, k],
                 pads=[pad] * 4, strides=[stride, stride], group=group)
        return f"{name}_out"

    def bn(self, name: str, x: str, c: int) -> str:
        # Log-uniform gammas over `spread`: after folding, channel ranges differ by about that factor, as in
        # trained depthwise nets (Nagel et al. 2019, fig. 2).
        gamma = np.exp(self.rng.uniform(-0.5, 0.5, c) * np.log(self.spread)).astype(np.float32)
        beta = self.rng.normal(0.1, 0.1, c).astype(np.float32)
        mean = self.rng.normal(0.0, 0.1, c).astype(np.float32)
        var = self.rng.uniform(0.5, 1.5, c).astype(np.float32)
        names = [f"{name}.{p}" for p in ("scale", "bias", "mean", "var")]
        for array, n in zip((gamma, beta, mean, var), names, strict=True):
            add_initializer(self.graph, n, array)
        add_node(self.graph, "BatchNormalization", [x, *names], [f"{name}_out"], name, epsilon=1e-5)
        return f"{name}_out"

    def act(self, name: str, x: str, op: str) -> str:
        if op == "Relu6":
            add_node(self.graph, "Clip", [x, "const/zero", "const/six"], [f"{name}_out"], name)
        else:
            add_node(self.graph, op, [x], [f"{name}_out"], name)
        return f"{name}_out"


def depthwise_net(
    *, seed: int = 0, spread: float = 100.0, width: int = 16, size: int = 32, activation: str = "Relu",
    classes: int = 10, batch: int | str = 1,
) -> onnx.ModelProto:
    """Stem Conv-BN-act → 2 depthwise-separable blocks (3x3 depthwise Conv-BN-act, 1x1 Conv-BN-act, the second
    strided) → GlobalAveragePool → Flatten → Gemm, opset 13, input ``[batch, 3, size, size]``.

    BN gammas are log-uniform over a factor ``spread`` (100: channel ranges differ ~100x after folding);
    ``activation`` is ``Relu``, ``Relu6`` (Clip 0..6) or ``HardSwish`` (opset 14 then).
    """
    opset = 14 if activation == "HardSwish" else 13
    model = new_model(opset, "depthwise_net")
    g = model.graph
    g.input.append(helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, size, size]))
    g.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes]))
    add_initializer(g, "const/zero", np.array(0.0, np.float32))
    add_initializer(g, "const/six", np.array(6.0, np.float32))
    b = _Builder(model, seed, spread)
    x = b.act("stem/act", b.bn("stem/bn", b.conv("stem/conv", "input", 3, width, 3, stride=2), width), activation)
    c = width
    for i, (c_out, stride) in enumerate(((2 * width, 1), (4 * width, 2))):
        x = b.act(f"b{i}/dw_act", b.bn(f"b{i}/dw_bn", b.conv(f"b{i}/dw", x, c, c, 3, stride, group=c), c), activation)
        x = b.act(f"b{i}/pw_act", b.bn(f"b{i}/pw_bn", b.conv(f"b{i}/pw", x, c, c_out, 1), c_out), activation)
        c = c_out
    add_node(g, "GlobalAveragePool", [x], ["head/gap_out"], "head/gap")
    add_node(g, "Flatten", ["head/gap_out"], ["head/flat_out"], "head/flatten", axis=1)
    w = b.rng.standard_normal((classes, c), dtype=np.float32) * np.float32(np.sqrt(2 / c))
    add_initializer(g, "head/fc.weight", w)
    add_initializer(g, "head/fc.bias", b.rng.normal(0, 0.02, classes).astype(np.float32))
    add_node(g, "Gemm", ["head/flat_out", "head/fc.weight", "head/fc.bias"], ["logits"], "head/fc", transB=1)
    return model


def depthwise_feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``n`` seeded standard-normal inputs ``(1, 3, 32, 32)`` for `depthwise_net`."""
    rng = np.random.default_rng(seed)
    return [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(n)]


def depthwise_float_and_qdq(seed: int = 0, spread: float = 100.0, preset: str = "ort-x86-vnni"
                            ) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(float with BatchNorm folded, its QDQ model from ``insert_qdq`` with ``preset``) of `depthwise_net`,
    calibrated on 8 `depthwise_feeds` (seed 1): the pair mixed-precision and fallback tests start from."""
    from qgraph import Pipeline, get_pass
    from qgraph.data import CallableSource

    model = depthwise_net(seed=seed, spread=spread)
    fuse = get_pass("fuse_batchnorm")
    floats = Pipeline([fuse()]).run(model).model
    cal = depthwise_feeds(8, 1)
    qdq = Pipeline([fuse(), get_pass("insert_qdq")(preset=preset)]).run(
        model, calibration_data=CallableSource(lambda: cal, "calibration")).model
    return floats, qdq
