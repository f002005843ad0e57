"""If/Loop bodies in a diff: each body of model A paired with B's, observed as a model of its own.

onnxruntime returns no tensor from inside a body, so the diff observes body tensors the way calibration does
(`qgraph.runtime.bodies`): each body of the top graph becomes a standalone model (`standalone_body`), and one run of
the whole model on the diff's samples records the body's inputs at every execution (`body_executions`: the outer
tensors of the samples whose condition selects an ``If`` branch, the formal inputs of every ``Loop`` iteration).
Nested bodies are reached one level at a time, from the standalone body and its executions. A's executions
are fed to A's body and B's to B's (B's body sees B's own upstream error, as its top-graph tensors do).

Executions are keyed by ``(sample, iteration, ...)`` (one entry per nesting level), so A's and B's are paired
even when a condition computed from quantized values selects another branch in B on some samples (those are
left out and counted). A body with no paired execution is *not run* on these inputs: its `BodyLevel.status`
says so, and nothing inside it is reported, never as "no error".

Names: the standalone body holds the outer Constants it reads first, then the body's nodes in order, so its
nodes map one to one onto the scoped keys of the whole model's `ModelIndex` (``If_0.then_branch/<node>``, the
names the rest of the diff, ``inspect`` and the remedies print). Cost: one session over each model per nesting
level plus one per body, and at most ``limit`` executions of a body kept in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import onnx

from qgraph.analysis.diff.protos import ModelIndex, NodeRef
from qgraph.data import Feed
from qgraph.errors import ModelError
from qgraph.runtime.bodies import Body, BodyError, ModelFacts, bodies, body_executions, standalone_body

#: Executions of one body observed at most (an If runs once per sample, a Loop once per iteration).
BODY_EXECUTIONS = 64

Key = tuple[int, ...]
_MISSING = "B has no such body (a pass inlined or removed the If/Loop)"


@dataclass
class BodyLevel:
    """One body of A (with B's counterpart) as standalone models, their paired executions and local indexes."""

    scope: str  # the body's scope in the whole model: ``<If/Loop key>.<attr>``
    path: tuple[tuple[str, str], ...]  # (first output of the If/Loop, attribute) from the top graph down
    a: Body | None  # None: not observable (the status says why)
    b: Body | None = None
    index_a: ModelIndex | None = None
    index_b: ModelIndex | None = None
    keys_a: dict[str, str] = field(default_factory=dict)  # key in the standalone A body -> scoped key in A
    keys_b: dict[str, str] = field(default_factory=dict)
    runs_a: list[Feed] = field(default_factory=list)  # executions (paired with runs_b when B was run)
    runs_b: list[Feed] = field(default_factory=list)
    status: str = ""

    @property
    def ran(self) -> bool:
        """Whether the body ran (in both models when B was run) on at least one execution."""
        return bool(self.runs_a)


@dataclass
class _Side:
    """One model's level: the model, its executions by key, and the scoped refs of its top-scope nodes."""

    model: onnx.ModelProto
    runs: list[tuple[Key, Feed]]
    refs: list[NodeRef]  # scoped refs of ``model``'s own nodes after its leading outer Constants
    scopes: dict[str, list[NodeRef]]


def scope_nodes(index: ModelIndex) -> dict[str, list[NodeRef]]:
    """Every scope's nodes in order (``""``: the top graph), in one walk."""
    out: dict[str, list[NodeRef]] = {}
    for ref in index.nodes:
        out.setdefault(ref.scope, []).append(ref)
    return out


def body_levels(a: onnx.ModelProto, b: onnx.ModelProto | None, feeds: Iterable[Feed], *,
                index_a: ModelIndex, index_b: ModelIndex | None = None, limit: int = BODY_EXECUTIONS
                ) -> list[BodyLevel]:
    """Every If/Loop body of ``a`` (nested too, parents first) with its executions on ``feeds``; with ``b``, B's
    body of the same node and attribute and the executions of both, paired (see module docs)."""
    keyed: list[tuple[Key, Feed]] = [((k,), f) for k, f in enumerate(feeds)]
    top_a = _Side(a, keyed, scope_nodes(index_a).get("", []), scope_nodes(index_a))
    top_b = None
    if b is not None and index_b is not None:
        scopes_b = scope_nodes(index_b)
        top_b = _Side(b, keyed, scopes_b.get("", []), scopes_b)
    out: list[BodyLevel] = []
    _descend(top_a, top_b, (), limit, out)
    return out


def _extract(side: _Side) -> tuple[list[tuple[onnx.NodeProto, str, int]], list[Body | str]]:
    """Bodies of ``side.model`` (node, attribute, position of the node) and each made standalone, or why not."""
    listed = list(bodies(side.model))
    if not listed:
        return [], []
    position = {_ident(n): i for i, n in enumerate(side.model.graph.node)}
    found = [(node, attr, position[_ident(node)]) for node, attr in listed]
    facts = ModelFacts.of(side.model)
    made: list[Body | str] = []
    for node, attr, _ in found:
        try:
            made.append(standalone_body(side.model, node, attr, facts))
        except BodyError as exc:
            made.append(str(exc))
    return found, made


def _runs(side: _Side, made: Sequence[Body | str], limit: int) -> list[list[tuple[Key, Feed]]]:
    """Each body's executions keyed by its parent execution's key plus the iteration."""
    ok = [m for m in made if isinstance(m, Body)]
    got = iter(body_executions(side.model, ok, [f for _, f in side.runs], limit) if ok and side.runs else
               [[] for _ in ok])
    out: list[list[tuple[Key, Feed]]] = []
    for m in made:
        runs: list[tuple[Key, Feed]] = []
        if isinstance(m, Body):
            count: dict[int, int] = {}
            for parent, feed in next(got):
                j = count[parent] = count.get(parent, -1) + 1
                runs.append(((*side.runs[parent][0], j), feed))
        out.append(runs)
    return out


def _observed(side: _Side, made: list[Body | str], limit: int
              ) -> tuple[list[Body | str], list[list[tuple[Key, Feed]]]]:
    """`_runs`, or every body marked unobservable with the reason when onnxruntime cannot run the model that
    records their inputs (the rest of the diff goes on)."""
    try:
        return made, _runs(side, made, limit)
    except ModelError as exc:
        why = f"its inputs could not be recorded ({str(exc).splitlines()[0][:200]})"
        return [m if isinstance(m, str) else why for m in made], [[] for _ in made]


def _local_keys(body: Body, refs: list[NodeRef]) -> tuple[ModelIndex, dict[str, str]]:
    """The standalone body's index and its top-scope keys mapped to the whole model's scoped keys."""
    index = ModelIndex.build(body.model)
    local = [r for r in index.nodes if not r.scope]
    extra = len(local) - len(refs)  # the outer Constants standalone_body put first
    return index, {r.key: g.key for r, g in zip(local[max(extra, 0):], refs, strict=False)}


def _descend(sa: _Side, sb: _Side | None, path: tuple[tuple[str, str], ...], limit: int,
             out: list[BodyLevel]) -> None:
    found_a, made_a = _extract(sa)
    if not found_a:
        return
    made_a, runs_a = _observed(sa, made_a, limit)
    b_of: dict[tuple[str, str], tuple[Body | str, list[tuple[Key, Feed]], int]] = {}
    if sb is not None:
        found_b, made_b = _extract(sb)
        made_b, runs_b = _observed(sb, made_b, limit)
        b_of = {(_pair_key(n), attr): (m, r, pos)
                for (n, attr, pos), m, r in zip(found_b, made_b, runs_b, strict=True)}
    for (node, attr, pos), made, runs in zip(found_a, made_a, runs_a, strict=True):
        scope = f"{sa.refs[pos - (len(sa.model.graph.node) - len(sa.refs))].key}.{attr}"
        if not isinstance(made, Body):  # e.g. an outer tensor of unknown type
            out.append(BodyLevel(scope, (*path, (_ident(node), attr)), None, status=f"not compared: {made}"))
            continue
        level = BodyLevel(scope, (*path, (_ident(node), attr)), made)
        level.index_a, level.keys_a = _local_keys(made, sa.scopes.get(scope, []))
        out.append(level)
        if sb is None:
            level.runs_a, level.status = [f for _, f in runs], _status(len(runs), len(sa.runs), bool(path))
            if level.ran:
                _descend(_Side(made.model, runs, sa.scopes.get(scope, []), sa.scopes), None, level.path, limit, out)
            continue
        mb, rb, pos_b = b_of.get((_pair_key(node), attr), (_MISSING, [], -1))
        if not isinstance(mb, Body):
            level.status = f"not compared: {mb}"
            continue
        scope_b = f"{sb.refs[pos_b - (len(sb.model.graph.node) - len(sb.refs))].key}.{attr}"
        level.b = mb
        level.index_b, level.keys_b = _local_keys(mb, sb.scopes.get(scope_b, []))
        of_a, of_b = dict(runs), dict(rb)
        both = [k for k in of_a if k in of_b]
        level.runs_a, level.runs_b = [of_a[k] for k in both], [of_b[k] for k in both]
        level.status = _status(len(both), len(sa.runs), bool(path), len(of_a) + len(of_b) - 2 * len(both))
        if level.ran:
            _descend(_Side(made.model, [(k, of_a[k]) for k in both], sa.scopes.get(scope, []), sa.scopes),
                     _Side(mb.model, [(k, of_b[k]) for k in both], sb.scopes.get(scope_b, []), sb.scopes),
                     level.path, limit, out)


def _ident(node: onnx.NodeProto) -> str:
    """What names an If/Loop in its graph: its first output (unique in the scope), else its name."""
    return node.output[0] if node.output and node.output[0] else node.name


def _pair_key(node: onnx.NodeProto) -> str:
    """What pairs an If/Loop of A with B's: its name (passes keep names, not always output names), else its first
    output."""
    return node.name or _ident(node)


def _status(runs: int, parents: int, nested: bool, unpaired: int = 0) -> str:
    if not runs:
        of = f"{parents} execution(s) of the enclosing body" if nested else f"{parents} sample(s)"
        why = f"; {unpaired} execution(s) ran in one model only: the models took different branches" if unpaired \
            else ""
        return f"did not run on these inputs ({of}{why})"
    tail = f"; {unpaired} execution(s) ran in one model only (different branch taken)" if unpaired else ""
    return f"observed on {runs} execution(s){tail}"


def level_of(levels: Sequence[BodyLevel], scope: str) -> BodyLevel | None:
    """The level of ``scope``, or None."""
    return next((lv for lv in levels if lv.scope == scope), None)
