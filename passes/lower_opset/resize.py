"""Resize version steps.

* ``Resize-19 → 18``: re-stamp, refused for ``coordinate_transformation_mode="half_pixel_symmetric"``.
* ``Resize-18 → 13``: ``antialias=1`` is refused unless it cannot matter (nearest mode, or constant scales
  that only upsample); ``axes=[...]`` is expanded to full-rank ``scales``/``roi`` (constants) or full-rank
  ``sizes`` (``ScatterElements(Shape(x), axes, sizes)``; runtime scales/roi are scattered the same way);
  ``keep_aspect_ratio_policy`` other than ``stretch`` is refused.
* ``Resize-13 → 11``: ``roi`` and ``scales`` became optional in 13; absent ones become empty constants.
"""

from __future__ import annotations

import numpy as np
import onnx

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, copy_node, del_attr, get_attr, input_at
from .registry import step


@step("resize_coordinate_modes", ("Resize", 19))
def resize_19(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Re-stamp; ``half_pixel_symmetric`` does not exist before opset 19."""
    mode = get_attr(node, "coordinate_transformation_mode", b"half_pixel")
    if mode == b"half_pixel_symmetric":
        raise NoMatch("coordinate_transformation_mode='half_pixel_symmetric' does not exist before opset 19")
    return [copy_node(node)]


@step("resize_axes_antialias", ("Resize", 18))
def resize_18(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """Drop ``antialias``/``axes``/``keep_aspect_ratio_policy`` when an exact Resize-13 form exists."""
    out = copy_node(node)
    mode = get_attr(node, "mode", b"nearest")
    scales_name, sizes_name = input_at(node, 2), input_at(node, 3)
    scales = ctx.const(scales_name)
    if int(get_attr(node, "antialias", 0)):
        upsample_only = scales is not None and bool(np.all(scales >= 1.0))
        if mode != b"nearest" and not upsample_only:
            raise NoMatch("antialias=1 with linear/cubic downsampling has no equivalent before opset 18")
    del_attr(out, "antialias")
    policy = get_attr(node, "keep_aspect_ratio_policy", b"stretch")
    if policy != b"stretch":
        if not sizes_name:
            del_attr(out, "keep_aspect_ratio_policy")
        else:
            raise NoMatch(f"keep_aspect_ratio_policy={policy.decode()!r} has no equivalent before opset 18")
    del_attr(out, "keep_aspect_ratio_policy")
    axes = get_attr(node, "axes")
    if axes is None:
        return [out]
    del_attr(out, "axes")
    x = node.input[0]
    r = ctx.require_rank(x, "Resize axes")
    axes = [int(a) + r if int(a) < 0 else int(a) for a in axes]
    if sorted(axes) == list(range(r)) and axes == sorted(axes):
        return [out]
    b = Builder(ctx, node.name or "Resize")
    ins = list(out.input) + [""] * (4 - len(out.input))
    roi_name = ins[1]
    if roi_name:
        roi = ctx.const(roi_name)
        if roi is not None:
            full = np.concatenate([np.zeros(r), np.ones(r)]).astype(roi.dtype)
            for i, a in enumerate(axes):
                full[a], full[a + r] = roi[i], roi[i + len(axes)]
            ins[1] = b.const(full, hint="roi")
        else:
            rdt = ctx.dtype(roi_name) or onnx.TensorProto.FLOAT
            base = np.concatenate([np.zeros(r), np.ones(r)]).astype(onnx.helper.tensor_dtype_to_np_dtype(rdt))
            idx = [*axes, *[a + r for a in axes]]
            ins[1] = b.op(
                "ScatterElements",
                [b.const(base, hint="roi0"), b.const(idx, "int64"), roi_name],
                axis=0,
                dtype=rdt,
                shape=[2 * r],
            )
    if scales_name and (scales is None or scales.size):
        if scales is None:
            ins[2] = b.op(
                "ScatterElements",
                [b.const(np.ones(r, np.float32), hint="scales1"), b.const(axes, "int64", "axes"), scales_name],
                axis=0,
                dtype=onnx.TensorProto.FLOAT,
                shape=[r],
            )
        else:
            full_s = np.ones(r, dtype=np.float32)
            for i, a in enumerate(axes):
                full_s[a] = scales[i]
            ins[2] = b.const(full_s, hint="scales")
    elif sizes_name:
        shp = b.shape(x, r)
        ins[3] = b.op(
            "ScatterElements",
            [shp, b.const(axes, "int64", "axes"), sizes_name],
            axis=0,
            dtype=onnx.TensorProto.INT64,
            shape=[r],
        )
    while ins and not ins[-1]:
        ins.pop()
    del out.input[:]
    out.input.extend(ins)
    b.nodes.append(out)
    return b.nodes


@step("resize_optional_inputs", ("Resize", 13))
def resize_13(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``Resize-13(x, "", "", sizes) → Resize-11(x, roi=[], scales=[], sizes)``."""
    out = copy_node(node)
    ins = list(out.input) + [""] * (3 - len(out.input))
    b = Builder(ctx, node.name or "Resize")
    if not ins[1]:
        ins[1] = b.const(np.zeros(0, dtype=np.float32), hint="roi")
    if not ins[2]:
        ins[2] = b.const(np.zeros(0, dtype=np.float32), hint="scales")
    del out.input[:]
    out.input.extend(ins)
    b.nodes.append(out)
    return b.nodes
