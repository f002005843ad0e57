"""A visual diff: the changed regions of a graph, before and after side by side, as inline SVG (no script, no URL).

A *changed node* is one the structural matching leaves unmatched (inserted in B, removed from A) or matched with
another op. Each changed node is *anchored* to its matched neighbours; changed nodes that touch, or feed the same
matched node (the Q/DQ pairs and weight DQs of one Conv), form one region (up to ``max_nodes``), drawn with its
anchors as context: A's nodes on the left, B's on the right, laid out in layers by longest path (top to bottom).
Colours: inserted Q/DQ blue, other inserted nodes green, removed red, op changed amber; context nodes are tinted by
the per-layer error of their output (the numeric diff's layer SQNR: green ≥ 40 dB, amber ≥ 20 dB, red below).
Regions with the most error come first. Everything is O(nodes + edges).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import networkx as nx
import onnx

from qgraph.analysis.diff.html import esc, short_name
from qgraph.analysis.diff.layers import NumericDiff
from qgraph.analysis.diff.protos import ModelIndex, NodeRef
from qgraph.analysis.diff.structural import match_nodes
from qgraph.quant.qdq import is_qdq

_W, _H, _GX, _GY, _PAD = 168, 38, 18, 30, 12
_FILL = {"qdq": "#dbe9fb", "inserted": "#dcf3dc", "removed": "#fbdada", "changed": "#fdf0cc"}
_STROKE = {"qdq": "#1565c0", "inserted": "#2e7d32", "removed": "#c62828", "changed": "#b7791f", "context": "#777"}
_ERROR = [(40.0, "#eef8ee"), (20.0, "#fff4d6"), (-math.inf, "#fde2e2")]


@dataclass
class Region:
    """Changed nodes of one region and their matched neighbours (A indices for anchors)."""

    changed_a: set[int] = field(default_factory=set)
    changed_b: set[int] = field(default_factory=set)
    anchors: set[int] = field(default_factory=set)  # A node indices
    worst_db: float = math.inf
    order: int = 0


def _neighbours(idx: ModelIndex, ref: NodeRef) -> list[NodeRef]:
    out = [idx.producer[t] for t in ref.node.input if t in idx.producer]
    out += [c for t in ref.node.output for c in idx.consumers.get(t, [])]
    return [r for r in out if not r.scope]


def find_regions(ia: ModelIndex, ib: ModelIndex, mapping: dict[int, NodeRef], max_nodes: int = 40) -> list[Region]:
    """Group the changed nodes into regions (see module docs), in topological order of their first node;
    ``mapping`` is `match_nodes`' B index → A node."""
    a_of_b = {b: a.index for b, a in mapping.items()}
    matched_a = set(a_of_b.values())
    changed: list[tuple[str, int]] = [("b", r.index) for r in ib.nodes if not r.scope and (
        r.index not in mapping or mapping[r.index].op != r.op)]
    changed += [("a", r.index) for r in ia.nodes if not r.scope and r.index not in matched_a]
    parent = {c: c for c in changed}

    def find(x: tuple[str, int]) -> tuple[str, int]:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    size = dict.fromkeys(changed, 1)
    anchor_owner: dict[int, tuple[str, int]] = {}
    anchors: dict[tuple[str, int], set[int]] = {c: set() for c in changed}
    for side, i in changed:
        idx = ib if side == "b" else ia
        ref = idx.nodes[i]
        downstream = {c.index for t in ref.node.output for c in idx.consumers.get(t, [])}
        for n in _neighbours(idx, ref):
            key = (side, n.index)
            if key in parent:
                _union(parent, size, find, (side, i), key, max_nodes)
                continue
            a_index = a_of_b.get(n.index) if side == "b" else n.index
            if a_index is None:
                continue
            anchors[(side, i)].add(a_index)
            if n.index not in downstream:  # regions join only at the node they feed (one region per op)
                continue
            if a_index in anchor_owner:
                _union(parent, size, find, (side, i), anchor_owner[a_index], max_nodes)
            else:
                anchor_owner[a_index] = (side, i)
    regions: dict[tuple[str, int], Region] = {}
    for c in changed:
        r = regions.setdefault(find(c), Region(order=10**9))
        (r.changed_b if c[0] == "b" else r.changed_a).add(c[1])
        r.anchors |= anchors[c]
        r.order = min(r.order, ia.nodes[c[1]].index if c[0] == "a" else c[1])
    return sorted(regions.values(), key=lambda r: r.order)


Key = tuple[str, int]  # ("a" | "b", node index)


def _union(parent: dict[Key, Key], size: dict[Key, int], find: Callable[[Key], Key], x: Key, y: Key,
           cap: int) -> None:
    rx, ry = find(x), find(y)
    if rx == ry or size[rx] + size[ry] > cap:
        return
    parent[ry] = rx
    size[rx] += size[ry]


# --------------------------------------------------------------------------------------------- layout
def _layout(idx: ModelIndex, members: Sequence[int]) -> tuple[dict[int, tuple[float, float]], list[tuple[int, int]],
                                                                 float, float]:
    """Positions (layered by longest path), edges, width and height of the subgraph on ``members``."""
    keep = set(members)
    g: nx.DiGraph = nx.DiGraph()
    g.add_nodes_from(keep)
    for i in keep:
        for t in idx.nodes[i].node.output:
            for c in idx.consumers.get(t, []):
                if c.index in keep:
                    g.add_edge(i, c.index)
    depth: dict[int, int] = {}
    for n in nx.topological_sort(g) if nx.is_directed_acyclic_graph(g) else sorted(keep):
        depth[n] = max((depth[p] + 1 for p in g.predecessors(n) if p in depth), default=0)
    layers: dict[int, list[int]] = {}
    for n in sorted(keep):
        layers.setdefault(depth[n], []).append(n)
    widest = max((len(v) for v in layers.values()), default=1)
    width = _PAD * 2 + widest * _W + (widest - 1) * _GX
    pos: dict[int, tuple[float, float]] = {}
    for d, row in layers.items():
        row_w = len(row) * _W + (len(row) - 1) * _GX
        x0 = (width - row_w) / 2
        for k, n in enumerate(row):
            pos[n] = (x0 + k * (_W + _GX), _PAD + d * (_H + _GY))
    height = _PAD * 2 + len(layers) * _H + max(len(layers) - 1, 0) * _GY
    return pos, list(g.edges), width, height


def _svg(idx: ModelIndex, members: Sequence[int], kinds: dict[int, str], tint: dict[int, str], title: str,
         svg_id: str) -> str:
    pos, edges, width, height = _layout(idx, members)
    parts = [f'<svg id="{esc(svg_id)}" class="graph" width="{width:.0f}" '
             f'height="{height + 22:.0f}" role="img" aria-label="{esc(title)}">',
             f'<text x="{_PAD}" y="14" font-weight="bold" font-size="12">{esc(title)}</text>',
             '<g transform="translate(0,20)">']
    for s, t in edges:
        (x1, y1), (x2, y2) = pos[s], pos[t]
        parts.append(f'<line x1="{x1 + _W / 2:.1f}" y1="{y1 + _H:.1f}" x2="{x2 + _W / 2:.1f}" y2="{y2:.1f}" '
                     'stroke="#999" stroke-width="1.2" marker-end="url(#arrow)"/>')
    for n in members:
        x, y = pos[n]
        kind = kinds.get(n, "context")
        fill = _FILL.get(kind, tint.get(n, "#ffffff"))
        ref = idx.nodes[n]
        parts.append(f'<g class="node {kind}"><title>{esc(ref.key)} ({esc(ref.op)})</title>'
                     f'<rect x="{x:.1f}" y="{y:.1f}" width="{_W}" height="{_H}" rx="5" fill="{fill}" '
                     f'stroke="{_STROKE[kind]}" stroke-width="{2 if kind != "context" else 1}"/>'
                     f'<text x="{x + _W / 2:.1f}" y="{y + 15:.1f}" text-anchor="middle" font-size="11" '
                     f'font-weight="bold">{esc(short_name(ref.op, 24))}</text>'
                     f'<text x="{x + _W / 2:.1f}" y="{y + 29:.1f}" text-anchor="middle" font-size="10" '
                     f'class="node-label">{esc(short_name(ref.key, 26))}</text></g>')
    parts.append("</g></svg>")
    return "".join(parts)


def _tints(ia: ModelIndex, numeric: NumericDiff | None) -> tuple[dict[int, str], dict[int, float]]:
    if numeric is None:
        return {}, {}
    by_node = {d.node: d.layer_sqnr_db for d in numeric.layers}
    tint: dict[int, str] = {}
    error: dict[int, float] = {}
    for r in ia.nodes:
        db = by_node.get(r.key)
        if db is not None and not math.isnan(db):
            error[r.index] = db
            tint[r.index] = next(c for lim, c in _ERROR if db >= lim)
    return tint, error


_ARROW = ('<svg width="0" height="0" style="position:absolute"><defs><marker id="arrow" viewBox="0 0 10 10" refX="9" '
          'refY="5" markerWidth="6" markerHeight="6" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
          'fill="#999"/></marker></defs></svg>')
_LEGEND = ('<p class="muted legend">Left: before (A); right: after (B). <span style="color:#1565c0">■ inserted '
           'Q/DQ</span> <span style="color:#2e7d32">■ inserted</span> <span style="color:#c62828">■ removed</span> '
           '<span style="color:#b7791f">■ op changed</span>; context nodes tinted by their layer SQNR: '
           '<span style="background:#eef8ee">≥ 40 dB</span> <span style="background:#fff4d6">≥ 20 dB</span> '
           '<span style="background:#fde2e2">&lt; 20 dB</span>. Hover a node for its full name.</p>')


def changed_regions_html(a: onnx.ModelProto, b: onnx.ModelProto, numeric: NumericDiff | None = None, *,
                         max_regions: int = 8, max_nodes: int = 40) -> str:
    """The changed regions, most error first, each as a before/after pair of SVG drawings (see module docs)."""
    ia, ib = ModelIndex.build(a), ModelIndex.build(b)
    mapping = match_nodes(ia, ib)
    regions = find_regions(ia, ib, mapping, max_nodes)
    if not regions:
        return '<p class="muted">No node was added, removed or changed.</p>'
    tint_a, error = _tints(ia, numeric)
    for r in regions:
        r.worst_db = min((error.get(i, math.inf) for i in r.anchors | r.changed_a), default=math.inf)
    shown = sorted(regions, key=lambda r: (r.worst_db, r.order))[:max_regions]
    b_of_a = {a.index: bi for bi, a in mapping.items()}
    out = [_ARROW, _LEGEND]
    for k, r in enumerate(shown):
        kinds_a = dict.fromkeys(r.changed_a, "removed")
        kinds_b = {i: "changed" if i in mapping else "qdq" if is_qdq(ib.nodes[i].node.op_type, ib.nodes[i].node.domain)
                   else "inserted" for i in r.changed_b}
        tint_b = {b_of_a[i]: c for i, c in tint_a.items() if i in b_of_a}
        members_a = sorted(r.anchors | r.changed_a)
        members_b = sorted({b_of_a[i] for i in r.anchors if i in b_of_a} | r.changed_b)
        worst = "" if math.isinf(r.worst_db) else f"; worst layer SQNR {r.worst_db:.1f} dB"
        head = (f"<h3>Region {k + 1}: {len(r.changed_b)} node(s) in B, {len(r.changed_a)} removed from A"
                f"{esc(worst)}</h3>")
        out.append(head + '<div class="regions">' + _svg(ia, members_a, kinds_a, tint_a, "before (A)",
                                                         f"region-{k + 1}-a")
                   + _svg(ib, members_b, kinds_b, tint_b, "after (B)", f"region-{k + 1}-b") + "</div>")
    if len(regions) > len(shown):
        out.append(f'<p class="muted">{len(regions) - len(shown)} more region(s) not drawn (the structural tables '
                   "list every node).</p>")
    return "".join(out)
