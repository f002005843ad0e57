"""Recipe commands: ``validate``, ``schema`` and ``passes`` (the pass catalogue, readable at 80 columns)."""

from __future__ import annotations

import enum
import json
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

import qgraph.cli._app as _app
from qgraph.cli._app import QGraphCommand, app, say
from qgraph.errors import RecipeError
from qgraph.graph.names import ModelName
from qgraph.io.outputs import check_output, write_atomic
from qgraph.pipeline.pass_api import PassClass, discover, get_pass


@app.command(cls=QGraphCommand)
def validate(recipes: Annotated[list[Path], typer.Argument(help="Recipe files to check.", metavar="RECIPE")]) -> None:
    """Validate recipes; print every problem with file:line:column and a suggestion (every file is checked)."""
    from qgraph.pipeline.recipe import Recipe
    from qgraph.pipeline.recipe_yaml import RecipeValidationError

    failed = 0
    for path in recipes:
        try:
            rec = Recipe.from_yaml(path)
        except RecipeValidationError as exc:
            failed += 1
            for issue in exc.issues:
                _app.out.print(str(issue), markup=False, highlight=False, soft_wrap=True)
            continue
        except RecipeError as exc:  # unreadable file: report it and go on with the others
            failed += 1
            _app.out.print(exc.message, markup=False, highlight=False, soft_wrap=True)
            continue
        _app.out.print(f"{path}: ok ({len(rec.passes)} passes: {', '.join(p.name for p in rec.passes)})",
                       markup=False, highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(2)


@app.command(cls=QGraphCommand)
def schema(
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write to a file.")] = None,
) -> None:
    """Print the JSON Schema of recipes (for yaml-language-server / editor completion)."""
    from qgraph.pipeline.recipe import recipe_json_schema

    text = json.dumps(recipe_json_schema(), indent=2) + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    write_atomic(check_output(output), text)
    say(f"wrote {output}")


@app.command("passes", cls=QGraphCommand)
def list_passes(
    name: Annotated[str | None, typer.Argument(help="Show one pass in full (options, types, example).")] = None,
) -> None:
    """List the available passes with their options; `qgraph passes NAME` shows one in full."""
    if name is not None:
        width = max(60, min(_app.out.width, 120))
        _app.out.print(describe_pass(get_pass(name), width), markup=False, highlight=False, soft_wrap=True)
        return
    width = max(60, min(_app.out.width, 120))
    blocks = []
    for pass_name, cls in discover().items():
        kind = "keeps float results" if cls.preserves_float else "changes float results"
        lines = [f"{pass_name}  ({kind})", *_wrap(cls.summary(), width, "  ")]
        for row in option_rows(cls.config_class, nested=False):
            lines += _wrap(f"{row.name} = {row.default}", width, "    ", "        ")
        blocks.append("\n".join(lines))
    _app.out.print("\n\n".join(blocks), markup=False, highlight=False, soft_wrap=True)
    _app.out.print(f"\n{len(blocks)} passes. `qgraph passes NAME` shows one with types, descriptions and an example.",
                   markup=False, highlight=False)


class OptionRow(BaseModel):
    """One option of a pass config as the catalogue shows it."""

    name: str
    type: str
    default: str
    description: str


def option_rows(config: type[BaseModel], *, nested: bool = True, prefix: str = "") -> list[OptionRow]:
    """Every option of ``config`` (nested option groups flattened as ``group.option`` when ``nested``)."""
    rows: list[OptionRow] = []
    for key, field in config.model_fields.items():
        name = prefix + (field.alias or key)
        group = _model_class(field.annotation)
        if group is not None and nested:
            rows.append(OptionRow(name=name, type="mapping", default="", description=field.description or ""))
            rows += option_rows(group, nested=True, prefix=name + ".")
            continue
        rows.append(OptionRow(name=name, type=type_name(field.annotation), default=_default_text(field),
                              description=field.description or ""))
    return rows


def describe_pass(cls: PassClass, width: int = 100) -> str:
    """The full catalogue entry of one pass: its help text, options with types and defaults, an example."""
    kind = "keeps float results (checked by --verify)" if cls.preserves_float else "changes float results"
    lines = [f"{cls.name}  ({kind})", ""]
    for paragraph in cls.help_text().split("\n\n"):
        lines += [*_wrap(" ".join(paragraph.split()), width, "  "), ""]
    lines.append("options:")
    for row in option_rows(cls.config_class):
        head = f"  {row.name}: {row.type}" + (f" = {row.default}" if row.default else "")
        lines += _wrap(head, width, "", "      ")
        lines += _wrap(row.description, width, "      ")
    lines += ["", "example:", "  passes:", f"    - pass: {cls.name}"]
    # A config whose defaults alone are not a valid entry (float_fallback needs nodes or auto) gives its own.
    own = getattr(cls.config_class, "recipe_example", None)
    example = ([f"{k}: {_yaml_flow(v)}" for k, v in own.items()] if isinstance(own, dict)
               else _example_lines(cls.config_class))
    for line in example:
        # Flow collections may continue on lines indented deeper than their key: still valid YAML.
        indent = "      " + " " * (len(line) - len(line.lstrip()))
        lines += _wrap(line.strip(), width, indent, indent + "    ")
    return "\n".join(lines)


def type_name(annotation: Any) -> str:
    """A readable type: ``int``, ``a | b``, ``list of str``, ``float | none``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a name of the model (`qgraph.graph.names`) says which; other metadata says nothing
        kind = next((m.kind for m in args[1:] if isinstance(m, ModelName)), None)
        return type_name(args[0]) if kind is None else "node name" if kind == "node" else f"graph {kind} name"
    if origin is typing.Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("none" if a is type(None) else type_name(a) for a in args)
    if origin in (tuple, list, set, frozenset):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(str(m.value) for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _model_class(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _default_value(field: FieldInfo) -> Any:
    if field.is_required():
        return None
    value = field.get_default(call_default_factory=True)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    return _yaml_flow(_default_value(field))


def _yaml_flow(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value) if (not value or any(c in value for c in ":#{}[],'\"")) else value
    return str(value)


def _example_lines(config: type[BaseModel], indent: str = "") -> list[str]:
    lines: list[str] = []
    for key, field in config.model_fields.items():
        name = field.alias or key
        group = _model_class(field.annotation)
        if group is not None:
            lines.append(f"{indent}{name}:")
            lines += _example_lines(group, indent + "  ")
        elif not field.is_required():
            lines.append(f"{indent}{name}: {_yaml_flow(_default_value(field))}")
        else:
            lines.append(f"{indent}{name}: ...  # required")
    return lines


def _wrap(text: str, width: int, indent: str, subsequent: str | None = None) -> list[str]:
    if not text:
        return []
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=subsequent or indent,
                         break_long_words=False, break_on_hyphens=False) or [indent]
