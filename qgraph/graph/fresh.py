"""Fresh names: the one rule every generated node or tensor name goes through, for both representations.

The rule: ``base`` if it is free, else ``base_1``, ``base_2``, ... (the first free one). `GraphHandle.unique_name`
applies it on the graphsurgeon graph a pass rewrites; `ProtoNames` applies it on a ``ModelProto`` that analysis
code extends with helper nodes (reductions, probes, twins) before handing it to onnxruntime.

`ProtoNames` knows every name of a model in every scope (node names; graph inputs, outputs, initializers, sparse
initializers, value infos, node inputs and outputs; the top graph, every If/Loop/Scan body and every local
function), built in one walk, O(N + total name length). Two ways to ask it:

- `ProtoNames.fresh` gives one free name (``fresh("x/scale")``);
- `ProtoNames.prefix` gives a free *namespace*: a stem ``p`` such that no name of the model is ``p`` or starts with
  ``p/``, returned as ``"p/"``. Every name built under it (``p + "3/err"``) is then free without a lookup, which is
  what code that derives dozens of names from one stem wants; a later `fresh` never hands out a name inside it.

Names handed out are remembered, so two requests never get the same answer. Both answer ``base`` itself when the
model does not use it, so a model without a clash gets exactly the names it got before the check existed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import onnx

from .ops import proto_scopes

#: The separator `ProtoNames.prefix` namespaces end with.
SEP = "/"


def free_name(base: str, taken: Callable[[str], bool]) -> str:
    """The first of ``base``, ``base_1``, ``base_2``, ... for which ``taken`` is false (the rule, module docs)."""
    name, k = base, 0
    while taken(name):
        k += 1
        name = f"{base}_{k}"
    return name


def _heads(name: str) -> Iterator[str]:
    """Every ``p`` such that ``name`` starts with ``p/`` (``"a/b/c"`` -> ``"a"``, ``"a/b"``)."""
    i = name.find(SEP)
    while i >= 0:
        yield name[:i]
        i = name.find(SEP, i + 1)


def _graph_names(g: onnx.GraphProto) -> Iterator[str]:
    for vi in (*g.input, *g.output, *g.value_info):
        yield vi.name
    for t in g.initializer:
        yield t.name
    for s in g.sparse_initializer:
        yield s.values.name
        yield s.indices.name
    for node in g.node:
        yield node.name
        yield from node.input
        yield from node.output


def model_names(model: onnx.ModelProto) -> Iterator[str]:
    """Every name ``model`` uses, in every scope and local function (duplicates and ``""`` included)."""
    for g in proto_scopes(model.graph):
        yield from _graph_names(g)
    for f in model.functions:
        yield from (*f.input, *f.output)
        for node in f.node:
            yield node.name
            yield from node.input
            yield from node.output
            for a in node.attribute:  # a function's If/Loop bodies
                for body in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    for g in proto_scopes(body):
                        yield from _graph_names(g)


class ProtoNames:
    """The names of a ``ModelProto`` (every scope) and the fresh names handed out for it (module docs)."""

    def __init__(self, model: onnx.ModelProto | Iterable[str]) -> None:
        names = model_names(model) if isinstance(model, onnx.ModelProto) else model
        self._names: set[str] = set()
        #: every ``p`` some name starts ``p/`` with: a namespace ``p/`` is free only when ``p`` is not here
        self._heads: set[str] = set()
        self._prefixes: set[str] = set()  # namespaces handed out (stems, without the separator)
        for name in names:
            self._add(name)

    def _add(self, name: str) -> None:
        self._names.add(name)
        self._heads.update(_heads(name))

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def _inside(self, name: str) -> bool:
        """Whether ``name`` lies in a namespace handed out (names under it belong to whoever asked for it)."""
        return any(h in self._prefixes for h in _heads(name))

    def fresh(self, base: str) -> str:
        """A name no node or tensor of the model has and not handed out before: ``base`` if free, else
        ``base_1``, ``base_2``, ... (O(1) per try). ``ValueError`` for a base inside a namespace `prefix` handed out:
        its owner names what is in it."""
        if self._inside(base):
            raise ValueError(f"{base!r} is inside a namespace handed out by ProtoNames.prefix: its owner names it")
        name = free_name(base, self._names.__contains__)
        self._add(name)
        return name

    def prefix(self, stem: str) -> str:
        """A free namespace ``"<stem>/"`` (``"<stem>_1/"``, ... when the model uses the first): no name of the model
        is the stem or starts with it, so every name built under it is fresh. Reserved for the caller."""
        free = free_name(stem, lambda p: p in self._names or p in self._heads or self._inside(p))
        self._prefixes.add(free)
        self._add(free)
        return free + SEP


def fresh_name(model: onnx.ModelProto, base: str) -> str:
    """One fresh name for ``model`` (`ProtoNames.fresh`); for several, build one `ProtoNames` and ask it."""
    return ProtoNames(model).fresh(base)
