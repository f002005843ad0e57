"""In-graph min/max: onnxruntime reduces every calibrated tensor to a few scalars per run.

Plain per-tensor ``minmax`` (the default method) needs four numbers per tensor and sample, and
fetching whole activations out of onnxruntime to reduce them in numpy costs more than the inference
itself.  For each *source* tensor ``x`` a copy of the graph gets::

    flat = Reshape(x, [-1])
    lo = ReduceMin(flat)        hi = ReduceMax(flat)        n = Shape(flat)
    sentinel = ReduceSum(flat)

and the results are concatenated across tensors into two outputs (``[lo..., hi..., sentinel...]`` and
the sizes): a run returns two small vectors whatever the number of tensors, and folding them is a few
vectorized numpy calls.

The sentinel is needed because onnxruntime's ReduceMin/ReduceMax skip NaN (measured: a NaN anywhere
but in the first element is missed, for every dtype and optimization level), while any NaN or Inf makes
the sum non-finite.  A non-finite sum with finite extremes is either NaN or the overflow of a sum of
huge finite values (a ``finfo.min`` attention mask): the collector then fetches that tensor once to tell,
and an overflowing tensor switches to ``ReduceSum(Mul(flat, 0))`` (0, or NaN for NaN/Inf; it cannot
overflow, but costs a write) in a rebuilt session, so the check never repeats.

Optionally (``subsample=K``) every source also yields ``Slice(flat, step=max(n // K, 1))``, the
same strided subsample :class:`qgraph.calibrate.robust.RobustMagnitude` takes from a whole tensor.

**Exact derivations.**  A requested tensor computed from other requested tensors by ``Relu``,
``Clip`` with constant bounds, an op that only moves values (``Identity``, ``Reshape``,
``Flatten``, ``Squeeze``, ``Unsqueeze``, ``Transpose``) or ``Concat`` is not reduced: its range
is its sources' ranges mapped through the op at the end (``min(relu(x)) = relu(min(x))`` exactly,
since the op is monotone and applied elementwise without rounding; a Concat's range is the union
of its inputs').  Half the reductions of a Conv-Relu network disappear, and with them a pass over
each tensor.  With subsamples, ``Transpose`` and ``Concat`` are not derived (they reorder values,
so the strided subsample would differ).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Ops whose output holds exactly the input's values, in the same row-major order.
SAME_ORDER = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"})
#: Ops whose output holds exactly the input's values, reordered.
REORDERED = frozenset({"Transpose"})
#: Monotone element-wise ops whose range maps exactly (clamps).
CLAMPS = frozenset({"Relu", "Clip"})

#: Default-domain opset the augmentation needs (Slice with steps).
MIN_OPSET = 10
_PREFIX = "qgraph_calib"


@dataclass(frozen=True)
class Derivation:
    """A tensor's range from its sources': the union over ``parts`` of each source's range through its clamps.

    ``parts`` is ``((source, ((a, b), ...)), ...)``: one part per source occurrence (a Concat of two tensors
    has two).  Clamps are monotone, so a clamp after a union equals the union of the clamped parts, which
    is how chains compose.  The tensor's size is the sum of its parts' sizes.
    """

    parts: tuple[tuple[str, tuple[tuple[float, float], ...]], ...]
    same_order: bool

    @property
    def source(self) -> str:
        """The single source of a one-part derivation (subsamples are taken from it)."""
        if len(self.parts) != 1:
            raise ValueError("a derivation from several tensors has no single source")
        return self.parts[0][0]

    def clamped(self, clamp: tuple[float, float] | None, same_order: bool) -> Derivation:
        """This derivation followed by one more op (a clamp, or a value-preserving op)."""
        extra = (clamp,) if clamp else ()
        return Derivation(tuple((s, c + extra) for s, c in self.parts), self.same_order and same_order)

    def apply(self, ranges: Mapping[str, tuple[float, float, int]]) -> tuple[float, float, int]:
        """``(lo, hi, size)`` from each source's ``(lo, hi, size)``; parts with no values are left out."""
        lo, hi, size = math.inf, -math.inf, 0
        for source, clamps in self.parts:
            a, b, n = ranges[source]
            if n == 0:
                continue
            for c0, c1 in clamps:  # + 0.0 turns -0.0 into 0.0
                a, b = min(max(a, c0), c1) + 0.0, min(max(b, c0), c1) + 0.0
            lo, hi, size = min(lo, a), max(hi, b), size + n
        return lo, hi, size

    def apply_values(self, x: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
        """Map the single source's values (a subsample) elementwise."""
        for a, b in self.parts[0][1]:
            x = np.minimum(np.maximum(x, x.dtype.type(a)), x.dtype.type(b))
        return x


def _constants(model: onnx.ModelProto) -> dict[str, npt.NDArray[np.generic]]:
    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_location != TensorProto.EXTERNAL}
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            out[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return out


def _clamp(node: onnx.NodeProto, constants: Mapping[str, npt.NDArray[np.generic]]) -> tuple[float, float] | None:
    """The ``[a, b]`` a Relu/Clip node clamps to, or None when its bounds are not constants."""
    if node.op_type == "Relu":
        return (0.0, math.inf)
    bounds = [-math.inf, math.inf]
    attrs = {a.name: a.f for a in node.attribute if a.name in ("min", "max")}  # Clip < 11
    bounds = [attrs.get("min", bounds[0]), attrs.get("max", bounds[1])]
    for k in (1, 2):
        if len(node.input) > k and node.input[k]:
            value = constants.get(node.input[k])
            if value is None or value.size != 1:
                return None
            bounds[k - 1] = float(value.reshape(()))
    return bounds[0], bounds[1]


def plan_derivations(model: onnx.ModelProto, names: Sequence[str], *, keep_order: bool) -> dict[str, Derivation]:
    """Which of ``names`` get their range from others of ``names`` (see module docstring); O(N).

    ``keep_order``: only derivations whose values keep their source's flat order (for strided subsamples).
    """
    wanted = set(names)
    constants: dict[str, npt.NDArray[np.generic]] | None = None
    derived: dict[str, Derivation] = {}

    def of(tensor: str) -> Derivation:
        return derived.get(tensor) or Derivation(((tensor, ()),), True)

    for node in model.graph.node:  # topological order: a node's inputs are resolved before it
        op = node.op_type
        if node.domain not in ("", "ai.onnx") or not node.input or len([o for o in node.output if o]) != 1:
            continue
        out = node.output[0]
        if out not in wanted or out in derived:
            continue
        if op == "Concat" and not keep_order:
            inputs = [t for t in node.input if t]
            if inputs and all(t in wanted and t != out for t in inputs):
                derived[out] = Derivation(tuple(p for t in inputs for p in of(t).parts), False)
            continue
        if op not in SAME_ORDER and op not in CLAMPS and (keep_order or op not in REORDERED):
            continue
        src = node.input[0]
        if src not in wanted or src == out:
            continue
        clamp = None
        if op in CLAMPS:
            if constants is None:
                constants = _constants(model)
            clamp = _clamp(node, constants)
            if clamp is None:
                continue
        derived[out] = of(src).clamped(clamp, op not in REORDERED)
    return derived


def _elem_types(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, int]:
    types: dict[str, int] = {}
    for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    if any(n not in types for n in names) and model.ByteSize() < 2**31 - (64 << 20):
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # inference is a best effort here: unknown types are assumed float32
            return types
        for vi in inferred.graph.value_info:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types.setdefault(vi.name, vi.type.tensor_type.elem_type)
    return types


class InGraphMinMax:
    """The reductions of ``sources`` as extra nodes and outputs (graph side only; state is :class:`MinMaxState`).

    Append :attr:`nodes`/:attr:`initializers`/:meth:`output_infos` to a copy of the model, run it for
    :attr:`outputs`, and :meth:`split` each run's results.  Sources in ``zeroed`` get the overflow-proof
    sentinel ``ReduceSum(Mul(flat, 0))``, the others ``ReduceSum(flat)`` (one read, no write; module docstring).
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        sources: Sequence[str],
        *,
        subsample: int | None = None,
        zeroed: frozenset[str] = frozenset(),
    ) -> None:
        self.sources = list(sources)
        self.subsample = subsample
        existing = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
        prefix = _PREFIX
        while any(name.startswith(prefix + "/") for name in existing):
            prefix += "_"
        types = _elem_types(model, self.sources)
        wide = any(types.get(s) == TensorProto.DOUBLE for s in self.sources)
        self.result_type = TensorProto.DOUBLE if wide else TensorProto.FLOAT
        self.nodes: list[onnx.NodeProto] = []
        self.initializers = [numpy_helper.from_array(np.array([-1], np.int64), f"{prefix}/flat_shape")]
        if zeroed:
            zero = np.array(0, helper.tensor_dtype_to_np_dtype(self.result_type))
            self.initializers.append(numpy_helper.from_array(zero, f"{prefix}/zero"))
        if subsample:
            self.initializers += [
                numpy_helper.from_array(np.array([subsample], np.int64), f"{prefix}/per_sample"),
                numpy_helper.from_array(np.array([1], np.int64), f"{prefix}/one"),
                numpy_helper.from_array(np.array([0], np.int64), f"{prefix}/start"),
                numpy_helper.from_array(np.array([2**62], np.int64), f"{prefix}/end"),
            ]
        mins, maxs, sums, sizes, subs, sub_sizes = [], [], [], [], [], []
        for i, src in enumerate(self.sources):
            t = f"{prefix}/{i}"
            flat = self._add("Reshape", [src, f"{prefix}/flat_shape"], f"{t}/flat")
            if types.get(src, TensorProto.FLOAT) != self.result_type:
                flat = self._add("Cast", [flat], f"{t}/cast", to=self.result_type)  # exact: fp16/bf16 -> fp32 -> fp64
            mins.append(self._add("ReduceMin", [flat], f"{t}/min", keepdims=1))
            maxs.append(self._add("ReduceMax", [flat], f"{t}/max", keepdims=1))
            summed = self._add("Mul", [flat, f"{prefix}/zero"], f"{t}/zeroed") if src in zeroed else flat
            sums.append(self._add("ReduceSum", [summed], f"{t}/sum", keepdims=1))
            sizes.append(self._add("Shape", [flat], f"{t}/size"))
            if subsample:
                step = self._add("Div", [f"{t}/size", f"{prefix}/per_sample"], f"{t}/div")
                step = self._add("Max", [step, f"{prefix}/one"], f"{t}/step")
                bounds = [f"{prefix}/start", f"{prefix}/end", f"{prefix}/start"]  # starts, ends, axes
                sub = self._add("Slice", [flat, *bounds, step], f"{t}/sub")
                subs.append(sub)
                sub_sizes.append(self._add("Shape", [sub], f"{t}/sub_size"))
        self.outputs = [
            self._add("Concat", [*mins, *maxs, *sums], f"{prefix}/extremes", axis=0),
            self._add("Concat", sizes, f"{prefix}/sizes", axis=0),
        ]
        if subsample:
            self.outputs += [
                self._add("Concat", subs, f"{prefix}/subsamples", axis=0),
                self._add("Concat", sub_sizes, f"{prefix}/subsample_sizes", axis=0),
            ]

    def _add(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def output_infos(self) -> list[onnx.ValueInfoProto]:
        """Graph outputs to declare (element type, no shape)."""
        types = [self.result_type, TensorProto.INT64, self.result_type, TensorProto.INT64]
        return [helper.make_tensor_value_info(o, t, None) for o, t in zip(self.outputs, types, strict=False)]

    def split(self, outputs: Sequence[Any]) -> Reduced:
        """One run's outputs (in :attr:`outputs` order) by kind."""
        n = len(self.sources)
        ext = np.asarray(outputs[0])
        subs: list[npt.NDArray[np.floating]] = []
        if self.subsample:
            subs = np.split(np.asarray(outputs[2]), np.cumsum(np.asarray(outputs[3]))[:-1])
        return Reduced(ext[:n], ext[n : 2 * n], ext[2 * n :], np.asarray(outputs[1]), subs, ext)


@dataclass(frozen=True)
class Reduced:
    """One run's reductions: per-source min, max, sentinel sum and size, and the strided subsamples."""

    mins: npt.NDArray[np.floating]
    maxs: npt.NDArray[np.floating]
    sums: npt.NDArray[np.floating]
    sizes: npt.NDArray[np.int64]
    subsamples: list[npt.NDArray[np.floating]]
    extremes: npt.NDArray[np.floating]  # mins, maxs and sums in one vector


    def suspects(self) -> tuple[list[int], list[int]]:
        """``(non_finite, overflow_or_nan)``: sources whose min or max is not finite (NaN or Inf, certain), and
        sources whose only non-finite number is the sentinel sum (NaN, or a sum of huge finite values)."""
        with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf: the slow path below sorts it out
            total = float(self.extremes.sum(dtype=np.float64))  # float32 inputs cannot overflow a float64 sum
        if math.isfinite(total) or not self.sizes.size:
            return [], []
        present = self.sizes > 0
        extremes_ok = np.isfinite(self.mins) & np.isfinite(self.maxs)
        certain = np.flatnonzero(present & ~extremes_ok).tolist()
        maybe = np.flatnonzero(present & extremes_ok & ~np.isfinite(self.sums)).tolist()
        return certain, maybe


class MinMaxState:
    """Running per-source ``[min, max]``, value and update counts (O(sources), whatever the data)."""

    def __init__(self, count: int) -> None:
        self.lo = np.full(count, np.inf)
        self.hi = np.full(count, -np.inf)
        self.num_values = np.zeros(count, dtype=np.int64)
        self.num_updates = 0

    def fold(self, r: Reduced) -> None:
        """Fold one run whose extremes are finite (check :meth:`Reduced.suspects` first)."""
        if r.sizes.all():
            np.minimum(self.lo, r.mins, out=self.lo)
            np.maximum(self.hi, r.maxs, out=self.hi)
        else:  # an empty tensor reduces to +/-inf: leave its state alone
            present = r.sizes > 0
            np.minimum(self.lo, np.where(present, r.mins, np.inf), out=self.lo)
            np.maximum(self.hi, np.where(present, r.maxs, -np.inf), out=self.hi)
        self.num_values += r.sizes
        self.num_updates += 1
