"""Steps that only widened dtypes, lowered by computing in a dtype the older version accepts.

* ``IsInf-20 / IsNaN-20 / IsNaN-13`` on float16/bfloat16 → ``IsX(Cast(x, float))`` (exact: the cast keeps
  inf/NaN and every finite value); other dtypes are a re-stamp.
* ``ReduceMax-20 / ReduceMin-20`` on bool → ``Cast(ReduceX(Cast(x, int32)), bool)``; other dtypes re-stamp.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from .build import Builder
from .context import LowerContext, copy_node
from .registry import step
from .restamp import restamp_node
from .schemas import allowed_types, previous_version, schema, type_str


@step("upcast_to_float", ("IsInf", 20), ("IsNaN", 20), ("IsNaN", 13))
def upcast_predicate(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``IsInf(x16) → IsInf(Cast(x16, float))`` when the older version lacks x's dtype."""
    prev = previous_version(node.op_type, from_v)
    assert prev is not None
    ts = ctx.type_str(node.input[0])
    old = schema(node.op_type, prev)
    if ts is None or ts in allowed_types(old, old.inputs[0]):
        return restamp_node(node, ctx, from_v)
    b = Builder(ctx, node.name or node.op_type)
    x = b.cast(node.input[0], TensorProto.FLOAT)
    out = copy_node(node)
    out.input[0] = x
    b.nodes.append(out)
    return b.nodes


@step("bool_via_int32", ("ReduceMax", 20), ("ReduceMin", 20))
def bool_reduce(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``ReduceMax(bool) → Cast(ReduceMax(Cast(x, int32)), bool)``."""
    if ctx.dtype(node.input[0]) != TensorProto.BOOL:
        return restamp_node(node, ctx, from_v)
    b = Builder(ctx, node.name or node.op_type)
    x = b.cast(node.input[0], TensorProto.INT32)
    out = copy_node(node)
    out.input[0] = x
    red = ctx.fresh(f"{node.op_type}_i32")
    ctx.set_type(red, TensorProto.INT32)
    out.output[0] = red
    b.nodes.append(out)
    b.cast(red, TensorProto.BOOL, out=node.output[0])
    return b.nodes


_ = type_str
