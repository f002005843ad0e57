"""Provenance written into every output model's ``metadata_props``: the canonical recipe and its hash, the input
model's hash, qgraph's version, per-pass stats (skips and decisions with their reasons) and the CPU family the
model is made for. Nothing in it depends on time or machine (a ``cpu: host`` recipe records the family it found),
so the same recipe on the same model gives a byte-identical file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import onnx

from qgraph._version import __version__
from qgraph.graph import describe
from qgraph.pipeline.pass_result import PassResult
from qgraph.pipeline.recipe_text import canonical_text, text_sha256
from qgraph.runtime.kernels.measure import TARGET_KEY

#: At most this many skipped nodes (with reasons) per pass are written into the output model's metadata.
MAX_SKIPPED_IN_PROVENANCE = 500


class RecordLike(Protocol):
    """What provenance reads of a pass's record (`qgraph.pipeline.runner.PassRecord`)."""

    name: str
    result: PassResult
    nodes_before: int
    nodes_after: int
    quantizes: bool


def write_provenance(model: onnx.ModelProto, recipe: dict[str, Any], input_hash: str,
                     records: Sequence[RecordLike], family: str | None) -> None:
    """Write the provenance entries into ``model`` (other metadata is kept; the entries sorted by key)."""
    stats = [
        {
            "pass": r.name,
            "matched": r.result.matched,
            "rewritten": r.result.rewritten,
            "skipped": len(r.result.skipped),
            # Reasons travel with the model (capped) so `qgraph diff` can say why a node stayed float.
            "skipped_nodes": [s.to_dict() for s in r.result.skipped[:MAX_SKIPPED_IN_PROVENANCE]],
            **({"kept_float": [s.to_dict() for s in r.result.kept_float[:MAX_SKIPPED_IN_PROVENANCE]]}
               if r.result.kept_float else {}),
            "nodes_before": r.nodes_before,
            "nodes_after": r.nodes_after,
            **({"quantizes": True} if r.quantizes else {}),
            **({"decisions": r.result.decisions} if r.result.decisions else {}),
        }
        for r in records
    ]
    entries = {
        "qgraph.version": __version__,
        "qgraph.recipe": canonical_text(recipe),
        "qgraph.recipe_sha256": text_sha256(recipe),
        "qgraph.input_sha256": input_hash,
        "qgraph.passes": describe(stats),
        **({TARGET_KEY: family} if family else {}),  # the CPU it is made for (`cpu: host` resolved)
    }
    kept = [(p.key, p.value) for p in model.metadata_props if p.key not in entries]
    del model.metadata_props[:]
    for key, value in [*kept, *sorted(entries.items())]:
        model.metadata_props.add(key=key, value=value)
