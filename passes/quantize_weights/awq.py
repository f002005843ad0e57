"""Activation-aware weight quantization (``algorithm: awq``; Lin et al. 2023, "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration").

A few input channels carry much larger activations; their weights matter most. Scaling input channel ``k`` of
every layer reading ``X`` up by ``s_k`` before quantizing (and ``X`` down by ``s_k``, folded into X's producer
exactly as ``smooth_quant`` folds it: LayerNorm γ/β, a Mul/Add constant, a producing MatMul's columns) gives
those weights a finer relative step. Per group of layers sharing ``X``, with ``x̄_k = E|x_k|`` and
``H = E[x xᵀ]`` from one streamed calibration pass:

    s(α) = x̄^α / sqrt(max x̄^α · min x̄^α),       α ∈ {0, 1/g, ..., (g-1)/g}   (g = ``awq_grid``; α = 0: s = 1)
    W'(α) = diag(1/s) · Q(diag(s) · W)          (RTN at the block's full range)
    L(α)  = Σ_layers tr((W - W'(α))ᵀ H (W - W'(α)))  = E||x W - x W'(α)||²   (exact, no activations kept)

and the group keeps ``argmin L`` (α = 0 when nothing beats it: the group is left unscaled). The scaled weights are
then quantized with the clip search weighted by ``diag(H) / s²`` (the scaled inputs' energy). A group whose X
cannot absorb ``1/s`` upstream (a residual Add, a graph input, other readers), or only by turning a scalar constant
into a vector (the 0.5 of an exported GELU, which onnxruntime then no longer fuses), is quantized unscaled, and
said so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from qgraph.quant.blockwise import BlockFormat, quantize_weight

F64 = npt.NDArray[np.float64]


def candidate_scales(x_mean: F64, grid: int) -> list[tuple[float, F64]]:
    """``(α, s(α))`` for every α of the grid (module docstring); channels never active get ``s = 1``."""
    x = np.asarray(x_mean, np.float64)
    live = x > 0
    out: list[tuple[float, F64]] = []
    for i in range(grid):
        alpha = i / grid
        s = np.ones_like(x)
        if live.any() and alpha > 0:
            p = x[live] ** alpha
            s[live] = p / np.sqrt(p.max() * p.min())
        out.append((alpha, s))
    return out


def scaled_loss(weights: Sequence[npt.NDArray[np.floating]], h: F64, s: F64, fmt: BlockFormat) -> float:
    """``Σ tr(Δᵀ H Δ)`` over the group's weights ``[K, N]`` with ``Δ = W - diag(1/s) Q(diag(s) W)``."""
    total = 0.0
    for w in weights:
        w64 = np.asarray(w, np.float64)
        scaled = (w64 * s[:, None]).astype(np.float32)
        deq = quantize_weight(scaled, fmt).dequantize().astype(np.float64) / s[:, None]
        delta = w64 - deq
        total += float(np.sum(delta * (h @ delta)))
    return total


def search_scales(weights: Sequence[npt.NDArray[np.floating]], h: F64, x_mean: F64, fmt: BlockFormat,
                  grid: int) -> tuple[float, F64, float, float]:
    """``(α, s, loss, loss at s = 1)`` of the best α for a group (module docstring)."""
    best: tuple[float, F64, float] | None = None
    base = 0.0
    for alpha, s in candidate_scales(x_mean, grid):
        loss = scaled_loss(weights, h, s, fmt)
        if alpha == 0:
            base = loss
        if best is None or loss < best[2]:
            best = (alpha, s, loss)
    assert best is not None
    return best[0], best[1], best[2], base
