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

AFFINE_WHY = ("scale/shift by a constant of a float-computed tensor: left float (quantizing its input, then its "
              "output, would round twice where the quantized op reading it rounds once; `elementwise: always` "
              "quantizes it)")


def float_fed_affine(units: Sequence[Unit], group: Callable[[str], str]) -> set[int]:
    """Ids of the binary units ``x * k`` / ``x + c`` (one constant operand) whose ``x`` no unit computes (a float
    op such as HardSwish, a graph input) or another such unit computes.

    Quantized, ``x`` gets a Q/DQ for the integer Mul/Add and its output another, so a chain of ``n`` of them
    before a Conv rounds ``n + 1`` times; left float, only the Conv's input is rounded, once (PP-LCNetV3's
    learnable affine blocks ``HardSwish -> Mul(k) -> Add(c) -> Conv``). One pass in graph order."""
    producers = {group(u.output): u for u in units if u.output}
    chosen: set[int] = set()
    for unit in units:
        if unit.kind != "binary" or not unit.const_inputs or len(unit.act_inputs) != 1:
            continue
        src = producers.get(group(unit.act_inputs[0]))
        if src is None or id(src) in chosen:
            chosen.add(id(unit))
    return chosen


def integer_fed(units: Sequence[Unit], group: Callable[[str], str]) -> tuple[list[Unit], list[tuple[Unit, str]]]:
    """``units`` (in graph order) without the elementwise ones no kept unit reads and the `float_fed_affine`
    ones, and those with why (left float: `WHY`, `AFFINE_WHY`).

    ``group`` maps a tensor to its data-movement group's root, so Reshape/Transpose/MaxPool between two units
    count as a direct read."""
    affine = float_fed_affine(units, group)
    read: set[str] = set()
    kept: list[Unit] = []
    skipped: list[tuple[Unit, str]] = []
    for unit in reversed(units):
        if id(unit) in affine or (unit.kind in ELEMENTWISE and unit.output and group(unit.output) not in read):
            skipped.append((unit, AFFINE_WHY if id(unit) in affine else WHY))
            continue
        kept.append(unit)
        read.update(group(t) for t in unit.act_inputs)
    kept.reverse()
    skipped.reverse()
    return kept, skipped
