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
    from .units import Unit

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


GRID_WHY = ("elementwise op reading a float-computed tensor: left float (its integer kernel would round that input "
            "first, then its output, where the quantized op reading it rounds once; `elementwise: integer_fed` "
            "quantizes it)")


def off_grid(units: Sequence[Unit], group: Callable[[str], str]) -> set[int]:
    """Ids of the elementwise units with an activation input that is not already on an integer grid
    (``elementwise: on_grid``).

    A tensor is on a grid when a unit with a quantized output computes it (Conv, an integer elementwise op) or a
    weighted/attention unit reads it quantized anyway (its Q/DQ is shared). Quantizing an elementwise op with an
    input off the grid adds a rounding of that input (the GELU ``x * (1 + erf)`` of a MatMul output, a Softmax of
    masked scores, the SmoothQuant ``1/s`` Mul): left float, the next quantized op rounds its output once. One pass
    in graph order; generalizes `float_fed_affine` to every elementwise kind."""
    grid = {group(t) for u in units if u.kind not in ELEMENTWISE for t in u.act_inputs}
    grid.update(group(u.output) for u in units if u.kind not in ELEMENTWISE and u.needs_q_out and u.output)
    chosen: set[int] = set()
    for unit in units:
        if unit.kind not in ELEMENTWISE:
            continue
        if all(group(t) in grid for t in unit.act_inputs):
            if unit.output:
                grid.add(group(unit.output))
        else:
            chosen.add(id(unit))
    return chosen


def integer_fed(
    units: Sequence[Unit], group: Callable[[str], str], on_grid: bool = False
) -> tuple[list[Unit], list[tuple[Unit, str]]]:
    """``units`` (in graph order) without the elementwise ones no kept unit reads and the `float_fed_affine`
    ones, and those with why (left float: `WHY`, `AFFINE_WHY`).

    ``group`` maps a tensor to its data-movement group's root, so Reshape/Transpose/MaxPool between two units
    count as a direct read. With ``on_grid`` the `off_grid` units are left float too (`GRID_WHY`)."""
    affine = float_fed_affine(units, group)
    grid_float = off_grid(units, group) - affine if on_grid else set()
    read: set[str] = set()
    kept: list[Unit] = []
    skipped: list[tuple[Unit, str]] = []
    for unit in reversed(units):
        if id(unit) in grid_float:
            skipped.append((unit, GRID_WHY))
            continue
        if id(unit) in affine or (unit.kind in ELEMENTWISE and unit.output and group(unit.output) not in read):
            skipped.append((unit, AFFINE_WHY if id(unit) in affine else WHY))
            continue
        kept.append(unit)
        read.update(group(t) for t in unit.act_inputs)
    kept.reverse()
    skipped.reverse()
    return kept, skipped
