"""Round to nearest with a per-block clip search (``algorithm: rtn``), data-free.

Per block of ``B`` input channels of output column ``n`` and each clip ratio ``r`` of ``clip_ratios``:

    asymmetric:  lo = r · min(min_k w_k, 0),  hi = r · max(max_k w_k, 0),
                 s = (hi - lo) / (2^b - 1),  z = round(-lo / s)
    symmetric:   s = r · max_k |w_k| / (2^(b-1) - 1),  z = 2^(b-1)
    q_k = clamp(round(w_k / s) + z, 0, 2^b - 1),   Δ_k = (q_k - z) · s - w_k
    err(r) = Σ_k h_k Δ_k² + (Σ_k √h_k Δ_k)² / B

and the block keeps the ``r`` with the least ``err`` (``h_k = 1`` without data; ``E[x_k²]`` when a data-driven
algorithm calls it: an error on a channel with large inputs costs more output error). Clipping a few outliers of
a block buys a finer step for the rest; the second term charges clipping for its bias (clipped errors all pull the
block toward zero and add up over a dot product with inputs that have a mean, where rounding errors cancel). The
math is `qgraph.quant.blockwise`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from qgraph.quant.blockwise import BlockFormat, BlockQuant, quantize_weight


def quantize_rtn(w: npt.NDArray[np.floating], fmt: BlockFormat, ratios: Sequence[float],
                 h: npt.NDArray[np.floating] | None = None) -> BlockQuant:
    """``W [K, N]`` block-quantized by round to nearest, the clip ratio searched per block (module docstring)."""
    return quantize_weight(w, fmt, ratios, h)
