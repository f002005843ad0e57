"""Field annotations that say "this option names something in the model", checked before the first pass runs.

A pass config declares what its string options refer to::

    from qgraph.graph.names import GraphInputName, GraphOutputName

    class MyConfig(PassConfig):
        outputs: tuple[GraphOutputName, ...] = Field(default=(), description="Score only these graph outputs.")
        state: dict[GraphInputName, GraphOutputName] = Field(default_factory=dict, description="Input <- output.")

The pipeline finds every such value in every pass's config (nested configs, lists, dict keys and values) and
checks it against the input model before any pass runs (`qgraph.pipeline.preflight`): a typo in a graph input or output
name is a `RecipeError` located in the recipe file, not a failure minutes into a run. The annotation changes
nothing else: the value validates and serializes as the plain ``str`` it is.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

NameKind = Literal["input", "output", "node"]


@dataclass(frozen=True)
class ModelName:
    """Marker in ``Annotated[str, ModelName(kind)]``: the string names a graph input, a graph output or a node."""

    kind: NameKind


#: A graph input of the model (not an initializer). No pass adds graph inputs, so it is checked exactly.
GraphInputName = Annotated[str, ModelName("input")]
#: A graph output of the model. No pass renames or adds graph outputs, so it is checked exactly.
GraphOutputName = Annotated[str, ModelName("output")]
#: A node name (a body node in its own or its scoped form ``If_0.then_branch/<node>``). Passes remove, rename and
#: create nodes, so an unknown one is a warning before the run, never an error (the pass's own check decides).
NodeName = Annotated[str, ModelName("node")]

_SCOPE = re.compile(r"^[^/]*\.(then_branch|else_branch|body)/")


def unscoped(name: str) -> str:
    """A body node's own name from the scoped form insert_qdq, inspect and diff print
    (``If_0.then_branch/<node>``, nested scopes too); other names unchanged."""
    while _SCOPE.match(name):
        name = _SCOPE.sub("", name, count=1)
    return name


def suggest(word: str, options: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the option equal to ``word`` but for case, else the closest one (difflib ratio
    >= 0.6), or ``""``."""
    listed = list(options)
    same = [o for o in listed if o.lower() == word.lower()]
    close = same or difflib.get_close_matches(word, listed, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
