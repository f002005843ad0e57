"""What ``smooth_quant`` measures on the calibration data, in one streamed pass for every group input.

Per input X (channels on the last axis): the observed ``min_j`` / ``max_j`` of every channel (so ``max|X_j|`` and
the exact per-tensor range after smoothing are known) and, for ``alpha: auto``, a seeded uniform sample of at
most ``rows`` rows of X (bounded memory whatever the data size) on which candidate αs are scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qgraph import DataError, GraphHandle, PassContext, PassError
from qgraph.calibrate import observe
from qgraph.data import batched


@dataclass
class ChannelStats:
    """Running per-channel min/max of one tensor, and a bounded row sample (``rows`` = 0: none)."""

    name: str
    rows: int
    low: np.ndarray | None = None
    high: np.ndarray | None = None
    sample: list[np.ndarray] = field(default_factory=list)
    kept: int = 0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def update(self, x: np.ndarray, sample_index: int | None = None, /) -> None:
        """Fold one batch (any leading shape, channels last) into the statistics; a batch without a channel axis (a
        0-d value) or with another channel count than the ones before is bad data (a shapeless model input takes
        any rank, so the data decides it), never an IndexError."""
        if np.ndim(x) == 0:
            raise DataError(f"smooth_quant: tensor {self.name!r} is a single value (0-d) on calibration sample "
                            f"{sample_index}: it is smoothed per channel on its last axis. The model's input "
                            "declares no shape, so the data decides it: give samples with the channel axis last.")
        if self.low is not None and x.shape[-1] != self.low.shape[0]:
            raise DataError(f"smooth_quant: tensor {self.name!r} has {x.shape[-1]} channel(s) (last axis) on "
                            f"calibration sample {sample_index}, {self.low.shape[0]} on the samples before: give "
                            "samples of one shape.")
        flat = np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1])
        if not np.all(np.isfinite(flat)):
            raise PassError(f"smooth_quant: tensor {self.name!r} holds NaN/Inf on calibration sample {sample_index}")
        lo, hi = flat.min(axis=0), flat.max(axis=0)
        self.low = lo if self.low is None else np.minimum(self.low, lo)
        self.high = hi if self.high is None else np.maximum(self.high, hi)
        if self.rows:
            take = flat[self.rng.choice(flat.shape[0], size=min(self.rows, flat.shape[0]), replace=False)]
            self.sample.append(take)
            self.kept += take.shape[0]
            if self.kept > 4 * self.rows:  # keep memory bounded: thin the pool back to `rows`
                pool = np.concatenate(self.sample)
                self.sample = [pool[self.rng.choice(pool.shape[0], size=self.rows, replace=False)]]
                self.kept = self.rows

    @property
    def absmax(self) -> np.ndarray:
        """``max|X_j|`` per channel."""
        assert self.low is not None and self.high is not None
        return np.asarray(np.maximum(np.abs(self.low), np.abs(self.high)))

    def rows_sample(self) -> np.ndarray:
        """At most ``rows`` sampled rows ``[R, K]``."""
        pool = np.concatenate(self.sample)
        if pool.shape[0] > self.rows:
            pool = pool[self.rng.choice(pool.shape[0], size=self.rows, replace=False)]
        return pool


def measure(graph: GraphHandle, ctx: PassContext, names: list[str], rows: int) -> dict[str, ChannelStats]:
    """Statistics of every tensor in ``names`` on the current graph, one streamed pass over the data."""
    data = ctx.calibration_data
    if data is None:  # requires() refuses first; a direct run() call gets the same message
        raise PassError("smooth_quant: no calibration data (pass --calibration-data DATA)")
    stats = {name: ChannelStats(name, rows) for name in names}
    observe(graph.to_onnx(), stats, lambda: batched(data, ctx.calibration.batch_size),
            progress=ctx.progress("smooth_quant: measuring activations"))
    return stats
