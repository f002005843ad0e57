"""Structural diff of two ONNX models: nodes, ops, initializers, attributes, opsets, QDQ coverage, size.

Nodes are matched in four steps, each only among nodes still unmatched and only when the key is unique on both
sides: (1) by name; then, for renamed nodes, (2) by op and output tensor names, (3) by op, input tensor names
and attributes, (4) by op, attributes and already-matched producers (propagated in topological order, so a
renamed chain is matched link by link). A node of B tagged by a qgraph pass (``doc_string = "qgraph:<pass>"``)
was created by that pass: it is only matched by name, or to a node of A carrying the same tag, never taken for a
renamed original. Everything is one O(N) pass per step over name-keyed dicts.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from qgraph.analysis.diff.blocks import BlockBlame, block_blame
from qgraph.analysis.diff.protos import (
    ModelIndex,
    NodeRef,
    describe_attribute,
    dtype_name,
    op_label,
    tensor_digest,
    tensor_nbytes,
)
from qgraph.analysis.diff.provenance import json_or_none, metadata_changes, provenance_reasons
from qgraph.analysis.diff.qdq import QdqCoverage, qdq_coverage
from qgraph.io.model_io import serialized_size


@dataclass
class ModelFacts:
    """Model-level facts shown side by side."""

    path: str | None
    ir_version: int
    opsets: dict[str, int]
    nodes: int
    initializers: int
    initializer_bytes: int
    model_bytes: int  # serialized size with all weights inline
    file_bytes: int | None  # on disk, external data included (None for in-memory models)

    @classmethod
    def of(cls, idx: ModelIndex, path: str | os.PathLike[str] | None) -> ModelFacts:
        """Facts of an indexed model (``path`` adds the on-disk size)."""
        m = idx.model
        return cls(
            path=str(path) if path is not None else None,
            ir_version=int(m.ir_version),
            opsets={o.domain or "ai.onnx": int(o.version) for o in m.opset_import},
            nodes=len(idx.nodes),
            initializers=len(idx.initializers),
            initializer_bytes=sum(tensor_nbytes(t) for t in idx.initializers.values()),
            model_bytes=serialized_size(m),  # ByteSize() would serialize the whole model
            file_bytes=_file_bytes(Path(path), m) if path is not None else None,
        )


def _file_bytes(path: Path, model: onnx.ModelProto) -> int | None:
    if not path.is_file():
        return None
    size = path.stat().st_size
    locations = {
        e.value
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for e in t.external_data
        if e.key == "location"
    }
    for loc in locations:
        f = path.parent / loc
        size += f.stat().st_size if f.is_file() else 0
    return size


@dataclass
class NodeEntry:
    """An added or removed node; ``pass_name`` is the qgraph pass that created it (from its tag)."""

    node: str
    op: str
    pass_name: str | None = None


@dataclass
class NodeChange:
    """A node present in both models whose op, wiring or attributes differ."""

    node: str
    op: str
    changes: list[str]
    new_name: str | None = None  # set when the node was matched structurally under another name


@dataclass
class InitializerChange:
    """An initializer added, removed or changed (dtype, shape or values)."""

    name: str
    kind: str  # "added" | "removed" | "changed" | "renamed" (same content, ``name`` = "old → new")
    before: str = ""  # "float32[64,3,7,7]"
    after: str = ""
    bytes_before: int = 0
    bytes_after: int = 0


@dataclass
class StructuralDiff:
    """Everything that differs structurally between model A (before) and model B (after)."""

    a: ModelFacts
    b: ModelFacts
    ops_a: dict[str, int]
    ops_b: dict[str, int]
    added: list[NodeEntry] = field(default_factory=list)
    removed: list[NodeEntry] = field(default_factory=list)
    changed: list[NodeChange] = field(default_factory=list)
    renamed: int = 0
    unchanged: int = 0
    attribute_changes: int = 0
    initializers: list[InitializerChange] = field(default_factory=list)
    coverage_a: QdqCoverage = field(default_factory=QdqCoverage)
    coverage_b: QdqCoverage = field(default_factory=QdqCoverage)
    provenance: list[dict[str, Any]] = field(default_factory=list)
    recipe: str | None = None
    metadata_changes: dict[str, list[str | None]] = field(default_factory=dict)
    #: Block-quantized layers of B against A's float weights, worst first (`qgraph.analysis.diff.blocks`).
    blocks: list[BlockBlame] = field(default_factory=list)

    def op_delta(self) -> dict[str, int]:
        """Per-op change in node count (only ops whose count changed), largest change first."""
        ops = set(self.ops_a) | set(self.ops_b)
        delta = {op: self.ops_b.get(op, 0) - self.ops_a.get(op, 0) for op in ops}
        return dict(sorted(((k, v) for k, v in delta.items() if v), key=lambda kv: (-abs(kv[1]), kv[0])))

    def has_quantization(self) -> bool:
        """Whether either model holds Q/DQ or integer ops (else QDQ sections are left out)."""
        return any(c.quantize_nodes or c.dequantize_nodes or c.counts()["int8"] for c in (self.coverage_a,
                                                                                        self.coverage_b))

    def added_by_pass(self) -> dict[str, int]:
        """Added nodes per creating pass (``"untagged"`` when a node carries no qgraph tag)."""
        c = Counter(e.pass_name or "untagged" for e in self.added)
        return dict(sorted(c.items()))

    def initializer_counts(self) -> dict[str, int]:
        """Initializers added/removed/changed."""
        c = Counter(i.kind for i in self.initializers)
        return {k: c[k] for k in ("added", "removed", "changed", "renamed")}

    def summary(self) -> dict[str, Any]:
        """The headline numbers (used in per-pass report rows and tests)."""
        return {
            "nodes_before": self.a.nodes,
            "nodes_after": self.b.nodes,
            "added": len(self.added),
            "removed": len(self.removed),
            "changed": len(self.changed),
            "renamed": self.renamed,
            "unchanged": self.unchanged,
            "attribute_changes": self.attribute_changes,
            "op_delta": self.op_delta(),
            "initializers": self.initializer_counts(),
            "initializer_bytes_delta": self.b.initializer_bytes - self.a.initializer_bytes,
            "ir_version": [self.a.ir_version, self.b.ir_version],
            "opsets_changed": self.a.opsets != self.b.opsets,
            "int8_nodes": [self.coverage_a.counts()["int8"], self.coverage_b.counts()["int8"]],
        }

    def short(self, limit: int = 4) -> str:
        """One line: ``+12 -4 ~8 nodes; +8 DequantizeLinear, -4 BatchNormalization``."""
        parts = [f"{'+' if v > 0 else ''}{v} {op}" for op, v in list(self.op_delta().items())[:limit]]
        more = len(self.op_delta()) - limit
        ops = ", ".join(parts) + (f", ... ({more} more)" if more > 0 else "")
        head = f"+{len(self.added)} -{len(self.removed)} ~{len(self.changed)} nodes"
        return f"{head}; {ops}" if ops else head

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "a": asdict(self.a),
            "b": asdict(self.b),
            "summary": self.summary(),
            "ops": {"a": self.ops_a, "b": self.ops_b, "delta": self.op_delta()},
            "added": [asdict(e) for e in self.added],
            "added_by_pass": self.added_by_pass(),
            "removed": [asdict(e) for e in self.removed],
            "changed": [asdict(c) for c in self.changed],
            "initializers": [asdict(i) for i in self.initializers],
            "qdq_coverage": {"a": self.coverage_a.to_dict(), "b": self.coverage_b.to_dict()},
            "provenance": {"recipe": self.recipe, "passes": self.provenance},
            "metadata_changes": self.metadata_changes,
            "blocks": [b.to_dict() for b in self.blocks],
        }


# --------------------------------------------------------------------------------------------- matching
def _attr_digest(node: onnx.NodeProto) -> str:
    h = hashlib.sha1()
    for attr in sorted(node.attribute, key=lambda a: a.name):
        h.update(attr.SerializeToString(deterministic=True))
    return h.hexdigest()


def _unique(refs: list[NodeRef], key: Any) -> dict[Hashable, NodeRef]:
    seen: dict[Hashable, NodeRef | None] = {}
    for r in refs:
        k = key(r)
        if k is not None:
            seen[k] = None if k in seen else r
    return {k: v for k, v in seen.items() if v is not None}


def match_nodes(ia: ModelIndex, ib: ModelIndex) -> dict[int, NodeRef]:
    """Map node positions of B to their counterpart in A (see module docs for the four steps)."""
    mapping: dict[int, NodeRef] = {}
    used: set[int] = set()

    def link(b: NodeRef, a: NodeRef) -> None:
        mapping[b.index] = a
        used.add(a.index)

    def renamable(b: NodeRef, a: NodeRef) -> bool:
        return a.index not in used and (b.pass_name is None or b.pass_name == a.pass_name)

    for b in ib.nodes:
        a = ia.by_key.get(b.key)  # an unnamed node's key is its first output's (`qgraph.graph.naming`): stable
        if a is not None and a.index not in used:
            link(b, a)
    keys = (
        lambda r: (r.op, r.scope, tuple(r.node.output)) if any(r.node.output) else None,
        lambda r: (r.op, r.scope, tuple(r.node.input), _attr_digest(r.node)) if any(r.node.input) else None,
    )
    for key in keys:
        left = _unique([r for r in ia.nodes if r.index not in used], key)
        right = _unique([r for r in ib.nodes if r.index not in mapping], key)
        for k, b in right.items():
            if k in left and renamable(b, left[k]):
                link(b, left[k])

    # Step 4: wiring through matched producers; constants compare by dtype and shape, not by name.
    def in_key(idx: ModelIndex, t: str, a_side: bool) -> Hashable | None:
        if t in idx.initializers:
            init = idx.initializers[t]
            return ("c", init.data_type, tuple(init.dims))
        prod = idx.producer.get(t)
        if prod is None:
            return ("t", t)
        target = prod if a_side else mapping.get(prod.index)
        return None if target is None else ("n", target.index, list(prod.node.output).index(t))

    def node_key(idx: ModelIndex, r: NodeRef, a_side: bool) -> Hashable | None:
        ins = tuple(in_key(idx, t, a_side) for t in r.node.input)
        if None in ins:
            return None
        return (r.op, r.scope, ins, _attr_digest(r.node))

    left4 = _unique([r for r in ia.nodes if r.index not in used], lambda r: node_key(ia, r, True))
    for b in ib.nodes:
        if b.index in mapping:
            continue
        k = node_key(ib, b, False)
        a = left4.get(k) if k is not None else None
        if a is not None and renamable(b, a):
            link(b, a)
    return mapping


def _node_changes(a: onnx.NodeProto, b: onnx.NodeProto,
                  same_constant: Callable[[str, str], bool] | None = None) -> tuple[list[str], int]:
    """What differs between two matched nodes (inputs that are renamed but identical constants do not count)."""
    changes: list[str] = []
    if (a.domain or "", a.op_type) != (b.domain or "", b.op_type):
        changes.append(f"op: {op_label(a)} → {op_label(b)}")  # a domain change too (com.microsoft 16-bit Q/DQ)
    for label, xs, ys in (("input", a.input, b.input), ("output", a.output, b.output)):
        if list(xs) == list(ys):
            continue
        if len(xs) != len(ys):
            changes.append(f"{label}s: {list(xs)} → {list(ys)}")
            continue
        pairs = enumerate(zip(xs, ys, strict=True))
        changes.extend(f"{label} {i}: {x or '∅'} → {y or '∅'}" for i, (x, y) in pairs
                       if x != y and not (same_constant is not None and same_constant(x, y)))
    aa = {x.name: x for x in a.attribute}
    ba = {x.name: x for x in b.attribute}
    n_attr = 0
    for name in sorted(set(aa) | set(ba)):
        x, y = aa.get(name), ba.get(name)
        if x is not None and y is not None and x.SerializeToString(deterministic=True) == y.SerializeToString(
            deterministic=True
        ):
            continue
        n_attr += 1
        before = describe_attribute(x) if x is not None else "∅"
        after = describe_attribute(y) if y is not None else "∅"
        changes.append(f"attribute {name}: {before} → {after}")
    return changes, n_attr


# --------------------------------------------------------------------------------------------- entry point
def structural_diff(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    *,
    a_path: str | os.PathLike[str] | None = None,
    b_path: str | os.PathLike[str] | None = None,
    reasons: Mapping[str, str] | None = None,
) -> StructuralDiff:
    """Diff model ``a`` (before) against ``b`` (after).

    ``reasons`` (node name -> why it stayed float) enriches B's QDQ coverage; reasons recorded in B's
    provenance metadata are used too.
    """
    ia, ib = ModelIndex.build(a), ModelIndex.build(b)
    meta_b = {p.key: p.value for p in b.metadata_props}
    passes = json_or_none(meta_b.get("qgraph.passes"))
    passes = passes if isinstance(passes, list) else []
    recipe = json_or_none(meta_b.get("qgraph.recipe"))
    why = {**provenance_reasons(passes), **(reasons or {})}
    d = StructuralDiff(
        a=ModelFacts.of(ia, a_path),
        b=ModelFacts.of(ib, b_path),
        ops_a=dict(sorted(ia.op_histogram().items())),
        ops_b=dict(sorted(ib.op_histogram().items())),
        coverage_a=qdq_coverage(ia),
        coverage_b=qdq_coverage(ib, why),
        provenance=[p for p in passes if isinstance(p, dict)],
        recipe=recipe.get("name") if isinstance(recipe, dict) else None,
        metadata_changes=metadata_changes(a, b),
        blocks=block_blame(a, b),
    )
    mapping = match_nodes(ia, ib)

    def same_constant(x: str, y: str) -> bool:
        tx, ty = ia.initializers.get(x), ib.initializers.get(y)
        return tx is not None and ty is not None and tensor_digest(tx) == tensor_digest(ty)

    matched_a = {r.index for r in mapping.values()}
    for rb in ib.nodes:
        ra = mapping.get(rb.index)
        if ra is None:
            d.added.append(NodeEntry(rb.key, rb.op, rb.pass_name))
            continue
        changes, n_attr = _node_changes(ra.node, rb.node, same_constant)
        renamed = ra.key != rb.key
        d.renamed += renamed
        d.attribute_changes += n_attr
        if renamed:
            changes.insert(0, f"renamed: {ra.key} → {rb.key}")
        if changes:
            d.changed.append(NodeChange(ra.key, ra.op, changes, rb.key if renamed else None))
        else:
            d.unchanged += 1
    d.removed = [NodeEntry(r.key, r.op, r.pass_name) for r in ia.nodes if r.index not in matched_a]
    d.initializers = _initializer_changes(ia, ib)
    return d


def _initializer_changes(ia: ModelIndex, ib: ModelIndex) -> list[InitializerChange]:
    def desc(t: onnx.TensorProto) -> str:
        return f"{dtype_name(t.data_type)}{list(t.dims)}"

    out: list[InitializerChange] = []
    for name, t in ia.initializers.items():
        u = ib.initializers.get(name)
        if u is None:
            out.append(InitializerChange(name, "removed", desc(t), "", tensor_nbytes(t), 0))
        elif tensor_digest(t) != tensor_digest(u):
            out.append(InitializerChange(name, "changed", desc(t), desc(u), tensor_nbytes(t), tensor_nbytes(u)))
    # An initializer removed under one name and added under another with the same content is a rename.
    removed = {tensor_digest(ia.initializers[c.name]): c for c in out if c.kind == "removed"}
    for name, u in ib.initializers.items():
        if name in ia.initializers:
            continue
        gone = removed.pop(tensor_digest(u), None)
        if gone is not None:
            gone.kind, gone.name, gone.after = "renamed", f"{gone.name} → {name}", desc(u)
            gone.bytes_after = tensor_nbytes(u)
        else:
            out.append(InitializerChange(name, "added", "", desc(u), 0, tensor_nbytes(u)))
    return out
