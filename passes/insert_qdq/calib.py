"""Calibration as a service: ranges of the tensors placement chose, on the current float graph.

Ranges come from the recipe's ranges file (``calibration.ranges``) when it has them, otherwise from running the
current float graph (``graph.to_onnx()``) over ``ctx.calibration_data`` with qgraph's collector and the
configured observer. Alongside the chosen range each tensor gets its observed extremes and, when outlier
screening is on, the 99.99th percentile of ``|x|`` (estimated in the same run), which is what decides that a
tensor is dominated by masking constants or extreme outliers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qgraph import GraphHandle, PassContext, PassError
from qgraph.calibrate import (
    ROBUST_PERCENTILE,
    TensorCalibration,
    collect_ranges,
    make_observer,
    most_fragile,
    read_ranges,
)
from qgraph.data import batched
from qgraph.io.model_io import model_fingerprint
from qgraph.recovery.reference_outputs import keep_reference_outputs

from .config import InsertQDQConfig

OUTLIER_PERCENTILE = ROBUST_PERCENTILE


@dataclass(frozen=True)
class RangeInfo:
    """Range to quantize with, the observed extremes and the robust magnitude (None when not measured)."""

    rmin: float
    rmax: float
    observed_min: float
    observed_max: float
    robust_absmax: float | None = None


def _scalar(v: Any) -> float:
    arr = np.asarray(v, dtype=np.float64)
    return float(arr.min() if arr.ndim else arr)


def _scalar_max(v: Any) -> float:
    arr = np.asarray(v, dtype=np.float64)
    return float(arr.max() if arr.ndim else arr)


@dataclass
class Calibration:
    """What :func:`calibrate` found: ranges to quantize with, notes on where they came from, where calibration is
    fragile (for the details), the per-tensor calibrations (``auto``'s choices) and the hand-overridden tensors."""

    ranges: dict[str, RangeInfo]
    notes: list[str]
    fragile: dict[str, Any]
    measured: dict[str, TensorCalibration]
    overridden: set[str]
    #: Per-channel observed ``(min, max)`` of the tensors asked for with ``channel_axes`` (same pass; empty when
    #: the ranges came from a file and no data ran).
    channels: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    #: Seconds the data pass took (None when every range came from the ranges file).
    seconds: float | None = None
    #: The channel axis each tensor of ``channels`` was measured on.
    axes: dict[str, int] = field(default_factory=dict)

    def channels_on(self, axes: dict[str, int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The per-channel ranges of the tensors of ``axes`` that were measured on that axis."""
        return {t: self.channels[t] for t, axis in axes.items() if t in self.channels and self.axes.get(t) == axis}


def observer_options(cfg: InsertQDQConfig) -> dict[str, Any]:
    """The observer options: the recipe's ``method_options``; ``auto`` and ``mse`` also get the activation grid
    (``dtype``, ``symmetric``) insert_qdq quantizes with, unless ``method_options`` says otherwise."""
    opts = dict(cfg.activations.method_options)
    if cfg.activations.method in ("auto", "mse"):
        opts.setdefault("dtype", cfg.activations.dtype.value)
        opts.setdefault("symmetric", cfg.activations.symmetric)
    return opts


def calibrate(graph: GraphHandle, ctx: PassContext, names: list[str], cfg: InsertQDQConfig,
              channel_axes: dict[str, int] | None = None) -> Calibration:
    """Ranges of ``names`` from the ranges file and/or by running the current graph (see :class:`Calibration`);
    ``channel_axes`` ``{tensor: axis}``: also the per-channel observed min/max of those tensors, in the same run."""
    notes: list[str] = []
    out: dict[str, RangeInfo] = {}
    measured: dict[str, TensorCalibration] = {}
    overridden: set[str] = set()
    path = ctx.calibration.ranges
    if path:
        # A ranges file computed on another graph is an error, never a silent mismatch.
        rf = read_ranges(path, model_fingerprint(graph.to_onnx()))
        given = rf.ranges()
        overridden = set(rf.overrides) & set(names)
        for name in names:
            r = given.get(name)
            if r is None:
                continue
            t = rf.tensors.get(name)
            if t is not None:
                measured[name] = t
            obs_lo = _scalar(t.observed.rmin) if t else _scalar(r.rmin)
            obs_hi = _scalar_max(t.observed.rmax) if t else _scalar_max(r.rmax)
            out[name] = RangeInfo(_scalar(r.rmin), _scalar_max(r.rmax), obs_lo, obs_hi, t.robust_absmax if t else None)
        notes.append(f"ranges of {len(out)}/{len(names)} tensors read from {path}")
    missing = [n for n in names if n not in out]
    if not missing:
        return Calibration(out, notes, _fragile(measured), measured, overridden)
    if ctx.calibration_data is None:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        where = f"the ranges file {path} lacks {len(missing)} of them ({shown})" if path else "no data was given"
        raise PassError(
            f"insert_qdq: static quantization needs activation ranges for {len(names)} tensors but {where}. "
            "Pass calibration data: `qgraph run RECIPE MODEL --calibration-data DATA` (an .npz with one array "
            "per input, a folder of .npz, or module:function), or use mode: dynamic."
        )
    batch = ctx.calibration.batch_size
    data = ctx.calibration_data
    side = {t: make_observer("minmax", t, axis) for t, axis in (channel_axes or {}).items()}
    # the fetch path runs anyway: keep the float reference's outputs too (an output that is also a depthwise input
    # is not: the guard then runs the reference itself)
    kept = keep_reference_outputs(ctx, graph) if cfg.activations.method != "minmax" else {}
    kept = {} if set(kept) & set(side) else kept
    model, held = graph.weightless_export()  # sessions read the graph's weights in place: no second copy
    start = time.perf_counter()
    cal = collect_ranges(
        model,
        missing,
        lambda: batched(data, batch),
        cfg.activations.method,
        options=observer_options(cfg),
        progress=ctx.progress("calibrating"),
        robust_percentile=OUTLIER_PERCENTILE if cfg.outliers.skip else None,
        weights={name: value for name, (value, _) in held.items()},
        extra={**side, **kept},
    )
    count = next(iter(cal.values())).num_updates if cal else 0
    notes.append(
        f"calibrated {len(missing)} tensors with {cfg.activations.method} on {count} batch(es) of the current graph"
    )
    measured.update(cal)
    for name, c in cal.items():
        out[name] = RangeInfo(
            _scalar(c.range.rmin), _scalar_max(c.range.rmax), _scalar(c.observed.rmin), _scalar_max(c.observed.rmax),
            c.robust_absmax,
        )
    channels = {t: (np.asarray(o.observed().rmin, np.float64), np.asarray(o.observed().rmax, np.float64))
                for t, o in side.items() if o.num_updates}
    return Calibration(out, notes, _fragile(measured), measured, overridden, channels, time.perf_counter() - start,
                       dict(channel_axes or {}))


def _fragile(measured: dict[str, TensorCalibration]) -> dict[str, Any]:
    return {kind: [r.to_dict() for r in rows] for kind, rows in most_fragile(measured).items()}


def screen(ranges: dict[str, RangeInfo], cfg: InsertQDQConfig) -> dict[str, str]:
    """Tensors not to quantize, with the reason (masking constants, extreme outliers)."""
    if not cfg.outliers.skip:
        return {}
    bad: dict[str, str] = {}
    limit = cfg.outliers.mask_magnitude
    for name, r in ranges.items():
        absmax = max(abs(r.observed_min), abs(r.observed_max))
        if absmax >= limit:
            bad[name] = (
                f"tensor {name!r} is dominated by masking constants: observed range [{r.observed_min:.4g}, "
                f"{r.observed_max:.4g}] reaches |x| >= {limit:g}; quantizing it would crush every other value"
            )
        elif r.robust_absmax is not None and r.robust_absmax > 0 and absmax > cfg.outliers.max_ratio * r.robust_absmax:
            bad[name] = (
                f"tensor {name!r} has extreme outliers: max|x| = {absmax:.4g} is {absmax / r.robust_absmax:.0f}x "
                f"its {OUTLIER_PERCENTILE}th percentile ({r.robust_absmax:.4g})"
            )
    return bad
