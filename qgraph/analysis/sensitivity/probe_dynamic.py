"""The probe's quantized copy of a dynamically quantized MatMul (`qgraph.quant.dynamic_graph.DynamicUnit`).

In the float model the probe starts from, a unit is the float ``MatMul`` that `qgraph.remedy.dynamic` puts back
(named as the unit, writing the unit's output ``y``). Its quantized copy is the unit's own nodes
(``DynamicQuantizeLinear`` first, then ``MatMulInteger``, ``Cast`` and the scale ``Mul``\\ s, or the fused
``com.microsoft`` node), every output renamed, fed the float model's ``X``: ``ŷ`` is what the quantized unit
computes from exact inputs, and ``(ŷ, y)`` its local error, as for a Q/DQ node (`qgraph.analysis.sensitivity.probe`).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from qgraph.graph import GraphHandle
from qgraph.quant.dynamic_graph import dynamic_units
from qgraph.quant.qdq import is_dynamic_quantize

#: A unit's nodes in order and its output tensor.
UnitNodes = tuple[list[onnx.NodeProto], str]


def unit_nodes(qdq: onnx.ModelProto) -> dict[str, UnitNodes]:
    """Every dynamic unit of ``qdq`` (a named model: `qgraph.graph.named_model`) by its name: its nodes, its
    ``DynamicQuantizeLinear`` first, and its output."""
    handle = GraphHandle(qdq)
    try:
        units = dynamic_units(handle)
        if not units:
            return {}
        by_name = {n.name: n for n in qdq.graph.node}
        found: dict[str, UnitNodes] = {}
        for u in units:
            names = [n.name for n in u.nodes]
            quantizer = handle.producer(u.anchor.inputs[0])
            if quantizer is not None and is_dynamic_quantize(quantizer.op, quantizer.domain):
                names.insert(0, quantizer.name)
            if all(n in by_name for n in names):
                found[u.name] = ([by_name[n] for n in names], u.output.name)
        return found
    finally:
        handle.release()


def copy_nodes(protos: list[onnx.NodeProto], prefix: str, need: Callable[[str], None]
               ) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """``protos`` (in order) copied with ``prefix`` on their names and outputs, reading each other's copies and,
    for every other input, the tensor itself (``need(t)`` makes it available); and the renamed outputs."""
    renamed: dict[str, str] = {}
    copies: list[onnx.NodeProto] = []
    for proto in protos:
        copy = onnx.NodeProto()
        copy.CopyFrom(proto)
        copy.name = prefix + proto.name
        for i, t in enumerate(copy.input):
            if t in renamed:
                copy.input[i] = renamed[t]
            else:
                need(t)
        for i, t in enumerate(copy.output):
            if t:
                renamed[t] = copy.output[i] = prefix + t
        copies.append(copy)
    return copies, renamed


def unit_copy(unit: UnitNodes, prefix: str, need: Callable[[str], None]
              ) -> tuple[list[onnx.NodeProto], list[tuple[str, str]]]:
    """The unit's nodes copied under ``prefix`` (``need(t)`` makes each outside tensor available) and the
    ``(ŷ, y)`` pair."""
    protos, y = unit
    copies, renamed = copy_nodes(protos, prefix, need)
    return copies, [(renamed[y], y)]
