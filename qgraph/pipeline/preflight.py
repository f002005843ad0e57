"""Recipe options that name things in the model, checked against the input model before the first pass runs.

A pass reads a graph output name in ``tune_ranges: {outputs: [...]}`` only when it starts, possibly minutes into a
run (after calibration). Options annotated with `qgraph.graph.names` markers (``GraphInputName``, ``GraphOutputName``,
``NodeName``) are found in every pass's config and checked here, once, against the pipeline's input model:

* graph inputs and outputs: an unknown name is an error (`qgraph.pipeline.recipe_yaml.RecipeValidationError`, a
  `RecipeError`, located at the field in the recipe file when the recipe came from one). No built-in pass renames
  or adds graph inputs or outputs (``specialize_inputs`` only removes inputs, which a later pass's own check
  still catches), so a name the input model lacks can never appear. A plug-in pass that adds some declares
  ``Pass.adds_graph_io = True``; names used by the passes after it are then only warned about.
* node names: a warning. ``fuse_batchnorm`` and ``fold_constants`` remove nodes, ``lower_opset`` and
  ``fuse_activations`` create nodes with new names, so a name the input model lacks may exist when the pass
  starts (and one it has may be gone); the pass's own check at its start decides, and says so.

Cost: one walk over the model's graphs to index its names (bodies included), one walk over each config; a close
match is looked for only for a name that is unknown.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args, get_origin

import onnx
from pydantic import BaseModel

from qgraph.errors import DataError
from qgraph.graph.names import ModelName, NameKind, suggest, unscoped
from qgraph.graph.naming import proto_node_names
from qgraph.pipeline.recipe_yaml import RecipeIssue, RecipeValidationError

if TYPE_CHECKING:
    from qgraph.pipeline.pass_api import Pass
    from qgraph.pipeline.target import CalibrationSpec

#: Names listed in a message before "... and N more".
LISTED = 20

OptionPath = tuple[int | str, ...]


@dataclass(frozen=True)
class NameRef:
    """One option value naming something in the model: where it is in the pass's config and what it names."""

    path: OptionPath
    kind: NameKind
    value: str
    #: The option as a recipe writes it, without list indexes and mapping keys (``auto.outputs``).
    field: str
    #: The value is a mapping's key (located at the key, not its value, in the recipe file).
    is_key: bool = False


@dataclass(frozen=True)
class NameIssue:
    """A name the input model lacks: which pass (its index in the recipe) and field, and the message."""

    pass_index: int
    pass_name: str
    ref: NameRef
    message: str
    #: An error (graph inputs and outputs); False: a warning (node names, or after a pass that adds graph I/O).
    fatal: bool


@dataclass(frozen=True)
class ModelNames:
    """The names a recipe may refer to in a model: graph inputs (initializers excluded), outputs and every node's
    name, bodies of If/Loop included."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: frozenset[str]

    @classmethod
    def of(cls, model: onnx.ModelProto) -> ModelNames:
        """Index ``model``'s names (one walk over its graphs)."""
        graph = model.graph
        initializers = {t.name for t in graph.initializer}
        return cls(
            inputs=tuple(v.name for v in graph.input if v.name not in initializers),
            outputs=tuple(v.name for v in graph.output),
            # the names the graph layer gives on load (unnamed/repeated nodes included: `qgraph.graph.naming`)
            nodes=frozenset(name for _, names in proto_node_names(graph)[0] for name in names),
        )


def name_refs(config: BaseModel, path: OptionPath = (), field: str = "") -> Iterator[NameRef]:
    """Every value in ``config`` (nested configs, tuples, lists, dict keys and values) whose annotation carries a
    `qgraph.graph.names.ModelName` marker, with its path as a recipe writes it (field aliases)."""
    for field_name, info in type(config).model_fields.items():
        key = info.alias or field_name
        yield from _walk(info.annotation, getattr(config, field_name), (*path, key), f"{field}.{key}".lstrip("."),
                         _kind(info.metadata))


def _kind(metadata: Sequence[Any]) -> NameKind | None:
    return next((m.kind for m in metadata if isinstance(m, ModelName)), None)


def _walk(annotation: Any, value: Any, path: OptionPath, field: str, kind: NameKind | None = None,
          is_key: bool = False) -> Iterator[NameRef]:
    if value is None:
        return
    if kind is not None and isinstance(value, str):
        yield NameRef(path, kind, value, field, is_key)
        return
    if isinstance(value, BaseModel):
        yield from name_refs(value, path, field)
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        yield from _walk(args[0], value, path, field, _kind(args[1:]), is_key)
    elif origin in (Union, types.UnionType):  # the first member that names something (Optional[X]: X)
        for arg in (a for a in args if a is not type(None)):
            found = list(_walk(arg, value, path, field))
            if found:
                yield from found
                return
    elif isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            yield from _walk(args[0], key, (*path, key), field, is_key=True)
            yield from _walk(args[1], item, (*path, key), field)
    elif isinstance(value, (tuple, list)) and args:
        for i, item in enumerate(value):
            element = args[0] if (origin is not tuple or args[-1] is Ellipsis) else args[i]
            yield from _walk(element, item, (*path, i), field)


def check_names(passes: Sequence[Pass[Any]], model: onnx.ModelProto) -> list[NameIssue]:
    """The option values of ``passes`` naming a graph input, output or node that ``model`` lacks (module doc)."""
    names: ModelNames | None = None
    issues: list[NameIssue] = []
    io_exact = True
    for index, p in enumerate(passes):
        config = getattr(p, "config", None)
        refs = list(name_refs(config)) if isinstance(config, BaseModel) else []
        if refs and names is None:
            names = ModelNames.of(model)
        for ref in refs:
            assert names is not None
            message = _unknown(p.name, ref, names)
            if message is not None:
                issues.append(NameIssue(index, p.name, ref, message, fatal=io_exact and ref.kind != "node"))
        io_exact = io_exact and not getattr(p, "adds_graph_io", False)
    return issues


def _unknown(pass_name: str, ref: NameRef, names: ModelNames) -> str | None:
    """What is wrong with ``ref`` in a model with ``names`` (None: the name exists)."""
    field = ref.field
    if ref.kind == "node":
        if ref.value in names.nodes or unscoped(ref.value) in names.nodes:
            return None
        hint = suggest(unscoped(ref.value), sorted(names.nodes))
        return (f"`{field}` names node {ref.value!r}, which the input model does not have.{hint} "
                f"(A warning: an earlier pass may create it; {pass_name} checks it when it starts. List the "
                "nodes with `qgraph inspect --json`.)")
    available = names.inputs if ref.kind == "input" else names.outputs
    if ref.value in available:
        return None
    hint = suggest(ref.value, available)
    listed = ", ".join(available[:LISTED]) + (f" ... and {len(available) - LISTED} more"
                                              if len(available) > LISTED else "")
    verb = "take" if ref.kind == "input" else "produce"
    return (f"`{field}` names graph {ref.kind} {ref.value!r}, which the input model does not {verb}.{hint} "
            f"Its {ref.kind}s: {listed or '(none)'}.")


#: ``(pass index, option path, at the key) -> (file, line, column)``: where a recipe wrote an option
#: (`qgraph.Recipe.field_location`).
Locate = Callable[[int, OptionPath, bool], tuple[str, int | None, int | None]]


def preflight(passes: Sequence[Pass[Any]], model: onnx.ModelProto, locate: Locate | None = None,
              source: str = "<pipeline>") -> list[RecipeIssue]:
    """Check ``passes``' option values naming graph inputs, outputs and nodes against ``model`` before any of them
    runs: raise `RecipeValidationError` (every unknown input and output, each located by ``locate`` in the recipe
    file, else in ``source``); return the warnings (unknown node names), located the same way."""
    issues = check_names(passes, model)
    located = [_located(issue, locate, source) for issue in issues]
    errors = [where for issue, where in zip(issues, located, strict=True) if issue.fatal]
    for index, p in enumerate(passes):  # option values the model's inputs cannot take (`Pass.option_issues`)
        for path, message in p.option_issues(model):
            file, line, col = locate(index, path, False) if locate else (source, None, None)
            errors.append(RecipeIssue(file, line, col, f"{_option_label(index, path)} ({p.name})", message))
    if errors:
        raise RecipeValidationError(errors)
    return located


def _option_label(index: int, path: OptionPath) -> str:
    """``passes[0].inputs.sr``: an option as the recipe nests it."""
    return f"passes[{index}]" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _located(issue: NameIssue, locate: Locate | None, source: str) -> RecipeIssue:
    path = _option_label(issue.pass_index, issue.ref.path)
    file, line, col = locate(issue.pass_index, issue.ref.path, issue.ref.is_key) if locate else (source, None, None)
    return RecipeIssue(file, line, col, f"{path} ({issue.pass_name})", issue.message)


def require_data(passes: Sequence[Pass[Any]], calibration: CalibrationSpec) -> None:
    """Without calibration data, raise `DataError` naming the first pass that cannot run without it
    (`Pass.missing_data`) and how to give it, before any pass runs (it failed after the passes before it)."""
    needs = [(i, p.name, why) for i, p in enumerate(passes) if (why := p.missing_data(calibration)) is not None]
    if needs:
        i, name, why = needs[0]
        more = f" ({len(needs) - 1} later pass(es) need it too)" if len(needs) > 1 else ""
        raise DataError(f"no calibration data given: passes[{i}] ({name}): {why}{more}")
