"""How ``float_fallback`` applies its remedy and says what it did (float nodes, 16-bit nodes, skips)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from qgraph import GraphHandle, PassResult
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.remedy.apply import Outcome, apply_remedy, remedy_model
from qgraph.remedy.fallback import FallbackOutcome
from qgraph.remedy.widen_weights import WeightWidenOutcome

from .details import FloatFallbackDetails


def apply_and_record(graph: GraphHandle, nodes: list[Any], to: str, weights: ReferenceWeights | None,
                     res: tuple[PassResult, FloatFallbackDetails], why: Callable[[str], str],
                     body_names: Sequence[str] = ()) -> None:
    """Apply the remedy ``to`` to ``nodes`` (top graph) and to the nodes named ``body_names`` inside If/Loop
    bodies, and record it in the result and its details (``why(name)`` says how each node was chosen)."""
    record(res, apply_remedy(graph, nodes, to, weights), why)
    if body_names:
        scoped = remedy_model(graph.to_onnx(), body_names, to, weights)
        graph.replace_model(scoped.model)
        for scope, outcome in scoped.outcomes:
            record(res, outcome, lambda name, scope=scope: f"{why(name)}; inside {scope}")  # type: ignore[misc]
        for name in scoped.unplaced:
            res[0].skip(name, "not found in any If/Loop body that can be made standalone")


def record(out: tuple[PassResult, FloatFallbackDetails], outcome: Outcome, why: Callable[[str], str]) -> None:
    """Record one scope's outcome in the result and its details: float nodes with their reason, or 16-bit nodes
    as decisions."""
    res, d = out
    if isinstance(outcome, FallbackOutcome):
        record_fallback(res, d, outcome)
        for name in outcome.fallen_back:
            res.keep_float(name, f"returned to float ({why(name)})")
        return
    d.setdefault("widened", []).extend(outcome.widened)
    d.setdefault("widened_tensors", []).extend(outcome.tensors)
    if outcome.biases_float:
        d.setdefault("biases_kept_float", []).extend(outcome.biases_float)
    for name, reason in outcome.refused:
        res.skip(name, f"not widened: {reason}")
    if outcome.widened:
        # One line (the summary shows a few decisions per pass): the first names and why, every one in details.
        d.setdefault("widened_why", {}).update({name: why(name) for name in outcome.widened})
        domain = " (com.microsoft Q/DQ: the model's opset is below 21)" if outcome.contrib_domain else ""
        shown = "; ".join(f"{name} ({why(name)})" for name in outcome.widened[:3])
        more = f"; ... {len(outcome.widened) - 3} more (--report: details.widened)" if len(outcome.widened) > 3 else ""
        res.decisions.append(f"{len(outcome.widened)} node(s) given 16-bit activations{domain}: "
                             f"{len(outcome.tensors)} Q/DQ pair(s) widened, {outcome.converted} reader(s) kept 8-bit "
                             f"through a conversion, {len(outcome.biases_requantized)} int32 bias(es) re-quantized, "
                             f"{len(outcome.biases_float)} kept float (int32 overflow): {shown}{more}")
    if outcome.weights is not None:
        record_weights(res, d, outcome.weights)


def record_weights(res: PassResult, d: FloatFallbackDetails, outcome: WeightWidenOutcome) -> None:
    """Record 16-bit weights (``to: a16w16``): how many, from what, and what was refused."""
    for name, reason in outcome.refused:
        res.skip(name, reason)
    if not outcome.widened:
        return
    d.setdefault("weights_widened", []).extend(outcome.widened)
    raised = (f", {outcome.weight_scales_raised} channel weight scale(s) raised so the int32 bias fits"
              if outcome.weight_scales_raised else "")
    res.decisions.append(f"{len(outcome.widened)} node(s) given int16 weights (per channel, symmetric) and "
                         f"{len(outcome.biases_requantized)} int32 bias(es) on the new scales{raised}")
    if outcome.from_codes:
        d.setdefault("weights_from_codes", []).extend(outcome.from_codes)
        res.decisions.append(f"{len(outcome.from_codes)} of them had no float weights to re-quantize (no float "
                             "reference: run float_fallback after insert_qdq in one recipe): their int16 weights "
                             "hold the int8 values, so only their activations gained: "
                             + ", ".join(outcome.from_codes[:3]) + (" ..." if len(outcome.from_codes) > 3 else ""))


def record_fallback(res: PassResult, d: FloatFallbackDetails, outcome: FallbackOutcome) -> None:
    """Record what `fall_back` did in ``res`` and its details ``d``: fallen-back nodes, restored weights, skips."""
    d.setdefault("fallen_back", []).extend(outcome.fallen_back)
    # One key per kind of restoration, written out (not looped over names) so mypy checks each key.
    if outcome.dequantized_weights:
        d.setdefault("dequantized_weights", []).extend(outcome.dequantized_weights)
    if outcome.relu_restored:
        d.setdefault("relu_restored", []).extend(outcome.relu_restored)
    if outcome.float_weights_restored:
        d.setdefault("float_weights_restored", []).extend(outcome.float_weights_restored)
    if outcome.still_quantized_for:
        d.setdefault("outputs_still_quantized_for", {}).update(outcome.still_quantized_for)
    for name in outcome.already_float:
        res.skip(
            name,
            "already float: no input is read through DequantizeLinear and no output quantization is its own",
        )
    for name, reason in outcome.refused:
        res.skip(name, reason)
    if outcome.ignored_qdq:
        res.notes.append(
            f"{outcome.ignored_qdq} QuantizeLinear/DequantizeLinear node(s) in the selection were "
            "ignored: select compute nodes, their Q/DQ are removed with them"
        )
    res.nodes_added += outcome.nodes_added
    res.nodes_removed += outcome.nodes_removed
