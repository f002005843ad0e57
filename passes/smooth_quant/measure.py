"""What ``smooth_quant`` measures on the calibration data, in one streamed pass for every group input.

Per input X (channels on the last axis): the observed ``min_j`` / ``max_j`` of every channel (so ``max|X_j|`` and
the exact per-tensor range after smoothing are known) and, for ``alpha: auto``, a seeded uniform sample of at
most ``rows`` rows of X (bounded memory whatever the data size) on which candidate αs are scored.

Cost: the session hands over one array per tensor per sample; a model with 1,000 group inputs and 32 samples makes
32,000 of them, each a handful of elements. `ChannelStats.update` only checks the shape and keeps the array; the
reductions run over many samples at once (`ChannelStats.fold`) once the arrays kept by all the tensors of one
measurement pass ``PENDING_BYTES``, and at the end. The result is the one a fold per sample gives, bit for bit:
minima and maxima are exact in any grouping, and the row sample draws from each tensor's seeded generator in the
same order with the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qgraph import DataError, GraphHandle, PassContext, PassError
from qgraph.calibrate import observe
from qgraph.data import batched

PENDING_BYTES = 32 << 20  #: arrays kept unreduced, over all tensors of one measurement, before they are folded


def _choice_of_one_is_free() -> bool:
    """Whether ``Generator.choice(1, size=1, replace=False)`` leaves the generator's state alone (numpy 1.x/2.x
    do: a one-element permutation draws nothing). Then a one-row batch is taken whole without the call (the
    common case: one token per sample), and the draws of every other batch are unchanged."""
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    picked = rng.choice(1, size=1, replace=False)
    return bool(picked.tolist() == [0] and rng.bit_generator.state == before)


_FREE_SINGLE = _choice_of_one_is_free()


@dataclass
class _Pending:
    """Arrays kept by the `ChannelStats` of one measurement, folded together when they pass ``limit`` bytes."""

    limit: int = PENDING_BYTES
    used: int = 0
    members: list[ChannelStats] = field(default_factory=list)

    def add(self, nbytes: int) -> None:
        self.used += nbytes
        if self.used > self.limit:
            for member in self.members:
                member.fold()
            self.used = 0


@dataclass
class ChannelStats:
    """Running per-channel min/max of one tensor, and a bounded row sample (``rows`` = 0: none)."""

    name: str
    rows: int
    sample: list[np.ndarray] = field(default_factory=list)
    kept: int = 0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    pending: _Pending = field(default_factory=_Pending)
    _low: np.ndarray | None = None
    _high: np.ndarray | None = None
    _channels: int | None = None
    _batches: list[tuple[np.ndarray, int | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pending.members.append(self)

    def update(self, x: np.ndarray, sample_index: int | None = None, /) -> None:
        """Take one batch (any leading shape, channels last); a batch without a channel axis (a 0-d value) or with
        another channel count than the ones before is bad data (a shapeless model input takes any rank, so the
        data decides it), never an IndexError."""
        if np.ndim(x) == 0:
            raise DataError(f"smooth_quant: tensor {self.name!r} is a single value (0-d) on calibration sample "
                            f"{sample_index}: it is smoothed per channel on its last axis. The model's input "
                            "declares no shape, so the data decides it: give samples with the channel axis last.")
        if self._channels is not None and x.shape[-1] != self._channels:
            raise DataError(f"smooth_quant: tensor {self.name!r} has {x.shape[-1]} channel(s) (last axis) on "
                            f"calibration sample {sample_index}, {self._channels} on the samples before: give "
                            "samples of one shape.")
        self._channels = int(x.shape[-1])
        kept = np.array(x, copy=True)  # the caller may reuse its buffer for the next sample
        self._batches.append((kept.reshape(-1, self._channels), sample_index))
        self.pending.add(kept.nbytes)

    def fold(self) -> None:
        """Fold the kept batches into the minima, maxima and row sample, in sample order."""
        if not self._batches:
            return
        batches, self._batches = self._batches, []
        block = np.concatenate([b for b, _ in batches]).astype(np.float64, copy=False)
        if not np.all(np.isfinite(block)):
            first = next(i for b, i in batches if not np.all(np.isfinite(b)))
            raise PassError(f"smooth_quant: tensor {self.name!r} holds NaN/Inf on calibration sample {first}")
        if block.shape[0]:
            lo, hi = block.min(axis=0), block.max(axis=0)
            self._low = lo if self._low is None else np.minimum(self._low, lo)
            self._high = hi if self._high is None else np.maximum(self._high, hi)
        if self.rows:
            self._draw(block, [b.shape[0] for b, _ in batches])

    def _draw(self, block: np.ndarray, counts: list[int]) -> None:
        """The row sample, batch by batch as each came: up to ``rows`` rows drawn from each batch, the pool thinned
        back to ``rows`` once it holds more than ``4 · rows``. Runs of one-row batches are taken in one slice."""
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        b = 0
        while b < len(counts):
            if counts[b] == 1 and _FREE_SINGLE:
                end, room = b, 4 * self.rows + 1 - self.kept  # the pool is thinned after the `room`-th row
                while end < len(counts) and counts[end] == 1 and end - b < room:
                    end += 1
                take = block[starts[b]:starts[end]].copy()
                b = end
            else:
                flat = block[starts[b]:starts[b + 1]]
                take = flat[self.rng.choice(flat.shape[0], size=min(self.rows, flat.shape[0]), replace=False)]
                b += 1
            self.sample.append(take)
            self.kept += take.shape[0]
            if self.kept > 4 * self.rows:  # keep memory bounded: thin the pool back to `rows`
                pool = np.concatenate(self.sample)
                self.sample = [pool[self.rng.choice(pool.shape[0], size=self.rows, replace=False)]]
                self.kept = self.rows

    @property
    def low(self) -> np.ndarray | None:
        """``min X_j`` per channel (None before any value)."""
        self.fold()
        return self._low

    @property
    def high(self) -> np.ndarray | None:
        """``max X_j`` per channel (None before any value)."""
        self.fold()
        return self._high

    @property
    def absmax(self) -> np.ndarray:
        """``max|X_j|`` per channel."""
        low, high = self.low, self.high
        assert low is not None and high is not None
        return np.asarray(np.maximum(np.abs(low), np.abs(high)))

    def rows_sample(self) -> np.ndarray:
        """At most ``rows`` sampled rows ``[R, K]``."""
        self.fold()
        pool = np.concatenate(self.sample)
        if pool.shape[0] > self.rows:
            pool = pool[self.rng.choice(pool.shape[0], size=self.rows, replace=False)]
        return pool


def measure(graph: GraphHandle, ctx: PassContext, names: list[str], rows: int) -> dict[str, ChannelStats]:
    """Statistics of every tensor in ``names`` on the current graph, one streamed pass over the data."""
    data = ctx.calibration_data
    if data is None:  # requires() refuses first; a direct run() call gets the same message
        raise PassError("smooth_quant: no calibration data (pass --calibration-data DATA)")
    pending = _Pending()
    stats = {name: ChannelStats(name, rows, pending=pending) for name in names}
    observe(graph.to_onnx(), stats, lambda: batched(data, ctx.calibration.batch_size),
            progress=ctx.progress("smooth_quant: measuring activations"))
    for st in stats.values():
        st.fold()
    return stats
