"""Opset raising engine behind the ``raise_opset`` pass: ``raise_model(model, target) -> RaisingResult``.

Raising wraps ``onnx.version_converter.convert_version`` and repairs what it leaves behind:

* Softmax/LogSoftmax/Hardmax below 13 with a non-last ``axis`` are first rewritten with the exact
  ``Flatten → op(axis=1) → Reshape(Shape(x))`` form (the converter's own handling depends on shapes);
* attributes the target schema no longer has are dropped when they hold the old default (else refused);
* the IR version is raised only as far as the new opset needs (never above what onnxruntime 1.31 loads);
* the result must pass the ONNX checker with strict shape inference, otherwise a `PassError` is raised and
  nothing is returned. The input model is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import helper

from qgraph.errors import PassError
from qgraph.graph import NoMatch, is_default_domain, placeholders_as_inputs
from qgraph.graph.opsets import MIN_OPSET, max_opset

from .adapters import load_adapters
from .context import LowerContext, iter_graphs
from .registry import RAISE_STEPS
from .schemas import attr_default, schema, version_at
from .types import MAX_IR, collect_types, fix_ir_version, opset_of


@dataclass
class RaisingResult:
    """What `raise_model` produced."""

    model: onnx.ModelProto
    source_opset: int
    target_opset: int
    adapters: dict[str, int] = field(default_factory=dict)
    dropped_attributes: list[str] = field(default_factory=list)


def _pre_rewrite(model: onnx.ModelProto, target: int) -> dict[str, int]:
    """Apply qgraph's own raising adapters (exact semantic rewrites) before the converter runs."""
    src = opset_of(model)
    ctx = LowerContext(model, target, collect_types(model))
    counts: dict[str, int] = {}
    for g in iter_graphs(model.graph):
        out: list[onnx.NodeProto] = []
        for node in g.node:
            if not is_default_domain(node.domain):
                out.append(node)
                continue
            v_src, v_dst = version_at(node.op_type, src), version_at(node.op_type, target)
            entry = next(
                (
                    (k, e)
                    for k, e in RAISE_STEPS.items()
                    if k[0] == node.op_type and v_src is not None and v_dst is not None and v_src < k[1] <= v_dst
                ),
                None,
            )
            if entry is None:
                out.append(node)
                continue
            try:
                new = entry[1][1](node, ctx, entry[0][1])
            except NoMatch as r:
                raise PassError(f"cannot raise {node.op_type} node {node.name!r}: {r.reason}") from None
            counts[entry[1][0]] = counts.get(entry[1][0], 0) + 1
            out.extend(new)
        del g.node[:]
        g.node.extend(out)
    model.graph.initializer.extend(ctx.initializers)
    return counts


def raise_model(model: onnx.ModelProto, target_opset: int) -> RaisingResult:
    """Rewrite ``model`` for the higher ``target_opset`` with the same results (see module docstring)."""
    load_adapters()
    src = opset_of(model)
    if target_opset < src:
        raise PassError(f"target opset {target_opset} is lower than the model's opset {src}; use lower_model")
    if helper.find_min_ir_version_for([helper.make_opsetid("", target_opset)]) > MAX_IR:
        raise PassError(f"opset {target_opset} needs an IR version onnxruntime 1.31 cannot load (max {MAX_IR})")
    work = onnx.ModelProto()
    work.CopyFrom(model)
    if target_opset == src:
        return RaisingResult(work, src, target_opset)
    counts = _pre_rewrite(work, target_opset)
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(work, target_opset)
    except Exception as exc:
        raise PassError(f"cannot raise the model from opset {src} to {target_opset}: {exc}") from None
    dropped: list[str] = []
    for g in iter_graphs(converted.graph):
        for node in g.node:
            if not is_default_domain(node.domain):
                continue
            v = version_at(node.op_type, target_opset)
            if v is None:
                raise PassError(f"{node.op_type} does not exist at opset {target_opset}")
            s = schema(node.op_type, v)
            keep = []
            for a in node.attribute:
                if a.name in s.attributes:
                    keep.append(a)
                    continue
                old_v = version_at(node.op_type, src)
                old_default = attr_default(schema(node.op_type, old_v), a.name) if old_v else None
                if old_default is not None and helper.get_attribute_value(a) == old_default:
                    dropped.append(f"{node.op_type}.{a.name}")
                    continue
                raise PassError(
                    f"{node.op_type} node {node.name!r}: attribute {a.name!r} has no meaning at opset "
                    f"{target_opset} and is not at its default"
                )
            if len(keep) != len(node.attribute):
                del node.attribute[:]
                node.attribute.extend(keep)
    for imp in converted.opset_import:
        if is_default_domain(imp.domain):
            imp.version = target_opset
    fix_ir_version(converted, lowering=False)
    try:
        onnx.checker.check_model(placeholders_as_inputs(converted), full_check=True)
    except Exception as exc:
        raise PassError(f"raising to opset {target_opset} produced an invalid model ({exc}); nothing written") from None
    return RaisingResult(converted, src, target_opset, counts, dropped)


__all__ = ["RaisingResult", "raise_model"]


def _pass_classes() -> tuple[type, type]:
    from pydantic import Field

    from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult, register

    from .details import RaiseOpsetDetails

    class RaiseOpsetConfig(PassConfig):
        """Options of `RaiseOpset`."""

        opset: int = Field(
            ge=MIN_OPSET, le=max_opset(),
            description="Target default-domain opset (higher than or equal to the model's).",
        )

    @register
    class RaiseOpset(Pass[RaiseOpsetConfig]):
        """Rewrite the model for a newer opset with the same results (version converter plus repairs)."""

        name = "raise_opset"
        config_class = RaiseOpsetConfig
        preserves_float = True

        def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
            """Raise the whole model; a `PassError` leaves the graph untouched."""
            model, held = graph.weightless_export()  # the converter never needs the weights' bytes
            res = raise_model(model, self.config.opset)
            del model
            out = PassResult(
                details=RaiseOpsetDetails(
                    source_opset=res.source_opset,
                    target_opset=res.target_opset,
                    adapters=res.adapters,
                    dropped_attributes=res.dropped_attributes,
                )
            )
            if res.source_opset != res.target_opset:
                graph.replace_model(res.model, held)
                # the opset stamp is itself a rewrite of the model, also when no node needed an adapter
                out.rewritten = max(1, sum(res.adapters.values()) + len(res.dropped_attributes))
                out.notes.append(f"opset {res.source_opset} -> {res.target_opset}")
            return out

    return RaiseOpsetConfig, RaiseOpset


RaiseOpsetConfig, RaiseOpset = _pass_classes()
__all__ += ["RaiseOpset", "RaiseOpsetConfig"]
