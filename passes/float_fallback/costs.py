"""The cost table float_fallback's automatic search orders by (``auto.cost: latency``) and reports with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qgraph import DataError, PassContext, PassError, PassResult
from qgraph.analysis.sensitivity.cost import CostSpec
from qgraph.runtime.latency import load_latency_table, shipped_latency_table

if TYPE_CHECKING:
    from .config import AutoFallbackConfig


def fallback_costs(auto: AutoFallbackConfig, ctx: PassContext, res: PassResult) -> CostSpec | None:
    """The cost table and preset: the order of ``cost: latency``, the modelled latency in the summary (with
    ``cost: error``, None when the table does not apply)."""
    try:
        return _table(auto, ctx, res)
    except (PassError, DataError):
        if auto.cost == "latency":
            raise
        return None


def _table(auto: AutoFallbackConfig, ctx: PassContext, res: PassResult) -> CostSpec:
    if auto.latency_table is not None:
        table = load_latency_table(auto.latency_table)
    else:
        table = shipped_latency_table()
    preset = auto.latency_preset or f"ort-{ctx.target.cpu}"
    if preset not in table.presets:
        if auto.latency_preset is not None or len(table.presets) != 1:
            raise PassError(f"float_fallback: the cost table has no preset {preset!r} (it has "
                            f"{sorted(table.presets)}); set auto.latency_preset or use auto.cost: error.")
        preset = next(iter(table.presets))
        res.notes.append(f"auto: latency costs from the table's preset {preset!r} (target cpu {ctx.target.cpu!r})")
    return CostSpec(table, preset)
