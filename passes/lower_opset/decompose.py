"""Hand-written decompositions of ops that do not exist at the target opset and carry no function body.

* ``Trilu(x, k; upper) → Where(j - i >= k (upper) / j - i <= k (lower), x, 0)`` with ``i``/``j`` from Range.
* ``GreaterOrEqual(a, b) → Or(Greater(a, b), Equal(a, b))`` (and LessOrEqual likewise; NaN stays False).
* ``CastLike(x, like) → Cast(x; to=dtype(like))``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, get_attr, input_at
from .registry import decomposition


@decomposition("trilu_mask", "Trilu")
def trilu(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> list[onnx.NodeProto]:
    """``Trilu → Where(mask, x, 0)`` with the mask built from two Ranges."""
    x = node.input[0]
    dt = ctx.dtype(x)
    if dt is None:
        raise NoMatch(f"dtype of {x!r} is unknown")
    upper = int(get_attr(node, "upper", 1))
    b = Builder(ctx, node.name or "Trilu")
    i64, bl = TensorProto.INT64, TensorProto.BOOL
    shp = b.shape(x)
    rows = b.op("Gather", [shp, b.const(-2, "int64")], axis=0, dtype=i64, shape=[])
    cols = b.op("Gather", [shp, b.const(-1, "int64")], axis=0, dtype=i64, shape=[])
    zero, one = b.const(0, "int64"), b.const(1, "int64")
    i = b.unsqueeze(b.op("Range", [zero, rows, one], dtype=i64, shape=[None]), [1], dtype=i64)
    j = b.unsqueeze(b.op("Range", [zero, cols, one], dtype=i64, shape=[None]), [0], dtype=i64)
    diff = b.op("Sub", [j, i], dtype=i64)
    k = input_at(node, 1)
    if not k:
        k = zero
    elif ctx.rank(k) != 0:
        k = b.op("Reshape", [k, b.const(np.zeros(0, np.int64), hint="scalar")], dtype=i64, shape=[])
    if upper:
        keep = b.op("Not", [b.op("Less", [diff, k], dtype=bl)], dtype=bl)
    else:
        keep = b.op("Not", [b.op("Greater", [diff, k], dtype=bl)], dtype=bl)
    zeros = b.const(np.zeros((), dtype=helper.tensor_dtype_to_np_dtype(dt)), hint="zero")
    b.op("Where", [keep, x, zeros], outputs=[node.output[0]])
    return b.nodes


@decomposition("compare_or_equal", "GreaterOrEqual", "LessOrEqual")
def or_equal(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> list[onnx.NodeProto]:
    """``GreaterOrEqual(a, b) → Or(Greater(a, b), Equal(a, b))``."""
    b = Builder(ctx, node.name or node.op_type)
    strict = "Greater" if node.op_type == "GreaterOrEqual" else "Less"
    bl = TensorProto.BOOL
    lhs = b.op(strict, list(node.input), dtype=bl)
    eq = b.op("Equal", list(node.input), dtype=bl)
    b.op("Or", [lhs, eq], outputs=[node.output[0]])
    return b.nodes


@decomposition("castlike_to_cast", "CastLike")
def castlike(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> list[onnx.NodeProto]:
    """``CastLike(x, like) → Cast(x; to=dtype(like))``."""
    to = ctx.dtype(node.input[1])
    if to is None:
        raise NoMatch(f"dtype of {node.input[1]!r} is unknown")
    n = helper.make_node("Cast", [node.input[0]], [node.output[0]], name=node.name, to=to)
    sat = get_attr(node, "saturate")
    if sat is not None and int(sat) == 0:
        n.attribute.append(helper.make_attribute("saturate", 0))
    ctx.at_level(n, max(opset, 19) if sat is not None else opset)
    return [n]
