"""Fixtures for the graph-preparation pass tests: cached real topologies and numeric comparison helpers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from qgraph import GraphHandle, Pass, PassContext, PassResult
from qgraph.testing.models import cached_light_model, run_ort


class Prep:
    """Helpers shared by test_fold_constants / test_fuse_batchnorm / test_cleanup."""

    @staticmethod
    def apply(model: onnx.ModelProto, *passes: Pass[Any]) -> tuple[onnx.ModelProto, list[PassResult], GraphHandle]:
        """Run ``passes`` on a handle of ``model`` (as the pipeline does) and export the result."""
        handle = GraphHandle(model)
        results = []
        for p in passes:
            p.requires(handle, PassContext())
            results.append(p.run(handle, PassContext()))
            handle.changed()
        out = handle.to_onnx()
        onnx.checker.check_model(out, full_check=True)
        return out, results, handle

    @staticmethod
    def ops(model: onnx.ModelProto) -> Counter[str]:
        """Op-type histogram of the top graph."""
        return Counter(n.op_type for n in model.graph.node)

    @staticmethod
    def relative_error(
        a: onnx.ModelProto,
        b: onnx.ModelProto,
        feed: dict[str, np.ndarray],
        level: str = "disable",
        level_b: str | None = None,
    ) -> float:
        """max over outputs of ``max|a - b| / max|a|`` in onnxruntime (outputs by position; optimization
        ``level`` for ``a``, ``level_b`` (default: the same) for ``b``)."""
        ra, rb = run_ort(a, feed, level), run_ort(b, feed, level_b or level)
        worst = 0.0
        for x, y in zip(ra, rb, strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype
            scale = float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0
            err = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
            worst = max(worst, err / scale if scale > 0 else err)
        return worst

    @staticmethod
    def local_errors(
        original: onnx.ModelProto, rewritten: onnx.ModelProto, feed: dict[str, np.ndarray]
    ) -> dict[str, float]:
        """Per-tensor error of the rewritten graph, each node fed the ORIGINAL model's values of its inputs.

        Every tensor the two models share (by name) is computed by ``rewritten`` from the original's values of
        the shared tensors it reads, so float32 rounding cannot compound through depth: what remains is the
        rewrite's own error. Returns ``name -> max|new - original| / max|original|``.
        """
        exposed = onnx.ModelProto()
        exposed.CopyFrom(original)
        have = {o.name for o in exposed.graph.output}
        for node in original.graph.node:
            for name in node.output:
                if name and name not in have:
                    exposed.graph.output.append(onnx.ValueInfoProto(name=name))
                    have.add(name)
        names = [o.name for o in exposed.graph.output]
        values = dict(zip(names, run_ort(exposed, feed, "disable"), strict=True))
        cut = onnx.ModelProto()
        cut.CopyFrom(rewritten)
        graph = cut.graph
        produced = {o for n in graph.node for o in n.output}
        fed: dict[str, np.ndarray] = {}
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name in values and name in produced:
                    node.input[i] = f"{name}@original"
                    fed[node.input[i]] = values[name]
        for name, value in fed.items():
            elem = helper.np_dtype_to_tensor_dtype(value.dtype)
            graph.input.append(helper.make_tensor_value_info(name, elem, value.shape))
        del graph.output[:]
        compared = [o for n in graph.node for o in n.output if o in values]
        for name in compared:
            graph.output.append(onnx.ValueInfoProto(name=name))
        results = run_ort(cut, {**feed, **fed}, "disable")
        out = {}
        for name, result in zip(compared, results, strict=True):
            ref = values[name].astype(np.float64)
            scale = float(np.max(np.abs(ref))) if ref.size else 0.0
            err = float(np.max(np.abs(result.astype(np.float64) - ref))) if ref.size else 0.0
            out[name] = err / scale if scale > 0 else err
        return out

    @staticmethod
    def graph_bytes(model: onnx.ModelProto) -> bytes:
        """Deterministic serialization of the graph (for "nothing changed" checks)."""
        g = onnx.GraphProto()
        g.CopyFrom(model.graph)
        return g.SerializeToString(deterministic=True)


@pytest.fixture(scope="session")
def prep() -> type[Prep]:
    """The `Prep` helpers."""
    return Prep


@pytest.fixture(scope="session")
def light_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], onnx.ModelProto]:
    """``light_model(name)``: a materialized light model (seed 0), built once per test session."""
    folder: Path = tmp_path_factory.mktemp("prep_light_models")
    cache: dict[str, onnx.ModelProto] = {}

    def get(name: str) -> onnx.ModelProto:
        if name not in cache:
            cache[name] = onnx.load(cached_light_model(name, folder))
        model = onnx.ModelProto()
        model.CopyFrom(cache[name])
        return model

    return get
