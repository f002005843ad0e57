"""Version steps of single ops whose change is a new attribute value, a new attribute or an input form.

* ``Cast/CastLike-19 → 13``: drop ``saturate`` (it only affects float8 targets, which opset 13 lacks).
* ``Shape-15(x; start, end) → Slice(Shape-13(x), [start], [end])`` (same clamping rules).
* ``Reshape-14(allowzero=1) → Reshape-13`` when the constant shape has no 0 (then allowzero is moot).
* ``Gemm-11(A, B) → Gemm-9(A, B, C=0)``: C became optional in 11.
* ``ScatterElements/ScatterND-18 → 16``: ``reduction='max'/'min'`` refused.
* ``GridSample-20 → 16``: ``linear``/``cubic`` → ``bilinear``/``bicubic``, 4-D input only.
* ``Constant-12(value_float/ints/...) → Constant-11(value=tensor)``; ``Constant-11(sparse_value)`` refused.
* ``QuantizeLinear/DequantizeLinear-13 → 10``: per-tensor only (scalar scale), ``axis`` dropped.
* ``Dropout-12(x, ratio, training_mode) → Dropout-10(x; ratio)`` for constant ratio and inference mode.
* ``Mod-28 → 13``: re-stamp, except floating-point ``fmod=0`` (integer-style modulo), which opset 13 forbids.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qgraph.graph import NoMatch

from .build import Builder
from .context import (
    LowerContext,
    constant_value,
    copy_node,
    del_attr,
    get_attr,
    input_at,
    set_attr,
    trim_inputs,
)
from .registry import step
from .restamp import restamp_node

_FLOAT8 = {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ}


@step("drop_saturate", ("Cast", 19), ("CastLike", 19))
def cast_19(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Drop ``saturate`` (float8 outputs are refused by the dtype check anyway)."""
    out = copy_node(node)
    del_attr(out, "saturate")
    return [out]


@step("shape_start_end_to_slice", ("Shape", 15))
def shape_15(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Shape(x; start, end) → Slice(Shape(x), [start], [end])``."""
    start = get_attr(node, "start")
    end = get_attr(node, "end")
    out = copy_node(node)
    del_attr(out, "start")
    del_attr(out, "end")
    if (start is None or int(start) == 0) and end is None:
        return [out]
    b = Builder(ctx, node.name or "Shape")
    full = ctx.fresh("shape_full")
    del out.output[:]
    out.output.append(full)
    ctx.set_type(full, TensorProto.INT64, [ctx.rank(node.input[0])])
    b.nodes.append(out)
    end_v = int(end) if end is not None else np.iinfo(np.int64).max
    b.op(
        "Slice",
        [full, b.const([int(start or 0)], "int64"), b.const([end_v], "int64"), b.const([0], "int64")],
        outputs=[node.output[0]],
    )
    return b.nodes


@step("reshape_allowzero", ("Reshape", 14))
def reshape_14(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Drop ``allowzero`` when it cannot matter (no 0 in a constant shape)."""
    out = copy_node(node)
    if int(get_attr(node, "allowzero", 0)):
        shape = ctx.const(node.input[1])
        if shape is None or bool(np.any(shape == 0)):
            raise NoMatch("allowzero=1 with a shape that may contain 0 has no equivalent before opset 14")
    del_attr(out, "allowzero")
    return [out]


@step("gemm_required_c", ("Gemm", 11))
def gemm_11(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Gemm(A, B) → Gemm(A, B, 0)``."""
    out = copy_node(node)
    if input_at(node, 2):
        return [out]
    dt = ctx.dtype(node.input[0])
    if dt is None:
        raise NoMatch("dtype of A is unknown")
    zero = ctx.add_const(np.zeros((), dtype=helper.tensor_dtype_to_np_dtype(dt)), "gemm_c")
    trim_inputs(out, 2)
    out.input.append(zero)
    return [out]


@step("scatter_reduction_values", ("ScatterElements", 18), ("ScatterND", 18))
def scatter_18(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Refuse ``reduction='max'/'min'`` (new in 18), re-stamp otherwise."""
    red = get_attr(node, "reduction", b"none")
    if red in (b"max", b"min"):
        raise NoMatch(f"reduction={red.decode()!r} does not exist before opset 18")
    return [copy_node(node)]


@step("gridsample_mode_names", ("GridSample", 20))
def gridsample_20(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Rename modes to their opset-16 names; only 4-D inputs existed in 16."""
    if ctx.rank(node.input[0]) != 4:
        raise NoMatch("GridSample-16 supports 4-D inputs only (or the rank is unknown)")
    out = copy_node(node)
    mode = get_attr(node, "mode", b"linear")
    set_attr(out, "mode", {b"linear": "bilinear", b"cubic": "bicubic"}.get(mode, mode.decode()))
    return [out]


@step("constant_value_attributes", ("Constant", 12), ("Constant", 11))
def constant_12(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Constant(value_*) → Constant(value=tensor)``; sparse values are refused below 11."""
    if get_attr(node, "sparse_value") is not None:
        raise NoMatch("sparse_value does not exist before opset 11")
    if get_attr(node, "value") is not None:
        return [copy_node(node)]
    val = constant_value(node)
    if val is None:
        raise NoMatch("constant value cannot be read")
    if val.dtype.kind in "UO":
        val = np.asarray(val.astype(object))
    out = copy_node(node)
    del out.attribute[:]
    out.attribute.append(helper.make_attribute("value", numpy_helper.from_array(val)))
    return [out]


@step("per_tensor_only", ("QuantizeLinear", 13), ("DequantizeLinear", 13))
def qdq_13(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Opset 10 (De)QuantizeLinear is per-tensor: the scale must be a scalar."""
    if ctx.rank(node.input[1]) != 0:
        raise NoMatch("per-axis (1-D scale) quantization does not exist before opset 13")
    out = copy_node(node)
    del_attr(out, "axis")
    return restamp_node(out, ctx, from_v)


@step("dropout_inference", ("Dropout", 12))
def dropout_12(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Dropout-12(x, ratio, training_mode=False) → Dropout-10(x; ratio)``."""
    out = copy_node(node)
    del_attr(out, "seed")
    if len(node.output) > 1 and node.output[1]:
        raise NoMatch("the mask output of Dropout-12 has no reliable equivalent in Dropout-10")
    mode = input_at(node, 2)
    if mode:
        v = ctx.const(mode)
        if v is None or bool(v.reshape(-1)[0]):
            raise NoMatch("training_mode is not a constant False")
    ratio = input_at(node, 1)
    trim_inputs(out, 1)
    if ratio:
        v = ctx.const(ratio)
        if v is None:
            raise NoMatch("ratio is not a constant")
        set_attr(out, "ratio", float(v.reshape(-1)[0]))
    return [out]


_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}


@step("mod_float_fmod", ("Mod", 28))
def mod_28(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Refuse float Mod with ``fmod=0`` (opset 13 requires fmod=1 for floats); re-stamp otherwise."""
    dt = ctx.dtype(node.input[0])
    if int(get_attr(node, "fmod", 0)) == 0 and (dt is None or dt in _FLOATS):
        raise NoMatch("floating-point Mod with fmod=0 does not exist before opset 28")
    return restamp_node(node, ctx, from_v)
