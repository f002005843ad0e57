"""Provenance qgraph records in a model (per-pass stats, recipe) and metadata differences between two models."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import onnx

_META_SHOWN = 160


def json_or_none(text: str | None) -> Any:
    """``text`` parsed as JSON, or None when it is missing or not JSON."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


#: Passes recorded before ``Pass.quantizes`` existed whose skips say why a node stayed float.
_QUANTIZING_BY_NAME = frozenset({"insert_qdq", "float_fallback", "quantize_lstm"})


@dataclass(frozen=True)
class Skip:
    """One pass leaving one node alone: the pass, whether it decides quantization (`Pass.quantizes`), why.
    ``kept``: the pass put the node in float on purpose (`PassResult.kept_float`) rather than skipping it."""

    pass_name: str
    quantizes: bool
    node: str
    reason: str
    kept: bool = False


def float_reasons(skips: Iterable[Skip]) -> dict[str, str]:
    """Node name -> why it is not integer, ``"<pass>: <reason>"``, from the skips of a run in pass order.

    A pass that put the node in float on purpose (``kept``: float_fallback returning a quantized node to float)
    wins over every skip. Otherwise the reason of a pass that decides quantization (insert_qdq) wins: a
    preparation pass's skip (equalize_weights: "not scale-equivariant") is about its own technique, and a later
    pass's skip (correct_bias:
    "its weight is not read through a DequantizeLinear") is a consequence of the node being float. Without a
    quantizing pass's reason, the first pass's reason is shown. Other passes that skipped the node are named
    after it (``(also skipped by equalize_weights, correct_bias)``).
    """
    by_node: dict[str, list[Skip]] = {}
    for s in skips:
        by_node.setdefault(s.node, []).append(s)
    out: dict[str, str] = {}
    for node, items in by_node.items():
        ordered = sorted(items, key=lambda s: (not s.kept, not s.quantizes))  # stable: pass order in a group
        first = ordered[0]
        others = list(dict.fromkeys(s.pass_name for s in ordered[1:] if s.pass_name != first.pass_name))
        also = f" (also skipped by {', '.join(others)})" if others else ""
        out[node] = f"{first.pass_name}: {first.reason}{also}"
    return out


def provenance_reasons(passes: list[dict[str, Any]]) -> dict[str, str]:
    """Node name -> why it is not integer (`float_reasons`) from the per-pass stats of a model's provenance."""
    skips: list[Skip] = []
    for stat in passes:
        name = str(stat.get("pass", "?"))
        quantizes = bool(stat.get("quantizes")) or name in _QUANTIZING_BY_NAME
        for key in ("kept_float", "skipped_nodes", "skipped"):
            items = stat.get(key)
            if isinstance(items, list):
                skips.extend(Skip(name, quantizes, str(s["node"]), str(s["reason"]), key == "kept_float") for s in items
                             if isinstance(s, dict) and "node" in s and "reason" in s)
    return float_reasons(skips)


def metadata_changes(a: onnx.ModelProto, b: onnx.ModelProto) -> dict[str, list[str | None]]:
    """Metadata keys whose values differ: ``{key: [value in a, value in b]}`` (long values shortened)."""
    ma = {p.key: p.value for p in a.metadata_props}
    mb = {p.key: p.value for p in b.metadata_props}

    def short(v: str | None) -> str | None:
        return v if v is None or len(v) <= _META_SHOWN else v[:_META_SHOWN] + f"... ({len(v)} chars)"

    return {k: [short(ma.get(k)), short(mb.get(k))] for k in sorted(set(ma) | set(mb)) if ma.get(k) != mb.get(k)}
