"""What ``gptq`` and ``awq`` measure on calibration data: per layer input ``X`` (channels last), in one streamed
pass over the data for every input at once (`qgraph.calibrate.observe`; no activation is kept):

    H = Σ xᵀx / n   ([K, K], float64: GPTQ's Hessian up to a factor, AWQ's exact layer-error metric)
    x̄ = Σ |x| / n   (per channel: AWQ's activation salience)

Memory is ``K²`` per distinct input, whatever the number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from qgraph import GraphHandle, PassContext, PassError
from qgraph.calibrate import observe
from qgraph.data import batched
from qgraph.recovery.weight_correction import weightless

F64 = npt.NDArray[np.float64]


@dataclass
class InputStats:
    """Running ``Σ xᵀx``, ``Σ |x|`` and the row count of one tensor."""

    name: str
    gram: F64 | None = None
    abs_sum: F64 | None = None
    rows: int = 0
    channels: int = field(default=0)

    def update(self, x: npt.NDArray[np.floating], sample_index: int | None = None, /) -> None:
        """Fold one batch (any leading shape, channels last)."""
        flat = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
        if not np.all(np.isfinite(flat)):
            raise PassError(f"quantize_weights: tensor {self.name!r} holds NaN/Inf on calibration sample "
                            f"{sample_index}; fix the model or the data")
        if self.gram is None:
            self.channels = flat.shape[1]
            self.gram = np.zeros((self.channels, self.channels))
            self.abs_sum = np.zeros(self.channels)
        assert self.abs_sum is not None
        self.gram += flat.T @ flat  # float32 product per batch (BLAS speed), summed in float64 across batches
        self.abs_sum += np.abs(flat).sum(axis=0, dtype=np.float64)
        self.rows += flat.shape[0]

    @property
    def hessian(self) -> F64:
        """``E[x xᵀ]``."""
        assert self.gram is not None
        return self.gram / max(self.rows, 1)

    @property
    def mean_abs(self) -> F64:
        """``E|x_k|``."""
        assert self.abs_sum is not None
        return self.abs_sum / max(self.rows, 1)


def collect(graph: GraphHandle, ctx: PassContext, names: list[str]) -> dict[str, InputStats]:
    """Statistics of every tensor in ``names`` on the current graph, one streamed pass over the data."""
    data = ctx.calibration_data
    if data is None:  # requires() refuses first; a direct run() call gets the same message
        raise PassError("quantize_weights: gptq/awq need calibration data (pass --calibration-data DATA)")
    stats = {name: InputStats(name) for name in names}
    model, held = weightless(graph)  # the session reads the graph's arrays in place: no second copy
    observe(model, stats, lambda: batched(data, ctx.calibration.batch_size), weights=held,
            progress=ctx.progress("quantize_weights: measuring layer inputs"))
    missing = [n for n, s in stats.items() if s.gram is None]
    if missing:
        raise PassError(f"quantize_weights: no calibration sample reached {missing[:3]}; check the data")
    return stats
