"""Helpers shared by the correct_bias / optimize_rounding tests: quantize then correct, compare initializers,
output SQNR against the float model."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from insert_qdq_helpers import source
from onnx import numpy_helper
from qgraph.passes.insert_qdq import InsertQDQ

from qgraph import Pass, Pipeline, PipelineResult
from qgraph.data import Feed
from qgraph.testing.runtime import run_ort

PER_TENSOR = {"preset": "ort-x86-vnni", "weights": {"per_channel": False}}


def run(model: onnx.ModelProto, feeds: list[Feed], *passes: Pass[Any], **qdq: Any) -> PipelineResult:
    """insert_qdq (``qdq`` options, default per-tensor weights) then ``passes``, calibrated on ``feeds``."""
    res = Pipeline([InsertQDQ(**(qdq or PER_TENSOR)), *passes]).run(model, calibration_data=source(feeds))
    onnx.checker.check_model(res.model, full_check=True)
    return res


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every initializer by name."""
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def changed(a: onnx.ModelProto, b: onnx.ModelProto) -> set[str]:
    """Initializers whose value differs (or that exist in only one model)."""
    ia, ib = initializers(a), initializers(b)
    return {k for k in ia.keys() | ib.keys() if k not in ia or k not in ib or not np.array_equal(ia[k], ib[k])}


def sqnr_db(reference: onnx.ModelProto, candidate: onnx.ModelProto, feeds: list[Feed]) -> float:
    """Output SQNR of ``candidate`` against ``reference`` over ``feeds`` (first output)."""
    signal = noise = 0.0
    for feed in feeds:
        r = run_ort(reference, feed, "disable")[0].astype(np.float64)
        c = run_ort(candidate, feed, "disable")[0].astype(np.float64)
        signal += float(np.sum(r * r))
        noise += float(np.sum((r - c) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(signal / noise)


def exact_gemm(seed: int = 0) -> tuple[onnx.ModelProto, list[Feed]]:
    """One Gemm whose quantization is exact: weights on the per-tensor int8 grid, zero bias, inputs on a uint8 grid
    that spans exactly [0, 255/64] (so the activation scale is 1/64)."""
    rng = np.random.default_rng(seed)
    w = (rng.integers(-127, 128, (6, 10)) / 512).astype(np.float32)
    w[0, 0] = 127 / 512  # max|w| = 127 step: the per-tensor scale is the grid step
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,10] x) => (float[1,6] y) {
      y = Gemm<transB=1>(x, w, b)
    }
    """
    m = onnx.parser.parse_model(text)
    m.graph.initializer.extend([numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(6, np.float32), "b")])
    feeds = []
    for _i in range(16):
        x = rng.integers(0, 256, (1, 10)).astype(np.float32) / 64
        x[0, 0], x[0, 1] = 0.0, 255 / 64
        feeds.append({"x": x})
    return m, feeds
