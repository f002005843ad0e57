"""Normalization layers.

* ``LayerNormalization-17`` does not exist before 17; it is decomposed (more accurately than the schema's
  E[x²]−E[x]² body) as::

      xs = Cast(X, stash)                    (only when stash_type differs from X's type)
      mean = ReduceMean(xs; axes=[axis..-1], keepdims=1);  d = xs - mean
      std = Sqrt(ReduceMean(d * d) + epsilon);              Y = Cast(d / std, X) * Scale + B
      Mean = mean;  InvStdDev = 1 / std

* ``BatchNormalization-14 → 9``: inference form only (``training_mode=0`` and a single output).
* ``GroupNormalization-21 → 18`` changed the meaning of scale/bias (per channel vs per group), so no step
  exists; the engine expands the opset-21 function body instead.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.graph import NoMatch

from .build import Builder
from .context import LowerContext, get_attr, input_at
from .registry import decomposition, step
from .restamp import restamp_node


@decomposition("layernorm_decomposition", "LayerNormalization")
def layer_norm(node: onnx.NodeProto, ctx: LowerContext, opset: int) -> list[onnx.NodeProto]:
    """LayerNormalization → ReduceMean/Sub/Mul/Sqrt/Div/Mul/Add (see module docstring)."""
    x, scale, bias = node.input[0], node.input[1], input_at(node, 2)
    dt = ctx.dtype(x)
    if dt is None:
        raise NoMatch(f"dtype of {x!r} is unknown")
    axis = int(get_attr(node, "axis", -1))
    eps = float(get_attr(node, "epsilon", 1e-5))
    stash = int(get_attr(node, "stash_type", 1))
    r = ctx.rank(x)
    if axis < 0:
        axes = [r + a for a in range(axis, 0)] if r is not None and ctx.target < 11 else list(range(axis, 0))
    else:
        r = ctx.require_rank(x, "LayerNormalization axis >= 0")
        axes = list(range(axis, r))
    b = Builder(ctx, node.name or "LayerNorm")
    cdt = stash if stash != dt else dt
    xs = b.cast(x, cdt) if cdt != dt else x
    np_c = helper.tensor_dtype_to_np_dtype(cdt)
    mean = b.reduce(
        "ReduceMean",
        xs,
        axes,
        keepdims=1,
        dtype=cdt,
        out=node.output[1] if len(node.output) > 1 and node.output[1] else None,
    )
    d = b.op("Sub", [xs, mean], dtype=cdt)
    var = b.reduce("ReduceMean", b.op("Mul", [d, d], dtype=cdt), axes, keepdims=1, dtype=cdt)
    std = b.op("Sqrt", [b.op("Add", [var, b.const(np.asarray(eps, dtype=np_c), hint="eps")], dtype=cdt)], dtype=cdt)
    norm = b.op("Div", [d, std], dtype=cdt)
    if cdt != dt:
        norm = b.cast(norm, dt)
    if bias:
        scaled = b.op("Mul", [norm, scale], dtype=dt)
        b.op("Add", [scaled, bias], outputs=[node.output[0]])
    else:
        b.op("Mul", [norm, scale], outputs=[node.output[0]])
    if len(node.output) > 2 and node.output[2]:
        b.op("Reciprocal", [std], outputs=[node.output[2]])
    return b.nodes


@step("batchnorm_inference_only", ("BatchNormalization", 14))
def batchnorm_14(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``BatchNormalization-14(training_mode=0) → BatchNormalization-9`` (statistics outputs refused)."""
    if int(get_attr(node, "training_mode", 0)):
        raise NoMatch("training_mode=1 has different outputs before opset 14")
    if any(o for o in list(node.output)[1:]):
        raise NoMatch("running statistics outputs have a different meaning before opset 14")
    out = restamp_node(node, ctx, from_v)[0]
    del out.output[1:]
    return [out]


_ = TensorProto
