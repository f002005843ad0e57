"""Run models in onnxruntime and make input feeds for quick numeric checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

Feeds = dict[str, np.ndarray]

_OPT_LEVELS: dict[str, object] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Return the model's real inputs: graph inputs that are not also initializers."""
    initializers = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def input_shape(
    info: onnx.ValueInfoProto, dynamic_dim: int = 1, dims: Mapping[str, int] | None = None
) -> tuple[int, ...]:
    """Concrete shape of a declared input.

    Symbolic dims found in ``dims`` take that size, any other unknown dim takes ``dynamic_dim``.
    """
    out: list[int] = []
    for dim in info.type.tensor_type.shape.dim:
        if dim.HasField("dim_value") and dim.dim_value > 0:
            out.append(int(dim.dim_value))
        elif dims is not None and dim.dim_param in dims:
            out.append(int(dims[dim.dim_param]))
        else:
            out.append(dynamic_dim)
    return tuple(out)


def random_feeds(
    model: onnx.ModelProto,
    n: int = 1,
    seed: int = 0,
    *,
    dynamic_dim: int = 1,
    dims: Mapping[str, int] | None = None,
    int_high: int = 10,
) -> list[Feeds]:
    """Build ``n`` feed dicts from the model's declared input shapes and element types.

    Float inputs are standard normal, integer inputs uniform in ``[0, int_high)``, bool inputs fair coins.
    Symbolic dims found in ``dims`` (e.g. ``{"seq": 16}``) take that size; any other dynamic dim takes
    ``dynamic_dim``. Deterministic for a given ``seed``.
    """
    rng = np.random.default_rng(seed)
    inputs = graph_inputs(model)
    feeds: list[Feeds] = []
    for _ in range(n):
        feed: Feeds = {}
        for info in inputs:
            shape = input_shape(info, dynamic_dim, dims)
            dtype = helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
            if np.issubdtype(dtype, np.floating):
                feed[info.name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
            elif np.issubdtype(dtype, np.integer):
                feed[info.name] = rng.integers(0, int_high, size=shape).astype(dtype)
            elif dtype == np.bool_:
                feed[info.name] = rng.random(shape) < 0.5
            else:
                raise TypeError(f"random_feeds: input {info.name!r} has unsupported element type {dtype}")
        feeds.append(feed)
    return feeds


def make_session(
    model: onnx.ModelProto | str | Path,
    optimization_level: str | object = "all",
    threads: int = 1,
) -> ort.InferenceSession:
    """Create a CPU onnxruntime session for a ModelProto or a path.

    ``optimization_level`` is ``"disable"``, ``"basic"``, ``"extended"``, ``"all"`` (onnxruntime's own
    default) or an ``ort.GraphOptimizationLevel``.
    """
    options = ort.SessionOptions()
    if isinstance(optimization_level, str):
        if optimization_level not in _OPT_LEVELS:
            raise ValueError(f"optimization_level must be one of {sorted(_OPT_LEVELS)}, got {optimization_level!r}")
        options.graph_optimization_level = _OPT_LEVELS[optimization_level]
    else:
        options.graph_optimization_level = optimization_level
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run_ort(
    model: onnx.ModelProto | str | Path,
    feeds: Mapping[str, np.ndarray],
    optimization_level: str | object = "all",
    *,
    output_names: Sequence[str] | None = None,
    threads: int = 1,
) -> list[np.ndarray]:
    """Run ``model`` once on ``feeds`` in onnxruntime (CPU) and return the outputs in graph order.

    See :func:`make_session` for ``optimization_level``. ``output_names`` picks a subset of outputs.
    """
    session = make_session(model, optimization_level, threads)
    names = list(output_names) if output_names is not None else None
    results = session.run(names, dict(feeds))
    return [np.asarray(r) for r in results]
