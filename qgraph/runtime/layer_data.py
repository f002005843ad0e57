"""What weight-correction passes measure on calibration data: per-channel output means
(`qgraph.runtime.channel_means`, re-exported here), mean input rows (`qgraph.runtime.row_means`) and sampled layer
inputs.

`sample_inputs` keeps a uniform random sample of at most ``max_rows`` input *rows* per layer over the whole data
(reservoir by random keys: every row gets a key ``U(0, 1)``, the rows with the smallest keys are kept), so memory
is ``max_rows x K`` per layer whatever the data. A Conv row is the receptive field of one output position
(im2col), gathered only at the sampled positions: ``x_pad[n, c, o·stride + k·dilation]`` for every input channel
``c`` of the group and kernel offset ``k``, flattened as the weight's ``(C_in/group, *kernel)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from qgraph.data import Feed
from qgraph.errors import DataError
from qgraph.runtime.channel_means import ChannelMeans, augment, channel_means
from qgraph.runtime.compare import make_session, session_run
from qgraph.runtime.parallel import array_bytes, ordered_map

__all__ = ["ChannelMeans", "RowSpec", "channel_means", "sample_inputs"]


@dataclass
class RowSpec:
    """How to cut a layer's input into rows of ``k`` values (per group): a Conv's geometry (``kernel`` non-empty;
    ``k = C_in / groups x kernel size``) or a matrix of ``k`` columns."""

    tensor: str
    k: int
    groups: int = 1
    kernel: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    dilations: tuple[int, ...] = ()
    pads: tuple[int, ...] = ()  # begins then ends, as ONNX


@dataclass
class _Reservoir:
    """``max_rows`` slots of rows and their keys (``inf``: empty); new rows overwrite the slots with the largest
    keys in place (no re-concatenation of the whole sample per batch)."""

    keys: npt.NDArray[np.float64] = field(default_factory=lambda: np.empty(0))
    rows: npt.NDArray[np.float32] | None = None

    def sample(self) -> npt.NDArray[np.float32] | None:
        """The rows of the filled slots ``(G, n, K)``."""
        if self.rows is None:
            return None
        filled = np.isfinite(self.keys)
        return self.rows if filled.all() else self.rows[:, filled]


def _positions(x: npt.NDArray[np.float32], spec: RowSpec) -> tuple[int, ...]:
    """Output positions per axis: ``(N, *out_spatial)`` for a Conv, ``(rows,)`` for a matrix."""
    if not spec.kernel:
        return (x.size // spec.k,)
    sp = x.shape[2:]
    nd = len(sp)
    out = [(sp[i] + spec.pads[i] + spec.pads[i + nd] - spec.dilations[i] * (spec.kernel[i] - 1) - 1)
           // spec.strides[i] + 1 for i in range(nd)]
    return (x.shape[0], *out)


def _gather(x: npt.NDArray[np.float32], spec: RowSpec, picked: npt.NDArray[np.intp],
            grid: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """Rows ``(G, m, K)`` at flat positions ``picked`` of ``grid``."""
    if not spec.kernel:
        return x.reshape(-1, spec.k)[picked][None]
    nd = len(spec.kernel)
    pad = [(0, 0), (0, 0)] + [(spec.pads[i], spec.pads[i + nd]) for i in range(nd)]
    xp = np.pad(x, pad) if any(spec.pads) else x
    xt = np.moveaxis(xp, 1, -1)  # (N, *spatial, C): channels last for one fancy-index gather
    coords = np.unravel_index(picked, grid)
    offsets = np.indices(spec.kernel).reshape(nd, -1)  # (nd, kernel elements), row-major like the weight
    index = [coords[0][:, None]] + [coords[i + 1][:, None] * spec.strides[i] + offsets[i][None] * spec.dilations[i]
                                    for i in range(nd)]
    patches = xt[tuple(index)]  # (m, kernel elements, C)
    m, ke, c = patches.shape
    g = spec.groups
    grouped = patches.reshape(m, ke, g, c // g).transpose(2, 0, 3, 1)  # (G, m, C/g, kernel elements)
    return np.ascontiguousarray(grouped.reshape(g, m, (c // g) * ke), dtype=np.float32)


def _fold(res: _Reservoir, x: npt.NDArray[np.float32], spec: RowSpec, max_rows: int,
          rng: np.random.Generator) -> None:
    grid = _positions(x, spec)
    total = int(np.prod(grid))
    if total == 0:
        return
    if res.rows is None:
        res.rows = np.empty((spec.groups, max_rows, spec.k), np.float32)
        res.keys = np.full(max_rows, np.inf)
    keys = rng.random(total)
    take = min(max_rows, total)
    picked = np.argpartition(keys, take - 1)[:take] if take < total else np.arange(total)
    picked = picked[keys[picked] < res.keys.max()]  # only rows that beat the worst kept one can enter
    if not picked.size:
        return
    both = np.concatenate([res.keys, keys[picked]])
    keep = np.argpartition(both, max_rows - 1)[:max_rows]
    incoming = keep[keep >= max_rows] - max_rows
    evicted = np.setdiff1d(np.arange(max_rows), keep[keep < max_rows], assume_unique=True)
    res.rows[:, evicted] = _gather(x, spec, picked[incoming], grid)
    res.keys[evicted] = keys[picked[incoming]]


def sample_inputs(model: onnx.ModelProto, specs: Sequence[RowSpec], batches: Iterable[Feed], max_rows: int,
                  seed: int = 0, weights: Mapping[str, npt.NDArray[Any]] | None = None
                  ) -> list[npt.NDArray[np.float32]]:
    """A uniform sample of at most ``max_rows`` rows ``(G, n, K)`` of each spec's input over every batch (module
    docstring); one streamed run of ``model`` fetching the input tensors. `DataError` on NaN/Inf. ``weights`` as
    in `channel_means`."""
    names = list(dict.fromkeys(s.tensor for s in specs))
    inputs = {i.name for i in model.graph.input}
    fetched = [n for n in names if n not in inputs]
    session = (make_session(augment(model, {}, [], fetched), mem_pattern=False, weights=weights) if fetched
               else None)
    rng = np.random.default_rng(seed)
    reservoirs = [_Reservoir() for _ in specs]
    def run(feed: Feed) -> tuple[Feed, list[Any]]:
        return feed, session_run(session, fetched, feed) if session is not None else []

    # several samples at once (at most ~1 GB of fetched tensors in flight), folded in order
    for feed, got in ordered_map(run, batches, size_of=lambda r: array_bytes(r[1])):
        values = dict(zip(fetched, got, strict=True))
        values.update({n: feed[n] for n in names if n in inputs})
        for spec, res in zip(specs, reservoirs, strict=True):
            x = np.asarray(values[spec.tensor], np.float32)
            if not np.all(np.isfinite(x)):
                raise DataError(f"tensor {spec.tensor!r} holds NaN/Inf on the calibration data; fix the model or "
                                "the data.")
            _fold(res, x, spec, max_rows, rng)
        del values
    out: list[npt.NDArray[np.float32]] = []
    for r, s in zip(reservoirs, specs, strict=True):
        kept = r.sample()
        out.append(kept if kept is not None else np.zeros((s.groups, 0, s.k), np.float32))
    return out
