"""Calibration as a service: ranges of the tensors placement chose, on the current float graph.

Ranges come from the recipe's ranges file (``calibration.ranges``) when it has them, otherwise from running the
current float graph (``graph.to_onnx()``) over ``ctx.calibration_data`` with the configured observer. Alongside
the chosen range each tensor gets its observed extremes and, when outlier screening is on, the 99.99th
percentile of ``|x|`` (a second, histogram observer fed by the same run), which is what decides that a tensor
is dominated by masking constants or extreme outliers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from qgraph import GraphHandle, PassContext, PassError
from qgraph.calibrate import Observer, make_observer, observe, read_ranges
from qgraph.data import batched
from qgraph.model_io import model_fingerprint

from .config import InsertQDQConfig
from .segments import SEGMENT_NODES, observe_segmented, segmentable

OUTLIER_PERCENTILE = 99.99


@dataclass(frozen=True)
class RangeInfo:
    """Range to quantize with, the observed extremes and the robust magnitude (None when not measured)."""

    rmin: float
    rmax: float
    observed_min: float
    observed_max: float
    robust_absmax: float | None = None


class RobustMagnitude:
    """Cheap robust magnitude: the ``OUTLIER_PERCENTILE`` of ``|x|`` over an evenly strided subsample.

    Each update keeps at most ``per_update`` values (every k-th), and at most ``limit`` values are kept in
    total (older ones are thinned by half when full), so cost and memory stay bounded; rare outliers are
    not needed in the sample: the exact maximum comes from the main observer.
    """

    def __init__(self, per_update: int = 4096, limit: int = 1 << 18) -> None:
        self.per_update, self.limit = per_update, limit
        self.chunks: list[npt.NDArray[np.float32]] = []
        self.size = 0

    def update(self, x: npt.ArrayLike, sample_index: int | None = None) -> None:
        """Fold one batch."""
        flat = np.abs(np.asarray(x, dtype=np.float32).ravel())
        step = max(1, flat.size // self.per_update)
        chunk = flat[::step].copy()
        self.chunks.append(chunk)
        self.size += chunk.size
        if self.size > self.limit:
            self.chunks = [c[::2].copy() for c in self.chunks]
            self.size = sum(c.size for c in self.chunks)

    def value(self) -> float | None:
        """The percentile, or None before any update."""
        if not self.chunks:
            return None
        values = np.concatenate(self.chunks)
        k = min(values.size - 1, int(np.ceil(values.size * OUTLIER_PERCENTILE / 100.0)) - 1)
        return float(np.partition(values, max(k, 0))[max(k, 0)])


class _Tee:
    """Feeds two observers from one onnxruntime run (duck-typed like an Observer for `observe`)."""

    def __init__(self, main: Observer, aux: RobustMagnitude) -> None:
        self.main, self.aux = main, aux

    def update(self, x: npt.ArrayLike, sample_index: int | None = None) -> None:
        self.main.update(x, sample_index)
        self.aux.update(x, sample_index)


def _scalar(v: Any) -> float:
    arr = np.asarray(v, dtype=np.float64)
    return float(arr.min() if arr.ndim else arr)


def _scalar_max(v: Any) -> float:
    arr = np.asarray(v, dtype=np.float64)
    return float(arr.max() if arr.ndim else arr)


def calibrate(
    graph: GraphHandle, ctx: PassContext, names: list[str], cfg: InsertQDQConfig
) -> tuple[dict[str, RangeInfo], list[str]]:
    """Ranges of ``names`` and notes on where they came from."""
    notes: list[str] = []
    out: dict[str, RangeInfo] = {}
    path = ctx.options.get("ranges_file")
    if path:
        # A ranges file computed on another graph is an error, never a silent mismatch.
        rf = read_ranges(path, model_fingerprint(graph.to_onnx()))
        given = rf.ranges()
        for name in names:
            r = given.get(name)
            if r is None:
                continue
            t = rf.tensors.get(name)
            obs_lo = _scalar(t.observed.rmin) if t else _scalar(r.rmin)
            obs_hi = _scalar_max(t.observed.rmax) if t else _scalar_max(r.rmax)
            out[name] = RangeInfo(_scalar(r.rmin), _scalar_max(r.rmax), obs_lo, obs_hi)
        notes.append(f"ranges of {len(out)}/{len(names)} tensors read from {path}")
    missing = [n for n in names if n not in out]
    if not missing:
        return out, notes
    if ctx.calibration_data is None:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        where = f"the ranges file {path} lacks {len(missing)} of them ({shown})" if path else "no data was given"
        raise PassError(
            f"insert_qdq: static quantization needs activation ranges for {len(names)} tensors but {where}. "
            "Pass calibration data: `qgraph run RECIPE MODEL --calibration-data DATA` (an .npz with one array "
            "per input, a folder of .npz, or module:function), or use mode: dynamic."
        )
    observers: dict[str, Any] = {}
    mains: dict[str, Observer] = {}
    auxes: dict[str, RobustMagnitude] = {}
    opts = dict(cfg.activations.method_options)
    for name in missing:
        main = make_observer(cfg.activations.method, name, None, **opts)
        mains[name] = main
        if cfg.outliers.skip:
            aux = RobustMagnitude()
            auxes[name] = aux
            observers[name] = _Tee(main, aux)
        else:
            observers[name] = main
    batch = int(ctx.options.get("batch_size") or 1)
    data = ctx.calibration_data
    model = graph.to_onnx()
    if segmentable(model):
        count = observe_segmented(model, observers, batched(data, batch))
        notes.append(f"calibration ran the {len(model.graph.node)}-node graph in segments of {SEGMENT_NODES} nodes")
    else:
        count = observe(model, observers, lambda: batched(data, batch))
    notes.append(
        f"calibrated {len(missing)} tensors with {cfg.activations.method} on {count} batch(es) of the current graph"
    )
    for name, obs in mains.items():
        rng, seen = obs.compute(), obs.observed()
        robust = auxes[name].value() if name in auxes else None
        out[name] = RangeInfo(
            _scalar(rng.rmin), _scalar_max(rng.rmax), _scalar(seen.rmin), _scalar_max(seen.rmax), robust
        )
    return out, notes


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
