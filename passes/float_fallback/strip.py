"""Helpers of ``float_fallback``'s auto mode: the float model behind a QDQ model, top graph and If/Loop bodies."""

from __future__ import annotations

import onnx

from qgraph import GraphHandle
from qgraph.fallback import fall_back, quantized_nodes
from qgraph.subgraphs import BodyError, ModelFacts, bodies, graft_body, standalone_body


def strip_all(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every quantized node of the top graph in float (`strip_bodies` does the bodies)."""
    handle = GraphHandle(model)
    fall_back(handle, quantized_nodes(handle))
    return handle.to_onnx()


def strip_bodies(model: onnx.ModelProto) -> int:
    """Every quantized node inside ``model``'s If/Loop bodies (nested ones too) back to float, in place; returns
    how many there were. Each body is rewritten as a model of its own (`qgraph.subgraphs`) and grafted back, so
    the baseline of the search includes the error made inside bodies (else a model quantized only there would
    read as float: "target met" at any target)."""
    if next(bodies(model), None) is None:
        return 0
    found = 0
    facts = ModelFacts.of(model)
    for node, attr in list(bodies(model)):
        try:
            body = standalone_body(model, node, attr, facts)
        except BodyError:
            continue  # not extractable: left as is (its outer types are unknown)
        handle = GraphHandle(body.model)
        nodes = quantized_nodes(handle)
        if nodes:
            fall_back(handle, nodes)
        inner = handle.to_onnx()
        nested = strip_bodies(inner)
        if nodes or nested:
            graft_body(model, body, inner)
        found += len(nodes) + nested
    return found


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out
