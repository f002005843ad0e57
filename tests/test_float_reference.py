"""`PassContext.float_reference`: the model before the first float-changing pass, exported only when asked."""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import onnx
import pytest
from conftest import DropIdentity, ScaleOutput, ScaleOutputConfig

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


class _Breaking(ScaleOutput):
    """ScaleOutput declared as float-changing (as a quantizer is)."""

    preserves_float = False


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def test_reference_is_the_model_before_the_first_float_changing_pass(small_model: onnx.ModelProto) -> None:
    _Recorder.seen.clear()
    Pipeline([DropIdentity(), _Breaking(ScaleOutputConfig(factor=2.0)), _Recorder()]).run(small_model)
    (ref,) = _Recorder.seen
    assert ref is not None
    assert _ops(ref) == {"Constant": 1, "MatMul": 1, "Relu": 1, "Add": 1}  # identities dropped, no Mul yet


def test_without_a_float_changing_pass_the_reference_is_what_the_asking_pass_receives(
        small_model: onnx.ModelProto) -> None:
    _Recorder.seen.clear()
    Pipeline([DropIdentity(), _Recorder()]).run(small_model)
    (ref,) = _Recorder.seen
    assert ref is not None and "Identity" not in _ops(ref)


def test_nothing_is_exported_when_no_pass_asks(small_model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    original = PassContext.set_float_reference

    def counted(self: PassContext, model: onnx.ModelProto | None) -> None:
        calls.append(model)
        original(self, model)

    monkeypatch.setattr(PassContext, "set_float_reference", counted)
    Pipeline([DropIdentity(), _Breaking(ScaleOutputConfig(factor=2.0))]).run(small_model)
    assert calls == []
    Pipeline([DropIdentity(), _Breaking(ScaleOutputConfig(factor=2.0)), _Recorder()]).run(small_model)
    assert len(calls) == 1
