"""Softmax / LogSoftmax / Hardmax axis semantics.

Opset 13 computes along one ``axis``; opsets 1-12 coerce the input to 2-D at ``axis`` (rows = dims before
``axis``, columns = all dims from ``axis`` on) and normalise each row. The two agree exactly when ``axis`` is
the last dimension, so

* ``Softmax-13(x; axis=r-1 or -1) → Softmax-11(x; axis=same)`` (a re-stamp);
* ``Softmax-13(x; axis=a<r-1) → Transpose(perm: a last) → Softmax-11(axis=r-1) → Transpose(inverse)``.

Raising uses the opposite trick: ``Softmax-11(x; axis=a)`` with ``a`` not last becomes
``Reshape(Softmax-13(Flatten(x; axis=a); axis=1), Shape(x))``.
"""

from __future__ import annotations

import onnx

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, copy_node, get_attr, set_attr
from .registry import raise_step, step

SOFTMAX_OPS = ("Softmax", "LogSoftmax", "Hardmax")


@step("softmax_axis_semantics", *[(op, 13) for op in SOFTMAX_OPS])
def softmax_13_to_11(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Keep the op when ``axis`` is last; otherwise move ``axis`` last with Transpose and back."""
    axis = int(get_attr(node, "axis", -1))
    x = node.input[0]
    r = ctx.rank(x)
    if axis == -1 or (r is not None and axis == r - 1):
        out = copy_node(node)
        set_attr(out, "axis", axis)
        return [out]
    if r is None:
        raise NoMatch(f"axis={axis} is not the last axis and the rank of {x!r} is unknown")
    a = axis + r if axis < 0 else axis
    if a == r - 1:
        out = copy_node(node)
        set_attr(out, "axis", -1)
        return [out]
    perm = [i for i in range(r) if i != a] + [a]
    inv = [perm.index(i) for i in range(r)]
    b = Builder(ctx, node.name or node.op_type)
    dt = ctx.dtype(x)
    t = b.op("Transpose", [x], perm=perm, dtype=dt)
    core = onnx.helper.make_node(
        node.op_type, [t], [ctx.fresh(f"{node.op_type}_last")], axis=r - 1, name=ctx.fresh(node.name or node.op_type)
    )
    ctx.set_type(core.output[0], dt)
    ctx.at_level(core, from_v - 1)
    b.nodes.append(core)
    b.op("Transpose", [core.output[0]], outputs=[node.output[0]], perm=inv)
    return b.nodes


@raise_step("softmax_axis_semantics", *[(op, 13) for op in SOFTMAX_OPS])
def softmax_11_to_13(node: onnx.NodeProto, ctx: LowerContext, to_v: int) -> list[onnx.NodeProto]:
    """``Softmax-11(x; axis=a)`` → same op at 13 when ``a`` is last, else Flatten → Softmax → Reshape."""
    axis = int(get_attr(node, "axis", 1))
    x = node.input[0]
    r = ctx.rank(x)
    if axis == -1 or (r is not None and (axis == r - 1 or axis + r == r - 1)):
        out = copy_node(node)
        set_attr(out, "axis", -1)
        return [out]
    b = Builder(ctx, node.name or node.op_type)
    flat = b.op("Flatten", [x], axis=axis)
    core = b.op(node.op_type, [flat], axis=1)
    b.op("Reshape", [core, b.op("Shape", [x])], outputs=[node.output[0]])
    return b.nodes
