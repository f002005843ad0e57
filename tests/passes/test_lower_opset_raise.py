"""raise_model and the LowerOpset / RaiseOpset pass wrappers."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import parser
from qgraph.passes.lower_opset import LowerOpset, lower_model
from qgraph.passes.lower_opset.raising import RaiseOpset, raise_model

from qgraph import GraphHandle, PassContext
from qgraph.errors import PassError


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return np.asarray(
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    )


X = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)


def test_raise_softmax_keeps_coerced_2d_semantics() -> None:
    m = parser.parse_model(
        '<ir_version: 6, opset_import: ["" : 11]> g (float[2,3,4] x) => (float[2,3,4] y) { y = Softmax<axis=1>(x) }'
    )
    res = raise_model(m, 17)
    assert [n.op_type for n in res.model.graph.node] == ["Flatten", "Softmax", "Shape", "Reshape"]
    assert res.model.ir_version == 8 and res.model.opset_import[0].version == 17
    np.testing.assert_allclose(_run(res.model, X), _run(m, X), rtol=1e-6)


def test_raise_then_lower_round_trip() -> None:
    m = parser.parse_model(
        '<ir_version: 6, opset_import: ["" : 11]> g (float[2,3,4] x) => (float[2,4] y) '
        "{ y = ReduceSum<axes=[1], keepdims=0>(x) }"
    )
    up = raise_model(m, 18).model
    red = next(n for n in up.graph.node if n.op_type == "ReduceSum")
    assert len(red.input) == 2
    down = lower_model(up, 11).model
    np.testing.assert_allclose(_run(down, X), _run(m, X), rtol=1e-6)


def test_raise_refuses_opsets_onnxruntime_cannot_load_and_lowering_targets() -> None:
    m = parser.parse_model('<ir_version: 8, opset_import: ["" : 13]> g (float[2] x) => (float[2] y) { y = Relu(x) }')
    with pytest.raises(PassError, match="lower than"):
        raise_model(m, 11)
    with pytest.raises(PassError, match="IR version"):
        raise_model(m, 28)


def test_pass_wrappers_report_counts() -> None:
    m = parser.parse_model(
        '<ir_version: 8, opset_import: ["" : 18]> g (float[2,3,4] x) => (float[2,4] y) '
        "{ ax = Constant<value = int64[1] {1}>() y = ReduceMean<keepdims=0>(x, ax) }"
    )
    g = GraphHandle(m)
    res = LowerOpset(opset=13).run(g, PassContext())
    assert res.rewritten == 1 and res.details["adapters"] == {"ReduceMean-18: reduce_axes_to_attribute": 1}
    lowered = g.to_onnx()
    assert lowered.opset_import[0].version == 13
    g2 = GraphHandle(lowered)
    RaiseOpset(opset=18).run(g2, PassContext())
    raised = g2.to_onnx()
    assert raised.opset_import[0].version == 18
    np.testing.assert_allclose(_run(raised, X), _run(m, X), rtol=1e-6)
