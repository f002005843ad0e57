"""Control-flow bodies as models of their own: extract, feed, and graft back.

Calibration only sees what onnxruntime can return, and onnxruntime returns no tensor from inside an ``If`` branch
or a ``Loop`` body. So a pass that must calibrate a body works on the body as a standalone model:

- `standalone_body` turns ``node.<attr>`` (a top-level ``If``'s ``then_branch``/``else_branch``, a ``Loop``'s
  ``body``) into a `onnx.ModelProto` whose inputs are the body's formal inputs plus every outer-scope tensor it
  reads (outer initializers become its own initializers);
- `body_feeds` runs the whole model on the calibration data once, for every body together, and returns each
  standalone body's inputs at each execution of the body: for an ``If`` the outer tensors of the samples whose
  condition selects the branch, for a ``Loop`` the formal inputs of every iteration (exposed as extra scan outputs
  of a copy of the loop) with the outer tensors repeated (`body_executions` also says which sample each
  execution ran on, to pair two models' executions);
- `graft_body` puts the transformed body back in place of the original (outer tensors stay outer).

Nested control flow needs nothing more: the standalone body still holds its own nested ``If``/``Loop``, and a pass
that runs on it with the fed data reaches them the same way. ``Scan`` bodies are not handled (`BodyError`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from qgraph.data import Feed
from qgraph.graph import ProtoNames, proto_label
from qgraph.runtime.compare import make_session, session_run

#: Bodies this module can extract, by op type.
BODY_ATTRS: dict[str, tuple[str, ...]] = {"If": ("then_branch", "else_branch"), "Loop": ("body",)}


class BodyError(Exception):
    """A body that cannot be made standalone (the reason is the message: a pass reports it as a skip)."""


@dataclass
class Body:
    """A body made standalone: the model, the outer tensors it reads, which of them are inputs."""

    node: onnx.NodeProto  # the If/Loop node of the model the body came from (graft_body edits it in place)
    attr: str
    model: onnx.ModelProto
    outer: list[str]  # every outer-scope name the body reads
    outer_inputs: list[str]  # those fed at run time (not initializers)


def bodies(model: onnx.ModelProto) -> Iterator[tuple[onnx.NodeProto, str]]:
    """``(node, attribute)`` for every extractable body of the top-level graph."""
    for node in model.graph.node:
        for attr in BODY_ATTRS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
            if any(a.name == attr for a in node.attribute):
                yield node, attr


def _body(node: onnx.NodeProto, attr: str) -> onnx.GraphProto:
    for a in node.attribute:
        if a.name == attr:
            graph: onnx.GraphProto = a.g
            return graph
    raise BodyError(f"{proto_label(node)} has no {attr}")


def _walk(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for n in g.node:
            stack.extend(a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
            for a in n.attribute:
                stack.extend(a.graphs)


def outer_names(body: onnx.GraphProto) -> list[str]:
    """Names ``body`` (at any depth) reads but does not define: its outer-scope references, in first-use order.
    ONNX forbids shadowing, so a name defined anywhere inside is never an outer one."""
    defined: set[str] = set()
    used: dict[str, None] = {}
    for g in _walk(body):
        defined.update(i.name for i in g.input)
        defined.update(i.name for i in g.initializer)
        for n in g.node:
            defined.update(n.output)
            used.update(dict.fromkeys(n.input))
        used.update(dict.fromkeys(o.name for o in g.output))
    return [u for u in used if u and u not in defined]


@dataclass
class ModelFacts:
    """What extracting bodies needs from the whole model, computed once (not once per body)."""

    initializers: dict[str, onnx.TensorProto]
    constants: dict[str, onnx.NodeProto]
    types: dict[str, onnx.TypeProto]
    inputs: set[str]

    @classmethod
    def of(cls, model: onnx.ModelProto) -> ModelFacts:
        """Initializers, Constant nodes, inferred types and graph inputs of ``model``'s top graph."""
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # an un-inferable model still has its declared inputs/outputs
            inferred = model
        g = inferred.graph
        return cls({i.name: i for i in model.graph.initializer},
                   {n.output[0]: n for n in model.graph.node if n.op_type == "Constant" and n.output},
                   {v.name: v.type for v in [*g.input, *g.value_info, *g.output]},
                   {i.name for i in model.graph.input})


def standalone_body(model: onnx.ModelProto, node: onnx.NodeProto, attr: str, facts: ModelFacts | None = None) -> Body:
    """``node.<attr>`` as a model of its own (see module docs); `BodyError` when an outer tensor's type is
    unknown. ``facts`` (`ModelFacts.of(model)`) is shared when extracting several bodies."""
    facts = facts if facts is not None else ModelFacts.of(model)
    body = _body(node, attr)
    outer = outer_names(body)
    inputs = list(body.input)
    initializers = list(body.initializer)
    fed: list[str] = []
    extra_nodes: list[onnx.NodeProto] = []
    for name in outer:
        if name in facts.initializers:
            initializers.append(facts.initializers[name])
        elif name in facts.constants:
            extra_nodes.append(facts.constants[name])
        elif name in facts.types and facts.types[name].HasField("tensor_type"):
            inputs.append(helper.make_value_info(name, facts.types[name]))
            fed.append(name)
        else:
            raise BodyError(f"the type of outer tensor {name!r} read by {proto_label(node)}.{attr} is unknown")
    graph = helper.make_graph([*extra_nodes, *body.node], f"{node.name}.{attr}", inputs, list(body.output),
                              initializers, value_info=list(body.value_info))
    standalone = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return Body(node, attr, standalone, outer, fed)


def _lift_loop_inputs(loop: onnx.NodeProto, names: ProtoNames) -> list[str]:
    """Make ``loop`` (edited in place) also return its body's formal inputs, stacked over iterations; the names of
    those extra outputs (fresh in the model ``names`` knows)."""
    body = _body(loop, "body")
    stacked: list[str] = []
    for i, formal in enumerate(list(body.input)):
        lifted = names.fresh(f"{formal.name}__qgraph_iter")
        body.node.append(helper.make_node("Identity", [formal.name], [lifted],
                                          name=names.fresh(f"{lifted}/identity")))
        body.output.append(helper.make_value_info(lifted, formal.type))
        out = names.fresh(f"{loop.name}__qgraph_input_{i}")
        loop.output.append(out)
        stacked.append(out)
    return stacked


def body_feeds(model: onnx.ModelProto, found: Sequence[Body], data: Iterable[Feed], limit: int) -> list[list[Feed]]:
    """Each standalone body's inputs at each of its executions on ``data`` (at most ``limit`` per body), from one
    session over ``model`` and one pass over the data, whatever the number of bodies."""
    return [[f for _, f in runs] for runs in body_executions(model, found, data, limit)]


def body_executions(model: onnx.ModelProto, found: Sequence[Body], data: Iterable[Feed], limit: int
                    ) -> list[list[tuple[int, Feed]]]:
    """`body_feeds`, each execution paired with the position in ``data`` of the sample it ran on (a loop's
    iterations of one sample share it, in order): what pairs the executions of two models on the same data."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe_nodes = {n.name: n for n in probe.graph.node}
    fresh = ProtoNames(probe)
    stacked = {b.node.name: _lift_loop_inputs(probe_nodes[b.node.name], fresh)
               for b in found if b.node.op_type == "Loop"}
    graph_inputs = {i.name for i in model.graph.input}
    wanted_all: list[str] = []
    for b in found:
        cond = list(b.node.input[:1]) if b.node.op_type == "If" else []
        wanted_all += [*cond, *b.outer_inputs, *stacked.get(b.node.name, [])]
    wanted = [n for n in dict.fromkeys(wanted_all) if n not in graph_inputs]
    probe = _with_outputs(probe, wanted)
    session = make_session(probe)
    names = [i.name for i in session.get_inputs()]
    out: list[list[tuple[int, Feed]]] = [[] for _ in found]
    for k, feed in enumerate(data):
        fetched = session_run(session, wanted, {n: feed[n] for n in names}) if wanted else []
        values = dict(zip(wanted, fetched, strict=True))
        values.update({n: feed[n] for n in graph_inputs if n in feed})
        for b, runs in zip(found, out, strict=True):
            if len(runs) < limit:
                runs += [(k, f) for f in _executions(b, values, stacked.get(b.node.name, []), limit - len(runs))]
        if all(len(r) >= limit for r in out):
            break
    return out


def _executions(body: Body, values: dict[str, Any], stacked: list[str], room: int) -> list[Feed]:
    """The executions of ``body`` one sample's ``values`` hold (at most ``room``)."""
    outer = {n: np.asarray(values[n]) for n in body.outer_inputs}
    if body.node.op_type == "If":
        taken = bool(np.asarray(values[body.node.input[0]]).reshape(-1)[0]) == (body.attr == "then_branch")
        return [outer] if taken else []
    formal = [i.name for i in _body(body.node, "body").input]
    iterations = min(room, len(values[stacked[0]]) if stacked else 0)
    return [{**outer, **{f: np.asarray(values[s][k]) for f, s in zip(formal, stacked, strict=True)}}
            for k in range(iterations)]


def _with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    have = {o.name for o in model.graph.output}
    if all(n in have for n in names):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in have)
    return out


def graft_body(model: onnx.ModelProto, body: Body, transformed: onnx.ModelProto) -> None:
    """Replace ``body`` in ``model`` (in place) by ``transformed``'s graph; outer tensors stay outer (the copies of
    outer initializers and Constants that `standalone_body` made are dropped again)."""
    node = body.node
    original = _body(node, body.attr)
    g = transformed.graph
    outer = set(body.outer)
    if [o.name for o in g.output] != [o.name for o in original.output]:
        raise BodyError(f"{node.name}.{body.attr}: the transformed body renamed its outputs")
    new = helper.make_graph(
        [n for n in g.node if not (n.op_type == "Constant" and set(n.output) <= outer)],
        original.name, list(original.input), list(g.output),
        [i for i in g.initializer if i.name not in outer], value_info=list(original.value_info))
    for a in node.attribute:
        if a.name == body.attr:
            a.g.CopyFrom(new)


__all__ = ["BODY_ATTRS", "Body", "BodyError", "ModelFacts", "bodies", "body_executions", "body_feeds", "graft_body",
           "outer_names", "standalone_body"]
