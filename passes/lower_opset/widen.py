"""Steps that added integer dtypes or a tie-breaking attribute, lowered with exact integer rewrites.

* ``Add/Sub/Mul/Div-14`` on int8/int16/uint8/uint16 → ``Cast(op(Cast(a, int32), Cast(b, int32)), T)``
  (two's-complement wrap-around is the same, the Cast back discards the high bits as the op would).
* ``Max/Min-12`` on integers → a chain of ``Where(Less(a, b), b, a)`` (ints have no NaN), computed in
  int32/int64 (exact widening) where onnxruntime has no kernel for the type; uint64 is refused.
* ``Clip-12`` on integers → ``Where(Less(x, lo), lo, x)`` then ``Where(Less(hi, y), hi, y)`` (same widening).
* ``ArgMax/ArgMin-12(select_last_index=1)`` → ``n - 1 - ArgX(Slice(x, -1, -inf, step -1))`` along ``axis``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, copy_node, del_attr, get_attr, input_at
from .registry import step
from .restamp import restamp_node
from .schemas import allowed_types, previous_version, schema

_SMALL = {TensorProto.INT8, TensorProto.INT16, TensorProto.UINT8, TensorProto.UINT16}
#: dtype -> dtype onnxruntime's Where/Less kernels handle exactly (uint64 has no exact stand-in)
_WHERE_AS: dict[int, int] = {
    TensorProto.INT8: TensorProto.INT32,
    TensorProto.INT16: TensorProto.INT32,
    TensorProto.UINT16: TensorProto.INT32,
    TensorProto.UINT8: TensorProto.INT32,
    TensorProto.UINT32: TensorProto.INT64,
    TensorProto.INT32: TensorProto.INT32,
    TensorProto.INT64: TensorProto.INT64,
}
_INTS = _SMALL | {TensorProto.INT32, TensorProto.INT64, TensorProto.UINT32, TensorProto.UINT64}


def _accepted(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> bool:
    prev = previous_version(node.op_type, from_v)
    assert prev is not None
    old = schema(node.op_type, prev)
    ts = ctx.type_str(node.input[0])
    return ts is None or ts in allowed_types(old, old.inputs[0])


@step("widen_small_ints", ("Add", 14), ("Sub", 14), ("Mul", 14), ("Div", 14))
def arith_14(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """8/16-bit integer arithmetic computed in int32 and cast back."""
    dt = ctx.dtype(node.input[0])
    if dt not in _SMALL:
        return restamp_node(node, ctx, from_v)
    b = Builder(ctx, node.name or node.op_type)
    a_, b_ = (b.cast(x, TensorProto.INT32) for x in node.input[:2])
    y = b.op(node.op_type, [a_, b_], dtype=TensorProto.INT32)
    b.cast(y, dt, out=node.output[0])
    return b.nodes


@step("int_max_min_by_where", ("Max", 12), ("Min", 12))
def maxmin_12(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Integer Max/Min as a Where chain."""
    if _accepted(node, ctx, from_v):
        return restamp_node(node, ctx, from_v)
    dt = ctx.dtype(node.input[0])
    if dt not in _WHERE_AS:
        raise NoMatch(f"{node.op_type}-8 does not accept dtype {dt} and there is no exact stand-in")
    wt = _WHERE_AS[dt]
    b = Builder(ctx, node.name or node.op_type)
    ins = [x if wt == dt else b.cast(x, wt) for x in node.input]
    acc = ins[0]
    for x in ins[1:]:
        less = b.op("Less", [acc, x] if node.op_type == "Max" else [x, acc], dtype=TensorProto.BOOL)
        acc = b.op("Where", [less, x, acc], dtype=wt)
    if wt == dt:
        b.op("Identity", [acc], outputs=[node.output[0]])
    else:
        b.cast(acc, dt, out=node.output[0])
    return b.nodes


@step("int_clip_by_where", ("Clip", 12))
def clip_12(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Integer Clip as two Where nodes."""
    if _accepted(node, ctx, from_v):
        return restamp_node(node, ctx, from_v)
    dt = ctx.dtype(node.input[0])
    if dt not in _WHERE_AS:
        raise NoMatch(f"Clip-11 does not accept dtype {dt} and there is no exact stand-in")
    wt = _WHERE_AS[dt]
    b = Builder(ctx, node.name or "Clip")
    y = node.input[0] if wt == dt else b.cast(node.input[0], wt)
    lo, hi = input_at(node, 1), input_at(node, 2)
    lo = lo if not lo or wt == dt else b.cast(lo, wt)
    hi = hi if not hi or wt == dt else b.cast(hi, wt)
    bl = TensorProto.BOOL
    if lo:
        y = b.op("Where", [b.op("Less", [y, lo], dtype=bl), lo, y], dtype=wt)
    if hi:
        y = b.op("Where", [b.op("Less", [hi, y], dtype=bl), hi, y], dtype=wt)
    if wt == dt:
        b.op("Identity", [y], outputs=[node.output[0]])
    else:
        b.cast(y, dt, out=node.output[0])
    return b.nodes


@step("select_last_index_by_reversal", ("ArgMax", 12), ("ArgMin", 12))
def argx_12(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``select_last_index=1``: search the reversed axis and map the index back."""
    if not int(get_attr(node, "select_last_index", 0)):
        return restamp_node(node, ctx, from_v)
    x = node.input[0]
    axis = int(get_attr(node, "axis", 0))
    keepdims = int(get_attr(node, "keepdims", 1))
    b = Builder(ctx, node.name or node.op_type)
    i64 = TensorProto.INT64
    dt = ctx.dtype(x)
    rev = b.op(
        "Slice",
        [
            x,
            b.const([-1], "int64"),
            b.const([np.iinfo(np.int64).min], "int64"),
            b.const([axis], "int64"),
            b.const([-1], "int64"),
        ],
        dtype=dt,
        shape=ctx.shape(x),
    )
    core = copy_node(node)
    del_attr(core, "select_last_index")
    core.input[0] = rev
    idx = ctx.fresh(f"{node.op_type}_rev")
    core.output[0] = idx
    ctx.set_type(idx, i64)
    ctx.at_level(core, from_v - 1)
    b.nodes.append(core)
    n = b.op("Gather", [b.shape(x), b.const([axis] if keepdims else axis, "int64")], axis=0, dtype=i64)
    last = b.op("Sub", [n, b.const(1, "int64")], dtype=i64)
    b.op("Sub", [last, idx], outputs=[node.output[0]])
    return b.nodes
