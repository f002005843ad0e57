"""What ``float_fallback`` reports in ``PassResult.details`` (typed, checked by mypy).

A `TypedDict` rather than a `qgraph.PassDetails` record: the keys appear in the order the pass met them (the
selected nodes' outcome first, or the automatic search's output parts and summary first, then the nodes it chose,
scope by scope), and the ``--report`` JSON keeps that order. A TypedDict is a dict at run time, so it keeps it.
"""

from __future__ import annotations

from typing import Any, TypedDict


class FloatFallbackDetails(TypedDict, total=False):
    """Every key ``float_fallback`` may report; a key is present only when it has something to say."""

    #: Nodes returned to float (``to: float``), and what that took: integer weights dequantized, Relus a
    #: quantizer had folded restored, constants taken from the float reference, consumers keeping their Q/DQ.
    fallen_back: list[str]
    dequantized_weights: list[str]
    relu_restored: list[str]
    float_weights_restored: list[str]
    outputs_still_quantized_for: dict[str, list[str]]
    #: Nodes given 16-bit activations (``to: a16w8`` / ``a16w16``): the nodes, their tensors, the int32 biases
    #: kept float (they would overflow) and why each node was chosen.
    widened: list[str]
    widened_tensors: list[str]
    biases_kept_float: list[str]
    widened_why: dict[str, str]
    #: Nodes given int16 weights (``to: a16w16``), and those whose int16 weights hold their int8 values.
    weights_widened: list[str]
    weights_from_codes: list[str]
    #: Auto mode: the outputs a final Concat joins, scored part by part (`qgraph.runtime.output_parts`).
    output_parts: list[dict[str, Any]]
    #: Auto mode: the search's summary (`qgraph.analysis.sensitivity.search`), without the sensitivity table.
    auto: dict[str, Any]
