"""Provenance qgraph records in a model (per-pass stats, recipe) and metadata differences between two models."""

from __future__ import annotations

import json
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


def provenance_reasons(passes: list[dict[str, Any]]) -> dict[str, str]:
    """Node name -> ``"<pass>: <reason>"`` from per-pass stats that list skipped nodes with reasons."""
    out: dict[str, str] = {}
    for stat in passes:
        for key in ("skipped_nodes", "skipped"):
            items = stat.get(key)
            if isinstance(items, list):
                for s in items:
                    if isinstance(s, dict) and "node" in s and "reason" in s:
                        out.setdefault(str(s["node"]), f"{stat.get('pass', '?')}: {s['reason']}")
    return out


def metadata_changes(a: onnx.ModelProto, b: onnx.ModelProto) -> dict[str, list[str | None]]:
    """Metadata keys whose values differ: ``{key: [value in a, value in b]}`` (long values shortened)."""
    ma = {p.key: p.value for p in a.metadata_props}
    mb = {p.key: p.value for p in b.metadata_props}

    def short(v: str | None) -> str | None:
        return v if v is None or len(v) <= _META_SHOWN else v[:_META_SHOWN] + f"... ({len(v)} chars)"

    return {k: [short(ma.get(k)), short(mb.get(k))] for k in sorted(set(ma) | set(mb)) if ma.get(k) != mb.get(k)}
