"""What ``quantize_weights`` reports in ``PassResult.details`` (typed, `qgraph.PassDetails`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qgraph import PassDetails

from .config import Algorithm


@dataclass(frozen=True)
class QuantizeWeightsDetails(PassDetails):
    """The bytes of the quantized weights before and after (float, then codes + scales + zero points), the
    algorithm and the format they were written in."""

    weight_bytes: tuple[int, int]
    algorithm: Algorithm
    format: Literal["matmul_nbits", "qdq"]
