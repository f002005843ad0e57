"""Which layers keep 8-bit codes: by selector (``keep_8bit``) or within a byte budget (``keep_8bit_budget``).

With a budget ``β``, every layer is first quantized at the configured bits and scored by the error it causes at
the model's outputs, measured (`output_errors`): with calibration data, the float model with only that layer's
weight dequantized, on a few samples, ``ε = Σ(y' - y)² / Σy²`` (where the error lands, not where it starts:
a query/key error fades through the softmax, a value or output projection's goes straight to the residual stream);
without data, the layer's relative weight error ``ε = ||Δ||² / ||W||²`` (``Δ = W - W'``);

then layers are promoted to 8 bits in decreasing ``ε`` while the promoted weights stay within ``β`` of all the
selected layers' weights (a layer that does not fit is passed over for smaller ones). At 4 bits, block 32, a
weight costs 4.5-5 bits, at 8 bits 9-9.5: ``β = 0.2`` keeps the MatMul weights under 0.2x their float32 bytes.
Layers kept 8-bit are quantized by the clip-searched RTN (weighted by ``E[x²]`` when measured) whatever the
algorithm: at 8 bits the rounding error is 16x smaller than at 4, and a second GPTQ sweep would double the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any

import numpy as np
import numpy.typing as npt

from qgraph import GraphHandle, PassContext
from qgraph.data import batched
from qgraph.quant.blockwise import BlockQuant
from qgraph.recovery.weight_correction import weightless
from qgraph.runtime.compare import make_session, session_run

F64 = npt.NDArray[np.float64]


def weight_error(w: npt.NDArray[np.floating], bq: BlockQuant) -> float:
    """``||W - W'||² / ||W||²`` of one layer; ``w`` ``[K, N]`` as quantized."""
    w64 = np.asarray(w, np.float64)
    delta = w64 - bq.dequantize().astype(np.float64)
    den = float(np.sum(w64 * w64))
    return float(np.sum(delta * delta)) / den if den > 0 else 0.0


def promote(errors: Sequence[float], sizes: Sequence[int], budget: float) -> list[int]:
    """Indices of the layers to keep 8-bit: largest ``ε`` first within ``budget · Σ sizes`` weights."""
    room = budget * float(sum(sizes))
    chosen: list[int] = []
    for i in sorted(range(len(errors)), key=lambda j: -errors[j]):
        if sizes[i] <= room:
            chosen.append(i)
            room -= sizes[i]
    return sorted(chosen)


def output_errors(graph: GraphHandle, ctx: PassContext, weights: Sequence[tuple[str, npt.NDArray[Any]]],
                  samples: int = 4) -> list[float] | None:
    """Per layer, the model's relative output error ``Σ(y' - y)² / Σy²`` on ``samples`` calibration samples with
    only that layer's weight replaced by its dequantized value (``weights``: ``(initializer name, W' in its
    stored layout)``), others float. One session whose weights are fed as inputs: one run per layer and sample.
    None without calibration data or when a weight is not fed (too small to be a placeholder)."""
    if ctx.calibration_data is None:
        return None
    model, held = weightless(graph)
    if any(name not in held for name, _ in weights):
        return None
    session = make_session(model, weights=held)
    outputs = [o.name for o in model.graph.output]
    feeds = list(islice(batched(ctx.calibration_data, 1), samples))
    ref = [session_run(session, outputs, f) for f in feeds]
    energy = sum(float(np.sum(np.square(np.asarray(y, np.float64)))) for r in ref for y in r)
    errors = []
    for name, value in weights:
        original = session.weights[name]
        session.weights[name] = np.ascontiguousarray(value.astype(original.dtype))
        noise = 0.0
        for f, r in zip(feeds, ref, strict=True):
            for y, y0 in zip(session_run(session, outputs, f), r, strict=True):
                noise += float(np.sum(np.square(np.asarray(y, np.float64) - y0)))
        session.weights[name] = original
        errors.append(noise / energy if energy > 0 else 0.0)
    return errors
