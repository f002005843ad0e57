"""Elementwise units whose output no quantized op reads stay float (``elementwise: integer_fed``).

An integer Add/Mul/Concat/Sigmoid saves little compute: what it buys is that its output stays on integers for the
next integer op. Where no quantized op reads that output (a residual sum going into LayerNormalization, sigmoid
scores going to a graph output through Reshape/Transpose), the requantization of its output is pure error: in a
BERT-style encoder the residual sums carry outlier channels 40-110x the median, and quantizing them is most of the
static INT8 error. One reverse walk over the units (in graph order) decides it, following data-movement groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .placement import Unit

#: Unit kinds that are elementwise (no weights): quantized only where their output feeds integer compute.
ELEMENTWISE = ("binary", "variadic", "unary")

WHY = ("elementwise op whose output no quantized op reads: left float (its integer kernel would only add a "
       "requantization; `elementwise: always` quantizes it)")


def integer_fed(units: Sequence[Unit], group: Callable[[str], str]) -> tuple[list[Unit], list[Unit]]:
    """``units`` (in graph order) without the elementwise ones no kept unit reads, and those (left float, `WHY`).

    ``group`` maps a tensor to its data-movement group's root, so Reshape/Transpose/MaxPool between two units
    count as a direct read."""
    read: set[str] = set()
    kept: list[Unit] = []
    skipped: list[Unit] = []
    for unit in reversed(units):
        if unit.kind in ELEMENTWISE and unit.output and group(unit.output) not in read:
            skipped.append(unit)
            continue
        kept.append(unit)
        read.update(group(t) for t in unit.act_inputs)
    kept.reverse()
    skipped.reverse()
    return kept, skipped
