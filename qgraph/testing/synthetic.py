"""Synthetic CNN/MLP graphs built directly as protobuf, fast enough for 100k-node scaling tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.testing._common import add_initializer, add_node, new_model

# Conv/MatMul weights in the long chains use std = sqrt(_CHAIN_GAIN / fan_in): a little below He-init so
# that the expected gain per block is < 1 and the biases keep activations alive; chains of any depth
# therefore stay finite and O(0.1 .. 1) instead of drifting like a random walk.
_CHAIN_GAIN = 1.5


def _bn_params(rng: np.random.Generator, count: int, channels: int) -> np.ndarray:
    """``(count, 4, channels)`` BN parameters.

    scale ~ U(0.5, 1.5), bias ~ N(0, 0.1), mean ~ N(0, 0.1), var ~ U(0.5, 1.5).
    """
    params = np.empty((count, 4, channels), dtype=np.float32)
    params[:, 0] = rng.uniform(0.5, 1.5, size=(count, channels))
    params[:, 1] = rng.normal(0.0, 0.1, size=(count, channels))
    params[:, 2] = rng.normal(0.0, 0.1, size=(count, channels))
    params[:, 3] = rng.uniform(0.5, 1.5, size=(count, channels))
    return params


def conv_bn_relu_chain(
    n_blocks: int,
    channels: int = 8,
    spatial: int = 8,
    opset: int = 13,
    *,
    seed: int = 0,
    conv_bias: bool = False,
) -> onnx.ModelProto:
    """Build a chain of ``n_blocks`` Conv(3x3, pad 1) → BatchNormalization → Relu blocks (3 nodes per block).

    Input ``input`` and output ``output`` are ``[1, channels, spatial, spatial]``. Block ``i`` has nodes
    ``block{i}/conv``, ``block{i}/bn``, ``block{i}/relu`` and its own seeded weights
    (``block{i}/conv.weight``, ``block{i}/bn.scale`` ...). Conv weights ~ N(0, 1.5 / fan_in); BN scale ~
    U(0.5, 1.5), bias ~ N(0, 0.1), mean ~ N(0, 0.1), var ~ U(0.5, 1.5). Built in linear time: 33,334
    blocks (100,002 nodes) take about 2 s.
    """
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    rng = np.random.default_rng(seed)
    fan_in = channels * 9
    weights = rng.standard_normal((n_blocks, channels, channels, 3, 3), dtype=np.float32)
    weights *= np.float32(np.sqrt(_CHAIN_GAIN / fan_in))
    bn = _bn_params(rng, n_blocks, channels)
    biases = rng.normal(0.0, 0.02, size=(n_blocks, channels)).astype(np.float32) if conv_bias else None

    model = new_model(opset, f"conv_bn_relu_chain_{n_blocks}")
    graph = model.graph
    shape = [1, channels, spatial, spatial]
    graph.input.append(helper.make_tensor_value_info("input", TensorProto.FLOAT, shape))
    graph.output.append(helper.make_tensor_value_info("output", TensorProto.FLOAT, shape))
    conv_attrs = [
        helper.make_attribute("kernel_shape", [3, 3]),
        helper.make_attribute("pads", [1, 1, 1, 1]),
        helper.make_attribute("strides", [1, 1]),
    ]
    bn_attrs = [helper.make_attribute("epsilon", 1e-5)]
    previous = "input"
    for i in range(n_blocks):
        prefix = f"block{i}"
        conv_inputs = [previous, f"{prefix}/conv.weight"]
        add_initializer(graph, f"{prefix}/conv.weight", weights[i])
        if biases is not None:
            conv_inputs.append(f"{prefix}/conv.bias")
            add_initializer(graph, f"{prefix}/conv.bias", biases[i])
        conv = add_node(graph, "Conv", conv_inputs, [f"{prefix}/conv_out"], f"{prefix}/conv")
        conv.attribute.extend(conv_attrs)
        bn_names = [f"{prefix}/bn.{p}" for p in ("scale", "bias", "mean", "var")]
        for j, bn_name in enumerate(bn_names):
            add_initializer(graph, bn_name, bn[i, j])
        norm = add_node(
            graph,
            "BatchNormalization",
            [f"{prefix}/conv_out", *bn_names],
            [f"{prefix}/bn_out"],
            f"{prefix}/bn",
        )
        norm.attribute.extend(bn_attrs)
        out = "output" if i == n_blocks - 1 else f"{prefix}/relu_out"
        add_node(graph, "Relu", [f"{prefix}/bn_out"], [out], f"{prefix}/relu")
        previous = out
    return model


def matmul_add_relu_chain(
    n_layers: int,
    width: int = 16,
    opset: int = 13,
    *,
    seed: int = 0,
    batch: int | str = 1,
) -> onnx.ModelProto:
    """Build a chain of ``n_layers`` MatMul → Add(bias) → Relu layers (1000 layers = 3000 nodes).

    Input ``input`` and output ``output`` are ``[batch, width]`` (``batch`` may be a symbolic name).
    Layer ``i`` has nodes ``layer{i}/matmul``, ``layer{i}/add``, ``layer{i}/relu`` and weights
    ``layer{i}/weight`` ~ N(0, 1.5 / width), ``layer{i}/bias`` ~ N(0, 0.2).
    """
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n_layers, width, width), dtype=np.float32)
    weights *= np.float32(np.sqrt(_CHAIN_GAIN / width))
    biases = rng.normal(0.0, 0.2, size=(n_layers, width)).astype(np.float32)

    model = new_model(opset, f"matmul_add_relu_chain_{n_layers}")
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, width]))
    graph.output.append(helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, width]))
    previous = "input"
    for i in range(n_layers):
        prefix = f"layer{i}"
        add_initializer(graph, f"{prefix}/weight", weights[i])
        add_initializer(graph, f"{prefix}/bias", biases[i])
        add_node(graph, "MatMul", [previous, f"{prefix}/weight"], [f"{prefix}/matmul_out"], f"{prefix}/matmul")
        add_node(graph, "Add", [f"{prefix}/matmul_out", f"{prefix}/bias"], [f"{prefix}/add_out"], f"{prefix}/add")
        out = "output" if i == n_layers - 1 else f"{prefix}/relu_out"
        add_node(graph, "Relu", [f"{prefix}/add_out"], [out], f"{prefix}/relu")
        previous = out
    return model


class _NetBuilder:
    """Tiny helper that appends Conv/BN/... nodes with He-initialised, seeded weights."""

    def __init__(self, model: onnx.ModelProto, seed: int) -> None:
        self.graph = model.graph
        self.rng = np.random.default_rng(seed)

    def conv(self, name: str, x: str, c_in: int, c_out: int, stride: int = 1, bias: bool = False) -> str:
        weight = self.rng.standard_normal((c_out, c_in, 3, 3), dtype=np.float32)
        weight *= np.float32(np.sqrt(2.0 / (c_in * 9)))
        add_initializer(self.graph, f"{name}.weight", weight)
        inputs = [x, f"{name}.weight"]
        if bias:
            add_initializer(self.graph, f"{name}.bias", self.rng.normal(0, 0.02, c_out).astype(np.float32))
            inputs.append(f"{name}.bias")
        add_node(
            self.graph,
            "Conv",
            inputs,
            [f"{name}_out"],
            name,
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[stride, stride],
        )
        return f"{name}_out"

    def bn(self, name: str, x: str, channels: int) -> str:
        params = _bn_params(self.rng, 1, channels)[0]
        names = [f"{name}.{p}" for p in ("scale", "bias", "mean", "var")]
        for array, tensor_name in zip(params, names, strict=True):
            add_initializer(self.graph, tensor_name, array)
        add_node(self.graph, "BatchNormalization", [x, *names], [f"{name}_out"], name, epsilon=1e-5, momentum=0.9)
        return f"{name}_out"

    def op(self, op_type: str, name: str, inputs: list[str], **attrs: object) -> str:
        add_node(self.graph, op_type, inputs, [f"{name}_out"], name, **attrs)
        return f"{name}_out"


def conv_bn_net(opset: int = 17, *, seed: int = 0, batch: int | str = 1, classes: int = 10) -> onnx.ModelProto:
    """Build a small Conv-BN-Relu CNN for opset-lowering and BN-folding tests (17 nodes).

    ``input [batch, 3, 32, 32]`` → stem Conv(bias)-BN-Relu → MaxPool → residual block (Conv-BN-Relu-Conv-BN,
    Add with the MaxPool output, Relu) → strided Conv-BN-Relu → GlobalAveragePool → Flatten → Gemm →
    ``logits [batch, classes]``. Uses only ops that exist (with these semantics) from opset 9 on.
    """
    model = new_model(opset, "conv_bn_net")
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, 32, 32]))
    graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes]))
    net = _NetBuilder(model, seed)
    x = net.conv("stem/conv", "input", 3, 16, bias=True)
    x = net.op("Relu", "stem/relu", [net.bn("stem/bn", x, 16)])
    pooled = net.op("MaxPool", "stem/pool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = net.conv("res/conv1", pooled, 16, 16)
    x = net.op("Relu", "res/relu1", [net.bn("res/bn1", x, 16)])
    x = net.bn("res/bn2", net.conv("res/conv2", x, 16, 16), 16)
    x = net.op("Relu", "res/relu2", [net.op("Add", "res/add", [x, pooled])])
    x = net.conv("down/conv", x, 16, 32, stride=2)
    x = net.op("Relu", "down/relu", [net.bn("down/bn", x, 32)])
    x = net.op("Flatten", "head/flatten", [net.op("GlobalAveragePool", "head/gap", [x])], axis=1)
    weight = net.rng.standard_normal((classes, 32), dtype=np.float32) * np.float32(np.sqrt(2.0 / 32))
    add_initializer(graph, "head/fc.weight", weight)
    add_initializer(graph, "head/fc.bias", net.rng.normal(0, 0.02, classes).astype(np.float32))
    add_node(graph, "Gemm", [x, "head/fc.weight", "head/fc.bias"], ["logits"], "head/fc", transB=1)
    return model


def fragile_resnet(
    blocks: int = 140,
    channels: int = 8,
    spatial: int = 16,
    opset: int = 13,
    *,
    fragile: dict[int, float] | None = None,
    seed: int = 0,
) -> onnx.ModelProto:
    """A residual CNN with planted fragile layers, for sensitivity and automatic-fallback tests.

    ``stem`` Conv → ``blocks`` × [``b{i}/conv1`` 3x3 → Relu → ``b{i}/conv2`` 3x3 → Add (residual) → Relu]
    (5 nodes per block) → two heads: ``logits`` (GlobalAveragePool → Flatten → Gemm) and ``features`` (the
    stream after the middle block, a second output as in multi-head detectors). ``fragile`` maps a block index
    to a factor ``k``: channel 0 of that block's conv1 is scaled by ``k`` and conv2's weights reading it by
    ``1/k``, so the float function is unchanged but the tensor between them holds one outlier channel ``k``
    times larger than the rest; a per-tensor activation pair then quantizes the other channels coarsely and
    ``b{i}/conv2`` carries a large local error (larger ``k``, larger error).
    Inputs ``input [batch, channels, spatial, spatial]`` with a dynamic batch.
    """
    rng = np.random.default_rng(seed)
    fragile = fragile or {}
    model = new_model(opset, f"fragile_resnet_{blocks}")
    g = model.graph
    shape: list[int | str] = ["batch", channels, spatial, spatial]
    g.input.append(helper.make_tensor_value_info("input", TensorProto.FLOAT, shape))
    g.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10]))
    g.output.append(helper.make_tensor_value_info("features", TensorProto.FLOAT, shape))
    std = float(np.sqrt(_CHAIN_GAIN / (channels * 9)))
    pads = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}

    def conv(name: str, x: str, gain: float, scale_out: float = 1.0, scale_in: float = 1.0) -> str:
        w = (rng.standard_normal((channels, channels, 3, 3)) * std * gain).astype(np.float32)
        b = rng.normal(0.0, 0.05, channels).astype(np.float32)
        if scale_out != 1.0:  # an outlier channel that is active (positive) on most inputs
            w[0] *= scale_out
            b[0] = 0.5 * scale_out
        w[:, 0] *= scale_in
        add_initializer(g, f"{name}.weight", w)
        add_initializer(g, f"{name}.bias", b)
        add_node(g, "Conv", [x, f"{name}.weight", f"{name}.bias"], [f"{name}_out"], name, **pads)
        return f"{name}_out"

    x = conv("stem", "input", 1.0)
    for i in range(blocks):
        k = float(fragile.get(i, 1.0))
        h = conv(f"b{i}/conv1", x, 1.0, scale_out=k)
        add_node(g, "Relu", [h], [f"b{i}/relu1_out"], f"b{i}/relu1")
        h = conv(f"b{i}/conv2", f"b{i}/relu1_out", 0.3, scale_in=1.0 / k)
        add_node(g, "Add", [x, h], [f"b{i}/add_out"], f"b{i}/add")
        out = "features" if i == blocks // 2 else f"b{i}/out"
        add_node(g, "Relu", [f"b{i}/add_out"], [out], f"b{i}/relu2")
        if i == blocks // 2:  # a graph output that is also read further on
            add_node(g, "Identity", [out], [f"b{i}/out"], f"b{i}/tap")
            out = f"b{i}/out"
        x = out
    add_node(g, "GlobalAveragePool", [x], ["pooled"], "head/pool")
    add_node(g, "Flatten", ["pooled"], ["flat"], "head/flatten")
    add_initializer(g, "head.weight", (rng.standard_normal((10, channels)) * 0.5).astype(np.float32))
    add_initializer(g, "head.bias", np.zeros(10, np.float32))
    add_node(g, "Gemm", ["flat", "head.weight", "head.bias"], ["logits"], "head/fc", transB=1)
    return model


def offset_conv_bn_chain(
    blocks: int = 4, channels: int = 32, spatial: int = 24, offset: float = 100.0, *, seed: int = 0, opset: int = 17
) -> onnx.ModelProto:
    """A chain whose float32 results are noisy under any reordering: its ``--verify`` noise floor is ~6e-5.

    Each block is ``Add(+offset) -> Conv 3x3 (no padding) -> BatchNormalization -> Relu``; the BN mean cancels
    the offset's contribution (``mean_c = offset * sum(W_c)``), so every Conv output is ~``offset * |sum W_c|``
    large while the block output is O(1): float32 rounding of the large sums (~1e-7 of them) survives the
    cancellation as ~1e-5..1e-4 relative error, as in a real detector's deep layers. ``x [1, channels, spatial,
    spatial]`` -> ``y [1, channels, spatial - 2 blocks, ...]``. With the defaults onnxruntime's own graph
    optimizations move ``y`` by 6.1e-5 relative (onnxruntime 1.31, x86).
    """
    rng = np.random.default_rng(seed)
    model = new_model(opset, "offset_conv_bn_chain")
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, spatial, spatial]))
    previous = "x"
    for i in range(blocks):
        weight = (rng.standard_normal((channels, channels, 3, 3)) * np.sqrt(2.0 / (channels * 9))).astype(np.float32)
        add_initializer(graph, f"b{i}/offset", np.array(offset, np.float32))
        add_node(graph, "Add", [previous, f"b{i}/offset"], [f"b{i}/shifted"], f"b{i}/shift")
        add_initializer(graph, f"b{i}/conv.weight", weight)
        add_node(graph, "Conv", [f"b{i}/shifted", f"b{i}/conv.weight"], [f"b{i}/conv_out"], f"b{i}/conv",
                 kernel_shape=[3, 3])
        bn = _bn_params(rng, 1, channels)[0]
        bn[2] = offset * weight.sum(axis=(1, 2, 3))  # the mean cancels the offset
        names = [f"b{i}/bn.{p}" for p in ("scale", "bias", "mean", "var")]
        for array, name in zip(bn, names, strict=True):
            add_initializer(graph, name, np.ascontiguousarray(array))
        add_node(graph, "BatchNormalization", [f"b{i}/conv_out", *names], [f"b{i}/bn_out"], f"b{i}/bn", epsilon=1e-5)
        previous = "y" if i == blocks - 1 else f"b{i}/relu_out"
        add_node(graph, "Relu", [f"b{i}/bn_out"], [previous], f"b{i}/relu")
        spatial -= 2
    graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, spatial, spatial]))
    return model
