"""What a model's inputs expect of data, and how a stacked array maps to samples (the layout rule)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnx

from qgraph.errors import DataError

Feed = dict[str, np.ndarray]
DataLayout = Literal["auto", "samples", "batched"]
#: Samples read when neither the recipe (``calibration.samples``) nor ``--samples`` says otherwise: enough for
#: stable ranges, and a bound on a ``module:function`` generator that never ends.
DEFAULT_MAX_SAMPLES = 1024


@dataclass(frozen=True)
class InputSpec:
    """A graph input as the data must match it: name, numpy dtype, shape (None/str for dynamic dims; the whole
    shape None when the model declares no shape at all)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int | str | None, ...] | None
    #: Wrappers around the tensor, outermost first: () for a plain tensor, ("optional", "sequence") for
    #: ``optional(seq(tensor))``. dtype/shape describe the innermost tensor.
    containers: tuple[str, ...] = ()

    def describe(self) -> str:
        """``name: float32[N,3,224,224]`` (``[?...]`` when the rank is unknown)."""
        if self.shape is None:
            inner = f"{self.dtype}[shape not declared]"
        else:
            inner = f"{self.dtype}[{','.join('?' if d is None else str(d) for d in self.shape)}]"
        for wrapper in reversed(self.containers):
            inner = f"{wrapper}({inner})"
        return f"{self.name}: {inner}"

    def batch_axis(self) -> int | None:
        """Where a left-out batch axis goes: the first axis of symbolic size or size 1 (None if there is none)."""
        for axis, d in enumerate(self.shape or ()):
            if not isinstance(d, int) or d <= 1:
                return axis
        return None


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The graph inputs that are fed at run time (initializers excluded)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tp, containers = vi.type, []
        while tp.WhichOneof("value") in ("optional_type", "sequence_type"):
            kind = tp.WhichOneof("value")
            containers.append("optional" if kind == "optional_type" else "sequence")
            tp = tp.optional_type.elem_type if kind == "optional_type" else tp.sequence_type.elem_type
        tt = tp.tensor_type
        dtype = _np_dtype(tt.elem_type) if tt.elem_type else np.dtype("f4")
        shape: tuple[int | str | None, ...] | None = (
            tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
            if tt.HasField("shape") else None
        )
        specs.append(InputSpec(vi.name, dtype, shape, tuple(containers)))
    return specs


def _np_dtype(elem_type: int) -> np.dtype[Any]:
    if elem_type == onnx.TensorProto.BFLOAT16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)  # type: ignore[no-any-return]
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return np.dtype("f4")


@dataclass(frozen=True)
class LayoutChoice:
    """How one stacked array was read: the layout, and the axis where a left-out batch axis was inserted."""

    input: str
    array_shape: tuple[int, ...]
    layout: Literal["samples", "batched", "single"]
    inserted_axis: int | None = None

    def describe(self) -> str:
        """``state: (16, 2, 128) read as 16 samples, batch axis inserted at 1``."""
        n = self.array_shape[0] if self.array_shape else 1
        if self.layout == "single":
            return f"{self.input}: a 0-d array, read as one sample"
        if self.layout == "batched":
            return f"{self.input}: {self.array_shape} read as {n} batches of one (axis 0 = batch axis)"
        axis = self.inserted_axis
        extra = f", batch axis of size 1 inserted at axis {axis}" if axis is not None else ""
        return f"{self.input}: {self.array_shape} read as {n} samples{extra}"


def _layout_hint(shape: tuple[int | str | None, ...], batch_ok: bool, insert_at: int | None) -> str:
    """A concrete array shape that reads right: the model's shape with N on its batch axis 0 (batches of one), or
    N samples along a new axis 0, each with the batch axis at size 1. Dynamic dims show their name (``?`` unnamed)."""
    dims = [str(d) if isinstance(d, int) and d >= 1 else (d if isinstance(d, str) and d else "?") for d in shape]
    if batch_ok:
        wanted = ", ".join(["N", *dims[1:]])
        how = "the model's shape with N samples on its batch axis 0"
    elif insert_at is not None:
        wanted = ", ".join(["N", *dims[:insert_at], "1", *dims[insert_at + 1:]])
        how = f"N samples along axis 0, each the model's shape with its batch axis {insert_at} of size 1"
    else:
        wanted = ", ".join(["N", *dims])
        how = "N samples along axis 0, each of the model's shape"
    dynamic = " (? = any size)" if "?" in wanted else ""
    return f"Store it as ({wanted}){dynamic}: {how}; or choose --data-layout."


def decide_layout(shape: tuple[int, ...], spec: InputSpec, layout: DataLayout, where: str) -> LayoutChoice:
    """Apply the layout rule (module docs) to a stacked array of ``shape`` for ``spec``; `DataError` if none fits."""
    assert spec.shape is not None
    rank, a = len(spec.shape), len(shape)
    if a == 0:
        return LayoutChoice(spec.name, shape, "single")
    axis0 = spec.shape[0] if rank else None
    batch_ok = rank > 0 and (not isinstance(axis0, int) or axis0 <= 1)
    insert_at = spec.batch_axis()
    can_samples = a == rank + 1 or (a == rank and insert_at is not None)
    hint = _layout_hint(spec.shape, batch_ok, insert_at)
    if layout == "batched" or (layout == "auto" and a == rank and batch_ok):
        if a == rank and batch_ok:
            return LayoutChoice(spec.name, shape, "batched")
        raise DataError(f"{where}, input {spec.name!r}: array of shape {list(shape)} cannot be read as batches of one "
                        f"for {spec.describe()} (needs the same rank and a symbolic or size-1 axis 0). {hint}")
    if can_samples:
        return LayoutChoice(spec.name, shape, "samples", None if a == rank + 1 else insert_at)
    raise DataError(f"{where}, input {spec.name!r}: array of shape {list(shape)} fits neither "
                    f"{spec.describe()} (rank {rank}) with axis 0 indexing samples, nor a sample without the batch "
                    f"axis. {hint}")


def check_array(arr: Any, spec: InputSpec, where: str) -> None:
    if not isinstance(arr, np.ndarray):
        raise DataError(f"{where}: expected a numpy array, got {type(arr).__name__}.")
    if arr.dtype != spec.dtype:
        fix = f"arr.astype(np.{spec.dtype})" if spec.dtype.kind in "biuf" and spec.dtype.isbuiltin else \
            f"arr.astype({spec.dtype})"
        raise DataError(f"{where}: dtype {arr.dtype} but the model expects {spec.dtype}. Convert it (e.g. {fix}) "
                        "when preparing the data.")
    if spec.shape is not None:
        if arr.ndim != len(spec.shape):
            raise DataError(f"{where}: shape {list(arr.shape)} has rank {arr.ndim} but the model expects "
                            f"{spec.describe()} (rank {len(spec.shape)}).")
        for axis, (got, want) in enumerate(zip(arr.shape, spec.shape, strict=True)):
            if isinstance(want, int) and want > 0 and got != want:
                raise DataError(f"{where}: dimension {axis} is {got} but the model fixes it to {want} "
                                f"(shape {list(arr.shape)} vs {spec.describe()}).")
    if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
        bad = "NaN" if np.isnan(arr).any() else "Inf"
        raise DataError(f"{where}: contains {bad}. Calibration data must be finite: fix the preprocessing or drop "
                        "the sample.")


def plain_value_problem(value: Any) -> str | None:
    """Why ``value`` (an option a recipe gives for a tensor: a number, a bool or a nested list of them) is not a
    tensor value: None, text, NaN/inf, a ragged list; None when it is one. Checked without the model."""
    if isinstance(value, list):
        if not value:
            return None
        problems = [plain_value_problem(v) for v in value]
        bad = next((p for p in problems if p is not None), None)
        if bad is not None:
            return bad
        shapes = {np.shape(v) for v in value}
        return None if len(shapes) == 1 else "a ragged list (rows of different lengths); give a rectangular value"
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    shown = "null" if value is None else repr(value)
    return f"{shown} is not a number (give a number, true/false, or a nested list of them)"


def exact_array(value: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """``value`` as an array of ``dtype``, only when every element converts exactly; `ValueError` saying which
    does not (16000.7 on an int64, true on an int64, 1e23 on an int64 or 1e40 on a float32 would become another
    number silently)."""
    problem = plain_value_problem(value)
    if problem is not None:
        raise ValueError(problem)
    flat = np.asarray(value, dtype=object).reshape(-1)
    kind = dtype.kind
    for v in flat:
        if kind == "b":
            if not isinstance(v, bool):
                raise ValueError(f"{v!r} is not a bool; this input is {dtype}: give true or false")
        elif isinstance(v, bool):
            raise ValueError(f"{v!r} is a bool; this input is {dtype}: give a number")
        elif kind in "iu":
            if isinstance(v, float) and not v.is_integer():
                raise ValueError(f"{v!r} is not a whole number; this input is {dtype}")
            info = np.iinfo(dtype)
            if not info.min <= int(v) <= info.max:
                raise ValueError(f"{v!r} does not fit {dtype} ({info.min}..{info.max})")
        elif kind == "f":
            top = float(np.finfo(dtype).max)
            if abs(float(v)) > top:
                raise ValueError(f"{v!r} does not fit {dtype} (largest {top:g}): it would become inf")
    return np.asarray(value, dtype=dtype)
