"""Input → attribute moves: ``axes`` of ReduceX / Squeeze / Unsqueeze.

* ``ReduceX-18(data, axes=const) → ReduceX-13(data; axes=[...])`` (``ReduceSum-13 → ReduceSum-11`` likewise);
  a missing or empty ``axes`` reduces everything, or with ``noop_with_empty_axes=1`` becomes the op's
  element-wise part alone (``Identity``, ``Abs`` for L1, ``Sqrt(x*x)`` for L2, ... as onnxruntime computes).
  Non-constant axes go to the runtime-axes rewrite of `reduce_dynamic` (exact, needs the input rank).
* ``Squeeze-13(data, axes=const) → Squeeze-11(data; axes=[...])`` and the same for ``Unsqueeze``; a
  non-constant ``axes`` is refused.
"""

from __future__ import annotations

import onnx

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, copy_node, del_attr, get_attr, input_at, set_attr, trim_inputs
from .reduce_dynamic import reduce_runtime_axes
from .registry import step

REDUCE_18 = (
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSumSquare",
)


@step("reduce_axes_to_attribute", *[(op, 18) for op in REDUCE_18], ("ReduceSum", 13))
def reduce_axes_to_attr(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``ReduceX(data, axes) → ReduceX(data; axes=const)``; empty/missing axes keep their meaning."""
    axes_name = input_at(node, 1)
    noop = int(get_attr(node, "noop_with_empty_axes", 0))
    out = copy_node(node)
    del_attr(out, "noop_with_empty_axes")
    if axes_name:
        axes = ctx.const(axes_name)
        if axes is None:
            return reduce_runtime_axes(node, ctx, from_v)
        vals = [int(a) for a in axes.reshape(-1)]
    else:
        vals = []
    trim_inputs(out, 1)
    if not vals:
        if noop:
            return _no_reduction(node, ctx)
        return [out]
    set_attr(out, "axes", vals)
    return [out]


def _no_reduction(node: onnx.NodeProto, ctx: LowerContext) -> list[onnx.NodeProto]:
    """``noop_with_empty_axes=1`` with empty axes: the element-wise part of the op, without reducing."""
    b = Builder(ctx, node.name or node.op_type)
    x, y = node.input[0], node.output[0]
    dt = ctx.dtype(x)
    op = node.op_type
    if op in ("ReduceL1",):
        b.op("Abs", [x], outputs=[y])
    elif op in ("ReduceL2", "ReduceSumSquare"):
        sq = b.op("Mul", [x, x], outputs=None if op == "ReduceL2" else [y], dtype=dt)
        if op == "ReduceL2":
            b.op("Sqrt", [sq], outputs=[y])
    elif op == "ReduceLogSum":
        b.op("Log", [x], outputs=[y])
    elif op == "ReduceLogSumExp":
        b.op("Log", [b.op("Exp", [x], dtype=dt)], outputs=[y])
    else:
        b.op("Identity", [x], outputs=[y])
    return b.nodes


@step("axes_to_attribute", ("Squeeze", 13), ("Unsqueeze", 13))
def squeeze_axes_to_attr(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Squeeze/Unsqueeze(data, axes=const) → Squeeze/Unsqueeze(data; axes=[...])``."""
    axes_name = input_at(node, 1)
    out = copy_node(node)
    trim_inputs(out, 1)
    if not axes_name:
        if node.op_type == "Unsqueeze":
            raise NoMatch("Unsqueeze without axes")
        return [out]
    axes = ctx.const(axes_name)
    if axes is None:
        raise NoMatch(f"axes input {axes_name!r} is not a constant; {node.op_type}-11 needs an attribute")
    vals = [int(a) for a in axes.reshape(-1)]
    if vals or node.op_type == "Unsqueeze":
        set_attr(out, "axes", vals)
    return [out]
