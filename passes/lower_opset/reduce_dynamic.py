"""Reductions over a non-constant ``axes`` input, for targets where ReduceX needs constant axes.

``ReduceX(x, axes)`` with a runtime ``axes`` and a known rank ``r`` becomes, exactly::

    flag[k] = k ∈ normalise(axes)            (or every k when axes is empty and noop_with_empty_axes=0)
    y = pre(x)                                 (Abs / Mul(x, x) / Exp for L1 / L2,SumSquare / LogSumExp)
    for k in 0..r-1:  y = If(flag[k], then: R(y; axes=[k], keepdims=1), else: y)
    y = post(y)                                (Sqrt / Log for L2 / LogSum, LogSumExp)
    keepdims=0: Squeeze(y, Compress(range(r), flag)) at opset >= 13, else Reshape(y, Compress(Shape(x), Not(flag)))

where ``R`` is the per-axis reduction (Sum for the sum family); reducing the flagged axes one at a time with
keepdims=1 is the same reduction (empty axes included, whose identity element R produces). With
``noop_with_empty_axes=1`` and an empty ``axes`` nothing is reduced and the output is ``post(pre(x))``, which
is what onnxruntime and the ONNX reference compute (e.g. ``|x|`` for ReduceL1).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, get_attr

#: op -> (pre, per-axis reduction, post)
_PLAN: dict[str, tuple[str | None, str, str | None]] = {
    "ReduceSum": (None, "ReduceSum", None),
    "ReduceMean": (None, "ReduceMean", None),
    "ReduceMax": (None, "ReduceMax", None),
    "ReduceMin": (None, "ReduceMin", None),
    "ReduceProd": (None, "ReduceProd", None),
    "ReduceL1": ("Abs", "ReduceSum", None),
    "ReduceL2": ("Square", "ReduceSum", "Sqrt"),
    "ReduceSumSquare": ("Square", "ReduceSum", None),
    "ReduceLogSum": (None, "ReduceSum", "Log"),
    "ReduceLogSumExp": ("Exp", "ReduceSum", "Log"),
}


def reduce_runtime_axes(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Rewrite a reduction whose ``axes`` input is not constant (see module docstring)."""
    x, axes = node.input[0], node.input[1]
    r = ctx.rank(x)
    if r is None:
        raise NoMatch(f"axes input {axes!r} is not a constant and the rank of {x!r} is unknown")
    if r == 0:
        raise NoMatch("runtime axes on a scalar")
    keepdims = int(get_attr(node, "keepdims", 1))
    noop = int(get_attr(node, "noop_with_empty_axes", 0))
    shp = ctx.shape(x) or []
    if not keepdims and ctx.target < 13 and any(d is None or d == 0 for d in shp):
        raise NoMatch("runtime axes with keepdims=0 below opset 13 need a fully known, non-empty input shape")
    pre, red, post = _PLAN[node.op_type]
    dt = ctx.dtype(x)
    if dt is None:
        raise NoMatch(f"dtype of {x!r} is unknown")
    b = Builder(ctx, node.name or node.op_type)
    i64, bl = TensorProto.INT64, TensorProto.BOOL
    ax = b.op("Reshape", [axes, b.const([-1], "int64")], dtype=i64, shape=[None])
    ax = b.op(
        "Where",
        [b.op("Less", [ax, b.const(0, "int64")], dtype=bl), b.op("Add", [ax, b.const(r, "int64")], dtype=i64), ax],
        dtype=i64,
        shape=[None],
    )
    eq = b.op("Equal", [b.unsqueeze(ax, [1], dtype=i64), b.const(list(range(r)), "int64")], dtype=bl)
    hits = b.reduce("ReduceSum", b.cast(eq, i64), [0], keepdims=0, dtype=i64)
    flags = b.op("Greater", [hits, b.const(0, "int64")], dtype=bl, shape=[r])
    empty = b.op("Equal", [b.op("Size", [ax], dtype=i64), b.const(0, "int64")], dtype=bl, shape=[])
    if not noop:
        flags = b.op("Or", [flags, empty], dtype=bl, shape=[r])
    y = x
    if pre == "Square":
        y = b.op("Mul", [x, x], dtype=dt)
    elif pre is not None:
        y = b.op(pre, [x], dtype=dt)
    for k in range(r):
        fk = b.op("Gather", [flags, b.const(k, "int64")], axis=0, dtype=bl, shape=[])
        then_b, else_b = Builder(ctx, b.hint), Builder(ctx, b.hint)
        t_out = then_b.reduce(red, y, [k], keepdims=1, dtype=dt)
        e_out = else_b.op("Identity", [y], dtype=dt)
        then_g = helper.make_graph(
            then_b.nodes, ctx.fresh("then"), [], [helper.make_tensor_value_info(t_out, dt, None)]
        )
        else_g = helper.make_graph(
            else_b.nodes, ctx.fresh("else"), [], [helper.make_tensor_value_info(e_out, dt, None)]
        )
        y = b.op("If", [fk], then_branch=then_g, else_branch=else_g, dtype=dt)
    if post is not None:
        y = b.op(post, [y], dtype=dt)
    if keepdims:
        b.op("Identity", [y], outputs=[node.output[0]])
    elif ctx.target >= 13:
        idx = b.op("Compress", [b.const(list(range(r)), "int64"), flags], axis=0, dtype=i64, shape=[None])
        b.op("Squeeze", [y, idx], outputs=[node.output[0]])
    else:
        keep = b.op("Not", [flags], dtype=bl, shape=[r])
        b.op("Reshape", [y, b.op("Compress", [b.shape(x, r), keep], axis=0, dtype=i64)], outputs=[node.output[0]])
    return b.nodes
