"""Pad, Clip and Split version steps.

* ``Pad-19 → 18``: re-stamp; ``mode="wrap"`` is refused (it does not exist before 19).
* ``Pad-18(x, pads, value, axes) → Pad-13(x, full_pads, value)``: with constant ``axes`` the pads are
  scattered into a full-rank vector: a constant when ``pads`` is constant, else
  ``Gather(Concat(pads, [0]), index_map)`` (exact for runtime pads).
* ``Pad-11(x, pads, value) → Pad-2(x; pads=[...], value=v)``: constant inputs only.
* ``Clip-11(x, min, max) → Clip-6(x; min=a, max=b)``: constant scalars only.
* ``Split-18(x; num_outputs=n) → Split-13(x, split=[...])``: sizes ``ceil(d/n)`` with a smaller last chunk,
  from the static dim or computed at run time from ``Shape(x)``.
* ``Split-13(x, split=const) → Split-11(x; split=[...])``; a runtime ``split`` becomes one ``Slice`` per
  output between the running sums ``CumSum(split)``.
"""

from __future__ import annotations

import numpy as np
import onnx

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, copy_node, del_attr, get_attr, input_at, set_attr, trim_inputs
from .registry import step


@step("pad_modes", ("Pad", 19))
def pad_19(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Re-stamp unless ``mode='wrap'``."""
    if get_attr(node, "mode", b"constant") == b"wrap":
        raise NoMatch("mode='wrap' does not exist before opset 19")
    return [copy_node(node)]


@step("pad_axes_to_full_pads", ("Pad", 18))
def pad_18(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Expand ``pads`` over ``axes`` to full-rank pads."""
    out = copy_node(node)
    axes_name = input_at(node, 3)
    if not axes_name:
        trim_inputs(out, 3)
        return [out]
    axes_v = ctx.const(axes_name)
    x = node.input[0]
    r = ctx.require_rank(x, "Pad axes")
    if axes_v is None:
        return _pad_runtime_axes(node, ctx, r)
    axes = [int(a) + r if int(a) < 0 else int(a) for a in axes_v.reshape(-1)]
    n = len(axes)
    b = Builder(ctx, node.name or "Pad")
    pads_name = node.input[1]
    pads = ctx.const(pads_name)
    if pads is not None:
        full = np.zeros(2 * r, dtype=np.int64)
        for i, a in enumerate(axes):
            full[a], full[a + r] = pads[i], pads[i + n]
        new_pads = b.const(full, hint="pads")
    else:
        index = [2 * n] * (2 * r)
        for i, a in enumerate(axes):
            index[a], index[a + r] = i, i + n
        ext = b.op("Concat", [pads_name, b.const([0], "int64")], axis=0, dtype=onnx.TensorProto.INT64)
        new_pads = b.op("Gather", [ext, b.const(index, "int64")], axis=0, dtype=onnx.TensorProto.INT64)
    ins = [x, new_pads] + ([input_at(node, 2)] if input_at(node, 2) else [])
    del out.input[:]
    out.input.extend(ins)
    b.nodes.append(out)
    return b.nodes


@step("pad_inputs_to_attributes", ("Pad", 11))
def pad_11(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Pad-11(x, pads, value) → Pad-2(x; pads, value)`` for constant pads/value."""
    pads = ctx.const(node.input[1])
    if pads is None:
        raise NoMatch("pads input is not a constant; Pad-2 needs an attribute")
    value = 0.0
    if input_at(node, 2):
        v = ctx.const(node.input[2])
        if v is None:
            raise NoMatch("constant_value input is not a constant")
        value = float(v.reshape(-1)[0])
    out = copy_node(node)
    trim_inputs(out, 1)
    set_attr(out, "pads", [int(p) for p in pads.reshape(-1)])
    set_attr(out, "value", value)
    return [out]


@step("clip_inputs_to_attributes", ("Clip", 11))
def clip_11(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Clip-11(x, min, max) → Clip-6(x; min, max)`` for constant bounds."""
    out = copy_node(node)
    trim_inputs(out, 1)
    for i, name in ((1, "min"), (2, "max")):
        src = input_at(node, i)
        if not src:
            continue
        v = ctx.const(src)
        if v is None:
            raise NoMatch(f"{name} input {src!r} is not a constant; Clip-6 needs an attribute")
        set_attr(out, name, float(v.reshape(-1)[0]))
    return [out]


@step("split_num_outputs", ("Split", 18))
def split_18(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Split-18(x; num_outputs=n) → Split-13(x, split)`` with ``ceil(d/n)``-sized chunks."""
    out = copy_node(node)
    n = get_attr(node, "num_outputs")
    del_attr(out, "num_outputs")
    if n is None or input_at(node, 1):
        return [out]
    n = int(n)
    x = node.input[0]
    axis = int(get_attr(node, "axis", 0))
    shape = ctx.shape(x)
    b = Builder(ctx, node.name or "Split")
    d = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
    chunk = -(-int(d) // n) if d is not None else 0
    if d is not None and int(d) - chunk * (n - 1) >= 0:
        split = b.const([chunk] * (n - 1) + [int(d) - chunk * (n - 1)], "int64", "split")
    else:
        i64 = onnx.TensorProto.INT64
        d_ = b.op("Gather", [b.shape(x), b.const([axis], "int64")], axis=0, dtype=i64, shape=[1])
        chunk_ = b.op(
            "Div",
            [b.op("Add", [d_, b.const([n - 1], "int64")], dtype=i64), b.const([n], "int64")],
            dtype=i64,
            shape=[1],
        )
        head = b.op("Tile", [chunk_, b.const([n - 1], "int64")], dtype=i64, shape=[n - 1])
        last = b.op("Sub", [d_, b.op("Mul", [chunk_, b.const([n - 1], "int64")], dtype=i64)], dtype=i64)
        split = b.op("Concat", [head, last], axis=0, dtype=i64, shape=[n])
    ins = [x, split]
    del out.input[:]
    out.input.extend(ins)
    b.nodes.append(out)
    return b.nodes


@step("split_input_to_attribute", ("Split", 13))
def split_13(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Split-13(x, split=const) → Split-11(x; split=[...])``."""
    out = copy_node(node)
    src = input_at(node, 1)
    trim_inputs(out, 1)
    if not src:
        return [out]
    v = ctx.const(src)
    if v is None:
        return _split_runtime(node, ctx)
    set_attr(out, "split", [int(s) for s in v.reshape(-1)])
    return [out]


def _split_runtime(node: onnx.NodeProto, ctx: LowerContext) -> list[onnx.NodeProto]:
    """``Split(x, split)`` with runtime sizes → one ``Slice`` per output between running sums of ``split``."""
    b = Builder(ctx, node.name or "Split")
    i64 = onnx.TensorProto.INT64
    axis = int(get_attr(node, "axis", 0))
    ends = b.op("CumSum", [node.input[1], b.const(0, "int64")], dtype=i64, shape=[len(node.output)])
    starts = b.op("Concat", [b.const([0], "int64"), ends], axis=0, dtype=i64)
    ax = b.const([axis], "int64")
    dt = ctx.dtype(node.input[0])
    for i, out in enumerate(node.output):
        if not out:
            continue
        s_i = b.op("Slice", [starts, b.const([i], "int64"), b.const([i + 1], "int64")], dtype=i64, shape=[1])
        e_i = b.op("Slice", [ends, b.const([i], "int64"), b.const([i + 1], "int64")], dtype=i64, shape=[1])
        b.op("Slice", [node.input[0], s_i, e_i, ax], outputs=[out], dtype=dt)
    return b.nodes


def _pad_runtime_axes(node: onnx.NodeProto, ctx: LowerContext, r: int) -> list[onnx.NodeProto]:
    """``Pad(x, pads, v, axes)`` with runtime axes: ``ScatterElements(zeros(2r), [a, a + r], pads)``."""
    b = Builder(ctx, node.name or "Pad")
    i64, bl = onnx.TensorProto.INT64, onnx.TensorProto.BOOL
    ax = b.op("Cast", [node.input[3]], to=i64, dtype=i64)
    ax = b.op(
        "Where",
        [b.op("Less", [ax, b.const(0, "int64")], dtype=bl), b.op("Add", [ax, b.const(r, "int64")], dtype=i64), ax],
        dtype=i64,
    )
    idx = b.op("Concat", [ax, b.op("Add", [ax, b.const(r, "int64")], dtype=i64)], axis=0, dtype=i64)
    full = b.op(
        "ScatterElements",
        [b.const(np.zeros(2 * r, np.int64), hint="pads0"), idx, node.input[1]],
        axis=0,
        dtype=i64,
        shape=[2 * r],
    )
    out = copy_node(node)
    ins = [node.input[0], full] + ([input_at(node, 2)] if input_at(node, 2) else [])
    del out.input[:]
    out.input.extend(ins)
    b.nodes.append(out)
    return b.nodes
