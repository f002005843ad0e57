"""In-graph min/max: onnxruntime reduces every calibrated tensor to a few scalars per run.

Plain per-tensor ``minmax`` (the default method) needs four numbers per tensor and sample, and
fetching whole activations out of onnxruntime to reduce them in numpy costs more than the inference
itself.  For each *source* tensor ``x`` a copy of the graph gets::

    flat = Reshape(x, [-1])
    lo = ReduceMin(flat)        hi = ReduceMax(flat)        sentinel = ReduceSum(flat)
    n = Shape(flat)                                        # only if x's shape is not static

and the scalars are stacked across tensors into one output ``[lo..., hi..., sentinel...]`` (plus the
dynamic sizes): a run returns one or two small vectors whatever the number of tensors, and folding them
is a few vectorized numpy calls.

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

from qgraph.graph import ProtoNames
from qgraph.graph.ops import is_default_domain

#: Ops whose output holds exactly the input's values, in the same row-major order.
SAME_ORDER = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"})
#: Ops whose output holds exactly the input's values, reordered.
REORDERED = frozenset({"Transpose"})
#: Monotone element-wise ops whose range maps exactly (clamps).
CLAMPS = frozenset({"Relu", "Clip"})

#: Default-domain opset the augmentation needs (Slice with steps, ConcatFromSequence).
MIN_OPSET = 11
_PREFIX = "qgraph_calib"


@dataclass(frozen=True)
class Derivation:
    """A tensor's range from others': ``clamp`` applied to the union of its ``inputs``' ranges.

    A single-input chain (Relu, Clip, reshapes) is composed when it is planned: ``inputs`` is then its reduced
    ``root`` and ``clamp`` the composition of the chain's clamps (a composition of clamps is the clamp
    ``[f(-inf), f(+inf)]``).  A Concat keeps its direct inputs, which are resolved once, in graph order, at the
    end (:func:`resolve_ranges`): planning and resolving are linear in the graph even for concat-of-concat
    chains.
    """

    inputs: tuple[str, ...]
    clamp: tuple[float, float] = (-math.inf, math.inf)
    same_order: bool = True
    #: The reduced tensor a single-input chain starts from (None after a Concat): subsamples derive from it.
    root: str | None = None

    def apply(self, lo: float, hi: float) -> tuple[float, float]:
        """The clamp applied to ``[lo, hi]`` (``+ 0.0`` turns ``-0.0`` into ``0.0``)."""
        a, b = self.clamp
        return min(max(lo, a), b) + 0.0, min(max(hi, a), b) + 0.0

    def apply_values(self, x: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
        """The clamp applied to the root's values (a subsample)."""
        a, b = self.clamp
        if a == -math.inf and b == math.inf:
            return x
        clamped: npt.NDArray[np.floating] = np.minimum(np.maximum(x, x.dtype.type(a)), x.dtype.type(b))
        return clamped


def resolve_ranges(
    derived: Mapping[str, Derivation], measured: Mapping[str, tuple[float, float, int]]
) -> dict[str, tuple[float, float, int]]:
    """``(lo, hi, size)`` of every derived tensor from the measured ones, in planning (graph) order.

    Inputs with no values (``size == 0``) are left out of the union; a tensor all of whose inputs are empty is
    ``(inf, -inf, 0)``.
    """
    out: dict[str, tuple[float, float, int]] = {}
    for name, d in derived.items():
        lo, hi, size = math.inf, -math.inf, 0
        for t in d.inputs:
            a, b, n = out[t] if t in out else measured[t]
            if n:
                lo, hi, size = min(lo, a), max(hi, b), size + n
        out[name] = (*d.apply(lo, hi), size) if size else (math.inf, -math.inf, 0)
    return out


def _constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Constant tensors by name, not converted (only the few a Clip reads are)."""
    out = {t.name: t for t in model.graph.initializer if t.data_location != TensorProto.EXTERNAL}
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            out[node.output[0]] = node.attribute[0].t
    return out


def _clamp(node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto]) -> tuple[float, float] | None:
    """The ``[a, b]`` a Relu/Clip node clamps to, or None when its bounds are not constants."""
    if node.op_type == "Relu":
        return (0.0, math.inf)
    bounds = [-math.inf, math.inf]
    attrs = {a.name: a.f for a in node.attribute if a.name in ("min", "max")}  # Clip < 11
    bounds = [attrs.get("min", bounds[0]), attrs.get("max", bounds[1])]
    for k in (1, 2):
        if len(node.input) > k and node.input[k]:
            proto = constants.get(node.input[k])
            if proto is None or math.prod(proto.dims) != 1:
                return None
            bounds[k - 1] = float(numpy_helper.to_array(proto).reshape(()))
    return bounds[0], bounds[1]


def plan_derivations(model: onnx.ModelProto, names: Sequence[str], *, keep_order: bool) -> dict[str, Derivation]:
    """Which of ``names`` get their range from others of ``names`` (see module docstring); O(N), in graph order.

    ``keep_order``: only derivations whose values keep their source's flat order (for strided subsamples).
    """
    wanted = set(names)
    constants: dict[str, onnx.TensorProto] | None = None
    derived: dict[str, Derivation] = {}
    for node in model.graph.node:  # topological order: a node's inputs are planned before it
        op = node.op_type
        if not is_default_domain(node.domain) or not node.input or len([o for o in node.output if o]) != 1:
            continue
        out = node.output[0]
        if out not in wanted or out in derived:
            continue
        if op == "Concat" and not keep_order:
            inputs = tuple(t for t in node.input if t)
            if inputs and all(t in wanted and t != out for t in inputs):
                derived[out] = Derivation(inputs, same_order=False)
            continue
        if op not in SAME_ORDER and op not in CLAMPS and (keep_order or op not in REORDERED):
            continue
        src = node.input[0]
        if src not in wanted or src == out:
            continue
        clamp = (-math.inf, math.inf)
        if op in CLAMPS:
            if constants is None:
                constants = _constants(model)
            found = _clamp(node, constants)
            if found is None:
                continue
            clamp = found
        ordered = op not in REORDERED
        base = derived.get(src)
        if base is None:
            derived[out] = Derivation((src,), clamp, ordered, src)
        elif base.root is not None:  # compose the chain: one clamp from the root
            lo, hi = (min(max(v, clamp[0]), clamp[1]) for v in base.clamp)
            derived[out] = Derivation((base.root,), (lo, hi), base.same_order and ordered, base.root)
        else:
            derived[out] = Derivation((src,), clamp, False)
    return derived


def _tensor_info(model: onnx.ModelProto, names: Sequence[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Element types and static sizes (every dim known and positive) of ``names``, inferring what the model
    does not declare.  Declared graph outputs are not trusted for sizes (onnxruntime only warns when a run
    disagrees with them); graph inputs are (onnxruntime rejects feeds that contradict a static dim)."""
    types: dict[str, int] = {}
    sizes: dict[str, int] = {}
    outputs = {o.name for o in model.graph.output}

    def read(infos: Sequence[onnx.ValueInfoProto]) -> None:
        for vi in infos:
            if not vi.type.HasField("tensor_type"):
                continue
            tt = vi.type.tensor_type
            if tt.elem_type:
                types.setdefault(vi.name, tt.elem_type)
            dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim]
            if tt.HasField("shape") and all(d > 0 for d in dims) and vi.name not in outputs:
                sizes.setdefault(vi.name, math.prod(dims))

    read([*model.graph.value_info, *model.graph.input, *model.graph.output])
    # Inference costs about as much as a few inferences on large models (resnet50: 0.3 s): run it only when an
    # element type is missing; a missing size just costs a Shape node.
    if any(n not in types for n in names):
        try:
            read(onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.value_info)
        except Exception:  # best effort (a > 2 GB proto, an unknown op): unknown types are assumed float32
            pass
    return types, sizes


class InGraphMinMax:
    """The reductions of ``sources`` as extra nodes and outputs (graph side only; state is :class:`MinMaxState`).

    Append :attr:`nodes`/:attr:`initializers`/:meth:`output_infos` to a copy of the model, run it for
    :attr:`outputs`, and :meth:`split` each run's results.  Sources in ``zeroed`` get the overflow-proof
    sentinel ``ReduceSum(Mul(x, 0))``, the others ``ReduceSum(x)`` (one read, no write; module docstring).

    onnxruntime's session setup grows with the node count, so a tensor of static shape costs four nodes
    (``Reshape`` to a flat view and its reductions; five with a subsample: ``Slice`` with a constant step) and
    its size is a constant; a tensor of dynamic shape adds ``Shape`` (and the subsample's step arithmetic).
    The scalars of every tensor are stacked by one ``SequenceConstruct`` + ``ConcatFromSequence``.
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
        self._prefix = prefix = ProtoNames(model).prefix(_PREFIX)  # "qgraph_calib/", or the next free namespace
        types, static = _tensor_info(model, self.sources)
        wide = any(types.get(s) == TensorProto.DOUBLE for s in self.sources)
        self.result_type = TensorProto.DOUBLE if wide else TensorProto.FLOAT
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._constants: set[str] = set()
        n = len(self.sources)
        #: Sizes known before running (0 where measured per run), and the positions measured per run.
        self.static_sizes = np.array([static.get(s, 0) for s in self.sources], dtype=np.int64)
        self.dynamic = np.flatnonzero(self.static_sizes == 0)
        self.static_sub_sizes = np.zeros(n, dtype=np.int64)
        scalars: list[list[str]] = [[], [], []]
        sizes, subs, sub_sizes = [], [], []
        for i, src in enumerate(self.sources):
            t = f"{prefix}{i}"
            x = src
            if types.get(src, TensorProto.FLOAT) != self.result_type:
                x = self._add("Cast", [x], f"{t}/cast", to=self.result_type)  # exact: fp16/bf16 -> fp32 -> fp64
            size = int(self.static_sizes[i])
            # onnxruntime reduces a flat view (Reshape aliases, no copy) much faster than all axes of an N-d tensor
            # (measured: resnet50 calibration 1.8x -> 2.2-2.5x FP32 without it)
            flat = self._add("Reshape", [x, self._constant("flat_shape", [-1])], f"{t}/flat")
            if not size:
                sizes.append(self._add("Shape", [flat], f"{t}/size"))
            summed = flat
            if src in zeroed:
                summed = self._add("Mul", [flat, self._constant("zero", 0, self.result_type)], f"{t}/zeroed")
            for kind, (op, arg) in enumerate((("ReduceMin", flat), ("ReduceMax", flat), ("ReduceSum", summed))):
                scalars[kind].append(self._add(op, [arg], f"{t}/{op}", keepdims=0))
            if subsample:
                bounds = [self._constant("start", [0]), self._constant("end", [2**62]), self._constant("start", [0])]
                if size:
                    step = max(1, size // subsample)
                    subs.append(self._add("Slice", [flat, *bounds, self._constant(f"step{step}", [step])], f"{t}/sub"))
                    self.static_sub_sizes[i] = -(-size // step)
                else:
                    div = self._add("Div", [f"{t}/size", self._constant("per_sample", [subsample])], f"{t}/div")
                    step_t = self._add("Max", [div, self._constant("one", [1])], f"{t}/step")
                    subs.append(self._add("Slice", [flat, *bounds, step_t], f"{t}/sub"))
                    sub_sizes.append(self._add("Shape", [subs[-1]], f"{t}/sub_size"))
        stacked = self._add("SequenceConstruct", [name for kind in scalars for name in kind], f"{prefix}scalars")
        self.outputs = [self._add("ConcatFromSequence", [stacked], f"{prefix}extremes", axis=0, new_axis=1)]
        self._kinds = [self.result_type]
        if sizes:
            self.outputs.append(self._add("Concat", sizes, f"{prefix}sizes", axis=0))
            self._kinds.append(TensorProto.INT64)
        if subsample:
            self.outputs.append(self._add("Concat", subs, f"{prefix}subsamples", axis=0))
            self._kinds.append(self.result_type)
            if sub_sizes:
                self.outputs.append(self._add("Concat", sub_sizes, f"{prefix}subsample_sizes", axis=0))
                self._kinds.append(TensorProto.INT64)

    def _add(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def _constant(self, key: str, value: Any, dtype: int = TensorProto.INT64) -> str:
        """A shared constant initializer."""
        name = f"{self._prefix}{key}"
        if name not in self._constants:
            self._constants.add(name)
            array = np.array(value, helper.tensor_dtype_to_np_dtype(dtype))
            self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def output_infos(self) -> list[onnx.ValueInfoProto]:
        """Graph outputs to declare (element type, no shape)."""
        return [helper.make_tensor_value_info(o, t, None) for o, t in zip(self.outputs, self._kinds, strict=True)]

    def split(self, outputs: Sequence[Any]) -> Reduced:
        """One run's outputs (in :attr:`outputs` order) by kind."""
        k = 1
        sizes = self.static_sizes
        if self.dynamic.size:
            sizes = sizes.copy()
            sizes[self.dynamic] = outputs[k]
            k += 1
        subs: list[npt.NDArray[np.floating]] = []
        if self.subsample:
            sub_sizes = self.static_sub_sizes
            if k + 1 < len(outputs):
                sub_sizes = sub_sizes.copy()
                sub_sizes[self.dynamic] = outputs[k + 1]
            subs = np.split(outputs[k], np.cumsum(sub_sizes)[:-1])
        return Reduced(len(self.sources), outputs[0], sizes, subs)


class Reduced:
    """One run's reductions: per-source min, max, sentinel sum (views of one vector) and size, and the strided
    subsamples.  Runs once per sample after onnxruntime has evicted the caches: few numpy calls on purpose."""

    __slots__ = ("extremes", "n", "sizes", "subsamples")

    def __init__(self, n: int, extremes: Any, sizes: Any, subsamples: list[npt.NDArray[np.floating]]) -> None:
        self.n, self.extremes, self.sizes, self.subsamples = n, extremes, sizes, subsamples

    @property
    def mins(self) -> npt.NDArray[np.floating]:
        """Per-source minima."""
        return self.extremes[: self.n]  # type: ignore[no-any-return]

    @property
    def maxs(self) -> npt.NDArray[np.floating]:
        """Per-source maxima."""
        return self.extremes[self.n : 2 * self.n]  # type: ignore[no-any-return]

    @property
    def sums(self) -> npt.NDArray[np.floating]:
        """Per-source sentinel sums."""
        return self.extremes[2 * self.n :]  # type: ignore[no-any-return]

    def suspects(self) -> tuple[list[int], list[int]]:
        """``(non_finite, overflow_or_nan)``: sources whose min or max is not finite (NaN or Inf, certain), and
        sources whose only non-finite number is the sentinel sum (NaN, or a sum of huge finite values)."""
        if np.isfinite(self.extremes).all():
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
