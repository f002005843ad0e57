"""Run models in onnxruntime and make input feeds for quick numeric checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from qgraph.runtime import compare

Feeds = dict[str, np.ndarray]

_OPT_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Return the model's real inputs: graph inputs that are not also initializers."""
    initializers = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def random_feeds(
    model: onnx.ModelProto,
    n: int = 1,
    seed: int = 0,
    *,
    dynamic_dim: int = 1,
    dims: Mapping[str, int] | None = None,
    int_high: int = 10,
) -> list[Feeds]:
    """``n`` seeded feed dicts from the model's declared inputs (`qgraph.runtime.compare.random_feeds`, ints in [0,
    10))."""
    return compare.random_feeds(model, n, seed, dynamic_dim, dims=dims, int_high=int_high)


def make_session(
    model: onnx.ModelProto | str | Path,
    optimization_level: str | ort.GraphOptimizationLevel = "all",
    threads: int = 1,
) -> ort.InferenceSession:
    """A CPU onnxruntime session (`qgraph.runtime.compare.make_session`) with onnxruntime's own default optimization.

    ``optimization_level`` is ``"disable"``, ``"basic"``, ``"extended"``, ``"all"`` or an
    ``ort.GraphOptimizationLevel``.
    """
    if isinstance(optimization_level, str):
        if optimization_level not in _OPT_LEVELS:
            raise ValueError(f"optimization_level must be one of {sorted(_OPT_LEVELS)}, got {optimization_level!r}")
        optimization_level = _OPT_LEVELS[optimization_level]
    return compare.make_session(model, optimization=optimization_level, threads=threads)


def target_session(model: onnx.ModelProto | str | Path) -> Any:
    """A session computing ``model`` as it deploys on the CPU it is made for, on any host: its provenance's
    ``qgraph.target_cpu`` (deployed kernels on such a host, that arithmetic emulated elsewhere), exact int32
    arithmetic for a quantized model made for no CPU in particular (`qgraph.runtime.kernels`). For assertions on a
    quantized model's accuracy that must hold on every host (a plain session's deployed kernels on an AVX2 host
    saturate where a VNNI host's do not)."""
    from qgraph.runtime.kernels.measure import EXACT, choose, model_target

    return choose(model_target(model) or EXACT).kernels.session(model)


def run_target(model: onnx.ModelProto | str | Path, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """`target_session` run once on ``feeds``: the outputs in graph order."""
    return [np.asarray(r) for r in target_session(model).run(None, dict(feeds))]


def run_ort(
    model: onnx.ModelProto | str | Path,
    feeds: Mapping[str, np.ndarray],
    optimization_level: str | ort.GraphOptimizationLevel = "all",
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


def ort_quantize_static(float_path: str | Path, out_path: str | Path, feeds: Sequence[Mapping[str, np.ndarray]],
                        **options: object) -> onnx.ModelProto:
    """onnxruntime's ``quantize_static`` (QDQ format unless ``options`` say otherwise) calibrated on ``feeds``: the
    peer quantizer the tests and benchmarks compare with, and a source of QDQ models qgraph did not make."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self) -> Mapping[str, np.ndarray] | None:
            return next(self.it, None)

    quantize_static(str(float_path), str(out_path), Reader(), **{"quant_format": QuantFormat.QDQ, **options})
    return onnx.load(str(out_path))


def output_sqnr_db(reference: onnx.ModelProto, candidate: onnx.ModelProto,
                   feeds: Sequence[Mapping[str, np.ndarray]]) -> float:
    """SQNR in dB of ``candidate``'s first output against ``reference``'s over ``feeds`` (onnxruntime, each model
    as it deploys on the CPU it is made for: `target_session`):
    ``10 log10(Σ ref² / Σ (ref - out)²)``."""
    ref = np.concatenate([run_target(reference, dict(f))[0] for f in feeds]).astype(np.float64)
    out = np.concatenate([run_target(candidate, dict(f))[0] for f in feeds]).astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / max(float(np.sum((ref - out) ** 2)), 1e-300)))
