"""Shared fixtures: toy passes registered for the duration of a test, small models written as ONNX text."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult
from qgraph.pipeline import pass_api

#: Modules whose assertions are accuracy thresholds measured with a target CPU's arithmetic (`qgraph.runtime.kernels`):
#: marked ``accuracy``, and run again by CI with QGRAPH_CPU_FLAGS declaring an AVX2 host and a VNNI host, so each
#: threshold is proven under both arithmetics whatever CPU CI has (issue #28).
ACCURACY_MODULES = frozenset({
    "recipes/test_recipes.py", "kernels/test_check_saturation.py", "kernels/test_measure.py", "test_check.py",
    "test_fidelity.py", "test_example.py", "test_target_cpu.py", "passes/test_insert_qdq_saturation.py",
    "passes/test_tune_ranges.py", "passes/test_correct_bias.py", "benchmarks/test_ocr_rec_int8.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of `ACCURACY_MODULES` ``accuracy`` (``pytest -m accuracy`` selects them)."""
    root = Path(__file__).resolve().parent
    for item in items:
        try:
            module = Path(str(item.path)).resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        if module in ACCURACY_MODULES:
            item.add_marker(pytest.mark.accuracy)


class DropIdentityConfig(PassConfig):
    """Options of the toy pass."""

    keep_graph_outputs: bool = Field(default=True, description="Keep Identity nodes producing graph outputs.")


class DropIdentity(Pass[DropIdentityConfig]):
    """Toy pass for core tests: bypass Identity nodes."""

    name = "toy_drop_identity"
    config_class = DropIdentityConfig

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        res = PassResult()
        for node in list(graph.graph.nodes):
            if node.op != "Identity" or graph.is_graph_output(node.outputs[0]):
                continue
            res.matched += 1
            src, dst = node.inputs[0], node.outputs[0]
            for consumer in list(graph.consumers(dst)):
                for i, t in enumerate(consumer.inputs):
                    if t is dst:
                        consumer.inputs[i] = src
            node.outputs.clear()
            res.rewritten += 1
        before = len(graph.graph.nodes)
        graph.cleanup()
        res.nodes_removed = before - len(graph.graph.nodes)
        return res


class ScaleOutputConfig(PassConfig):
    """Options of the toy pass that breaks float semantics."""

    factor: float = Field(description="Multiply the first output by this (required).")


class ScaleOutput(Pass[ScaleOutputConfig]):
    """Toy pass that (wrongly) claims to preserve float: multiplies the first graph output."""

    name = "toy_scale_output"
    config_class = ScaleOutputConfig

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        import numpy as np
        import onnx_graphsurgeon as gs

        out = graph.graph.outputs[0]
        prod = graph.producer(out)
        assert prod is not None
        mid = gs.Variable(out.name + "/pre", dtype=out.dtype, shape=out.shape)
        prod.outputs[prod.outputs.index(out)] = mid
        k = gs.Constant(out.name + "/k", np.array(self.config.factor, dtype=np.float32))
        graph.graph.nodes.append(gs.Node("Mul", out.name + "/scale", inputs=[mid, k], outputs=[out]))
        return PassResult(matched=1, rewritten=1, nodes_added=1)


@pytest.fixture
def toy_passes() -> Iterator[dict[str, type[Pass]]]:  # type: ignore[type-arg]
    """Register the toy passes for one test, then remove them."""
    pass_api.discover()
    added = {p.name: p for p in (DropIdentity, ScaleOutput)}
    for p in added.values():
        pass_api.register(p)
    yield added
    for name in added:
        pass_api._REGISTRY.pop(name, None)


SMALL_MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
small (float[N,4] x) => (float[N,4] y) {
  a = Identity(x)
  w = Constant<value = float[4,4] {1,0,0,0, 0,2,0,0, 0,0,3,0, 0,0,0,4}>()
  b = MatMul(a, w)
  c = Relu(b)
  d = Identity(c)
  y = Add(d, a)
}
"""


@pytest.fixture
def created_sessions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an item for every onnxruntime session the test creates from now on."""
    import onnxruntime as ort

    created: list[int] = []
    init = ort.InferenceSession.__init__

    def counting(self: ort.InferenceSession, *a: Any, **k: Any) -> None:
        created.append(1)
        init(self, *a, **k)

    monkeypatch.setattr(ort.InferenceSession, "__init__", counting)
    return created


@pytest.fixture
def small_model() -> onnx.ModelProto:
    """A 6-node float model with two Identity nodes to remove."""
    return onnx.parser.parse_model(SMALL_MODEL)


@pytest.fixture(scope="session")
def local_ray() -> Iterator[Any]:
    """A local Ray with 2 CPUs for the whole session (started once, shut down at the end), or a skip saying why."""
    try:
        import ray
    except ImportError:
        pytest.skip("Ray is not installed: the Ray executor tests need the extra (pip install -e '.[test,ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
             object_store_memory=256 << 20)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def detector(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A YOLO-style head whose ``output0`` joins boxes (0..320 px) and class scores (0..1) through a Concat
    (`qgraph.testing.detection_head`, batch axis dynamic), quantized with one scale for the join (as onnxruntime's
    quantize_static does: the scores are lost, the whole output reads > 40 dB): paths ``float``, ``int8``,
    ``calibration`` and ``eval`` (``.npz``, 16 images each), and ``recipe`` (the quantization as a recipe)."""
    import numpy as np

    from qgraph import Recipe
    from qgraph.testing import detection_feeds, detection_head

    folder = tmp_path_factory.mktemp("detector")
    onnx.save(detection_head(batch="batch"), folder / "float.onnx")
    for name, seed in (("calibration", 1), ("eval", 2)):
        images = np.concatenate([f["images"] for f in detection_feeds(16, seed=seed)])
        np.savez(folder / f"{name}.npz", images=images)
    recipe = folder / "shared.yaml"
    recipe.write_text("name: shared-join\npasses:\n  - pass: insert_qdq\n    preset: ort-x86-vnni\n"
                      "    elementwise: always\n    joins: {keep_float: false}\n")
    Recipe.from_yaml(recipe).pipeline().run(str(folder / "float.onnx"),
                                            calibration_data=str(folder / "calibration.npz")).save(folder / "int8.onnx")
    return {"float": folder / "float.onnx", "int8": folder / "int8.onnx", "calibration": folder / "calibration.npz",
            "eval": folder / "eval.npz", "recipe": recipe}
