"""Helpers of ``float_fallback``: the float model behind a QDQ model (top graph and If/Loop bodies), and the one
auto mode compares with."""

from __future__ import annotations

import onnx

from qgraph import GraphHandle, PassContext, PassResult
from qgraph.graph.detach import with_weights
from qgraph.quant.qdq import has_quantization
from qgraph.remedy.apply import fall_back_all
from qgraph.runtime.bodies import BodyError, ModelFacts, bodies, graft_body, standalone_body


def strip_all(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every quantized node of the top graph in float (`strip_bodies` does the bodies)."""
    handle = GraphHandle(model)
    fall_back_all(handle)
    return handle.to_onnx()


def strip_bodies(model: onnx.ModelProto) -> int:
    """Every quantized node inside ``model``'s If/Loop bodies (nested ones too) back to float, in place; returns
    how many there were. Each body is rewritten as a model of its own (`qgraph.runtime.bodies`) and grafted back, so
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
        nodes = fall_back_all(handle).fallen_back
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


def compare_with(qdq: onnx.ModelProto, given: str | None, floats: onnx.ModelProto | None,
                 ctx: PassContext, res: PassResult) -> tuple[onnx.ModelProto, int]:
    """The float model auto mode compares with (``given``: the file `auto.reference` names, else ``floats``: the
    recipe's float reference, else ``qdq`` stripped of Q/DQ), and how many quantized nodes sit inside bodies."""
    from qgraph.io.model_io import load_model

    if given is not None or floats is not None:
        if given is not None:
            reference = load_model(given)
        else:
            assert floats is not None
            reference = with_weights(floats, ctx.float_reference_weights)
            res.notes.append("auto: compared with the float model before quantization (the recipe's float reference)")
        return reference, strip_bodies(copy_model(qdq)) if next(bodies(qdq), None) is not None else 0
    reference = strip_all(qdq)
    res.notes.append("auto: compared with this model with every Q/DQ removed (set auto.reference to the float model "
                     "to include weight quantization error)")
    return reference, strip_bodies(reference)


def recipe_reference(graph: GraphHandle, ctx: PassContext) -> onnx.ModelProto | None:
    """The recipe's float reference when a quantizing pass ran before this one (it is not quantized) and it takes the
    same inputs and gives as many outputs as this graph (a pass such as specialize_inputs may have changed them
    since), else None."""
    ref = ctx.float_reference
    if ref is None or has_quantization(ref):
        return None
    inits = {t.name for t in ref.graph.initializer}
    ref_inputs = sorted(i.name for i in ref.graph.input if i.name not in inits)
    if ref_inputs != sorted(t.name for t in graph.graph.inputs) or len(ref.graph.output) != len(graph.graph.outputs):
        return None
    return ref
