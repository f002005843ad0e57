"""Helpers shared by the insert_qdq tests: tiny models written as ONNX text, running the pass, metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper, parser
from qgraph.passes.insert_qdq import InsertQDQ

from qgraph import Pipeline, PipelineResult
from qgraph.data import CallableSource, Feed
from qgraph.testing import target_session

CNN_TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
tiny (float[1,3,8,8] x) => (float[1,4] y) {
  c1 = Conv<pads=[1,1,1,1]>(x, w1, b1)
  r1 = Relu(c1)
  p1 = MaxPool<kernel_shape=[2,2], strides=[2,2]>(r1)
  c2 = Conv<pads=[1,1,1,1]>(p1, w2, b2)
  a = Add(c2, p1)
  r2 = Relu(a)
  g = GlobalAveragePool(r2)
  f = Flatten(g)
  y = Gemm<transB=1>(f, wf, bf)
}
"""


def with_weights(text: str, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Parse ``text`` and add ``weights`` as initializers; the result passes the full checker."""
    m = parser.parse_model(text)
    m.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in weights.items())
    onnx.checker.check_model(m, full_check=True)
    return m


def tiny_cnn(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """Conv-Relu-MaxPool-Conv-Add(residual)-Relu-GAP-Flatten-Gemm with seeded weights."""
    rng = np.random.default_rng(seed)
    w = {
        "w1": rng.normal(0, 0.3, (8, 3, 3, 3)),
        "b1": rng.normal(0, 0.1, (8,)),
        "w2": rng.normal(0, 0.15, (8, 8, 3, 3)),
        "b2": rng.normal(0, 0.1, (8,)),
        "wf": rng.normal(0, 0.3, (4, 8)),
        "bf": rng.normal(0, 0.1, (4,)),
    }
    text = CNN_TEXT.replace('"" : 17', f'"" : {opset}')
    return with_weights(text, {k: v.astype(np.float32) for k, v in w.items()})


def feeds_for(model: onnx.ModelProto, n: int, seed: int = 0) -> list[Feed]:
    """``n`` seeded N(0,1) feeds for every float input (static shapes, batch 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        feed = {}
        for vi in model.graph.input:
            shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
            feed[vi.name] = rng.standard_normal(shape).astype(np.float32)
        out.append(feed)
    return out


def source(feeds: list[Feed]) -> CallableSource:
    """A re-iterable data source over ``feeds``."""
    return CallableSource(lambda: feeds, "test feeds")


def quantize(model: onnx.ModelProto, feeds: list[Feed] | None = None, **options: Any) -> PipelineResult:
    """Run ``insert_qdq`` with ``options`` on ``model`` (calibrated on ``feeds``), checking the output."""
    data = source(feeds) if feeds is not None else None
    res = Pipeline([InsertQDQ(**options)]).run(model, calibration_data=data)
    onnx.checker.check_model(res.model, full_check=True)
    return res


def run(model: onnx.ModelProto, feed: Feed, optimized: bool = True) -> list[np.ndarray]:
    """Outputs of ``model`` in onnxruntime CPU: ``optimized``, as it deploys on the CPU it is made for (fused
    integer kernels on such a host, that CPU's arithmetic emulated on another: `qgraph.testing.target_session`, so
    an assertion holds on every host); else with no optimization at all."""
    if optimized:
        return [np.asarray(o) for o in target_session(model).run(None, feed)]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in sess.run(None, feed)]


def cosine(a: Iterable[np.ndarray], b: Iterable[np.ndarray]) -> float:
    """Cosine similarity of the concatenated arrays."""
    x = np.concatenate([np.ravel(v).astype(np.float64) for v in a])
    y = np.concatenate([np.ravel(v).astype(np.float64) for v in b])
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def nodes_by_name(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """Top-graph nodes keyed by name."""
    return {n.name: n for n in model.graph.node}


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of initializer ``name``."""
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise KeyError(name)
