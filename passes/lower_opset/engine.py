"""The opset lowering engine: ``lower_model(model, target) -> LoweringResult``.

For every node of the default ONNX domain (in the main graph, in If/Loop/Scan bodies and in model-local
functions, which are inlined first) the engine walks the op's version history down to the version the target
opset uses, one registered step adapter at a time, and lowers whatever a step emitted recursively. Ops that do
not exist at the target are replaced by a registered decomposition or by the function body the ONNX schema
carries. Every rewritten node is finally checked against the target schema (attributes, arity, dtypes taken
from shape inference). Any node that cannot be lowered exactly is a refusal; refusals are collected for the
whole model and raised together as one `PassError` before anything is returned.

Cost is linear in the model size: the model is indexed once (names, types, constants) and each node is
handled with O(1) look-ups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnx

from qgraph.errors import PassError
from qgraph.graph import NoMatch, is_default_domain, placeholders_as_inputs, proto_label

from .adapters import load_adapters
from .context import LowerContext, iter_graphs
from .functions import expand_function
from .registry import DECOMPOSITIONS, STEPS
from .schemas import allowed_types, formal_index, has_function, schema, version_at
from .types import collect_types, fix_ir_version, opset_of

#: Lowest target the adapter table covers (older opsets used legacy broadcasting attributes).
MIN_TARGET = 7


@dataclass
class LoweringResult:
    """What `lower_model` produced: the new model and exact counts of what was rewritten."""

    model: onnx.ModelProto
    source_opset: int
    target_opset: int
    #: adapter name -> how many times it was applied
    adapters: dict[str, int] = field(default_factory=dict)
    #: op type -> how many nodes of that op (at any depth) were rewritten
    ops: dict[str, int] = field(default_factory=dict)
    refusals: list[NoMatch] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0

    @property
    def changed(self) -> bool:
        """Whether any node was rewritten (besides the opset stamp)."""
        return bool(self.adapters)


class LoweringError(PassError):
    """Lowering is impossible without changing results; ``refusals`` lists every offending node."""

    def __init__(self, message: str, refusals: list[NoMatch]) -> None:
        super().__init__(message)
        self.refusals = refusals


class _Engine:
    def __init__(self, ctx: LowerContext) -> None:
        self.ctx = ctx
        self.op_counts: Counter[str] = Counter()

    def lower_graph(self, graph: onnx.GraphProto, opset: int, refusals: list[NoMatch]) -> None:
        out: list[onnx.NodeProto] = []
        for node in graph.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    self.lower_graph(a.g, opset, refusals)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for g in a.graphs:
                        self.lower_graph(g, opset, refusals)
            try:
                new = self.lower_node(node, opset, original=True)
            except NoMatch as r:
                name = proto_label(node)
                refusals.append(NoMatch(r.reason, name, node.op_type))
                out.append(node)
                continue
            if len(new) != 1 or new[0] is not node:
                self.op_counts[node.op_type] += 1
            out.extend(new)
        del graph.node[:]
        graph.node.extend(out)

    def lower_node(self, node: onnx.NodeProto, opset: int, original: bool) -> list[onnx.NodeProto]:
        ctx = self.ctx
        if not is_default_domain(node.domain):
            return [node]
        if id(node) in ctx.final_ids:
            self.validate(node, strict=False)
            return [node]
        op = node.op_type
        if not original:
            self.lower_subgraphs(node, opset)
        v = version_at(op, opset)
        if v is None:
            raise NoMatch(f"{op} does not exist at opset {opset}")
        t = version_at(op, ctx.target)
        if t == v:
            if not original:
                self.validate(node, strict=True)
            return [node]
        if t is None:
            emitted, level = self.decompose(node, opset, v), v
        else:
            entry = STEPS.get((op, v))
            try:
                if entry is None:
                    raise NoMatch(f"no exact rewrite from {op}-{v} to an earlier version")
                emitted, level = entry[1](node, ctx, v), v - 1
                ctx.counts[f"{op}-{v}: {entry[0]}"] += 1
            except NoMatch as first:
                if not has_function(schema(op, v)):
                    raise
                try:
                    emitted, level = expand_function(node, ctx, opset), v
                except NoMatch as second:
                    raise NoMatch(f"{first.reason}; function expansion: {second.reason}") from None
                ctx.counts[f"{op}-{v}: function_body"] += 1
        result: list[onnx.NodeProto] = []
        for e in emitted:
            lvl = ctx.levels.get(id(e), level)
            result.extend(self.lower_node(e, lvl, original=False))
        return result

    def lower_subgraphs(self, node: onnx.NodeProto, opset: int) -> None:
        """Lower the bodies of an emitted If/Loop/Scan (first refusal inside is raised)."""
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                inner: list[NoMatch] = []
                self.lower_graph(g, opset, inner)
                if inner:
                    raise NoMatch(f"in the body of {node.op_type}: {inner[0].where}")

    def decompose(self, node: onnx.NodeProto, opset: int, v: int) -> list[onnx.NodeProto]:
        ctx = self.ctx
        op = node.op_type
        entry = DECOMPOSITIONS.get(op)
        reasons = []
        if entry is not None:
            try:
                out = entry[1](node, ctx, opset)
                ctx.counts[f"{op}-{v}: {entry[0]}"] += 1
                return out
            except NoMatch as r:
                reasons.append(r.reason)
        if has_function(schema(op, v)):
            try:
                out = expand_function(node, ctx, opset)
                ctx.counts[f"{op}-{v}: function_body"] += 1
                return out
            except NoMatch as r:
                reasons.append(f"function expansion: {r.reason}")
        why = "; ".join(reasons) if reasons else "no decomposition and no function body"
        raise NoMatch(f"{op} (since opset {v}) does not exist at opset {ctx.target}: {why}")

    def validate(self, node: onnx.NodeProto, strict: bool) -> None:
        """Check a rewritten node against the target schema (arity, attributes, dtypes)."""
        ctx = self.ctx
        t = version_at(node.op_type, ctx.target)
        if t is None:
            raise NoMatch(f"internal: emitted {node.op_type} which does not exist at opset {ctx.target}")
        s = schema(node.op_type, t)
        if len(node.input) > s.max_input or len(node.output) > s.max_output:
            raise NoMatch(f"{node.op_type}-{t} takes at most {s.max_input} inputs / {s.max_output} outputs")
        for a in node.attribute:
            if a.name not in s.attributes:
                raise NoMatch(f"attribute {a.name!r} does not exist in {node.op_type}-{t}")
        bound: dict[str, str] = {}
        for names, params in ((node.input, s.inputs), (node.output, s.outputs)):
            for i, name in enumerate(names):
                if not name:
                    continue
                fi = formal_index(list(params), i)
                if fi is None:
                    raise NoMatch(f"{node.op_type}-{t} has no parameter #{i}")
                p = params[fi]
                ts = ctx.type_str(name)
                if ts is None:
                    if strict and name not in ctx.trusted:
                        raise NoMatch(f"dtype of {name!r} is unknown, cannot check it against {node.op_type}-{t}")
                    continue
                allowed = allowed_types(s, p)
                if ts not in allowed:
                    raise NoMatch(f"{node.op_type}-{t} does not accept {ts} for {p.name!r} ({name!r})")
                if p.type_str in bound and bound[p.type_str] != ts and p.option != p.option.Variadic:
                    raise NoMatch(f"{node.op_type}-{t} needs the same type for all {p.type_str} parameters")
                bound.setdefault(p.type_str, ts)
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                for sub in g.node:
                    if is_default_domain(sub.domain):
                        self.validate(sub, strict=False)


def lower_model(model: onnx.ModelProto, target_opset: int) -> LoweringResult:
    """Rewrite ``model`` so it is valid at ``target_opset`` and computes the same results.

    The input is never modified. Raises `LoweringError` (a `PassError`) listing every node that has no exact
    form at the target, and `PassError` when ``target_opset`` is higher than the model's opset.
    """
    load_adapters()
    src = opset_of(model)
    if target_opset > src:
        raise PassError(f"target opset {target_opset} is higher than the model's opset {src}; use raise_model")
    if target_opset < MIN_TARGET:
        raise PassError(f"lowering below opset {MIN_TARGET} is not supported (target {target_opset})")
    work = onnx.ModelProto()
    work.CopyFrom(model)
    before = sum(len(g.node) for g in iter_graphs(work.graph))
    if target_opset == src:
        return LoweringResult(work, src, target_opset, nodes_before=before, nodes_after=before)
    if len(work.functions):
        from onnx import inliner

        work = inliner.inline_local_functions(work)
    types = collect_types(work)
    ctx = LowerContext(work, target_opset, types)
    engine = _Engine(ctx)
    refusals: list[NoMatch] = []
    engine.lower_graph(work.graph, src, refusals)
    if refusals:
        lines = "\n".join(f"  - {r.where}" for r in refusals)
        raise LoweringError(
            f"cannot lower the model from opset {src} to {target_opset} exactly; {len(refusals)} node(s) "
            f"have no exact form at opset {target_opset}:\n{lines}",
            refusals,
        )
    work.graph.initializer.extend(ctx.initializers)
    for imp in work.opset_import:
        if is_default_domain(imp.domain):
            imp.version = target_opset
    fix_ir_version(work, lowering=True)
    _check(model, work)
    after = sum(len(g.node) for g in iter_graphs(work.graph))
    return LoweringResult(work, src, target_opset, dict(ctx.counts), dict(engine.op_counts), [], before, after)


def _check(original: onnx.ModelProto, new: onnx.ModelProto) -> None:
    """Run the ONNX checker on ``new`` when ``original`` passes it (never return an invalid model)."""
    try:
        onnx.checker.check_model(placeholders_as_inputs(original))
    except Exception:
        return
    try:
        onnx.checker.check_model(placeholders_as_inputs(new))
    except Exception as exc:
        raise PassError(f"internal error: the lowered model is invalid ({exc}); nothing was written") from exc


__all__ = ["MIN_TARGET", "LoweringError", "LoweringResult", "lower_model"]
