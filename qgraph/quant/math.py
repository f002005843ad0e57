"""Quantization math shared by every part of qgraph.

This module is the single place where integer ranges, scales, zero points and the
QuantizeLinear / DequantizeLinear arithmetic are defined.  Everything is vectorized numpy
and works elementwise for per-channel parameters.  It is longer than 400 lines on purpose: the
quantization math stays in one place rather than spread over modules.

Conventions (they match ONNX ``QuantizeLinear`` / ``DequantizeLinear``):

* quantize:    ``q = saturate(round_half_to_even(x / scale) + zero_point)``
* dequantize:  ``x' = (q - zero_point) * scale``
* fake quantize: ``dequantize(quantize(x))``

Scales are always ``float32`` and at least :data:`MIN_SCALE`; an exactly-zero range gets
scale ``1.0`` (see :func:`compute_scale_zero_point`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from onnx import TensorProto
from pydantic import BaseModel, ConfigDict, model_validator

FloatArray: TypeAlias = npt.NDArray[np.float32]

#: Smallest scale ever produced: ``2**-40`` (~9.1e-13).  Scales below this would make
#: ``input_scale * weight_scale`` (the bias scale) underflow towards float32 denormals.
MIN_SCALE: float = 2.0**-40

#: Scale used when the (zero-extended) range is exactly ``[0, 0]``: any positive scale
#: represents the only observed value 0 exactly; 1.0 keeps downstream products well away
#: from denormals.
ZERO_RANGE_SCALE: float = 1.0

_INT32_MAX = 2**31 - 1


class QuantDtype(str, enum.Enum):
    """Integer storage type of a quantized tensor."""

    INT8 = "int8"
    UINT8 = "uint8"
    INT16 = "int16"
    UINT16 = "uint16"
    INT4 = "int4"
    UINT4 = "uint4"
    INT32 = "int32"

    @property
    def bits(self) -> int:
        """Number of bits of the type (4, 8, 16 or 32)."""
        return _BITS[self]

    @property
    def signed(self) -> bool:
        """True for the two's-complement signed types."""
        return self in (QuantDtype.INT8, QuantDtype.INT16, QuantDtype.INT4, QuantDtype.INT32)

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """numpy storage dtype (int4/uint4 are stored unpacked in int8/uint8)."""
        return np.dtype(_NUMPY[self])

    @property
    def onnx_type(self) -> int:
        """``onnx.TensorProto`` element type (e.g. ``TensorProto.INT8``)."""
        return _ONNX[self]


_BITS = {
    QuantDtype.INT8: 8,
    QuantDtype.UINT8: 8,
    QuantDtype.INT16: 16,
    QuantDtype.UINT16: 16,
    QuantDtype.INT4: 4,
    QuantDtype.UINT4: 4,
    QuantDtype.INT32: 32,
}
_NUMPY: dict[QuantDtype, type[np.integer[Any]]] = {
    QuantDtype.INT8: np.int8,
    QuantDtype.UINT8: np.uint8,
    QuantDtype.INT16: np.int16,
    QuantDtype.UINT16: np.uint16,
    QuantDtype.INT4: np.int8,
    QuantDtype.UINT4: np.uint8,
    QuantDtype.INT32: np.int32,
}
_ONNX = {
    QuantDtype.INT8: TensorProto.INT8,
    QuantDtype.UINT8: TensorProto.UINT8,
    QuantDtype.INT16: TensorProto.INT16,
    QuantDtype.UINT16: TensorProto.UINT16,
    QuantDtype.INT4: TensorProto.INT4,
    QuantDtype.UINT4: TensorProto.UINT4,
    QuantDtype.INT32: TensorProto.INT32,
}


def dtype_range(dtype: QuantDtype | str, narrow: bool = False, reduce_range: bool = False) -> tuple[int, int]:
    """Integer range ``(qmin, qmax)`` of ``dtype``.

    With ``b`` bits (``b - 1`` when ``reduce_range``):

    * signed: ``[-2**(b-1), 2**(b-1) - 1]``; ``narrow`` drops the most negative code,
      e.g. int8 ``[-127, 127]``; ``reduce_range`` int8 ``[-64, 63]``.
    * unsigned: ``[0, 2**b - 1]``; ``narrow`` drops the highest code so the range is
      symmetric around its midpoint, e.g. uint8 ``[0, 254]``; ``reduce_range`` uint8 ``[0, 127]``.
    """
    dt = QuantDtype(dtype)
    bits = dt.bits - 1 if reduce_range else dt.bits
    if dt.signed:
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        if narrow:
            qmin += 1
    else:
        qmin, qmax = 0, 2**bits - 1
        if narrow:
            qmax -= 1
    return qmin, qmax


def storage_range(dtype: npt.DTypeLike) -> tuple[int, int] | None:
    """`dtype_range` of the codes a numpy array of ``dtype`` holds (int4/uint4 as ``ml_dtypes`` names them, int8 to
    int32); None for other carriers (float8: no integer clamp to speak of)."""
    try:
        return dtype_range(QuantDtype(np.dtype(dtype).name))
    except (TypeError, ValueError):
        return None


def symmetric_zero_point(dtype: QuantDtype | str, narrow: bool = False, reduce_range: bool = False) -> int:
    """Zero point of a symmetric quantizer: 0 for signed types, ``(qmin + qmax + 1) // 2`` otherwise.

    uint8 -> 128, uint16 -> 32768, narrow uint8 ``[0, 254]`` -> 127.
    """
    dt = QuantDtype(dtype)
    if dt.signed:
        return 0
    qmin, qmax = dtype_range(dt, narrow, reduce_range)
    return (qmin + qmax + 1) // 2


class QuantSpec(BaseModel):
    """How one tensor is quantized.

    ``axis`` is required (and only allowed) when ``per_channel`` is true.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: QuantDtype = QuantDtype.INT8
    symmetric: bool = False
    per_channel: bool = False
    axis: int | None = None
    narrow_range: bool = False
    reduce_range: bool = False

    @model_validator(mode="after")
    def _check_axis(self) -> QuantSpec:
        if self.per_channel and self.axis is None:
            raise ValueError("per_channel quantization needs an axis")
        if not self.per_channel and self.axis is not None:
            raise ValueError("axis is only meaningful with per_channel=True")
        return self

    @property
    def qrange(self) -> tuple[int, int]:
        """``dtype_range(dtype, narrow_range, reduce_range)``."""
        return dtype_range(self.dtype, self.narrow_range, self.reduce_range)


@dataclass(frozen=True, eq=False)
class ActivationRange:
    """Real-valued range ``[rmin, rmax]`` of a tensor (arrays of shape ``(C,)`` when per channel)."""

    rmin: float | npt.NDArray[np.float64]
    rmax: float | npt.NDArray[np.float64]

    @property
    def per_channel(self) -> bool:
        """True when ``rmin``/``rmax`` are arrays."""
        return isinstance(self.rmin, np.ndarray) and self.rmin.ndim > 0


def compute_scale_zero_point(
    rmin: float | npt.ArrayLike, rmax: float | npt.ArrayLike, spec: QuantSpec
) -> tuple[FloatArray, npt.NDArray[Any]]:
    """Scale and zero point that map ``[rmin, rmax]`` onto ``spec``'s integer range.

    The range is first extended to include 0: ``lo = min(rmin, 0)``, ``hi = max(rmax, 0)``, so
    that 0 is exactly representable (``quantize(0) == zero_point``).  With ``(qmin, qmax) =
    spec.qrange``:

    * symmetric: ``zp = symmetric_zero_point(...)``, ``a = max(-lo, hi)``,
      ``scale = a / min(qmax - zp, zp - qmin)`` (e.g. ``a / 127`` for int8 and uint8), so both
      ``-a`` and ``a`` are representable without clipping.
    * asymmetric: ``scale = (hi - lo) / (qmax - qmin)``,
      ``zp = clip(round_half_even(qmin - lo / scale), qmin, qmax)``.

    Special cases: an exactly-zero range (``lo == hi == 0``) gives ``scale =
    ZERO_RANGE_SCALE`` (1.0); any other scale is floored at :data:`MIN_SCALE`.  The scale is
    rounded to float32 before the zero point is derived from it.  Works elementwise on
    per-channel arrays.  Returns ``(scale float32, zero_point of spec.dtype.numpy_dtype)`` with
    the broadcast shape of the inputs.

    Raises:
        ValueError: non-finite bounds or ``rmin > rmax``.
    """
    lo_in = np.asarray(rmin, dtype=np.float64)
    hi_in = np.asarray(rmax, dtype=np.float64)
    if not (np.all(np.isfinite(lo_in)) and np.all(np.isfinite(hi_in))):
        raise ValueError(f"range bounds must be finite, got rmin={rmin!r}, rmax={rmax!r}")
    if np.any(lo_in > hi_in):
        raise ValueError(f"rmin must be <= rmax, got rmin={rmin!r}, rmax={rmax!r}")
    lo = np.minimum(lo_in, 0.0)
    hi = np.maximum(hi_in, 0.0)
    qmin, qmax = spec.qrange
    if spec.symmetric:
        zp_int = symmetric_zero_point(spec.dtype, spec.narrow_range, spec.reduce_range)
        absmax = np.maximum(-lo, hi)
        raw = absmax / float(min(qmax - zp_int, zp_int - qmin))
    else:
        raw = (hi - lo) / float(qmax - qmin)
    zero = (lo == 0.0) & (hi == 0.0)
    scale64 = np.where(zero, ZERO_RANGE_SCALE, np.maximum(raw, MIN_SCALE))
    scale = scale64.astype(np.float32)
    # float32 rounding may push a floored scale just below MIN_SCALE; nudge it back up.
    scale = np.where(scale < np.float32(MIN_SCALE), np.float32(MIN_SCALE), scale).astype(np.float32)
    if spec.symmetric:
        zp = np.full(scale.shape, zp_int, dtype=np.float64)
    else:
        zp = np.clip(np.rint(qmin - lo / scale.astype(np.float64)), qmin, qmax)
    return scale, zp.astype(spec.dtype.numpy_dtype)


def _broadcast_param(
    p: npt.ArrayLike, ndim: int, axis: int | None, block_size: int = 0, size: int | None = None
) -> npt.NDArray[Any]:
    """Reshape a per-channel parameter so it broadcasts along ``axis`` of an ``ndim`` array (for blocked
    quantization, repeat each value ``block_size`` times and cut to the axis' ``size``)."""
    arr = np.asarray(p)
    if axis is None or arr.ndim == 0 or ndim == 0:
        if arr.size != 1 and axis is None:
            raise ValueError(f"per-tensor quantization needs a scalar parameter, got shape {arr.shape}")
        return arr.reshape(()) if arr.size == 1 else arr
    ax = axis % ndim
    if block_size > 0:
        blocked = np.repeat(arr, block_size, axis=ax)
        return np.take(blocked, np.arange(size if size is not None else blocked.shape[ax]), axis=ax)
    shape = [1] * ndim
    shape[ax] = arr.size
    return arr.reshape(shape)


def quantize(
    x: npt.ArrayLike,
    scale: npt.ArrayLike,
    zero_point: npt.ArrayLike,
    dtype: QuantDtype | str,
    axis: int | None = None,
) -> npt.NDArray[Any]:
    """ONNX ``QuantizeLinear``: ``saturate(round_half_to_even(x / scale) + zero_point)``.

    ``x / scale`` is computed in float32 like onnxruntime.  Saturation clips to the full
    range of ``dtype`` (not the narrow or reduced one).  ``axis`` selects the channel axis
    for per-channel ``scale``/``zero_point`` of shape ``(C,)``.

    Runs in float32 in place, `QUANTIZE_CHUNK` elements at a time (a weight costs its integer result plus one
    bounded scratch). Exact: ``round(x / scale) + zp`` in float32 is exact inside the (<= 16-bit) integer range,
    and a sum outside it stays outside (rounding is monotonic), saturating to the same bound.
    """
    dt = QuantDtype(dtype)
    xa = np.asarray(x, dtype=np.float32)
    s = _broadcast_param(np.asarray(scale, dtype=np.float32), xa.ndim, axis)
    z = _broadcast_param(np.asarray(zero_point, dtype=np.float64), xa.ndim, axis)
    qmin, qmax = dtype_range(dt)
    out: npt.NDArray[Any] = np.empty(xa.shape, dt.numpy_dtype)
    if xa.ndim == 0 or xa.size == 0 or max(abs(qmin), abs(qmax)) > 2**16:
        q: npt.NDArray[np.float64] = np.rint(xa / s).astype(np.float64) + z
        out[...] = np.clip(q, qmin, qmax).astype(dt.numpy_dtype)
        return out
    zf = z.astype(np.float32)
    add_zero = bool(np.any(zf))
    rows = max(1, QUANTIZE_CHUNK // max(1, xa[0].size))
    buf = np.empty((min(rows, xa.shape[0]), *xa.shape[1:]), np.float32)
    for start in range(0, xa.shape[0], rows):
        stop = min(start + rows, xa.shape[0])
        part = buf[: stop - start]
        np.divide(xa[start:stop], _rows(s, start, stop), out=part)
        np.rint(part, out=part)
        if add_zero:
            np.add(part, _rows(zf, start, stop), out=part)
        np.clip(part, qmin, qmax, out=part)
        out[start:stop] = part  # exact: integers within the dtype's range
    return out


QUANTIZE_CHUNK = 1 << 22  #: elements quantized per slab (float32 scratch: 16 MB)


def _rows(p: npt.NDArray[Any], start: int, stop: int) -> npt.NDArray[Any]:
    """Rows ``start:stop`` of a broadcast parameter when it varies along the first axis, else the parameter."""
    return p[start:stop] if p.ndim and p.shape[0] > 1 else p


def dequantize(
    q: npt.ArrayLike, scale: npt.ArrayLike, zero_point: npt.ArrayLike, axis: int | None = None, block_size: int = 0
) -> FloatArray:
    """ONNX ``DequantizeLinear``: ``(q - zero_point) * scale`` as onnxruntime computes it (integer subtract, then
    float32 multiply; float32 result). ``block_size`` > 0: blocked quantization along ``axis``."""
    qa = np.asarray(q)
    size = qa.shape[axis % qa.ndim] if axis is not None and qa.ndim else None
    s = _broadcast_param(np.asarray(scale, dtype=np.float32), qa.ndim, axis, block_size, size)
    if qa.dtype.kind in "iu":
        z = _broadcast_param(np.asarray(zero_point, dtype=np.int64), qa.ndim, axis, block_size, size)
        diff = (qa.astype(np.int64) - z).astype(np.float32)
    else:  # float8 and other non-integer carriers
        z = _broadcast_param(np.asarray(zero_point, dtype=np.float32), qa.ndim, axis, block_size, size)
        diff = qa.astype(np.float32) - z
    return np.asarray(diff * s, dtype=np.float32)


def fake_quantize(
    x: npt.ArrayLike,
    scale: npt.ArrayLike,
    zero_point: npt.ArrayLike,
    dtype: QuantDtype | str,
    axis: int | None = None,
) -> FloatArray:
    """``dequantize(quantize(x))``: the float values a QDQ pair produces."""
    return dequantize(quantize(x, scale, zero_point, dtype, axis), scale, zero_point, axis)


def fake_quantize_counted(
    x: npt.ArrayLike,
    scale: npt.ArrayLike,
    zero_point: npt.ArrayLike,
    qmin: int,
    qmax: int,
    axis: int | None = None,
    block_size: int = 0,
) -> tuple[FloatArray, int]:
    """What a Q/DQ pair with integer range ``[qmin, qmax]`` produces from ``x`` (x / scale in float32 as
    onnxruntime computes it, round half to even, saturate), and how many elements saturated."""
    xa = np.asarray(x, dtype=np.float32)
    size = xa.shape[axis % xa.ndim] if axis is not None and xa.ndim else None
    s = _broadcast_param(np.asarray(scale, dtype=np.float32), xa.ndim, axis, block_size, size)
    z = _broadcast_param(np.asarray(zero_point, dtype=np.float64), xa.ndim, axis, block_size, size)
    q = np.rint(xa / s).astype(np.float64) + z
    clipped = int(np.count_nonzero((q < qmin) | (q > qmax)))
    out = ((np.clip(q, qmin, qmax) - z) * s).astype(np.float32)
    return out, clipped


@dataclass(frozen=True, eq=False)
class QuantizedBias:
    """Result of :func:`quantize_bias`.

    Attributes:
        values: int32 bias, ``round_half_even(bias / scale)``.
        scale: float32 bias scale ``input_scale * weight_scale`` (per output channel).
        weight_scale: float32 weight scale actually used; differs from the requested one in
            the channels flagged by ``adjusted`` (the weight must then be quantized with it).
        adjusted: bool mask of the channels whose weight scale was raised.
    """

    values: npt.NDArray[np.int32]
    scale: FloatArray
    weight_scale: FloatArray
    adjusted: npt.NDArray[np.bool_]


def quantize_bias(bias: npt.ArrayLike, input_scale: npt.ArrayLike, weight_scale: npt.ArrayLike) -> QuantizedBias:
    """Quantize a bias to int32 with ``scale = input_scale * weight_scale`` and zero point 0.

    ``q = round_half_even(bias / scale)``.  Guard against tiny scales: a channel needs
    ``|bias| / scale <= 2**31 - 1`` and ``scale >= MIN_SCALE**2`` (never denormal).  Where this
    fails the *weight* scale of that channel is raised to the smallest float32 value that
    satisfies both, ``weight_scale' = max(|bias| / (2**31 - 1), MIN_SCALE**2) / input_scale``
    (rounded up), and the channel is reported in ``adjusted``: the caller must quantize that
    weight channel with ``weight_scale'`` so ``input_scale * weight_scale'`` stays the product
    of the two scales used by the QDQ graph.
    """
    b = np.asarray(bias, dtype=np.float64)
    s_in = np.float32(np.asarray(input_scale, dtype=np.float32).reshape(()))
    w = np.broadcast_to(np.asarray(weight_scale, dtype=np.float32), b.shape).astype(np.float32)
    if not np.all(np.isfinite(b)):
        raise ValueError("bias contains NaN or Inf")
    if not (np.isfinite(s_in) and s_in > 0 and np.all(np.isfinite(w)) and np.all(w > 0)):
        raise ValueError("input_scale and weight_scale must be finite and positive")
    need = np.maximum(np.abs(b) / _INT32_MAX, MIN_SCALE**2)
    scale = (w * s_in).astype(np.float32)
    adjusted = scale.astype(np.float64) < need
    if np.any(adjusted):
        w_new = (need / np.float64(s_in)).astype(np.float32)
        # round up until the float32 product meets the requirement (at most a few ulps)
        for _ in range(8):
            low = adjusted & ((w_new * s_in).astype(np.float64) < need)
            if not np.any(low):
                break
            w_new = np.where(low, np.nextafter(w_new, np.float32(np.inf)), w_new).astype(np.float32)
        w = np.where(adjusted, w_new, w).astype(np.float32)
        scale = (w * s_in).astype(np.float32)
    q = np.clip(np.rint(b / scale.astype(np.float64)), -_INT32_MAX - 1, _INT32_MAX).astype(np.int32)
    return QuantizedBias(values=q, scale=scale, weight_scale=w, adjusted=np.asarray(adjusted, dtype=np.bool_))


def shift_int32_bias(
    codes: npt.ArrayLike, scale: npt.ArrayLike, delta: npt.ArrayLike
) -> tuple[npt.NDArray[np.int32], int]:
    """Fold a float correction ``delta`` into an int32 bias of scale ``scale`` (zero point 0).

    ``q' = clip(q + round_half_even(delta / scale), -2**31, 2**31 - 1)`` elementwise (``scale`` broadcasts: a
    scalar or one value per channel); the dequantized bias moves by ``delta`` to within half a step. Returns the
    new codes and how many saturated. NaN/Inf in ``delta`` is an error, never "no change".
    """
    q = np.asarray(codes, dtype=np.int64)
    d = np.asarray(delta, dtype=np.float64)
    s = np.asarray(scale, dtype=np.float64)
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(s)) and np.all(s > 0)):
        raise ValueError("bias correction and scale must be finite (scale > 0)")
    moved = q + np.rint(d / s)
    clipped = int(np.count_nonzero((moved < -_INT32_MAX - 1) | (moved > _INT32_MAX)))
    out = np.clip(moved, -_INT32_MAX - 1, _INT32_MAX).astype(np.int32)
    return out.reshape(q.shape), clipped


def matches_codes(values: npt.ArrayLike, codes: npt.ArrayLike, scale: npt.ArrayLike, zero_point: npt.ArrayLike,
                  axis: int | None = None, steps: float = 1.01) -> bool:
    """Whether ``values`` are the float weights ``codes`` were quantized from (so they may stand in for them).

    With ``x̂ = (codes - zero_point) * scale``, an element matches when ``|x̂ - values| <= steps * scale`` (+1e-12):
    ``steps = 0.51`` asks for round-to-nearest, the default ``1.01`` also admits floor/ceil rounding (AdaRound).
    True when at least half of the channels along ``axis`` (the whole tensor when None) have >= 99% of their
    elements matching, so one corrupted channel does not disqualify a weight, while a BatchNorm fused or an
    equalization applied after the values were taken (every channel rescaled) does. Shapes must agree.
    """
    q, v = np.asarray(codes), np.asarray(values, dtype=np.float64)
    if q.shape != v.shape or q.size == 0:
        return False
    deq = dequantize(q, scale, zero_point, axis).astype(np.float64)
    step = np.abs(dequantize(np.ones_like(q), scale, np.zeros_like(np.asarray(zero_point)), axis)).astype(np.float64)
    within = np.abs(deq - v) <= steps * step + 1e-12
    rows = within.reshape(1, -1) if axis is None or q.ndim == 0 else np.moveaxis(within, axis % q.ndim, 0).reshape(
        q.shape[axis % q.ndim], -1)
    return bool(np.mean(rows.mean(axis=1) >= 0.99) >= 0.5)
