"""`PassContext.float_reference`: the model before the first float-changing pass, exported only when asked."""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import onnx
import pytest

from qgraph import GraphHandle, Pass, PassContext, PassResult, Pipeline
from qgraph.pass_api import PassConfig


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

    def counted(self: PassContext, model: onnx.ModelProto | None) -> None:
        calls.append(model)
        original(self, model)

    monkeypatch.setattr(PassContext, "set_float_reference", counted)
    Pipeline(list(_passes(toy_passes))).run(small_model)
    assert calls == []
    Pipeline([*_passes(toy_passes), _Recorder()]).run(small_model)
    assert len(calls) == 1
