"""The pass contract the pipeline enforces around every pass, built-in or plug-in alike.

Before a pass: ``requires`` (the pass's own preconditions). Around ``run``: the cyclic GC is paused (with ~100k
graphsurgeon objects alive every collection rescans them, which made passes super-linear; graph objects are freed
by reference counting), unless the pass sets ``pause_gc = False`` (a search building hundreds of temporary models
would otherwise keep all their cyclic garbage until it ends). After it:

1. ``run`` must return a `PassResult` (anything else is a `PassError` naming the pass);
2. the handle's caches are invalidated (a pass that forgot ``graph.changed()`` cannot leave a stale index behind);
3. nodes added and removed are *measured* (by identity, in every scope) and override what the pass counted, and a
   pass that changed the graph while reporting nothing is recorded as changed all the same;
4. every node the pass created is tagged with its name (provenance, diff and fallback find them by it);
5. the graph is checked (`qgraph.graph.check_structure`: no dangling input, one producer per tensor, arity and
   required attributes, acyclic): a broken graph is "pass #i NAME produced an invalid graph: ..." (exit 1);
6. ``ensures`` (the pass's own postconditions).

An exception other than a qgraph error (`qgraph.errors.QGraphError`, already a message for the user) raised by the
pass's own code (``requires``, ``run``, ``ensures``) becomes a `PassError` (exit 1) naming the pass (registered name
and index in the recipe), the exception's type, message and innermost line, and whose bug it is: a built-in pass's is
qgraph's, a plug-in's is its module's; the original exception is its ``__cause__`` (``--debug`` prints both).

Each step is O(N): two graph walks per pass.
"""

from __future__ import annotations

import functools
import gc
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import onnx_graphsurgeon as gs

from qgraph.errors import PassError, QGraphError
from qgraph.graph import GraphHandle, check_structure, graph_scopes
from qgraph.graph.detach import constant_bytes
from qgraph.pipeline.pass_api import Pass, PassContext, PassResult, install_nested_runner


@dataclass
class Snapshot:
    """What a graph looked like before a pass: its nodes (kept alive so identities stay unique) and a digest of
    its wiring (node op, attribute count, the identity of every input and output, constants' shapes and dtypes)."""

    nodes: list[gs.Node]
    digest: int
    #: The constants the nodes read: identity -> bytes (`constant_bytes`).
    constants: dict[int, int]

    @classmethod
    def of(cls, graph: gs.Graph) -> Snapshot:
        """Take a snapshot of ``graph`` (every scope), O(nodes + edges)."""
        nodes: list[gs.Node] = []
        parts: list[Any] = []
        constants: dict[int, int] = {}
        for g in graph_scopes(graph):
            parts.append((tuple(map(id, g.inputs)), tuple(map(id, g.outputs))))
            nodes.extend(g.nodes)
            for node in g.nodes:
                parts.append((id(node), node.op, len(node.attrs), tuple(map(id, node.inputs)),
                              tuple(map(id, node.outputs))))
                for t in node.inputs:
                    if isinstance(t, gs.Constant):
                        # A constant reshaped or retyped in place is a change too (new values of the same shape and
                        # dtype are not seen: reading values may swap graphsurgeon's lazy proto for an array)
                        parts.append((id(t), _dtype_name(t.dtype), tuple(t.shape)))
                        if id(t) not in constants:
                            constants[id(t)] = constant_bytes(t)
        return cls(nodes, hash(tuple(parts)), constants)

    def dropped_bytes(self, after: Snapshot) -> int:
        """Bytes of the constants read before and not after: what a cyclic collection can give back (every
        graphsurgeon tensor is a reference cycle with its own producer and consumer lists)."""
        return sum(size for key, size in self.constants.items() if key not in after.constants)


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
    # str(np.dtype) costs ~10 us: two snapshots per pass name every constant of the graph (100k at 30k nodes)
    return str(dtype)


#: Weights (bytes) a pass must drop, or the output hold, before a full cyclic collection is worth its cost.
COLLECT_BYTES = 8 << 20


def collect_cycles(freed_bytes: int) -> None:
    """Give back now the weights a pass dropped (graphsurgeon's node <-> tensor references are cycles) when they
    are at least `COLLECT_BYTES`: a full collection walks every node and tensor of the graph (0.15 s at 3k nodes,
    1.9 s at 30k, after every pass), and below a few MB the ordinary cyclic GC gives them back soon enough."""
    if freed_bytes >= COLLECT_BYTES:
        gc.collect()


@dataclass
class Measured:
    """What the pipeline measured about one pass; ``dropped_bytes``: `Snapshot.dropped_bytes`."""

    nodes_added: int
    nodes_removed: int
    changed: bool
    dropped_bytes: int = 0


def _new_nodes(nodes: list[gs.Node], reference: list[gs.Node]) -> list[gs.Node]:
    """Nodes of ``nodes`` absent from ``reference``: by identity, except that a named node whose name was there
    before is the same node re-created (a pass that rebuilds the whole model, e.g. opset conversion)."""
    ids = {id(n) for n in reference}
    names = {n.name for n in reference if n.name}
    return [n for n in nodes if id(n) not in ids and not (n.name and n.name in names)]


def run_pass(p: Pass[Any], index: int, handle: GraphHandle, ctx: PassContext) -> tuple[PassResult, Measured]:
    """Run ``p`` on ``handle`` under the contract (module docs); raises `PassError` when the pass breaks it."""
    where = f"pass #{index} {p.name!r}"
    ctx.running = where
    with pass_code(p, where):
        p.requires(handle, ctx)
    before = _snapshot(handle)
    gc_was_enabled = gc.isenabled()
    if p.pause_gc:
        gc.disable()
    try:
        with pass_code(p, where):
            result = p.run(handle, ctx)
    finally:
        if gc_was_enabled:
            gc.enable()
    handle.changed()
    _check_result(result, where)
    after = Snapshot.of(handle.graph)
    seen = (handle.version, id(handle.graph), after)
    added = _new_nodes(after.nodes, before.nodes)
    measured = Measured(len(added), len(_new_nodes(before.nodes, after.nodes)), after.digest != before.digest,
                        before.dropped_bytes(after))
    for node in added:
        if node.name and node.name not in handle.tags:
            handle.tag(node, p.name)
    if measured.changed and not result.changed and not measured.nodes_added and not measured.nodes_removed:
        result.notes.append("the graph changed although the pass reported no rewrite")
    result.nodes_added, result.nodes_removed = measured.nodes_added, measured.nodes_removed
    _check_graph_and_ensures(p, where, handle, ctx, result)
    _LAST_SNAPSHOT[handle] = seen
    return result, measured


#: Per graph, its last snapshot with the graph's version and identity then: the next pass starts from it when the
#: graph did not change since (every pass would otherwise walk the same graph twice: 0.4 s per walk at 30k nodes).
_LAST_SNAPSHOT: weakref.WeakKeyDictionary[GraphHandle, tuple[int, int, Snapshot]] = weakref.WeakKeyDictionary()


def _snapshot(handle: GraphHandle) -> Snapshot:
    """`Snapshot.of` the handle's graph, or the previous pass's when nothing called ``handle.changed()`` since."""
    last = _LAST_SNAPSHOT.get(handle)
    if last is not None and last[:2] == (handle.version, id(handle.graph)):
        return last[2]
    return Snapshot.of(handle.graph)


def run_nested(p: Pass[Any], handle: GraphHandle, ctx: PassContext) -> PassResult:
    """`PassContext.run_pass`: ``p`` run from inside another pass, under the contract (``requires``, a `PassResult`,
    caches invalidated, the graph checked, ``ensures``); node tags and measured counts stay the calling pass's."""
    where = f"{ctx.running or 'a pass'}, in the {p.name!r} it runs inside itself,"
    with pass_code(p, where):
        p.requires(handle, ctx)
        result = p.run(handle, ctx)
    handle.changed()
    _check_result(result, where)
    _check_graph_and_ensures(p, where, handle, ctx, result)
    return result


install_nested_runner(run_nested)


def _check_result(result: object, where: str) -> None:
    if not isinstance(result, PassResult):
        raise PassError(f"{where} returned {type(result).__name__} instead of a PassResult: its run() must end with "
                        "`return PassResult(...)` saying what it changed. This is a bug in the pass.")


def _check_graph_and_ensures(p: Pass[Any], where: str, handle: GraphHandle, ctx: PassContext,
                             result: PassResult) -> None:
    """The structural check of the graph ``p`` left, then ``p.ensures``."""
    problems = check_structure(handle.graph, handle.opset)
    if problems:
        raise PassError(f"{where} produced an invalid graph: {'; '.join(problems)}. This is a bug in the pass (or an "
                        "unsupported pattern): exclude the nodes it touched or report it.")
    with pass_code(p, where):
        p.ensures(handle, ctx, result)


@contextmanager
def pass_code(p: Pass[Any], where: str) -> Iterator[None]:
    """Run a pass's own code: an exception that is not a qgraph error becomes a `PassError` naming the pass
    (``where``: "pass #i 'name'"), the exception and whose bug it is (module docs); MemoryError passes through."""
    try:
        yield
    except (QGraphError, MemoryError):
        raise
    except Exception as exc:
        raise PassError(crash_message(p, where, exc)) from exc


def crash_message(p: Pass[Any], where: str, exc: BaseException) -> str:
    """``where`` failed: the exception's type, message and innermost line, and whom to report it to."""
    cls = type(p)
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    text = str(exc).strip() or "(no message)"
    if cls.__module__.split(".")[0] == "qgraph":
        whose = "This is a bug in qgraph, please report it (with the recipe and, if you can, the model)"
    else:
        whose = (f"The error is in plug-in pass {cls.__qualname__} from module {cls.__module__}: report it to its "
                 "authors, or leave the pass out of the recipe")
    return f"{where} failed: {type(exc).__name__}: {text}{at}. {whose}; run with --debug for the traceback."
