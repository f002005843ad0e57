"""Real architecture graphs from the onnx wheel, with realistic seeded weights.

The onnx wheel ships ``onnx/backend/test/data/light/light_<name>.onnx``: the topologies of classic CNNs
whose weights are ``ConstantOfShape`` fills (every weight 0.02, sometimes followed by ``Unsqueeze``).
:func:`materialize_light_model` folds those constant subgraphs into initializers and fills every float
weight with seeded random values of realistic scale, keeping every compute node (BatchNormalization stays
BatchNormalization, Dropout stays Dropout).

BatchNormalization statistics are set relative to the statistics the layer actually sees on a seeded
N(0, 1) input (``mean = mu + N(0, 0.1) * sigma``, ``var = sigma**2 * U(0.5, 1.5)``), as in a trained
network whose running statistics roughly match its data. That keeps activations O(1) through 100+ layers
while the parameters stay far from identity, so BN-folding bugs show up numerically. Conv/Gemm layers
whose output RMS leaves [0.5, 2] on that input are rescaled to the nearest bound (LSUV-style), so plain
He-initialised stacks (VGG, Inception v1) neither drift nor saturate their final Softmax.

The result is a deterministic function of ``(name, seed)`` on a given machine (the calibration pass runs
single-threaded); another CPU's kernels may differ in the last bits of a few statistics.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qgraph.graph.opsets import model_opset
from qgraph.testing._common import add_initializer, ir_version_for_opset, rng_for
from qgraph.testing.runtime import make_session

LIGHT_MODEL_NAMES: tuple[str, ...] = (
    "bvlc_alexnet",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "resnet50",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "zfnet512",
)

_BN_MEAN_STD = 0.1
_BIAS_STD = 0.02
_STAT_FLOOR = 1e-4
_RMS_LOW = 0.5
_RMS_HIGH = 2.0
_CACHE_VERSION = 1  # bump when materialization changes, so persistent caches are not reused


def light_model_path(name: str) -> Path:
    """Path of ``light_<name>.onnx`` inside the installed onnx wheel (the raw, unmaterialized graph)."""
    if name not in LIGHT_MODEL_NAMES:
        raise ValueError(f"unknown light model {name!r}; choose one of {', '.join(LIGHT_MODEL_NAMES)}")
    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the installed onnx wheel does not ship light models")
    return path


def _opset(model: onnx.ModelProto) -> int:
    return model_opset(model)


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


_SHAPE_OPS = ("Unsqueeze", "Reshape", "Identity")


def _folds(node: onnx.NodeProto, kept: dict[str, np.ndarray]) -> bool:
    """Whether ``node`` only re-shapes a weight (axes/shape from attributes or constant inputs)."""
    return node.op_type in _SHAPE_OPS and all(name in kept for name in node.input[1:])


def _folded_shape(node: onnx.NodeProto, shape_in: tuple[int, ...], kept: dict[str, np.ndarray]) -> tuple[int, ...]:
    """Output shape of a folded Unsqueeze/Reshape/Identity applied to a weight of shape ``shape_in``."""
    if node.op_type == "Identity":
        return shape_in
    if node.op_type == "Unsqueeze":
        axes_value = kept[node.input[1]] if len(node.input) > 1 else _attr(node, "axes", [])
        axes = [int(a) for a in np.asarray(axes_value).reshape(-1)]
        rank = len(shape_in) + len(axes)
        out = list(shape_in)
        for axis in sorted(a % rank for a in axes):
            out.insert(axis, 1)
        return tuple(out)
    target = [int(d) for d in kept[node.input[1]]]  # Reshape: 0 copies the input dim, -1 is inferred
    target = [shape_in[i] if d == 0 else d for i, d in enumerate(target)]
    if -1 in target:
        known = int(np.prod([d for d in target if d != -1]))
        target[target.index(-1)] = int(np.prod(shape_in)) // max(known, 1)
    return tuple(target)


def _fold_constants(
    graph: onnx.GraphProto,
) -> tuple[dict[str, tuple[int, ...]], dict[str, np.ndarray], list[onnx.NodeProto]]:
    """Split the graph into float weights to randomize (by shape), kept constants and compute nodes.

    ``ConstantOfShape`` fills and the shape-only ops on top of them (Unsqueeze, Reshape, Identity) are
    folded: only the final weight's shape matters, since its values are drawn afresh.
    """
    random_shapes: dict[str, tuple[int, ...]] = {}
    kept: dict[str, np.ndarray] = {}
    for tensor in graph.initializer:
        array = numpy_helper.to_array(tensor)
        if array.dtype.kind == "f":
            random_shapes[tensor.name] = tuple(int(d) for d in array.shape)
        else:
            kept[tensor.name] = array
    compute: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in kept:
            shape = tuple(int(d) for d in kept[node.input[0]])
            value = _attr(node, "value")
            fill = numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.zeros(1, np.float32)
            if fill.dtype.kind == "f":
                random_shapes[node.output[0]] = shape
            else:
                kept[node.output[0]] = np.full(shape, fill.reshape(-1)[0], dtype=fill.dtype)
        elif node.input and node.input[0] in random_shapes and _folds(node, kept):
            random_shapes[node.output[0]] = _folded_shape(node, random_shapes[node.input[0]], kept)
        else:
            compute.append(node)
    return random_shapes, kept, compute


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    array = rng.standard_normal(shape, dtype=np.float32)
    array *= np.float32(std)
    return array


def _weight(name: str, shape: tuple[int, ...], consumer: onnx.NodeProto, index: int, seed: int) -> np.ndarray:
    """Draw a seeded weight whose distribution depends on how the consuming node uses it."""
    rng = rng_for(seed, name)
    op = consumer.op_type
    if op == "Conv" and index == 1:
        return _normal(rng, shape, float(np.sqrt(2.0 / max(1, int(np.prod(shape[1:]))))))
    if op == "Gemm" and index == 1:
        trans_b = _attr(consumer, "transB", 0)
        fan_in = shape[1] if trans_b else shape[0]
        return _normal(rng, shape, float(np.sqrt(2.0 / max(1, fan_in))))
    if op in ("Conv", "Gemm") and index == 2:
        return _normal(rng, shape, _BIAS_STD)
    if op == "BatchNormalization" and index in (1, 4):  # scale; var (relative, calibrated later)
        return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    if op == "BatchNormalization" and index in (2, 3):  # bias; mean (relative, calibrated later)
        return _normal(rng, shape, _BN_MEAN_STD)
    if op == "Mul":
        return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    return _normal(rng, shape, 0.1)


def _round_sig(array: np.ndarray, digits: int = 4) -> np.ndarray:
    """Round to ``digits`` significant digits (absorbs most last-bit differences between CPU kernels)."""
    safe = np.where(array == 0, 1.0, np.abs(array))
    step = 10.0 ** (np.floor(np.log10(safe)) - (digits - 1))
    return (np.round(array / step) * step).astype(np.float32)


def _run_node(node: onnx.NodeProto, values: dict[str, np.ndarray], elem_types: dict[str, int], opset: int) -> None:
    """Run one node in onnxruntime on the arrays in ``values`` and store its outputs there."""
    model = onnx.ModelProto()
    model.ir_version = ir_version_for_opset(opset)
    model.opset_import.add(domain="", version=opset)
    model.graph.name = "single_node"
    model.graph.node.add().CopyFrom(node)
    seen: set[str] = set()
    feeds: dict[str, np.ndarray] = {}
    for name in node.input:
        if name and name not in seen:
            seen.add(name)
            array = values[name]
            feeds[name] = array
            elem = helper.np_dtype_to_tensor_dtype(array.dtype)
            model.graph.input.append(helper.make_tensor_value_info(name, elem, array.shape))
    outputs = [o for o in node.output if o and o in elem_types]
    for name in outputs:
        model.graph.output.append(helper.make_tensor_value_info(name, elem_types[name], None))
    # One thread: a multi-threaded reduction order would change the last bits of the statistics.
    results = make_session(model, "disable", threads=1).run(outputs, feeds)
    for name, result in zip(outputs, results, strict=True):
        values[name] = np.asarray(result)


def _keep_output_scale(node: onnx.NodeProto, values: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> None:
    """Rescale a Conv/Gemm's weight and bias when its output RMS leaves [0.5, 2] (LSUV-style, clipped)."""
    out = values[node.output[0]]
    rms = float(np.sqrt(np.mean(np.square(out, dtype=np.float64))))
    if not np.isfinite(rms) or rms == 0.0 or _RMS_LOW <= rms <= _RMS_HIGH:
        return
    factor = float(_round_sig(np.array([min(max(rms, _RMS_LOW), _RMS_HIGH) / rms]), 3)[0])
    for name in node.input[1:3]:
        if name in weights:
            weights[name] = values[name] = (weights[name] * np.float32(factor)).astype(np.float32)
    values[node.output[0]] = (out * np.float32(factor)).astype(out.dtype)


def _calibrate(
    skeleton: onnx.ModelProto, weights: dict[str, np.ndarray], kept: dict[str, np.ndarray], seed: int
) -> None:
    """Run the graph node by node on a seeded input; set BN statistics and keep Conv/Gemm outputs O(1).

    ``skeleton`` declares every constant as a graph input (no data), so shape inference stays cheap.
    """
    graph = skeleton.graph
    inferred = onnx.shape_inference.infer_shapes(skeleton)
    elem_types = {
        v.name: v.type.tensor_type.elem_type
        for v in list(inferred.graph.value_info) + list(inferred.graph.output)
        if v.type.HasField("tensor_type")
    }
    values: dict[str, np.ndarray] = {**kept, **weights}
    rng = np.random.default_rng([seed, 1])
    for info in graph.input:
        if info.name not in values:
            shape = [d.dim_value if d.dim_value > 0 else 1 for d in info.type.tensor_type.shape.dim]
            values[info.name] = rng.standard_normal(shape, dtype=np.float32)
    constants = set(values)
    last_use: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            last_use[name] = i
    opset = _opset(skeleton)
    for i, node in enumerate(graph.node):
        if node.op_type == "BatchNormalization" and node.input[3] in weights and node.input[4] in weights:
            x = values[node.input[0]].astype(np.float64)
            axes = tuple(a for a in range(x.ndim) if a != 1)
            mu = x.mean(axis=axes)
            var = np.maximum(x.var(axis=axes), _STAT_FLOOR)
            mean_name, var_name = node.input[3], node.input[4]
            mean = _round_sig(mu + weights[mean_name].astype(np.float64) * np.sqrt(var))
            variance = _round_sig(var * weights[var_name].astype(np.float64))
            weights[mean_name] = values[mean_name] = mean
            weights[var_name] = values[var_name] = variance
        _run_node(node, values, elem_types, opset)
        if node.op_type in ("Conv", "Gemm") and node.input[1] in weights:
            _keep_output_scale(node, values, weights)
        for name in node.input:
            if last_use.get(name) == i and name not in constants:
                del values[name]


def materialize_light_model(name: str, seed: int = 0) -> onnx.ModelProto:
    """Return light model ``name`` with folded constants and seeded realistic weights.

    * every ``ConstantOfShape`` (and the Unsqueeze/Reshape on top of it) becomes an initializer;
    * Conv/Gemm weights are He-initialised (std = sqrt(2 / fan_in)), their biases N(0, 0.02); a layer
      whose output RMS on the seeded input leaves [0.5, 2] is rescaled to the nearest bound, so deep
      stacks neither blow up nor saturate the final Softmax;
    * BatchNormalization scale ~ U(0.5, 1.5), bias ~ N(0, 0.1), mean/var calibrated as described in the
      module docstring; the channel-wise ``Mul``/``Add`` after BN get U(0.5, 1.5) / N(0, 0.1);
    * the opset stays as in the original (9), the IR version becomes the one matching it (4), and graph
      inputs are only the real data inputs (e.g. ``1x3x224x224``); unnamed nodes get ``<Op>_<index>``.
    """
    source = onnx.load(light_model_path(name))
    opset = _opset(source)
    graph = source.graph
    random_shapes, kept, compute = _fold_constants(graph)

    consumers: dict[str, tuple[onnx.NodeProto, int]] = {}
    for node in compute:
        for index, tensor_name in enumerate(node.input):
            consumers.setdefault(tensor_name, (node, index))
    weights: dict[str, np.ndarray] = {}
    for tensor_name, shape in random_shapes.items():
        if tensor_name in consumers:
            consumer, index = consumers[tensor_name]
            weights[tensor_name] = _weight(tensor_name, shape, consumer, index, seed)
    constant_names = set(random_shapes) | set(kept)
    kept = {k: v for k, v in kept.items() if k in consumers}

    model = onnx.ModelProto()
    model.ir_version = ir_version_for_opset(opset)
    model.producer_name = "qgraph.testing"
    model.opset_import.add(domain="", version=opset)
    model.doc_string = f"light_{name}.onnx from the onnx wheel, materialized by qgraph.testing (seed={seed})"
    out_graph = model.graph
    out_graph.name = graph.name or name
    for info in graph.input:
        if info.name not in constant_names:
            out_graph.input.append(info)
    out_graph.output.extend(graph.output)
    for index, node in enumerate(compute):
        new_node = out_graph.node.add()
        new_node.CopyFrom(node)
        if not new_node.name:
            new_node.name = f"{node.op_type}_{index}"

    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    for tensor_name, array in {**kept, **weights}.items():
        elem = helper.np_dtype_to_tensor_dtype(array.dtype)
        skeleton.graph.input.append(helper.make_tensor_value_info(tensor_name, elem, array.shape))
    _calibrate(skeleton, weights, kept, seed)

    for tensor_name, array in kept.items():
        add_initializer(out_graph, tensor_name, array)
    for tensor_name in sorted(weights):
        add_initializer(out_graph, tensor_name, weights[tensor_name])
    entry = model.metadata_props.add()
    entry.key, entry.value = "qgraph.testing.source", f"light_{name}.onnx seed={seed}"
    return model


def cached_light_model(name: str, cache_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Materialize light model ``name`` into ``cache_dir`` once and return the file's path.

    Later calls with the same name and seed return the existing file without rebuilding it. The file is
    written to a temporary name and renamed, so concurrent test workers never see a partial model.
    """
    folder = Path(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{name}_seed{seed}_v{_CACHE_VERSION}.onnx"
    if not target.is_file():
        model = materialize_light_model(name, seed)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        onnx.save(model, tmp)
        os.replace(tmp, target)
    return target
