"""Function-body expansion: replace a node by the function body its ONNX schema defines.

``Op(x; attrs) → body nodes`` (the schema's FunctionProto for the chosen function opset, context-dependent
bodies built from the actual input types), with formal inputs/outputs bound to the node's values, internal
values renamed to fresh names, and attribute references (``ref_attr_name``) resolved from the node or the
schema defaults. The body nodes are then lowered recursively from the function's own opset, so an expansion
written for opset 18 still lands on opset 11 when every body op has a lowering.
"""

from __future__ import annotations

import onnx
from onnx import helper

from qgraph.graph import NoMatch, is_default_domain

from .context import LowerContext, constant_value
from .schemas import schema, version_at


def _pick_version(versions: list[int], target: int) -> int:
    below = [v for v in versions if v <= target]
    return max(below) if below else min(versions)


def function_proto(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> tuple[onnx.FunctionProto, onnx.NodeProto]:
    """The FunctionProto defining ``node`` at ``opset`` and the node with schema defaults filled in."""
    v = version_at(node.op_type, opset)
    if v is None:
        raise NoMatch(f"{node.op_type} does not exist at opset {opset}")
    s = schema(node.op_type, v)
    plain: list[int] = list(getattr(s, "function_opset_versions", [])) if getattr(s, "has_function", False) else []
    dep: list[int] = (
        list(getattr(s, "context_dependent_function_opset_versions", []))
        if getattr(s, "has_context_dependent_function", False)
        else []
    )
    if not plain and not dep:
        raise NoMatch(f"{node.op_type}-{v} has no function body")
    full = onnx.NodeProto()
    full.CopyFrom(node)
    present = {a.name for a in full.attribute}
    for name, attr in s.attributes.items():
        if name not in present and attr.default_value is not None and attr.default_value.type != 0:
            full.attribute.append(attr.default_value)
    fp = onnx.FunctionProto()
    f = _pick_version(plain + dep, ctx.target)
    try:
        if f in plain:
            fp.ParseFromString(getattr(s, "get_function_with_opset_version")(f))  # noqa: B009
        else:
            types = []
            for name in full.input:
                if not name:
                    types.append(onnx.TypeProto().SerializeToString())
                    continue
                tp = ctx.types.get(name)
                if tp is None:
                    raise NoMatch(f"type of {name!r} is unknown, needed to build the {node.op_type} body")
                types.append(tp.SerializeToString())
            fp.ParseFromString(
                getattr(s, "get_context_dependent_function_with_opset_version")(  # noqa: B009
                    f, full.SerializeToString(), types
                )
            )
    except NoMatch:
        raise
    except Exception as exc:
        raise NoMatch(f"ONNX cannot build the {node.op_type}-{v} function body: {exc}") from None
    if not fp.node:
        raise NoMatch(f"{node.op_type}-{v} function body is empty for these inputs")
    return fp, full


def expand_function(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> list[onnx.NodeProto]:
    """Inline the schema function body of ``node``; body nodes are declared at the function's opset."""
    fp, full = function_proto(node, ctx, opset)
    body_opset = next((int(i.version) for i in fp.opset_import if is_default_domain(i.domain)), opset)
    attrs = {a.name: a for a in full.attribute}
    for a in fp.attribute_proto:
        attrs.setdefault(a.name, a)
    mapping: dict[str, str] = {}
    for i, formal in enumerate(fp.input):
        mapping[formal] = node.input[i] if i < len(node.input) else ""
    for i, formal in enumerate(fp.output):
        actual = node.output[i] if i < len(node.output) else ""
        mapping[formal] = actual if actual else ctx.fresh(f"{node.op_type}_{formal}_unused")
    prefix = f"{node.name or node.op_type}_{node.op_type}"
    out: list[onnx.NodeProto] = []
    for bn in fp.node:
        new = _inline_node(bn, mapping, attrs, ctx, prefix)
        if is_default_domain(new.domain):
            ctx.at_level(new, body_opset)
        out.append(new)
    for n in out:
        if n.op_type == "Constant" and len(n.output) == 1:
            val = constant_value(n)
            if val is not None:
                ctx.consts[n.output[0]] = val
    _infer_local(out, node, ctx, fp)
    return out


def _rename(name: str, mapping: dict[str, str], ctx: LowerContext, prefix: str) -> str:
    if not name:
        return ""
    if name not in mapping:
        mapping[name] = ctx.fresh(f"{prefix}_{name}")
    return mapping[name]


def _inline_node(
    bn: onnx.NodeProto,
    mapping: dict[str, str],
    attrs: dict[str, onnx.AttributeProto],
    ctx: LowerContext,
    prefix: str,
) -> onnx.NodeProto:
    new = onnx.NodeProto()
    new.op_type, new.domain = bn.op_type, bn.domain
    new.name = ctx.fresh(f"{prefix}_{bn.name or bn.op_type}")
    new.input.extend(_rename(x, mapping, ctx, prefix) for x in bn.input)
    new.output.extend(_rename(x, mapping, ctx, prefix) for x in bn.output)
    for a in bn.attribute:
        if a.ref_attr_name:
            src = attrs.get(a.ref_attr_name)
            if src is None:
                continue
            b = onnx.AttributeProto()
            b.CopyFrom(src)
            b.name = a.name
            new.attribute.append(b)
            continue
        b = onnx.AttributeProto()
        b.CopyFrom(a)
        if b.type == onnx.AttributeProto.GRAPH:
            _rename_graph(b.g, mapping, attrs, ctx, prefix)
        elif b.type == onnx.AttributeProto.GRAPHS:
            for g in b.graphs:
                _rename_graph(g, mapping, attrs, ctx, prefix)
        new.attribute.append(b)
    for o in new.output:
        if o:
            ctx.trusted.add(o)
    return new


def _rename_graph(
    g: onnx.GraphProto,
    mapping: dict[str, str],
    attrs: dict[str, onnx.AttributeProto],
    ctx: LowerContext,
    prefix: str,
) -> None:
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        vi.name = _rename(vi.name, mapping, ctx, prefix)
        ctx.trusted.add(vi.name)
        if vi.type.WhichOneof("value") is not None:
            ctx.types.setdefault(vi.name, vi.type)
    for t in g.initializer:
        t.name = _rename(t.name, mapping, ctx, prefix)
    nodes = [_inline_node(n, mapping, attrs, ctx, prefix) for n in g.node]
    del g.node[:]
    g.node.extend(nodes)


def _infer_local(nodes: list[onnx.NodeProto], node: onnx.NodeProto, ctx: LowerContext, fp: onnx.FunctionProto) -> None:
    """Give the expanded body's intermediate values types (shape inference on the body alone)."""
    inputs = []
    for name in dict.fromkeys(x for x in node.input if x):
        tp = ctx.types.get(name)
        if tp is None:
            continue
        inputs.append(helper.make_value_info(name, tp))
    produced = [o for n in nodes for o in n.output if o]
    graph = helper.make_graph(nodes, "body", inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in produced])
    model = helper.make_model(graph, opset_imports=list(fp.opset_import))
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:
        return
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.type.WhichOneof("value") is not None and vi.name not in ctx.types:
            ctx.types[vi.name] = vi.type
