"""Pure version re-stamps: version steps where the op kept its meaning and only widened its signature.

``op-v → op-(v-1)`` is a re-stamp when the newer version only added dtypes, added attributes whose default
reproduces the old behaviour, or added optional inputs/outputs. The generic adapter

* drops attributes the older version does not know when they hold the newer default,
* refuses non-default new attributes and used new inputs/outputs,
* leaves dtypes to the engine's final check against the target schema (from shape-inferred types).

Steps from opset 11 down to 10 or lower also normalise negative axes (added in opset 11) when the rank is
known. Every step listed in `RESTAMP` was checked against the operator changelog.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import defs, helper

from qgraph.graph import NoMatch

from .context import LowerContext, copy_node, get_attr, set_attr
from .registry import step
from .schemas import attr_default, previous_version, schema

#: op -> versions whose step down to the previous version is a pure re-stamp.
RESTAMP: dict[str, tuple[int, ...]] = {
    "Abs": (13,),
    "Acos": (22,),
    "Acosh": (22,),
    "Add": (13,),
    "ArgMax": (13,),
    "ArgMin": (13,),
    "Asin": (22,),
    "Asinh": (22,),
    "Atan": (22,),
    "Atanh": (22,),
    "Attention": (24, 25),
    "AveragePool": (10, 11, 19, 22),
    "BatchNormalization": (9, 15),
    "Bernoulli": (22,),
    "BitShift": (28,),
    "Cast": (9, 13, 21, 23, 24, 25, 28),
    "CastLike": (21, 23, 24, 25),
    "Ceil": (13,),
    "Celu": (28,),
    "Clip": (13,),
    "Compress": (28,),
    "Concat": (13,),
    "Constant": (13, 19, 21, 23, 24, 25),
    "ConstantOfShape": (20, 21, 23, 24, 25),
    "Conv": (11, 22),
    "ConvTranspose": (22,),
    "Cos": (22,),
    "Cosh": (22,),
    "CumSum": (14,),
    "DeformConv": (22,),
    "DepthToSpace": (11, 13, 28),
    "DequantizeLinear": (19, 21, 23, 24, 25, 28),
    "Det": (22,),
    "Div": (13,),
    "Dropout": (13, 22),
    "Einsum": (28,),
    "Elu": (22,),
    "Equal": (11, 13, 19),
    "Erf": (13,),
    "Exp": (13,),
    "Expand": (13,),
    "EyeLike": (22,),
    "Flatten": (9, 13, 21, 23, 24, 25),
    "Floor": (13,),
    "GRU": (14, 22),
    "Gather": (13,),
    "GatherElements": (13,),
    "GatherND": (12, 13),
    "Gemm": (9, 13),
    "GlobalAveragePool": (22,),
    "GlobalLpPool": (22,),
    "GlobalMaxPool": (22,),
    "Greater": (9, 13),
    "GreaterOrEqual": (16,),
    "GridSample": (22,),
    "HardSigmoid": (22,),
    "HardSwish": (22,),
    "Identity": (13, 14, 16, 19, 21, 23, 24, 25),
    "If": (13, 16, 19, 21, 23, 24, 25),
    "InstanceNormalization": (22,),
    "LRN": (13,),
    "LSTM": (14, 22),
    "LeakyRelu": (16,),
    "Less": (9, 13),
    "LessOrEqual": (16,),
    "Log": (13,),
    "Loop": (13, 16, 19, 21, 23, 24, 25),
    "LpNormalization": (22,),
    "LpPool": (11, 18, 22),
    "MatMul": (9, 13),
    "Max": (13,),
    "MaxPool": (8, 10, 11, 12, 22),
    "MaxRoiPool": (22,),
    "MaxUnpool": (11, 22),
    "Mean": (13,),
    "MeanVarianceNormalization": (13,),
    "Min": (13,),
    "Mish": (22,),
    "Mod": (13,),
    "Mul": (13,),
    "Multinomial": (22,),
    "Neg": (13,),
    "NegativeLogLikelihoodLoss": (13, 22),
    "NonZero": (13,),
    "OneHot": (28,),
    "Optional": (28,),
    "OptionalGetElement": (18, 28),
    "OptionalHasElement": (18, 28),
    "PRelu": (9, 16),
    "Pad": (13, 21, 23, 24, 25),
    "Pow": (12, 13, 15),
    "QLinearMatMul": (21,),
    "QuantizeLinear": (19, 21, 23, 24, 25, 28),
    "RNN": (14, 22),
    "RandomNormal": (22,),
    "RandomNormalLike": (22,),
    "RandomUniform": (22,),
    "RandomUniformLike": (22,),
    "Range": (27,),
    "Reciprocal": (13,),
    "ReduceL1": (13,),
    "ReduceL2": (13,),
    "ReduceLogSum": (13, 28),
    "ReduceLogSumExp": (13, 28),
    "ReduceMax": (12, 13),
    "ReduceMean": (13,),
    "ReduceMin": (12, 13),
    "ReduceProd": (13,),
    "ReduceSumSquare": (13,),
    "Relu": (13, 14),
    "Reshape": (13, 19, 21, 23, 24, 25),
    "ReverseSequence": (28,),
    "RoiAlign": (22,),
    "Round": (22,),
    "Scan": (16, 19, 21, 23, 24, 25),
    "ScatterElements": (13, 16),
    "ScatterND": (13, 16),
    "Selu": (22,),
    "Shape": (13, 19, 21, 23, 24, 25),
    "Sigmoid": (13,),
    "Sign": (13,),
    "Sin": (22,),
    "Sinh": (22,),
    "Size": (13, 19, 21, 23, 24, 25),
    "Slice": (13,),
    "SoftmaxCrossEntropyLoss": (13,),
    "Softplus": (22,),
    "Softsign": (22,),
    "SpaceToDepth": (13, 28),
    "SplitToSequence": (24,),
    "Sqrt": (13,),
    "Squeeze": (21, 23, 24, 25),
    "Sub": (13,),
    "Sum": (13,),
    "Tan": (22,),
    "Tanh": (13,),
    "ThresholdedRelu": (22,),
    "Tile": (13,),
    "TopK": (11, 24),
    "Transpose": (13, 21, 23, 24, 25),
    "Unique": (28,),
    "Unsqueeze": (21, 23, 24, 25),
    "Upsample": (10,),
    "Where": (16,),
}

#: Attribute values that the generic re-stamp may drop although the schema declares no default.
_IMPLICIT_DEFAULTS: dict[tuple[str, str], Any] = {
    ("AveragePool", "dilations"): "ones",
    ("LpPool", "dilations"): "ones",
    ("MaxPool", "dilations"): "ones",
}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bytes):
        a = a.decode()
    if isinstance(b, bytes):
        b = b.decode()
    if isinstance(a, onnx.TensorProto) or isinstance(b, onnx.TensorProto):
        return False
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except Exception:
        return False


def restamp_node(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``op-v(x; a=default_v) → op-(v-1)(x)``: drop attributes/inputs/outputs the older version lacks.

    Refuses when a dropped attribute is not at its default, or a dropped input/output is used.
    """
    op = node.op_type
    prev = previous_version(op, from_v)
    if prev is None:
        raise NoMatch(f"{op}-{from_v} has no earlier version")
    new, old = schema(op, from_v), schema(op, prev)
    out = copy_node(node)
    keep = []
    for a in out.attribute:
        if a.name in old.attributes:
            keep.append(a)
            continue
        val = helper.get_attribute_value(a)
        default = attr_default(new, a.name)
        implicit = _IMPLICIT_DEFAULTS.get((op, a.name))
        if implicit == "ones" and all(int(x) == 1 for x in val):
            continue
        if default is not None and _equal(val, default):
            continue
        raise NoMatch(f"attribute {a.name}={val!r} of {op}-{from_v} has no equivalent in {op}-{prev}")
    del out.attribute[:]
    out.attribute.extend(keep)
    ins = list(out.input)
    while len(ins) > old.max_input:
        if ins[-1]:
            raise NoMatch(f"input #{len(ins) - 1} ({ins[-1]!r}) of {op}-{from_v} does not exist in {op}-{prev}")
        ins.pop()
    for i, p in enumerate(old.inputs):
        if p.option == defs.OpSchema.FormalParameterOption.Single and (i >= len(ins) or not ins[i]):
            raise NoMatch(f"input {p.name!r} is optional in {op}-{from_v} but required in {op}-{prev}")
    del out.input[:]
    out.input.extend(ins)
    outs = list(out.output)
    while len(outs) > old.max_output:
        if outs[-1]:
            raise NoMatch(f"output #{len(outs) - 1} of {op}-{from_v} does not exist in {op}-{prev}")
        outs.pop()
    del out.output[:]
    out.output.extend(outs)
    return [out]


step("restamp", *[(op, v) for op, vs in RESTAMP.items() for v in vs])(restamp_node)


# --------------------------------------------------------------------------------------------------
# Opset 11 → 10: negative axes. Every op below gained negative axis values in opset 11.
_AXIS_OPS = ("ArgMax", "ArgMin", "Concat", "Flatten", "Softmax", "LogSoftmax", "Hardmax", "Compress", "Split")
_AXES_OPS = (
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
    "Squeeze",
    "Unsqueeze",
)


@step("normalize_negative_axes", *[(op, 11) for op in _AXIS_OPS + _AXES_OPS])
def negative_axes_11(node: onnx.NodeProto, ctx: LowerContext, from_v: int) -> list[onnx.NodeProto]:
    """``op-11(axis=-k) → op-(prev)(axis=r-k)``: rewrite negative axes with the input's rank.

    Unsqueeze counts axes in the output rank (input rank + number of axes).
    """
    out = restamp_node(node, ctx, from_v)[0]
    name = "axis" if node.op_type in _AXIS_OPS else "axes"
    val = get_attr(out, name)
    if val is None:
        return [out]
    vals = [int(val)] if isinstance(val, int) else [int(v) for v in val]
    if any(v < 0 for v in vals):
        if node.op_type == "Concat":
            r = next((ctx.rank(x) for x in node.input if ctx.rank(x) is not None), None)
        else:
            r = ctx.rank(node.input[0])
        if r is None:
            raise NoMatch("negative axis needs the input rank, which is unknown")
        if node.op_type == "Unsqueeze":
            r += len(vals)
        if node.op_type == "Flatten":
            r += 0
        vals = [v + r if v < 0 else v for v in vals]
        set_attr(out, name, vals[0] if name == "axis" else vals)
    return [out]
