"""``fold_constants``: evaluate every subgraph whose inputs are all constants and store the results.

Rewrite, per scope (the top graph, then If/Loop/Scan bodies)::

    before: c = Constant<value=V>()              after: c ← initializer V
    before: y = f(c1, c2, ...)   (all constant)   after: y ← initializer f(c1, c2, ...)
    before: s = Shape(x)  (x's shape static)      after: s ← initializer shape(x)[start:end]
    before: n = Size(x)   (x's shape static)      after: n ← initializer prod(shape(x))

Constness propagates forward (Kahn-style, O(N)); every foldable node of a scope is then evaluated in ONE
onnxruntime session (``onnx.reference`` as fallback), never one session per node. Results keep their tensor
names; a folded graph output becomes a ``Constant`` node producing it.

Never folded: QuantizeLinear / DequantizeLinear (a Q/DQ pair on a weight must stay), random ops, Dropout,
ops with subgraphs, sequence/optional ops and ops outside the default domain. Size cap: a result larger than
``max_output_bytes`` is not materialized; generator ops (ConstantOfShape, Expand, Tile, Range, ...) are not
even evaluated unless their output size is known below the cap beforehand.

Initializers listed as graph inputs (IR < 4) stop being inputs: qgraph's graph handle already drops them
from the inputs on import and writes IR >= 4, so they are plain constants for this pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassDetails, PassResult, register
from qgraph.graph import (
    Inferred,
    const_value,
    constant_node_value,
    graph_scopes,
    is_default_domain,
    node_subgraphs,
    rebuild,
    tensor_shape,
)
from qgraph.quant.qdq_graph import is_qdq

from .evaluate import evaluation_model, generator_size, run_model, shape_value

_RANDOM = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
_NEVER = (  # and Q/DQ (`is_qdq`)
    _RANDOM
    | frozenset(
        {
            "Constant",
            "Dropout",
            "If",
            "Loop",
            "Scan",
            "SequenceConstruct",
            "SequenceEmpty",
            "SequenceInsert",
            "SequenceErase",
            "SequenceAt",
            "SequenceLength",
            "SplitToSequence",
            "ConcatFromSequence",
            "SequenceMap",
            "Optional",
            "OptionalGetElement",
            "OptionalHasElement",
        }
    )
)
#: Ops whose output size depends on input *values*: evaluated only when that size is known to fit the cap.
_GENERATORS = frozenset(
    {"ConstantOfShape", "Expand", "Tile", "Range", "EyeLike", "OneHot", "Resize", "Upsample", "Pad"}
)


@dataclass(frozen=True)
class FoldConstantsDetails(PassDetails):
    """What `FoldConstants` folded: nodes by kind, the initializers (and bytes) it created, the onnxruntime
    sessions it ran and the scopes it walked."""

    constant_nodes: int
    shape_nodes: int
    evaluated_nodes: int
    initializers: int
    bytes: int
    sessions: int
    scopes: int


class FoldConstantsConfig(PassConfig):
    """Options of `FoldConstants`."""

    max_output_bytes: int = Field(
        default=64 << 20, ge=0, description="Never materialize a folded tensor larger than this many bytes."
    )
    fold_shapes: bool = Field(default=True, description="Fold Shape/Size of tensors whose shape is fully static.")
    recurse_subgraphs: bool = Field(default=True, description="Also fold inside If/Loop/Scan bodies.")
    evaluator: Literal["onnxruntime", "reference"] = Field(
        default="onnxruntime", description="Engine evaluating the constant subgraphs (the other is the fallback)."
    )


@register
class FoldConstants(Pass[FoldConstantsConfig]):
    """Replace constant subgraphs, Constant nodes and static Shape/Size by initializers (batched evaluation).

    Rewrite: ``y = f(c1, ..., ck)`` with every ``ci`` constant ⇒ initializer ``y = f(c1, ..., ck)``; Q/DQ on
    weights, random ops and results over ``max_output_bytes`` are kept.
    """

    name = "fold_constants"
    config_class = FoldConstantsConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Fold every scope; report folded node counts, created initializers and skipped nodes."""
        return _Folder(graph, self.config, self.name).run()


class _Folder:
    def __init__(self, handle: GraphHandle, config: FoldConstantsConfig, pass_name: str) -> None:
        self.handle = handle
        self.cfg = config
        self.pass_name = pass_name
        self.result = PassResult()
        self.scopes = graph_scopes(handle.graph, config.recurse_subgraphs)
        self.inferred: Inferred | None = None
        self.stats = {"constant_nodes": 0, "shape_nodes": 0, "evaluated_nodes": 0, "initializers": 0, "bytes": 0}
        self.sessions = 0

    def name(self, base: str) -> str:
        return self.handle.unique_name(base)

    def run(self) -> PassResult:
        for g in self.scopes:
            self.constant_nodes(g)
        if self.cfg.fold_shapes and any(self.shape_unknown(n) for g in self.scopes for n in g.nodes):
            self.inferred = self.handle.shapes()
        for g in self.scopes:
            self.fold(g)
        res = self.result
        res.rewritten = self.stats["constant_nodes"] + self.stats["shape_nodes"] + self.stats["evaluated_nodes"]
        res.nodes_removed = res.rewritten - res.nodes_added
        res.details = FoldConstantsDetails(**self.stats, sessions=self.sessions, scopes=len(self.scopes))
        return res

    # ------------------------------------------------------------------ Constant nodes
    def constant_nodes(self, g: gs.Graph) -> None:
        """``c = Constant<value=V>()`` → initializer ``c`` (kept when ``c`` is a graph output)."""
        outputs = {id(t) for t in g.outputs}
        removed = []
        for node in g.nodes:
            if node.op != "Constant" or not is_default_domain(node.domain) or len(node.outputs) != 1:
                continue
            out = node.outputs[0]
            value = constant_node_value(node)
            if value is None or id(out) in outputs or not out.name:
                continue
            self.result.matched += 1
            list.clear(out.inputs)
            list.clear(node.outputs)
            out.to_constant(np.array(value))
            removed.append(node)
            self.stats["constant_nodes"] += 1
        rebuild(g, removed)

    # ------------------------------------------------------------------ planning
    def shape_unknown(self, node: gs.Node) -> bool:
        return node.op in ("Shape", "Size") and node.inputs and tensor_shape(node.inputs[0]) is None

    def shape_value(self, node: gs.Node) -> np.ndarray | None:
        return shape_value(node, self.static_shape) if self.cfg.fold_shapes else None

    def static_shape(self, t: gs.Tensor) -> tuple[int, ...] | None:
        shape = tensor_shape(t, self.inferred)
        if shape is None or any(d is None for d in shape):
            return None
        return tuple(int(d) for d in shape)  # type: ignore[arg-type]

    def plan(self, g: gs.Graph, known: dict[int, np.ndarray]) -> list[gs.Node]:
        """Foldable nodes of ``g`` in dependency order; fills ``known`` with Shape/Size values."""
        waiting: dict[int, int] = {}
        watchers: dict[int, list[gs.Node]] = {}
        ready: list[gs.Node] = []

        def constant(t: gs.Tensor) -> bool:
            return not t.name or isinstance(t, gs.Constant) or id(t) in known or const_value(t) is not None

        for node in g.nodes:
            value = self.shape_value(node)
            if value is not None:
                ready.append(node)
                continue
            qdq = is_qdq(node, dynamic=True)
            if qdq or not is_default_domain(node.domain) or node.op in _NEVER or node_subgraphs(node):
                if (qdq or node.op in _RANDOM) and node.inputs and all(constant(t) for t in node.inputs):
                    kind = "Q/DQ on a constant weight is kept" if qdq else "random op"
                    self.result.skip(node.name, f"{kind}: never folded")
                continue
            if not node.outputs:
                continue
            pending = {id(t): t for t in node.inputs if not constant(t)}
            if not pending:
                ready.append(node)
            else:
                waiting[id(node)] = len(pending)
                for t in pending.values():
                    watchers.setdefault(id(t), []).append(node)
        order: list[gs.Node] = []
        i = 0
        while i < len(ready):
            node = ready[i]
            i += 1
            value = self.shape_value(node)
            if value is not None:
                known[id(node.outputs[0])] = value
            elif node.op in _GENERATORS:
                size = generator_size(node, known, self.static_shape)
                if size is None or size > self.cfg.max_output_bytes:
                    what = "unknown before evaluation" if size is None else f"{size} bytes"
                    self.result.skip(node.name, f"{node.op} output size {what} (cap {self.cfg.max_output_bytes})")
                    continue
            self.result.matched += 1
            order.append(node)
            for out in node.outputs:
                for w in watchers.pop(id(out), ()):
                    waiting[id(w)] -= 1
                    if waiting[id(w)] == 0:
                        ready.append(w)
        return order

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, nodes: list[gs.Node], known: dict[int, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Run ``nodes`` (dependency order) as one model; output name → value, None if evaluation failed."""
        if not nodes:
            return {}
        model, names = evaluation_model(nodes, known, self.handle.opset, list(self.handle.graph.import_domains or []))
        errors = []
        order = ["onnxruntime", "reference"] if self.cfg.evaluator == "onnxruntime" else ["reference", "onnxruntime"]
        for engine in order:
            try:
                values = run_model(engine, model, names)
            except Exception as exc:  # both engines raise their own exception types: report and fall back
                errors.append(f"{engine}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            self.sessions += 1
            return dict(zip(names, values, strict=True))
        self.result.notes.append(
            f"could not evaluate {len(nodes)} constant node(s) ({'; '.join(errors)}); they are left unfolded"
        )
        return None

    # ------------------------------------------------------------------ rewrite
    def fold(self, g: gs.Graph) -> None:
        known: dict[int, np.ndarray] = {}
        order = self.plan(g, known)
        if not order:
            return
        shape_ids = {id(n) for n in order if id(n.outputs[0]) in known and n.op in ("Shape", "Size")}
        computed = self.evaluate([n for n in order if id(n) not in shape_ids], known)
        if computed is None:
            order = [n for n in order if id(n) in shape_ids]
            computed = {}
        values = dict(known)
        for node in order:
            for t in node.outputs:
                if t.name in computed:
                    values[id(t)] = np.asarray(computed[t.name])
        outputs = {id(t) for t in g.outputs}
        folded = {id(n) for n in order}

        def needed(t: gs.Tensor) -> bool:
            return bool(t.name) and (id(t) in outputs or any(id(c) not in folded for c in t.outputs))

        for node in reversed(order):  # consumers first: un-folding a node makes its inputs needed
            for t in node.outputs:
                if not needed(t):
                    continue
                value = values.get(id(t))
                if value is None or value.dtype == object:
                    reason = "no value" if value is None else "non-numeric result"
                elif value.nbytes > self.cfg.max_output_bytes:
                    reason = f"result {t.name!r} is {value.nbytes} bytes (cap {self.cfg.max_output_bytes})"
                else:
                    continue
                folded.discard(id(node))
                self.result.matched -= 1
                self.result.skip(node.name, f"not folded: {reason}")
                break
        removed: list[gs.Node] = []
        replaced: dict[int, list[gs.Node]] = {}
        for node in order:
            if id(node) not in folded:
                continue
            keep_outputs = [t for t in node.outputs if needed(t)]
            for t in node.outputs:
                list.clear(t.inputs)
            list.clear(node.outputs)
            new_nodes = []
            for t in keep_outputs:
                value = values[id(t)]
                self.stats["initializers"] += 1
                self.stats["bytes"] += int(value.nbytes)
                if id(t) in outputs:
                    const_node = gs.Node(
                        "Constant",
                        self.name(f"{t.name}/folded"),
                        attrs={"value": gs.Constant(t.name, value)},
                        outputs=[t],
                    )
                    self.handle.tag(const_node, self.pass_name)
                    new_nodes.append(const_node)
                else:
                    t.to_constant(value)
            self.stats["shape_nodes" if id(node) in shape_ids else "evaluated_nodes"] += 1
            if new_nodes:
                self.result.nodes_added += len(new_nodes)
                replaced[id(node)] = new_nodes
            else:
                removed.append(node)
        rebuild(g, removed, replaced)
