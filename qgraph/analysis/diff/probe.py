"""Model A with one Q/DQ pair of B applied (`only_this_pair`): what measures the output error a pair causes alone.

A weight pair replaces A's float weight by its fake-quantized value ``dequantize(codes)`` (or ``DQ(Q(w))``); an
activation pair inserts ``x → (clip(round(x / s) + z, qmin, qmax) - z) · s`` with B's scale and zero point before
the nodes that read the pair in B. A pair inside an If/Loop body (`QuantPoint.path`) is applied in that body of A:
its probe nodes sit in the body's graph, next to the readers; a weight is looked for from the body outwards. Both
edit one working copy in place and are undone on exit, so measuring many pairs copies A once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qgraph.analysis.diff.quant_points import QuantPoint
from qgraph.graph import ProtoNames
from qgraph.graph.opsets import model_opset
from qgraph.quant.math import dequantize
from qgraph.quant.rescaling import channel_shape

if TYPE_CHECKING:
    from qgraph.analysis.diff.attribution import Culprit


def body_graphs(model: onnx.ModelProto, path: tuple[tuple[str, str], ...]) -> list[onnx.GraphProto] | None:
    """The graphs from the top one down to the body at ``path`` (``(first output of the If/Loop, attribute)``
    per level), or None when ``model`` has no such body."""
    graphs = [model.graph]
    for ident, attr in path:
        node = next((n for n in graphs[-1].node if (n.output[0] if n.output and n.output[0] else n.name) == ident),
                    None)
        body = None if node is None else next((a.g for a in node.attribute if a.name == attr), None)
        if body is None:
            return None
        graphs.append(body)
    return graphs


#: The oldest opset an activation probe runs in (Max/Min broadcast from opset 8; Round is emulated before 11).
MIN_PROBE_OPSET = 8


def _rounded(n: Callable[[str, list[str], str], onnx.NodeProto], base: str, opset: int) -> list[onnx.NodeProto]:
    """``{base}/round`` = round(``{base}/div``) with the ops the model's opset has: Round from opset 11, before it
    Floor(x + 0.5) (halves round up instead of to even: a probe's estimate, never the model's result)."""
    if opset >= 11:
        return [n("Round", [f"{base}/div"], "round")]
    return [n("Add", [f"{base}/div", f"{base}/half"], "plus_half"), n("Floor", [f"{base}/plus_half"], "round")]


class only_this_pair:
    """Apply one pair to ``work`` (A) in place and undo it on exit. ``names``: the names of ``work``
    (`qgraph.graph.ProtoNames`), built once by a caller applying many pairs; the probe's nodes get a free
    namespace from it."""

    def __init__(self, work: onnx.ModelProto, culprit: Culprit, rescaled: tuple[int, np.ndarray] | None = None,
                 names: ProtoNames | None = None) -> None:
        self.work, self.c, self.rescaled = work, culprit, rescaled
        self.names = names if names is not None else ProtoNames(work)
        self.undo: list[Any] = []

    def __enter__(self) -> object | None:
        p = self.c.point
        graphs = body_graphs(self.work, p.path)
        if graphs is None:
            return None
        return self._activation(p, graphs[-1]) if p.kind == "activation" else self._weight(p, graphs)

    def __exit__(self, *exc: object) -> None:
        for fn in reversed(self.undo):
            fn()

    def _weight(self, p: QuantPoint, graphs: list[onnx.GraphProto]) -> object | None:
        """The weight as the pair's readers see it: the innermost graph holding an initializer of that name."""
        found = ((g, i) for g in reversed(graphs) for i, t in enumerate(g.initializer) if t.name == p.tensor)
        hit = next(found, None)
        if hit is None:
            return None
        g, pos = hit
        old = onnx.TensorProto()
        old.CopyFrom(g.initializer[pos])
        w = numpy_helper.to_array(old)
        if p.codes is not None:
            fq = dequantize(p.codes, p.scale, p.zero_point, p.axis)
        else:
            from qgraph.quant.math import quantize

            fq = dequantize(quantize(w, p.scale, p.zero_point, p.dtype, p.axis), p.scale, p.zero_point, p.axis)
        g.initializer[pos].CopyFrom(numpy_helper.from_array(fq.astype(w.dtype), p.tensor))
        self.undo.append(lambda: g.initializer[pos].CopyFrom(old))
        return True

    def _activation(self, p: QuantPoint, g: onnx.GraphProto) -> object | None:
        """The probe in ``g`` (the graph of the pair's readers), before the readers named by the pair."""
        space = self.names.prefix(f"{p.tensor}/qgraph_probe")  # "<tensor>/qgraph_probe/" unless the model uses it
        shape: list[int] = []
        if p.axis is not None:
            shape = [1] * (self.c.stats.ndim or 1)
            shape[p.axis % len(shape)] = p.channels
        qmin, qmax = p.qrange
        dt = np.dtype(self.c.stats.value_dtype)
        scale = np.asarray(p.scale, np.float64).reshape(shape)
        if self.rescaled is not None:  # B quantizes f·x: on A's x that is the step s / f per channel
            axis, f = self.rescaled
            fit = channel_shape(self.c.stats.ndim or 0, axis, f.size)
            if fit is None or (p.axis is not None and p.axis % len(fit) != axis % len(fit)):
                return None
            scale = scale.reshape(fit if p.axis is not None else [1] * len(fit)) / f.reshape(fit)
            shape = fit if p.axis is not None else shape
        # a flat side (`QuantPoint.flat`) is not clipped: the activation after it gives those values one code anyway
        lo, hi = (-np.inf if p.flat[0] else qmin), (np.inf if p.flat[1] else qmax)
        consts = {"s": scale.astype(dt), "z": np.asarray(p.zero_point, dt).reshape(shape),
                  "lo": np.asarray(lo, dt), "hi": np.asarray(hi, dt)}
        inits = [numpy_helper.from_array(v, f"{space}{k}") for k, v in consts.items()]

        def n(op: str, ins: list[str], o: str) -> onnx.NodeProto:
            return helper.make_node(op, ins, [f"{space}{o}"], name=f"{space}{o}")

        base = space[:-1]  # `_rounded` names "<base>/<what>": the same free namespace
        nodes = [n("Div", [p.tensor, f"{base}/s"], "div"), *_rounded(n, base, model_opset(self.work, 11)),
                 n("Add", [f"{base}/round", f"{base}/z"], "add"),
                 # Max/Min, not Clip: Clip takes its bounds as inputs only from opset 11
                 n("Max", [f"{base}/add", f"{base}/lo"], "max"), n("Min", [f"{base}/max", f"{base}/hi"], "clip"),
                 n("Sub", [f"{base}/clip", f"{base}/z"], "sub"), n("Mul", [f"{base}/sub", f"{base}/s"], "fq")]
        if model_opset(self.work, 11) < 11:
            inits.append(numpy_helper.from_array(np.asarray(0.5, dt), f"{base}/half"))
        names = {k[len(p.scope) + 1:] if p.scope else k for k, _ in p.consumers}  # local names inside a body
        readers = [(k, i) for k, node in enumerate(g.node) for i, t in enumerate(node.input) if t == p.tensor]
        targets = [(k, i) for k, i in readers if g.node[k].name in names] or readers
        outputs = [o for o in g.output if o.name == p.tensor] if not targets else []  # a graph/body output's pair
        if not targets and not outputs:
            return None
        saved = onnx.GraphProto()
        saved.node.extend(g.node)
        first = min((k for k, _ in targets), default=len(g.node))
        for k, i in targets:
            g.node[k].input[i] = f"{space}fq"
        for o in outputs:
            o.name = f"{space}fq"
        # The probe goes right before its first reader: onnxruntime wants every graph (bodies too) sorted.
        order = onnx.GraphProto()
        order.node.extend(g.node[:first])
        order.node.extend(nodes)
        order.node.extend(g.node[first:])
        n_inits = len(g.initializer)
        del g.node[:]
        g.node.extend(order.node)
        g.initializer.extend(inits)

        def undo() -> None:
            del g.node[:]
            g.node.extend(saved.node)
            del g.initializer[n_inits:]
            for o in outputs:
                o.name = p.tensor

        self.undo.append(undo)
        return True
