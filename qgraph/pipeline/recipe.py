"""Recipes: YAML files validated by Pydantic v2 into an ordered list of pass configs.

::

    name: cnn-int8
    description: Conv nets for x86 with VNNI
    target: {runtime: onnxruntime, opset: 17}
    calibration: {data: calib.npz, samples: 256}
    passes:
      - pass: fold_constants
      - pass: fuse_batchnorm
      - pass: insert_qdq
        preset: ort-x86-vnni

``passes`` is a discriminated union keyed by ``pass`` (the registered pass name), so a pass may appear twice
with different options. Every error names file:line:column and the field path, says what was expected and
suggests the closest valid key or pass name. Unknown keys are errors, never warnings.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic_core import ErrorDetails
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from qgraph.graph.names import suggest
from qgraph.options import PassConfig
from qgraph.pipeline.pass_api import Pass, PassClass, discover
from qgraph.pipeline.recipe_text import RecipeSpec
from qgraph.pipeline.recipe_yaml import RecipeIssue, RecipeValidationError, load_yaml, read_yaml_text
from qgraph.pipeline.target import CalibrationSpec, TargetSpec

if TYPE_CHECKING:
    from qgraph.pipeline.runner import Pipeline

RECIPE_FORMAT = 1


def _step_model(cls: PassClass) -> type[PassConfig]:
    """The recipe entry of pass ``cls``: its config plus ``pass: <name>``."""
    step: type[PassConfig] = create_model(
        f"{cls.config_class.__name__}Step",
        __base__=cls.config_class,
        __doc__=cls.summary() or cls.config_class.__doc__,
        pass_=(Literal[cls.name], Field(alias="pass", description=f"Pass name: {cls.name}")),  # type: ignore[arg-type]
    )
    return step


@lru_cache(maxsize=8)
def _recipe_model(names: tuple[str, ...]) -> type[BaseModel]:
    passes = discover()
    steps = tuple(_step_model(passes[n]) for n in names)
    step_union: Any = Annotated[Union[steps], Field(discriminator="pass_")]  # noqa: UP007
    model: type[BaseModel] = create_model(
        "Recipe",
        __config__=ConfigDict(extra="forbid", frozen=True),
        __doc__="A qgraph recipe: ordered graph transformation passes with their options.",
        name=(str, Field(description="Recipe name, recorded in the output model.")),
        description=(str, Field(default="", description="What the recipe is for.")),
        target=(TargetSpec, Field(default_factory=TargetSpec)),
        calibration=(CalibrationSpec, Field(default_factory=CalibrationSpec)),
        passes=(list[step_union], Field(min_length=1, description="Passes, run in order.")),
    )
    return model


def recipe_model() -> type[BaseModel]:
    """The Pydantic model of recipes for the passes registered now."""
    return _recipe_model(tuple(discover()))


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema of recipes (for yaml-language-server / editor completion)."""
    schema = recipe_model().model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "qgraph recipe"
    return schema


class Recipe(RecipeSpec):
    """A validated recipe: a `RecipeSpec` (name, passes, description, target, calibration) that knows the file it
    was read from, to locate each option's line for error messages."""

    def __init__(
        self,
        name: str,
        passes: list[Pass[Any]],
        *,
        description: str = "",
        target: TargetSpec | None = None,
        calibration: CalibrationSpec | None = None,
        source: str | None = None,
        origins: list[tuple[str, Any]] | None = None,
    ) -> None:
        super().__init__(name, passes, description=description, target=target, calibration=calibration)
        self.source = source
        #: Per pass: the file it was written in and its (ruamel-annotated) mapping, to locate its fields.
        self._origins = list(origins or [])

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        """Load and validate a recipe file."""
        return cls.from_text(read_yaml_text(path, "recipe"), str(path))

    @classmethod
    def from_text(cls, text: str, filename: str = "<recipe>") -> Recipe:
        """Validate recipe YAML ``text``; errors are located in ``filename``."""
        data = load_yaml(text, filename)
        if data is None:
            raise RecipeValidationError(
                [RecipeIssue(filename, 1, 1, "", "the recipe is empty; expected a mapping with `name` and `passes`.")]
            )
        if not isinstance(data, dict):
            kind = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
            raise RecipeValidationError(
                [RecipeIssue(filename, 1, 1, "", f"the recipe is {kind}; expected a mapping with `name` and `passes`.")]
            )
        return cls.from_dict(data, filename)

    @classmethod
    def from_dict(cls, data: dict[str, Any], filename: str = "<recipe>") -> Recipe:
        """Validate a recipe given as a (possibly ruamel-annotated) mapping."""
        model = recipe_model()
        plain = _plain(data)
        try:
            spec = model.model_validate(plain)
        except ValidationError as exc:
            issues = [_issue(err, data, filename, model) for err in exc.errors()]
            raise RecipeValidationError(issues) from None
        passes = discover()
        instances: list[Pass[Any]] = []
        for step, raw in zip(spec.passes, plain["passes"], strict=True):  # type: ignore[attr-defined]
            # Built from what the user wrote (not the validated step), so configs know which options were set.
            options = {k: v for k, v in raw.items() if k != "pass"}
            instances.append(passes[step.pass_](passes[step.pass_].config_class(**options)))
        return cls(
            spec.name,  # type: ignore[attr-defined]
            instances,
            description=spec.description,  # type: ignore[attr-defined]
            target=spec.target,  # type: ignore[attr-defined]
            calibration=spec.calibration,  # type: ignore[attr-defined]
            source=filename,
            origins=[(filename, step) for step in data["passes"]],
        )

    def apply_patch(self, patch: str | Path) -> Recipe:
        """This recipe with the passes of a patch file (YAML with a ``passes:`` list, ``name`` optional) appended;
        target and calibration stay this recipe's."""
        filename = str(patch)
        data = load_yaml(read_yaml_text(patch, "patch"), filename)
        if not isinstance(data, dict) or "passes" not in data:
            raise RecipeValidationError([RecipeIssue(filename, 1, 1, "", "a patch is a mapping with a `passes:` list "
                                                     "(e.g. written by `qgraph sensitivity --patch`).")])
        if "name" not in data:
            data["name"] = "patch"
        patch_recipe = Recipe.from_dict(data, filename)
        return Recipe(self.name, [*self.passes, *patch_recipe.passes], description=self.description,
                      target=self.target, calibration=self.calibration, source=self.source,
                      origins=[*self._origins, *patch_recipe._origins])

    def field_location(self, index: int, path: Sequence[int | str], key: bool = False
                       ) -> tuple[str, int | None, int | None]:
        """File, line and column (1-based) where option ``path`` of pass ``index`` is written (at the mapping key
        with ``key``); line and column None for a recipe built in Python."""
        if not 0 <= index < len(self._origins):
            return self.source or "<recipe>", None, None
        filename, step = self._origins[index]
        line, col = _position(step, list(path), want_key=key)
        return filename, line, col

    # ---------------------------------------------------------------- output
    def pipeline(self) -> Pipeline:
        """A `Pipeline` running this recipe's passes in order."""
        from qgraph.pipeline.runner import Pipeline

        return Pipeline(self.passes, name=self.name, recipe=self)


# ------------------------------------------------------------------------- error locating
def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, str) else k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _strip_tags(loc: tuple[int | str, ...], data: Any) -> tuple[list[int | str], str | None]:
    """Remove discriminator tags pydantic inserts after list indexes of ``passes``."""
    out: list[int | str] = []
    pass_name: str | None = None
    node = data
    i = 0
    while i < len(loc):
        part = loc[i]
        out.append(part)
        node = node[part] if _has(node, part) else None
        if (
            len(out) == 2
            and out[0] == "passes"
            and isinstance(part, int)
            and i + 1 < len(loc)
            and isinstance(node, dict)
            and loc[i + 1] == node.get("pass")
        ):
            pass_name = str(loc[i + 1])
            i += 1
        i += 1
    return out, pass_name


def _has(node: Any, key: int | str) -> bool:
    if isinstance(node, dict):
        return key in node
    if isinstance(node, list) and isinstance(key, int):
        return 0 <= key < len(node)
    return False


def _position(data: Any, path: list[int | str], want_key: bool) -> tuple[int | None, int | None]:
    """1-based line/column of ``path`` in ruamel-annotated ``data`` (the deepest existing prefix)."""
    node = data
    line: int | None = None
    col: int | None = None
    if hasattr(data, "lc"):
        line, col = data.lc.line + 1, data.lc.col + 1
    for depth, part in enumerate(path):
        last = depth == len(path) - 1
        if isinstance(node, CommentedMap) and part in node:
            lc_pos = node.lc.key(part) if (want_key and last) else node.lc.value(part)
            line, col = lc_pos[0] + 1, lc_pos[1] + 1
            node = node[part]
        elif isinstance(node, CommentedSeq) and isinstance(part, int) and 0 <= part < len(node):
            pos = node.lc.item(part)
            line, col = pos[0] + 1, pos[1] + 1
            node = node[part]
        else:
            break
    return line, col


def _fmt_path(path: list[int | str]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_of(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_at(root: type[BaseModel], path: list[int | str], pass_name: str | None) -> type[BaseModel] | None:
    """The pydantic model describing the mapping at ``path`` (for key suggestions)."""
    model: type[BaseModel] | None = root
    rest = list(path)
    if len(rest) >= 2 and rest[0] == "passes" and isinstance(rest[1], int):
        if pass_name is None:
            return None
        model = discover()[pass_name].config_class
        rest = rest[2:]
    for part in rest:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        if field is None:
            return None
        model = _nested_model(field.annotation)
    return model


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _nested_model(arg)
        if found is not None:
            return found
    return None




def _issue(err: ErrorDetails, data: Any, filename: str, root: type[BaseModel]) -> RecipeIssue:
    path, pass_name = _strip_tags(tuple(err["loc"]), data)
    kind = err["type"]
    ctx = err.get("ctx", {}) or {}
    where = _fmt_path(path)
    if pass_name:
        where += f" ({pass_name})"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        names = list(discover())
        if kind == "union_tag_not_found":
            line, col = _position(data, path, want_key=False)
            msg = f"missing `pass: <name>`; expected one of: {', '.join(names)}."
            return RecipeIssue(filename, line, col, where, msg)
        tag = str(ctx.get("tag", ""))
        line, col = _position(data, [*path, "pass"], want_key=False)
        msg = f"unknown pass {tag!r}.{suggest(tag, names)} Known passes: {', '.join(names)}."
        return RecipeIssue(filename, line, col, _fmt_path([*path, "pass"]), msg)
    if kind == "extra_forbidden":
        key = str(path[-1])
        parent = _model_at(root, path[:-1], pass_name)
        options = [o for o in _fields_of(parent) if o != "pass"] if parent else []
        line, col = _position(data, path, want_key=True)
        what = "option" if pass_name else "key"
        msg = f"unknown {what} {key!r}.{suggest(key, options)}"
        if options:
            msg += f" Valid {what}s: {', '.join(options)}."
        return RecipeIssue(filename, line, col, where, msg)
    if kind == "missing":
        line, col = _position(data, path[:-1], want_key=False)
        return RecipeIssue(filename, line, col, where, f"missing required field {path[-1]!r}.")
    line, col = _position(data, path, want_key=False)
    got = err.get("input")
    if kind == "value_error":  # our own validators: the message says what is wrong and how to fix it
        msg = str(err["msg"]).removeprefix("Value error, ")
        shown_msg = msg if isinstance(got, (dict, list)) else f"{msg} (got {got!r})."
        return RecipeIssue(filename, line, col, where, shown_msg)
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return RecipeIssue(filename, line, col, where, f"{err['msg']} (got {shown}).")
