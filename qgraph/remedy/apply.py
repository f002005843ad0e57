"""What chosen nodes of a QDQ model become, in the top graph and inside If/Loop bodies.

A *remedy* is float (`qgraph.remedy.fallback.fall_back`), 16-bit activations (`qgraph.remedy.widen.widen_activations`),
or 16-bit activations and weights (`qgraph.remedy.widen_weights.widen_weights` too). `apply_remedy` applies it to nodes
of one graph; `remedy_model` to nodes named anywhere in a model: the top graph through a `GraphHandle`, each body as a
model of its own (`qgraph.runtime.bodies.standalone_body`, rewritten, then `graft_body`), nested bodies by recursion. So
a model whose compute sits in ``If`` branches selected at run time (a sample-rate switch) keeps its control flow and
still gets its body nodes back to float one by one.

Body nodes are named by their own node name, as `qgraph.graph.naming` gives it (the models are named first, so an
unnamed node is ``<OpType>(<first output>)`` and a name used again, as in both branches of an ``If``, ``name#2``):
every node can be chosen by the name the reports show.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import onnx
import onnx_graphsurgeon as gs

from qgraph.graph import GraphHandle, named_model
from qgraph.graph.names import unscoped
from qgraph.graph.ops import proto_scopes
from qgraph.graph.selectors import NodeSelector, selects
from qgraph.quant.dynamic_graph import DynamicUnit, dynamic_units, origin_name
from qgraph.quant.qdq_graph import quantized_nodes
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.remedy.dynamic import fall_back_dynamic
from qgraph.remedy.fallback import FallbackOutcome, fall_back
from qgraph.remedy.widen import WidenOutcome, widen_activations
from qgraph.remedy.widen_weights import widen_weights
from qgraph.runtime.bodies import BodyError, ModelFacts, bodies, graft_body, standalone_body

#: What a node the search (or a selector) picks becomes: float; 16-bit activations with its weights unchanged
#: (a16w8); or 16-bit activations and 16-bit weights re-quantized from the float reference (a16w16).
Remedy = Literal["float", "a16w8", "a16w16"]
REMEDIES: tuple[str, ...] = ("float", "a16w8", "a16w16")
Outcome = FallbackOutcome | WidenOutcome


def apply_remedy(graph: GraphHandle, targets: Iterable[gs.Node], to: str = "float",
                 reference: ReferenceWeights | None = None, units: Sequence[DynamicUnit] = ()) -> Outcome:
    """``targets`` back to float (``to="float"``, weights from ``reference`` when given), to 16-bit activations
    (``to="a16w8"``) or to 16-bit activations and weights (``to="a16w16"``: weights re-quantized from
    ``reference`` when given), in place. Dynamically quantized MatMuls (``units``) go back to float
    (`qgraph.remedy.dynamic`); they have no 16-bit form and are refused with ``a16w8``/``a16w16``."""
    if to in ("a16w8", "a16w16"):
        chosen = list(targets)
        outcome = widen_activations(graph, chosen)
        outcome.refused += [(u.name, "dynamically quantized (activations quantized at run time): it has no 16-bit "
                             "form; use to: float") for u in units]
        if to == "a16w16":
            # Nodes whose activations were 16-bit already (a widened neighbour's pair) still get 16-bit weights.
            wide = set(outcome.widened) | {n for n, why in outcome.refused if why.startswith("already 16-bit")}
            outcome.weights = widen_weights(graph, [n for n in chosen if n.name in wide], reference,
                                            int32_biases=outcome.biases_float)
        return outcome
    if to != "float":
        raise ValueError(f"unknown remedy {to!r}: one of {', '.join(REMEDIES)}")
    out = fall_back(graph, targets, reference=reference)
    return fall_back_dynamic(graph, units, reference, out) if units else out


def fall_back_all(graph: GraphHandle) -> FallbackOutcome:
    """Every quantized node and every dynamically quantized MatMul of the top graph back to float, in place (the
    float model whose tensors keep the quantized model's names)."""
    outcome = apply_remedy(graph, quantized_nodes(graph), "float", None, dynamic_units(graph))
    assert isinstance(outcome, FallbackOutcome)
    return outcome


def chosen_in(graph: GraphHandle, wanted: set[str]) -> tuple[list[gs.Node], list[DynamicUnit]]:
    """The nodes of ``graph`` named in ``wanted`` and its dynamic units named there (by their name or their
    integer node's, `qgraph.quant.dynamic_graph`)."""
    units = [u for u in dynamic_units(graph) if u.name in wanted or u.anchor_name in wanted]
    anchors = {id(u.anchor) for u in units}
    return [n for n in graph.graph.nodes if n.name in wanted and id(n) not in anchors], units


@dataclass
class ScopedOutcome:
    """`remedy_model`'s result: the rewritten model and what happened in each scope (``""``: the top graph)."""

    model: onnx.ModelProto
    outcomes: list[tuple[str, Outcome]] = field(default_factory=list)
    unplaced: list[str] = field(default_factory=list)  # names found in no scope


def remedy_model(model: onnx.ModelProto, names: Sequence[str], to: str = "float",
                 reference: ReferenceWeights | None = None) -> ScopedOutcome:
    """``model`` (not modified) with the nodes ``names`` given remedy ``to`` wherever they are (see module docs)."""
    wanted = {unscoped(n) for n in names}
    given = model
    model, _ = named_model(model)  # the names GraphHandle gives (a body is found by the name reports show)
    handle = GraphHandle(model)
    top, units = chosen_in(handle, wanted)
    outcomes: list[tuple[str, Outcome]] = []
    if top or units:
        outcomes.append(("", apply_remedy(handle, top, to, reference, units)))
    out = handle.to_onnx() if top or units else (_copy(model) if model is given else model)  # never edit the caller's
    handle.release()
    placed = {n.name for n in top} | {u.name for u in units} | {u.anchor_name for u in units}
    rest = wanted - placed
    if rest:
        placed |= _in_bodies(out, rest, to, reference, outcomes, "")
    return ScopedOutcome(out, outcomes, sorted(wanted - placed))


def _in_bodies(model: onnx.ModelProto, wanted: set[str], to: str, reference: ReferenceWeights | None,
               outcomes: list[tuple[str, Outcome]], prefix: str) -> set[str]:
    """Apply the remedy to the nodes of ``wanted`` inside ``model``'s bodies, in place; the names placed."""
    placed: set[str] = set()
    facts: ModelFacts | None = None
    for node, attr in list(bodies(model)):
        inner = {m for g in _body_graphs(node, attr) for n in g.node for m in (n.name, origin_name(n.name))}
        if not inner & wanted:
            continue
        facts = facts if facts is not None else ModelFacts.of(model)
        try:
            body = standalone_body(model, node, attr, facts)
        except BodyError:
            continue  # its outer types are unknown: the names stay unplaced
        scope = f"{prefix}{node.name}.{attr}"
        handle = GraphHandle(body.model)
        here, units = chosen_in(handle, wanted)
        if here or units:
            outcomes.append((scope, apply_remedy(handle, here, to, reference, units)))
            placed |= {n.name for n in here} | {u.name for u in units} | {u.anchor_name for u in units}
        rewritten = handle.to_onnx()
        handle.release()
        placed |= _in_bodies(rewritten, wanted - placed, to, reference, outcomes, scope + "/")
        graft_body(model, body, rewritten)
        _import_domains(model, rewritten)
    return placed


def _import_domains(model: onnx.ModelProto, body: onnx.ModelProto) -> None:
    """Opset imports a rewritten body added (``com.microsoft`` for 16-bit Q/DQ) belong to the whole model."""
    have = {o.domain for o in model.opset_import}
    model.opset_import.extend(o for o in body.opset_import if o.domain not in have)


def _body_graphs(node: onnx.NodeProto, attr: str) -> list[onnx.GraphProto]:
    return [g for a in node.attribute if a.name == attr for g in proto_scopes(a.g)]


def body_candidates(model: onnx.ModelProto, restrict: NodeSelector | None = None
                    ) -> tuple[list[tuple[str, str]], list[str]]:
    """``(name, op)`` of every quantized node inside ``model``'s If/Loop bodies (nested ones too), by the names
    `qgraph.graph.naming` gives (unique in the model), optionally only those ``restrict`` selects by name, regex or
    op type; and notes."""
    model, _ = named_model(model)  # a standalone body alone would name its nodes without the rest of the model
    found: list[tuple[str, str]] = []
    _collect(model, found)
    if restrict is not None:
        found = [(n, op) for n, op in found if selects(restrict, n, op)]
    return found, []


def _collect(model: onnx.ModelProto, found: list[tuple[str, str]]) -> None:
    facts: ModelFacts | None = None
    for node, attr in list(bodies(model)):
        facts = facts if facts is not None else ModelFacts.of(model)
        try:
            body = standalone_body(model, node, attr, facts)
        except BodyError:
            continue
        handle = GraphHandle(body.model)
        found.extend((n.name, n.op) for n in quantized_nodes(handle))
        found.extend((u.name, u.op) for u in dynamic_units(handle))
        handle.release()
        _collect(body.model, found)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out
