"""Bitwise ops (opset 18) and CumProd (opset 26) for older targets, with exact integer arithmetic.

* ``BitwiseNot(x) → Cast(-1 - Cast(x, int64))`` for signed types, ``(2^w - 1) - x`` for unsigned ones.
* ``BitwiseAnd/Or/Xor(a, b)``: both inputs are cast to int64 (sign-extended; uint64 wraps, which the Cast
  spec defines as two's-complement reinterpretation) and split into their ``w`` bits with floor division
  (``bit = Mod(q, 2); q = (q - bit) / 2`` — an arithmetic shift, so negative values yield two's-complement
  bits). The result is ``Σ f(a_k, b_k)·2^k`` with the top bit weighted ``-2^(w-1)`` for signed types, cast
  back to the input type (``f`` = ``a·b``, ``a+b-a·b`` or ``a+b-2·a·b``).
* ``CumProd(x, axis)`` with a static length ``n ≤ 256`` along the axis: ``n`` Slices, a running ``Mul`` chain
  and a ``Concat`` (``exclusive`` shifts in ones, ``reverse`` runs the chain from the end). A runtime
  ``axis`` picks one such branch per possible axis with nested ``If`` nodes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, get_attr
from .registry import decomposition

_WIDTH: dict[int, tuple[int, bool]] = {
    TensorProto.INT8: (8, True),
    TensorProto.INT16: (16, True),
    TensorProto.INT32: (32, True),
    TensorProto.INT64: (64, True),
    TensorProto.UINT8: (8, False),
    TensorProto.UINT16: (16, False),
    TensorProto.UINT32: (32, False),
    TensorProto.UINT64: (64, True),
}
_I64 = TensorProto.INT64


@decomposition("bitwise_not_arithmetic", "BitwiseNot")
def bitwise_not(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> list[onnx.NodeProto]:
    """``~x`` as ``-1 - x`` (signed) or ``(2^w - 1) - x`` (unsigned), computed in int64."""
    dt = ctx.dtype(node.input[0])
    if dt not in _WIDTH:
        raise NoMatch(f"BitwiseNot on dtype {dt} is not supported")
    w, signed = _WIDTH[dt]
    b = Builder(ctx, node.name or "BitwiseNot")
    x = node.input[0] if dt == _I64 else b.cast(node.input[0], _I64)
    top = -1 if signed or w == 64 else (1 << w) - 1
    y = b.op("Sub", [b.const(top, "int64"), x], dtype=_I64)
    if dt == _I64:
        b.op("Identity", [y], outputs=[node.output[0]])
    else:
        b.cast(y, dt, out=node.output[0])
    return b.nodes


@decomposition("bitwise_by_bits", "BitwiseAnd", "BitwiseOr", "BitwiseXor")
def bitwise_binary(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> list[onnx.NodeProto]:
    """Bit-by-bit And/Or/Xor in int64 arithmetic (see module docstring)."""
    dt = ctx.dtype(node.input[0])
    if dt not in _WIDTH:
        raise NoMatch(f"{node.op_type} on dtype {dt} is not supported")
    w, signed = _WIDTH[dt]
    b = Builder(ctx, node.name or node.op_type)
    two, one = b.const(2, "int64"), b.const(1, "int64")
    qa = node.input[0] if dt == _I64 else b.cast(node.input[0], _I64)
    qb = node.input[1] if dt == _I64 else b.cast(node.input[1], _I64)
    acc = ""
    for k in range(w):
        bits = []
        for q in (qa, qb):
            bits.append(b.op("Mod", [q, two], fmod=0, dtype=_I64))
        qa = b.op("Div", [b.op("Sub", [qa, bits[0]], dtype=_I64), two], dtype=_I64)
        qb = b.op("Div", [b.op("Sub", [qb, bits[1]], dtype=_I64), two], dtype=_I64)
        prod = b.op("Mul", [bits[0], bits[1]], dtype=_I64)
        if node.op_type == "BitwiseAnd":
            c = prod
        else:
            s = b.op("Add", [bits[0], bits[1]], dtype=_I64)
            c = b.op(
                "Sub", [s, prod if node.op_type == "BitwiseOr" else b.op("Mul", [prod, two], dtype=_I64)], dtype=_I64
            )
        weight = -(1 << (w - 1)) if (signed and k == w - 1) else (1 << k)
        term = b.op("Mul", [c, b.const(np.int64(weight) if weight >= -(1 << 63) else 0, "int64")], dtype=_I64)
        acc = term if not acc else b.op("Add", [acc, term], dtype=_I64)
    _ = one
    if dt == _I64:
        b.op("Identity", [acc], outputs=[node.output[0]])
    else:
        b.cast(acc, dt, out=node.output[0])
    return b.nodes


@decomposition("cumprod_unrolled", "CumProd")
def cumprod(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> list[onnx.NodeProto]:
    """CumProd as a running Mul over static slices; a runtime axis selects among per-axis branches (If)."""
    x = node.input[0]
    shape = ctx.shape(x)
    if shape is None:
        raise NoMatch(f"shape of {x!r} is unknown")
    dt = ctx.dtype(x)
    if dt is None:
        raise NoMatch(f"dtype of {x!r} is unknown")
    exclusive = int(get_attr(node, "exclusive", 0))
    reverse = int(get_attr(node, "reverse", 0))
    r = len(shape)
    axis_v = ctx.const(node.input[1])
    b = Builder(ctx, node.name or "CumProd")
    if axis_v is not None:
        axis = int(axis_v.reshape(-1)[0])
        axis = axis + r if axis < 0 else axis
        _unrolled(b, x, axis, shape[axis], dt, exclusive, reverse, node.output[0])
        return b.nodes
    i64, bl = TensorProto.INT64, TensorProto.BOOL
    ax = b.op("Reshape", [b.op("Cast", [node.input[1]], to=i64, dtype=i64), b.const([], "int64")], dtype=i64)
    ax = b.op(
        "Where",
        [b.op("Less", [ax, b.const(0, "int64")], dtype=bl), b.op("Add", [ax, b.const(r, "int64")], dtype=i64), ax],
        dtype=i64,
        shape=[],
    )
    branches = []
    for a in range(r):
        sub = Builder(ctx, b.hint)
        out = ctx.fresh("cumprod_branch")
        _unrolled(sub, x, a, shape[a], dt, exclusive, reverse, out)
        branches.append(
            helper.make_graph(sub.nodes, ctx.fresh("cumprod_axis"), [], [helper.make_tensor_value_info(out, dt, shape)])
        )
    graph = branches[r - 1]
    for a in range(r - 2, -1, -1):
        cond = b.op("Equal", [ax, b.const(a, "int64")], dtype=bl, shape=[])
        if a == 0:
            b.op("If", [cond], outputs=[node.output[0]], then_branch=branches[a], else_branch=graph)
            return b.nodes
        inner = Builder(ctx, b.hint)
        res = inner.op("If", [cond], then_branch=branches[a], else_branch=graph, dtype=dt)
        graph = helper.make_graph(
            inner.nodes, ctx.fresh("cumprod_switch"), [], [helper.make_tensor_value_info(res, dt, shape)]
        )
    b.op("Identity", [branches[0].output[0].name], outputs=[node.output[0]])
    b.nodes[:0] = list(branches[0].node)
    return b.nodes


def _unrolled(b: Builder, x: str, axis: int, n: int | None, dt: int, exclusive: int, reverse: int, out: str) -> None:
    if n is None or n > 256 or n == 0:
        raise NoMatch(f"CumProd needs a static length along axis {axis} (1..256), got {n}")
    ax = b.const([axis], "int64")
    slices = [b.op("Slice", [x, b.const([i], "int64"), b.const([i + 1], "int64"), ax], dtype=dt) for i in range(n)]
    order = list(range(n - 1, -1, -1)) if reverse else list(range(n))
    ones = b.op(
        "Expand", [b.const(np.ones((), helper.tensor_dtype_to_np_dtype(dt)), hint="one"), b.shape(slices[0])], dtype=dt
    )
    res: dict[int, str] = {}
    run = ""
    for i in order:
        if exclusive:
            res[i] = run or ones
            run = slices[i] if not run else b.op("Mul", [run, slices[i]], dtype=dt)
        else:
            run = slices[i] if not run else b.op("Mul", [run, slices[i]], dtype=dt)
            res[i] = run
    parts = [res[i] for i in range(n)]
    if n == 1:
        b.op("Identity", parts, outputs=[out])
    else:
        b.op("Concat", parts, outputs=[out], axis=axis)
