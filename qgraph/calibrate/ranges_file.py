"""Calibration ranges file (JSON): write atomically, read with validation and overrides.

Schema, format version 1 (``//`` comments are explanations, not part of the file)::

    {
      "format": "qgraph-ranges",          // constant
      "version": 1,                        // format version
      "model_fingerprint": "<sha256 hex>", // qgraph.io.model_io.model_fingerprint of the float model
      "data_fingerprint": "<hex>" | null,  // qgraph.data.DataSource.fingerprint (same scheme as the
                                           // collector's data_hasher); informational
      "method": "entropy",                 // minmax | percentile | entropy | mse | auto | mixed
      "options": {...},                    // observer options used
      "tensors": {
        "<tensor name>": {
          "method": "entropy",
          "chosen": null | "mse",          // optional, method auto: the winning candidate (minmax,
                                           // percentile:99.99, mse, entropy)
          "candidates": null | {           // optional, method auto: every candidate's range and its
            "mse": {"min": -2.1, "max": 2.3, "error": 1.7e-5}, ...  // expected squared error per value
          },
          "axis": null,                    // or the channel axis (then every value below is a list)
          "min": -3.2, "max": 5.1,         // exact observed extremes
          "range": {"min": -3.0, "max": 3.0},  // chosen range (what the quantizer uses)
          "clip_fraction": 0.0004,         // fraction of observed values outside "range"
          "num_values": 1048576, "num_updates": 128,
          "robust_absmax": 2.9 | null,     // optional: 99.99th percentile of |x| (strided subsample);
                                           // max(|min|, |max|) / robust_absmax is the outlier ratio
          "histogram": null | {            // optional, per-tensor histogram methods only
            "kind": "abs" | "signed",      // histogram of |x| or of x
            "bin_width": 0.0078125,        // power of two
            "first_bin": 0,                // bin j covers [(first_bin+j)*w, (first_bin+j+1)*w)
            "counts": [12, 40, ...],       // occupied bins only
            "zeros": 5120                  // optional: values exactly 0 (also counted in their bin)
          }
        }
      },
      "overrides": {                       // optional, hand-edited; wins over "range"
        "<tensor name>": {"min": -6.0, "max": 6.0}
      }
    }

Numbers are JSON floats (round-trip exact); per-channel values are lists of length C.
An override may name a tensor absent from ``tensors``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from qgraph.calibrate.auto import AutoChoice
from qgraph.calibrate.collector import TensorCalibration
from qgraph.calibrate.observers import HistogramSummary
from qgraph.errors import DataError
from qgraph.io.outputs import write_atomic
from qgraph.quant.math import ActivationRange

FORMAT = "qgraph-ranges"
VERSION = 1

Number = float | list[float]


class _Range(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: Number
    max: Number

    @model_validator(mode="after")
    def _check(self) -> _Range:
        lo, hi = np.asarray(self.min, dtype=np.float64), np.asarray(self.max, dtype=np.float64)
        if lo.shape != hi.shape:
            raise ValueError("min and max must both be numbers or lists of the same length")
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            raise ValueError("min and max must be finite")
        if np.any(lo > hi):
            raise ValueError("min must be <= max")
        return self


class _Histogram(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["abs", "signed"]
    bin_width: float
    first_bin: int
    counts: list[int]
    zeros: int = 0


class _Candidate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: float
    max: float
    error: float


class _Tensor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str
    chosen: str | None = None
    candidates: dict[str, _Candidate] | None = None
    axis: int | None = None
    min: Number
    max: Number
    range: _Range
    clip_fraction: float = 0.0
    num_values: int = 0
    num_updates: int = 0
    robust_absmax: float | None = None
    histogram: _Histogram | None = None


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["qgraph-ranges"]
    version: int
    model_fingerprint: str
    data_fingerprint: str | None = None
    method: str
    options: dict[str, Any] = {}
    tensors: dict[str, _Tensor]
    overrides: dict[str, _Range] = {}


@dataclass(frozen=True)
class RangesFile:
    """A read ranges file.  ``tensors`` holds the computed results, ``overrides`` the hand edits."""

    version: int
    model_fingerprint: str
    data_fingerprint: str | None
    method: str
    options: dict[str, Any]
    tensors: dict[str, TensorCalibration]
    overrides: dict[str, ActivationRange]

    def ranges(self) -> dict[str, ActivationRange]:
        """Range to use per tensor: the override if there is one, else the computed range."""
        out = {name: t.range for name, t in self.tensors.items()}
        out.update(self.overrides)
        return out


def _num(v: float | npt.NDArray[np.float64]) -> Number:
    arr = np.asarray(v, dtype=np.float64)
    return [float(x) for x in arr.ravel()] if arr.ndim > 0 else float(arr)


def _val(v: Number) -> float | npt.NDArray[np.float64]:
    return np.asarray(v, dtype=np.float64) if isinstance(v, list) else float(v)


def _tensor_json(t: TensorCalibration, include_histogram: bool) -> dict[str, Any]:
    h = t.histogram
    c = t.choice
    return {
        "method": t.method,
        "chosen": None if c is None else c.winner,
        "candidates": None if c is None else {
            n: {"min": c.ranges[n][0], "max": c.ranges[n][1], "error": e} for n, e in c.errors.items()},
        "axis": t.axis,
        "min": _num(t.observed.rmin),
        "max": _num(t.observed.rmax),
        "range": {"min": _num(t.range.rmin), "max": _num(t.range.rmax)},
        "clip_fraction": float(t.clip_fraction),
        "num_values": int(t.num_values),
        "num_updates": int(t.num_updates),
        "robust_absmax": t.robust_absmax,
        "histogram": None
        if h is None or not include_histogram
        else {"kind": h.kind, "bin_width": h.width, "first_bin": h.first, "counts": list(h.counts), "zeros": h.zeros},
    }


def write_ranges(
    path: str | os.PathLike[str],
    calibrations: Mapping[str, TensorCalibration],
    *,
    model_fingerprint: str,
    data_fingerprint: str | None = None,
    method: str | None = None,
    options: Mapping[str, Any] | None = None,
    overrides: Mapping[str, ActivationRange] | None = None,
    include_histograms: bool = True,
) -> Path:
    """Write a ranges file atomically (temporary file in the same folder, then ``os.replace``).

    ``method``/``options`` default to those of the calibrations (``"mixed"`` if they differ).
    """
    methods = {t.method for t in calibrations.values()}
    if method is None:
        method = methods.pop() if len(methods) == 1 else "mixed"
    if options is None:
        first = next(iter(calibrations.values()), None)
        options = first.options if first is not None else {}
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model_fingerprint": model_fingerprint,
        "data_fingerprint": data_fingerprint,
        "method": method,
        "options": dict(options),
        "tensors": {name: _tensor_json(t, include_histograms) for name, t in calibrations.items()},
        "overrides": {n: {"min": _num(r.rmin), "max": _num(r.rmax)} for n, r in (overrides or {}).items()},
    }
    return write_atomic(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def read_ranges(path: str | os.PathLike[str], expected_model_fingerprint: str | None = None) -> RangesFile:
    """Read and validate a ranges file.

    Raises:
        DataError: missing/unreadable file, invalid JSON or schema, unsupported version, or
            (when ``expected_model_fingerprint`` is given) a file computed for another model.
    """
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"ranges file not found: {p}; run `qgraph calibrate` to create it") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{p}: not a readable JSON ranges file ({exc}); fix the JSON or recreate it") from exc
    if isinstance(raw, dict) and isinstance(raw.get("version"), int) and raw["version"] > VERSION:
        raise DataError(
            f"{p}: ranges file format version {raw['version']} is newer than this qgraph supports "
            f"({VERSION}); upgrade qgraph or recalibrate"
        )
    try:
        doc = _File.model_validate(raw)
    except ValidationError as exc:
        from qgraph.options import validation_problems

        raise DataError(f"{p}: invalid ranges file: {validation_problems(exc)}") from None
    if expected_model_fingerprint is not None and doc.model_fingerprint != expected_model_fingerprint:
        raise DataError(
            f"{p} was computed for a different model (fingerprint {doc.model_fingerprint[:16]}..., this "
            f"model is {expected_model_fingerprint[:16]}...): the graph changed since calibration. "
            "Recalibrate this model (`qgraph calibrate`) or pass the ranges file made for it."
        )
    tensors = {name: _calibration(name, t) for name, t in doc.tensors.items()}
    overrides = {name: ActivationRange(_val(r.min), _val(r.max)) for name, r in doc.overrides.items()}
    return RangesFile(
        version=doc.version,
        model_fingerprint=doc.model_fingerprint,
        data_fingerprint=doc.data_fingerprint,
        method=doc.method,
        options=doc.options,
        tensors=tensors,
        overrides=overrides,
    )


def _calibration(name: str, t: _Tensor) -> TensorCalibration:
    h = t.histogram
    return TensorCalibration(
        name=name,
        method=t.method,
        axis=t.axis,
        range=ActivationRange(_val(t.range.min), _val(t.range.max)),
        observed=ActivationRange(_val(t.min), _val(t.max)),
        clip_fraction=t.clip_fraction,
        num_values=t.num_values,
        num_updates=t.num_updates,
        histogram=None if h is None else HistogramSummary(h.kind, h.bin_width, h.first_bin, tuple(h.counts), h.zeros),
        robust_absmax=t.robust_absmax,
        choice=_choice(t),
    )


def _choice(t: _Tensor) -> AutoChoice | None:
    if t.chosen is None or not t.candidates or t.chosen not in t.candidates or "minmax" not in t.candidates:
        return None
    return AutoChoice(t.chosen, {n: c.error for n, c in t.candidates.items()},
                      {n: (c.min, c.max) for n, c in t.candidates.items()})
