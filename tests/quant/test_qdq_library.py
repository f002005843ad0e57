"""The one Q/DQ library (`qgraph.quant.qdq` on protos, `qgraph.quant.qdq_graph` on graphsurgeon graphs): recognition
with the domain check, the pair walker (the same answers in both representations), the integer ranges."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import onnx
import pytest
from hypothesis import given
from onnx import helper, numpy_helper

from qgraph.graph import GraphHandle
from qgraph.quant.math import QuantDtype, dtype_range, storage_range
from qgraph.quant.qdq import float_behind, is_dequantize, is_qdq, is_quantize, pair_quantize, pairs_reading
from qgraph.quant.qdq_graph import is_dq, is_q, owned_output_pairs, pair_q, qparams
from qgraph.quant.qdq_graph import is_qdq as is_qdq_node
from qgraph.quant.qdq_graph import pairs_reading as gs_pairs_reading


@pytest.mark.parametrize(("domain", "known"), [("", True), ("ai.onnx", True), ("com.microsoft", True),
                                               ("com.example", False)])
def test_recognition_checks_the_domain(domain: str, known: bool) -> None:
    assert is_quantize("QuantizeLinear", domain) is known and is_dequantize("DequantizeLinear", domain) is known
    assert is_qdq("QuantizeLinear", domain) is known and not is_qdq("Conv", domain)
    assert is_qdq("DynamicQuantizeLinear", domain, dynamic=True) is (domain in ("", "ai.onnx"))
    assert not is_qdq("DynamicQuantizeLinear", domain)


def _chain() -> onnx.ModelProto:
    """x -> Q -> DQ -> Q2 -> DQ2 -> Relu -> y (graph output through its own pair y -> Q3 -> DQ3); a weight DQ of
    stored codes; a custom-domain "QuantizeLinear" that is not one."""
    s, z = numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.uint8(3), "z")
    w = numpy_helper.from_array(np.array([1, 2], np.int8), "w_codes")
    ws = numpy_helper.from_array(np.float32(0.5), "ws")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
        helper.make_node("QuantizeLinear", ["xd", "s", "z"], ["xq2"], name="q2", domain="com.microsoft"),
        helper.make_node("DequantizeLinear", ["xq2", "s", "z"], ["xd2"], name="dq2", domain="com.microsoft"),
        helper.make_node("Relu", ["xd2"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q3"),
        helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"], name="dq3"),
        helper.make_node("DequantizeLinear", ["w_codes", "ws"], ["w"], name="wdq"),
        helper.make_node("QuantizeLinear", ["w", "s", "z"], ["fake"], name="custom", domain="com.example"),
        helper.make_node("DequantizeLinear", ["fake", "s", "z"], ["fake_d"], name="after_custom"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("fake_d", onnx.TensorProto.FLOAT, [2])], [s, z, w, ws])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1),
                                                   helper.make_opsetid("com.example", 1)])


def test_the_proto_and_graph_walkers_agree() -> None:
    model = _chain()
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    by_name = {n.name: n for n in model.graph.node}
    assert [(q.name, dq.name) for q, dq in pairs_reading("x", consumers)] == [("q", "dq")]
    assert [(q.name, dq.name) for q, dq in pairs_reading("xd", consumers)] == [("q2", "dq2")]
    assert pairs_reading("w", consumers) == []  # read by a custom-domain op, not a QuantizeLinear
    assert pair_quantize(by_name["dq2"], producer) is by_name["q2"]
    assert pair_quantize(by_name["wdq"], producer) is None  # stored codes: no pair
    assert pair_quantize(by_name["after_custom"], producer) is None
    assert float_behind("xd2", producer) == "x" and float_behind("y", producer) == "r"
    assert float_behind("w", producer) == "w" and float_behind("fake_d", producer) == "fake_d"

    graph = GraphHandle(model)
    nodes = {n.name: n for n in graph.graph.nodes}
    tensors = graph.graph.tensors()
    for t in ("x", "xd", "w", "r"):
        assert [(q.name, dq.name) for q, dq in gs_pairs_reading(graph, tensors[t])] == \
            [(q.name, dq.name) for q, dq in pairs_reading(t, consumers)]
    for name in ("dq", "dq2", "dq3", "wdq", "after_custom"):
        q_gs, q_proto = pair_q(graph, nodes[name]), pair_quantize(by_name[name], producer)
        assert (q_gs.name if q_gs else None) == (q_proto.name if q_proto else None)
    assert [(t.name, dq.name) for t, dq in owned_output_pairs(graph, nodes["relu"])] == [("r", "dq3")]
    assert is_q(nodes["q2"]) and is_dq(nodes["dq2"]) and not is_q(nodes["custom"])
    assert is_qdq_node(nodes["wdq"]) and not is_qdq_node(nodes["relu"])


@given(st.sampled_from(list(QuantDtype)), st.booleans(), st.booleans())
def test_storage_range_is_dtype_range(dtype: QuantDtype, narrow: bool, reduce: bool) -> None:
    lo, hi = dtype_range(dtype, narrow, reduce)
    full = dtype_range(dtype)
    assert full[0] <= lo < hi <= full[1]
    if dtype.bits >= 8:  # numpy carries these types natively: the range is numpy's own
        info = np.iinfo(dtype.numpy_dtype)
        assert full == (int(info.min), int(info.max)) == storage_range(dtype.numpy_dtype)
    rlo, rhi = dtype_range(dtype, reduce_range=True)
    assert rhi - rlo == 2 ** (dtype.bits - 1) - 1


def test_int4_pairs_clamp_to_the_int4_range() -> None:
    """An int4 zero point (stored by onnx as ``ml_dtypes.int4``, which ``np.iinfo`` does not know) gives the int4
    range, not the "no clamp" range of non-integer carriers."""
    zp = numpy_helper.to_array(helper.make_tensor("z4", onnx.TensorProto.INT4, [], [0]))
    assert storage_range(zp.dtype) == (-8, 7) and storage_range(np.float32) is None
    s = numpy_helper.from_array(np.float32(0.5), "s")
    z4 = helper.make_tensor("z4", onnx.TensorProto.INT4, [], [0])
    graph = helper.make_graph([helper.make_node("QuantizeLinear", ["x", "s", "z4"], ["q"], name="q")], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("q", onnx.TensorProto.INT4, [2])], [s, z4])
    handle = GraphHandle(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    params = qparams(handle, next(n for n in handle.graph.nodes if n.name == "q"))
    assert params is not None and (params.qmin, params.qmax) == (-8, 7)
