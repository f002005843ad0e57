"""`PassContext.float_reference`: the model before the first float-changing pass, exported only when asked."""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qgraph import GraphHandle, Pass, PassContext, PassResult, Pipeline
from qgraph.graph.detach import is_placeholder, with_weights
from qgraph.options import PassConfig


class _RecorderConfig(PassConfig):
    """No options."""


class _Recorder(Pass[_RecorderConfig]):
    """Records the float reference it is given."""

    name = "toy_recorder"
    config_class = _RecorderConfig
    preserves_float = False
    needs_float_reference: ClassVar[bool] = True
    seen: ClassVar[list[onnx.ModelProto | None]] = []

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        type(self).seen.append(ctx.float_reference)
        return PassResult()


def _passes(toy: dict[str, type[Pass[Any]]]) -> tuple[Pass[Any], Pass[Any]]:
    """The toy Identity remover, and the toy output scaler declared float-changing (as a quantizer is)."""
    scale = toy["toy_scale_output"]
    breaking = type("Breaking", (scale,), {"preserves_float": False})
    return toy["toy_drop_identity"](), breaking(factor=2.0)


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def test_reference_is_the_model_before_the_first_float_changing_pass(
        small_model: onnx.ModelProto, toy_passes: dict[str, type[Pass[Any]]]) -> None:
    _Recorder.seen.clear()
    Pipeline([*_passes(toy_passes), _Recorder()]).run(small_model)
    (ref,) = _Recorder.seen
    assert ref is not None
    assert _ops(ref) == {"Constant": 1, "MatMul": 1, "Relu": 1, "Add": 1}  # identities dropped, no Mul yet


def test_without_a_float_changing_pass_the_reference_is_what_the_asking_pass_receives(
        small_model: onnx.ModelProto, toy_passes: dict[str, type[Pass[Any]]]) -> None:
    _Recorder.seen.clear()
    Pipeline([_passes(toy_passes)[0], _Recorder()]).run(small_model)
    (ref,) = _Recorder.seen
    assert ref is not None and "Identity" not in _ops(ref)


def test_nothing_is_exported_when_no_pass_asks(small_model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch,
                                               toy_passes: dict[str, type[Pass[Any]]]) -> None:
    calls: list[Any] = []
    original = PassContext.set_float_reference

    def counted(self: PassContext, model: onnx.ModelProto | None, weights: dict[str, Any] | None = None,
                graph: Any = None) -> None:
        calls.append(model)
        original(self, model, weights, graph)

    monkeypatch.setattr(PassContext, "set_float_reference", counted)
    Pipeline(list(_passes(toy_passes))).run(small_model)
    assert calls == []
    Pipeline([*_passes(toy_passes), _Recorder()]).run(small_model)
    assert len(calls) == 1


class _WeightRecorder(_Recorder):
    """Records the float reference and its placeholders' values."""

    name = "toy_weight_recorder"
    weights: ClassVar[list[dict[str, Any]]] = []

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        type(self).seen.append(ctx.float_reference)
        type(self).weights.append(dict(ctx.float_reference_weights))
        return PassResult()


def _matmul_model() -> tuple[onnx.ModelProto, np.ndarray]:
    """``y = x @ w`` with a 16 KB weight (above DETACH_BYTES, so the graph holds it as a shared array)."""
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), w


def test_reference_is_weightless_and_shares_the_graph_arrays() -> None:
    model, w = _matmul_model()
    _WeightRecorder.seen.clear()
    _WeightRecorder.weights.clear()
    Pipeline([_WeightRecorder()]).run(model)
    (ref,), (weights,) = _WeightRecorder.seen, _WeightRecorder.weights
    assert ref is not None
    (init,) = ref.graph.initializer
    assert is_placeholder(init) and not init.raw_data  # no second copy of the weights in the protobuf
    np.testing.assert_array_equal(weights["w"], w)
    full = with_weights(ref, weights)
    np.testing.assert_array_equal(numpy_helper.to_array(full.graph.initializer[0]), w)


class _InPlaceWriter(Pass[_RecorderConfig]):
    """Writes into the graph's weight array in place (what a pass must never do once the reference exists)."""

    name = "toy_in_place_writer"
    config_class = _RecorderConfig
    preserves_float = False
    needs_float_reference: ClassVar[bool] = True
    error: ClassVar[list[str]] = []

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        from qgraph.graph import const_value

        node = next(n for n in graph.graph.nodes if n.op == "MatMul")
        value = const_value(node.inputs[1])
        assert value is not None
        try:
            value[0, 0] = 123.0
        except ValueError as exc:
            type(self).error.append(str(exc))
        return PassResult()


def test_shared_weight_arrays_are_read_only_so_an_in_place_write_raises() -> None:
    """The reference shares the graph's arrays (no copy): writing into one would silently change the reference,
    so the arrays are read-only once it exists; the reference keeps the original value."""
    model, w = _matmul_model()
    _InPlaceWriter.error.clear()
    _WeightRecorder.weights.clear()
    out = Pipeline([_InPlaceWriter(), _WeightRecorder()]).run(model).model
    (message,) = _InPlaceWriter.error
    assert "read-only" in message
    (weights,) = _WeightRecorder.weights
    assert not weights["w"].flags.writeable
    np.testing.assert_array_equal(weights["w"], w)
    np.testing.assert_array_equal(numpy_helper.to_array(out.graph.initializer[0]), w)
