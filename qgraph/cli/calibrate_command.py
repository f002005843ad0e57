"""``qgraph calibrate``: ranges of every float activation of the graph a recipe quantizes.

The recipe's passes up to its first non-float-preserving pass (usually ``insert_qdq``) run first, so the
ranges describe the graph that actually gets quantized (after BN fusion, folding, lowering). The ranges
file records that graph's fingerprint; a recipe that reuses it (``calibration: {ranges: file}``) on another
graph gets an error, not a silent mismatch.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qgraph.calibrate.collector import TensorCalibration, collect_ranges
from qgraph.calibrate.ranges_file import write_ranges
from qgraph.calibrate.robust import ROBUST_PERCENTILE
from qgraph.data import DataSource, batched, open_data_source
from qgraph.errors import RecipeError
from qgraph.graph import proto_scopes
from qgraph.graph.detach import is_placeholder, split_weights, with_weights
from qgraph.io.model_io import model_fingerprint
from qgraph.pipeline.recipe import Recipe
from qgraph.pipeline.runner import Pipeline

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def float_activations(model: onnx.ModelProto) -> list[str]:
    """Names of the float tensors computed at run time (graph inputs and node outputs, not constants)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*inferred.graph.value_info, *inferred.graph.input,
                                                                *inferred.graph.output)}
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    names += [o for n in model.graph.node if n.op_type != "Constant" for o in n.output if o]
    return [n for n in dict.fromkeys(names) if types.get(n) in FLOAT_TYPES]


def prepared_model(recipe: Recipe, model: str | Path | onnx.ModelProto,
                   calibration_data: str | Path | DataSource | None = None) -> onnx.ModelProto:
    """The model as the recipe's first quantizing pass will see it (float-preserving passes that measure the
    data, such as ``smooth_quant``, read ``calibration_data``)."""
    prep = list(itertools.takewhile(lambda p: p.preserves_float, recipe.passes))
    if not prep:
        return _copy_or_load(model)
    return Pipeline(prep, name=recipe.name).run(model, keep_input=False, calibration_data=calibration_data).model


def _prepared_weightless(
    recipe: Recipe, model: str | Path | onnx.ModelProto, calibration_data: str | Path | DataSource | None = None
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """`prepared_model` as a weightless export and its placeholders' values: the weights once, as arrays (filling
    a protobuf and splitting it again held them twice). Weights inside subgraphs are filled (sessions share only
    the top graph's)."""
    prep = [p for p in itertools.takewhile(lambda p: p.preserves_float, recipe.passes)]
    if not prep:
        return split_weights(_copy_or_load(model))
    result = Pipeline(prep, name=recipe.name).run(model, keep_input=False, weightless=True,
                                                  calibration_data=calibration_data)
    graph, weights = result.model, result.weights
    if any(is_placeholder(t) for g in proto_scopes(graph.graph)[1:] for t in g.initializer):
        return split_weights(with_weights(graph, weights))
    return graph, weights


def _copy_or_load(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    from qgraph.io.model_io import load_model

    if isinstance(model, onnx.ModelProto):
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out
    return load_model(model)


def calibrate_recipe(
    recipe: Recipe,
    model: str | Path | onnx.ModelProto,
    data: str | Path | DataSource | None,
    output: str | Path,
    *,
    method: str | None = None,
    options: dict[str, Any] | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    on_result: Callable[[dict[str, TensorCalibration]], None] | None = None,
    samples: int | None = None,
) -> Path:
    """Calibrate the recipe's quantized graph on ``data`` and write a ranges file to ``output``.

    Every tensor also gets its robust magnitude (outlier ratio); ``on_result`` receives the calibrations."""
    spec = data if data is not None else recipe.calibration.data
    if spec is None:
        raise RecipeError("no calibration data: pass --calibration-data or set calibration.data in the recipe.")
    graph, weights = _prepared_weightless(recipe, model, spec)
    chosen_method, chosen_options = _method_from_recipe(recipe)
    method = method or chosen_method
    options = {**chosen_options, **(options or {})} if method == chosen_method else dict(options or {})
    if method in ("auto", "mse"):  # the grid the recipe quantizes activations to decides their ranges
        for key, value in _activation_grid(recipe).items():
            options.setdefault(key, value)
    source = open_data_source(spec, samples=samples or recipe.calibration.samples).bind(graph)
    fingerprint = model_fingerprint(graph, weights)  # the filled model's, as ranges files always recorded
    names = float_activations(graph)  # shape inference on the weightless protobuf: no copies of the weights
    hasher = hashlib.sha256()
    batch = recipe.calibration.batch_size
    calibrations = collect_ranges(
        graph, names, lambda: batched(source, batch), method, options=options, progress=progress,
        data_hasher=hasher, robust_percentile=ROBUST_PERCENTILE, weights=weights,
    )
    if on_result is not None:
        on_result(calibrations)
    return write_ranges(
        output, calibrations, model_fingerprint=fingerprint, data_fingerprint=hasher.hexdigest(),
        method=method, options=options,
    )


def _activation_grid(recipe: Recipe) -> dict[str, Any]:
    """``dtype``/``symmetric`` of the recipe's activation quantization (empty when no pass says)."""
    for p in recipe.passes:
        activations = getattr(p.config, "activations", None)
        if activations is not None and hasattr(activations, "dtype"):
            dtype = getattr(activations.dtype, "value", activations.dtype)
            return {"dtype": dtype, "symmetric": bool(getattr(activations, "symmetric", False))}
    return {}


def _method_from_recipe(recipe: Recipe) -> tuple[str, dict[str, Any]]:
    for p in recipe.passes:
        activations = getattr(p.config, "activations", None)
        if activations is not None and hasattr(activations, "method"):
            return str(activations.method), dict(getattr(activations, "method_options", {}) or {})
    return "minmax", {}
