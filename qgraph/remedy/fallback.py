"""The float-fallback rewrite, for QDQ models from any tool (which nodes are quantized: `qgraph.quant.qdq_graph`).

Falling a node back to float (`fall_back`) rewires it, and only it:

- every input read through ``DequantizeLinear`` is rewired to the float tensor behind it: the input of the
  ``QuantizeLinear`` for activations (walking back through ``DQ → Q → DQ`` chains), the float constant for
  weights stored as ``Q(float constant)``, or a new float constant equal to ``DQ(int constant)`` for weights
  stored as integers (the original float weights are not in such a model; the dequantized values are what
  the quantized model computed with, so the weight side is exact w.r.t. the QDQ model);
- an output that reaches a graph output through ``Q → DQ`` is connected to that graph output directly.

Shared pairs are never modified: a quantized neighbour that reads the same ``DQ`` output keeps reading it (the
fallen-back node is the one that gets rewired), and a neighbour that reads a ``DQ`` whose output is also a graph
output gets that pair on a renamed output, so it stays quantized and bit-identical. Q/DQ nodes that serve no
one afterwards are removed by one cleanup.

With the float model the QDQ model was made from (`ReferenceWeights`: the pipeline's float reference, whose
tensors carry the same names), a weight stored as integers is restored to its float value instead: the constant
input at the same position of the reference node producing the same output tensor (so BatchNorm folding,
equalization and bias correction of the quantized model are undone only for the nodes that go back to float).

Quantizers fold ``Relu`` into the ``QuantizeLinear`` after a Conv/MatMul when its range starts at 0 (onnxruntime
does). Bypassing such a pair would silently drop the Relu, so when a bypassed pair clamps at exactly 0 and the
tensor's producer is not already non-negative, a ``Relu`` is inserted on the float path (``<tensor>/relu``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.graph import GraphHandle
from qgraph.quant.qdq_graph import (
    FloatSource,
    can_be_negative,
    dequantize,
    dq_inputs,
    float_source,
    is_qdq,
    owned_output_pairs,
    pairs_reading,
    qparams,
)
from qgraph.quant.reference_weights import ReferenceWeights

PASS_NAME = "float_fallback"


@dataclass
class FallbackOutcome:
    """What `fall_back` did, node by node."""

    fallen_back: list[str] = field(default_factory=list)
    already_float: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    ignored_qdq: int = 0  # Q/DQ nodes in the selection (they are what gets removed, not what is selected)
    dequantized_weights: list[str] = field(default_factory=list)  # new float constants from integer weights
    relu_restored: list[str] = field(default_factory=list)  # tensors given back the Relu a quantizer folded
    float_weights_restored: list[str] = field(default_factory=list)  # constants taken from the float reference
    still_quantized_for: dict[str, list[str]] = field(default_factory=dict)  # node -> consumers keeping Q/DQ
    #: dynamically quantized MatMuls returned to float (`qgraph.remedy.dynamic`): float node -> (integer node it
    #: replaced, where its weight came from: "float reference" or "dequantized codes")
    dynamic: dict[str, tuple[str, str]] = field(default_factory=dict)
    nodes_added: int = 0
    nodes_removed: int = 0


def fall_back(graph: GraphHandle, targets: Iterable[gs.Node], tag: str = PASS_NAME,
              reference: ReferenceWeights | None = None) -> FallbackOutcome:
    """Return ``targets`` to float in place (see module docs); weights stored as integers take their float value
    from ``reference`` when it has one of the same shape. Bounded walks: 2 index builds, 1 cleanup."""
    out = FallbackOutcome()
    nodes_before = len(graph.graph.nodes)
    chosen: list[gs.Node] = []
    plans: list[list[tuple[int, FloatSource]]] = []
    for node in targets:
        if is_qdq(node):
            out.ignored_qdq += 1
            continue
        plan = [(i, float_source(graph, node.inputs[i])) for i in dq_inputs(graph, node)]
        problems = [s.problem for _, s in plan if s.problem]
        if problems:
            out.refused.append((node.name, "; ".join(problems)))
            continue
        if not plan and not owned_output_pairs(graph, node):
            out.already_float.append(node.name)
            continue
        chosen.append(node)
        plans.append(plan)
    consts: dict[int, gs.Constant] = {}
    relus: dict[str, gs.Tensor] = {}
    added: list[gs.Node] = []
    for node, plan in zip(chosen, plans, strict=True):
        for i, src in plan:
            restored = _restore(graph, node, i, src, reference, out)
            node.inputs[i] = restored if restored is not None else _materialize(graph, src, consts, relus, added, out,
                                                                                 tag)
    graph.graph.nodes.extend(added)
    graph.changed()  # consumer lists moved: rebuild the index once before looking at the output side
    n_relus = len(added)
    for node in chosen:
        keep = sorted(
            {
                c.name
                for t in node.outputs
                for _, dq in pairs_reading(graph, t)
                for c in graph.consumers(dq.outputs[0])
            }
        )
        if keep:
            out.still_quantized_for[node.name] = keep
        for t, dq in owned_output_pairs(graph, node):
            _detach_graph_output(graph, t, dq, added, tag)
        out.fallen_back.append(node.name)
    graph.graph.nodes.extend(added[n_relus:])
    graph.cleanup()
    if added:
        graph.toposort()
    out.nodes_added = len(added)
    out.nodes_removed = nodes_before + len(added) - len(graph.graph.nodes)
    return out


def _restore(graph: GraphHandle, node: gs.Node, i: int, src: FloatSource, reference: ReferenceWeights | None,
             out: FallbackOutcome) -> gs.Constant | None:
    """The reference's float constant for integer weight input ``i`` of ``node`` (None: none of that shape)."""
    if reference is None or src.weight_dq is None or not node.outputs:
        return None
    q = graph.constant_value(src.weight_dq.inputs[0])
    params = qparams(graph, src.weight_dq)
    if q is None or params is None:
        return None
    values = reference.get(node.outputs[0].name, i, src.weight_dq.inputs[0].name, (q, params))
    if values is None or tuple(values.shape) != tuple(q.shape):
        return None
    const = gs.Constant(graph.unique_name(f"{node.name}/float_input{i}"), np.asarray(values, params.scale.dtype))
    out.float_weights_restored.append(const.name)
    return const


def _materialize(
    graph: GraphHandle,
    src: FloatSource,
    consts: dict[int, gs.Constant],
    relus: dict[str, gs.Tensor],
    added: list[gs.Node],
    out: FallbackOutcome,
    tag: str,
) -> gs.Tensor:
    if src.weight_dq is not None:
        dq = src.weight_dq
        if id(dq) not in consts:
            params = qparams(graph, dq)
            values = graph.constant_value(dq.inputs[0])
            assert params is not None and values is not None  # checked by float_source
            base = dq.inputs[0].name
            base = base[: -len("_quantized")] if base.endswith("_quantized") else base + "/float"
            consts[id(dq)] = gs.Constant(graph.unique_name(base), dequantize(values, params))
            out.dequantized_weights.append(consts[id(dq)].name)
        return consts[id(dq)]
    assert src.tensor is not None
    if not src.relu:
        return src.tensor
    t = src.tensor
    if t.name not in relus:
        name = graph.unique_name(f"{t.name}/relu")
        relu_out = gs.Variable(name, dtype=t.dtype, shape=t.shape)
        node = gs.Node("Relu", name, inputs=[t], outputs=[relu_out])
        graph.tag(node, tag)
        added.append(node)
        relus[t.name] = relu_out
        out.relu_restored.append(t.name)
    return relus[t.name]


def _detach_graph_output(graph: GraphHandle, t: gs.Tensor, dq: gs.Node, added: list[gs.Node], tag: str) -> None:
    """Make graph output ``y = DQ(Q(t))`` float; other readers of ``y`` keep the pair on a renamed tensor."""
    y = dq.outputs[0]
    readers = list(graph.consumers(y))
    if readers:
        renamed = gs.Variable(graph.unique_name(f"{y.name}/dq"), dtype=y.dtype, shape=y.shape)
        for reader in readers:
            for i, inp in enumerate(reader.inputs):
                if inp is y:
                    reader.inputs[i] = renamed
        dq.outputs[0] = renamed
    else:
        dq.outputs.clear()
    q = graph.producer(dq.inputs[0])
    params = qparams(graph, q) if q is not None else None
    relu = params is not None and params.clamps_at_zero and can_be_negative(graph, t)
    node = gs.Node("Relu" if relu else "Identity", graph.unique_name(f"{y.name}/float"), inputs=[t], outputs=[y])
    graph.tag(node, tag)
    added.append(node)
