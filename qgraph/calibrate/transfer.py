"""Ranges of tensors read only by an activation: clipped where the activation is flat.

A tensor read only by an activation ``f`` (a convolution's output before SiLU ``x * sigmoid(x)``, HardSwish,
Sigmoid, Tanh, HardSigmoid, Relu, LeakyRelu or Clip) reaches the rest of the network only through ``f``, and when
``f``'s output is quantized, only through the code each value gets. Where ``f`` is within a fraction of a code of its
limit, clipping changes no code, and a range that spends input codes there wastes them: YOLOv8's convolution outputs
before SiLU span ``[-136, 127]`` while SiLU's Sigmoid gate is below a quarter of a code of its 8-bit ``[0, 1]`` grid
from ``-6.93`` down. :func:`clip_flat` clips the calibrated range at :meth:`Transfer.flat_bounds` and never clips the
side where ``f`` carries the signal; the step on the side that matters gets finer by the range's ratio.

How far is "flat": within half of what still rounds to the limit's code on the output grid (:func:`tolerance`; a
quarter code for the limit 0, which every grid holds exactly). Half a code was tried first: the integer zero points
move the clip point by up to half an input step, and a clip at exactly half a code let every clipped value round *up*
to one code (a detection head's near-zero scores all read 1/255: measured 31 -> 21 dB).

Choosing instead the range that minimizes the error after ``f`` (``E[(f(x) - f(Q(x)))**2]`` on the histogram, over
``method: auto``'s candidates and a grid) was measured first and lost to the flat-side clip: it also clipped the large
positive tails and moderately negative values (SiLU at -4 is -0.07, the same shift for every clipped value),
systematic errors that the next convolutions sum where rounding noise averages out (YOLOv8n class scores: calibrated
16.4 dB, error-optimal 18.1 dB, flat-side clip 19.7 dB).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from qgraph.quant.math import QuantSpec, compute_scale_zero_point

F64 = npt.NDArray[np.float64]

#: Activations :class:`Transfer` knows (ONNX op types, and ``SiLU`` for the ``x * Sigmoid(x)`` pattern).
KINDS = ("SiLU", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Relu", "LeakyRelu", "Clip")


@dataclass(frozen=True)
class Transfer:
    """An activation ``f`` with its parameters: ``alpha``/``beta`` of HardSigmoid and LeakyRelu, ``low``/``high``
    of Clip (infinite when absent)."""

    kind: str
    alpha: float = 0.0
    beta: float = 0.0
    low: float = -np.inf
    high: float = np.inf

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown activation {self.kind!r}; known: {', '.join(KINDS)}")

    def value(self, x: F64) -> F64:
        """``f(x)``."""
        k = self.kind
        if k == "SiLU":
            return np.asarray(x * _sigmoid(x), np.float64)
        if k == "Sigmoid":
            return _sigmoid(x)
        if k == "Tanh":
            return np.asarray(np.tanh(x), np.float64)
        if k == "HardSigmoid":
            return np.asarray(np.clip(self.alpha * x + self.beta, 0.0, 1.0), np.float64)
        if k == "HardSwish":
            return np.asarray(x * np.clip(x / 6.0 + 0.5, 0.0, 1.0), np.float64)
        if k == "Relu":
            return np.asarray(np.maximum(x, 0.0), np.float64)
        if k == "LeakyRelu":
            return np.asarray(np.where(x >= 0, x, self.alpha * x), np.float64)
        return np.asarray(np.clip(x, self.low, self.high), np.float64)  # Clip

    def slope(self, x: F64) -> F64:
        """``f'(x)`` (one-sided values at the kinks do not matter: they are measure zero)."""
        k = self.kind
        if k == "SiLU":
            s = _sigmoid(x)
            return np.asarray(s * (1.0 + x * (1.0 - s)), np.float64)
        if k == "Sigmoid":
            s = _sigmoid(x)
            return np.asarray(s * (1.0 - s), np.float64)
        if k == "Tanh":
            return np.asarray(1.0 - np.tanh(x) ** 2, np.float64)
        if k == "HardSigmoid":
            y = self.alpha * x + self.beta
            return np.where((y > 0.0) & (y < 1.0), self.alpha, 0.0)
        if k == "HardSwish":
            return np.where(x <= -3.0, 0.0, np.where(x >= 3.0, 1.0, x / 3.0 + 0.5))
        if k == "Relu":
            return np.where(x > 0.0, 1.0, 0.0)
        if k == "LeakyRelu":
            return np.where(x >= 0.0, 1.0, self.alpha)
        return np.where((x > self.low) & (x < self.high), 1.0, 0.0)  # Clip

    def limits(self) -> tuple[float | None, float | None]:
        """The values ``f`` approaches on its lower and upper flat side (None where it has none)."""
        return {
            "SiLU": (0.0, None), "Sigmoid": (0.0, 1.0), "Tanh": (-1.0, 1.0), "HardSigmoid": (0.0, 1.0),
            "HardSwish": (0.0, None), "Relu": (0.0, None), "LeakyRelu": (None, None),
            "Clip": (None if np.isinf(self.low) else self.low, None if np.isinf(self.high) else self.high),
        }[self.kind]

    def flat_bounds(self, low_tol: float, high_tol: float, gate_tol: float | None = None) -> tuple[float, float]:
        """Input bounds beyond which ``f`` stays within ``low_tol``/``high_tol`` of its lower/upper limit
        (``-inf``/``inf`` on a side that is not flat). SiLU: ``|SiLU(lo)| <= low_tol`` (it rises monotonically to 0
        below its minimum at -1.28) and, with its Sigmoid gate quantized too, ``sigmoid(lo) <= gate_tol`` (-6.93 for
        a quarter code of a ``[0, 1]`` u8 gate); Sigmoid: ``sigmoid(-t) = tol``; Tanh: ``1 - tanh(t) = tol``;
        HardSwish -3, HardSigmoid where ``alpha x + beta`` leaves ``[0, 1]``, Relu 0 and Clip its bounds are
        exactly flat (no tolerance needed); LeakyRelu: none."""
        k = self.kind
        if k == "SiLU":
            lo = _silu_level(low_tol)
            return (min(lo, -_logit_edge(gate_tol)) if gate_tol is not None else lo), np.inf
        if k == "Sigmoid":
            return -_logit_edge(low_tol), _logit_edge(high_tol)
        if k == "Tanh":
            return -_tanh_edge(low_tol), _tanh_edge(high_tol)
        if k == "HardSigmoid" and self.alpha > 0:
            return -self.beta / self.alpha, (1.0 - self.beta) / self.alpha
        if k == "HardSwish":
            return -3.0, np.inf
        if k == "Relu":
            return 0.0, np.inf
        if k == "Clip":
            return self.low, self.high
        return -np.inf, np.inf

    def describe(self) -> str:
        """The activation as reports name it, e.g. ``SiLU`` or ``Clip[0, 6]``."""
        if self.kind == "Clip":
            return f"Clip[{self.low:g}, {self.high:g}]"
        if self.kind in ("HardSigmoid", "LeakyRelu"):
            return f"{self.kind}(alpha={self.alpha:g})"
        return self.kind


#: Where SiLU has its minimum (-0.2785): below it, SiLU rises monotonically towards 0.
SILU_ARGMIN = -1.2785


def _logit_edge(margin: float) -> float:
    """``t`` with ``sigmoid(-t) = margin`` (``inf`` for a zero margin)."""
    if margin <= 0:
        return float(np.inf)
    return float(np.log(max(1.0 / min(margin, 0.5) - 1.0, 1.0)))


def _tanh_edge(margin: float) -> float:
    """``t`` with ``1 - tanh(t) = margin`` (``inf`` for a zero margin)."""
    return float(np.arctanh(1.0 - min(margin, 1.0))) if margin > 0 else float(np.inf)


def tolerance(limit: float | None, grid: tuple[float, float]) -> float:
    """How far ``f`` may stay from ``limit`` and still get ``limit``'s code on the output ``grid`` (scale, zero
    point), with a factor 2 of safety: ``0.5 * (0.5 - |p - round(p)|) * scale``, ``p = limit / scale + zero_point``
    (a quarter code where the limit is on the grid, as 0 always is; 0 where it sits between two codes)."""
    if limit is None:
        return 0.0
    scale, zero_point = grid
    p = limit / scale + zero_point
    return 0.5 * max(0.0, 0.5 - abs(p - round(p))) * scale


def _silu_level(margin: float) -> float:
    """The largest ``x <= SILU_ARGMIN`` with ``|SiLU(x)| <= margin`` (bisection; ``-inf`` for a zero margin)."""
    if margin <= 0:
        return float(-np.inf)
    lo, hi = -200.0, SILU_ARGMIN
    if abs(float(hi / (1.0 + np.exp(-hi)))) <= margin:
        return SILU_ARGMIN
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if abs(mid / (1.0 + np.exp(-mid))) <= margin:
            lo = mid
        else:
            hi = mid
    return lo


def _sigmoid(x: F64) -> F64:
    return np.asarray(0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64))), np.float64)  # overflow-free


@dataclass(frozen=True)
class ThroughChoice:
    """The range :func:`clip_flat` chose and the calibrated range it replaces."""

    transfer: Transfer
    range: tuple[float, float]
    calibrated: tuple[float, float]

    @property
    def changed(self) -> bool:
        """Whether the range differs from the calibrated one."""
        return self.range != self.calibrated

    @property
    def finer(self) -> float:
        """How many times finer the quantization step gets: the calibrated range's width over the chosen one's
        (both extended to 0, as the grid is)."""
        def width(r: tuple[float, float]) -> float:
            return max(r[1], 0.0) - min(r[0], 0.0)

        return width(self.calibrated) / max(width(self.range), 1e-30)


def clip_flat(
    calibrated: tuple[float, float],
    transfer: Transfer,
    spec: QuantSpec,
    out_grid: tuple[float, float],
    gate_grid: tuple[float, float] | None = None,
) -> ThroughChoice:
    """``calibrated`` intersected with ``transfer``'s :meth:`Transfer.flat_bounds` for the :func:`tolerance` of its
    output grid (scale, zero point) and, for SiLU, of its quantized gate's grid; when the data lie entirely on a flat
    side, the range collapses to that bound, which 0 then extends. A clipped end is moved out by one step of ``spec``'s
    grid where the integer zero point would put the grid's end inside the non-flat region (HardSwish clipped at -3
    must not end at -2.98)."""
    low, high = transfer.limits()
    gate = tolerance(0.0, gate_grid) if gate_grid is not None else None
    flat_lo, flat_hi = transfer.flat_bounds(tolerance(low, out_grid), tolerance(high, out_grid), gate)
    lo = min(max(calibrated[0], flat_lo), flat_hi)
    hi = max(min(calibrated[1], flat_hi), flat_lo)
    scale, zp = compute_scale_zero_point(lo, hi, spec)
    s, z = float(np.asarray(scale).ravel()[0]), float(np.asarray(zp).ravel()[0])
    qmin, qmax = spec.qrange
    if lo > calibrated[0] and (qmin - z) * s > flat_lo:
        lo -= s
    if hi < calibrated[1] and (qmax - z) * s < flat_hi:
        hi += s
    return ThroughChoice(transfer, (float(lo), float(hi)), (float(calibrated[0]), float(calibrated[1])))
