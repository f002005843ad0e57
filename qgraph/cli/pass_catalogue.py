"""The pass catalogue ``qgraph passes`` prints: each pass's summary, options (name, type, default, description)
and an example recipe entry, read from its config class."""

from __future__ import annotations

import enum
import json
import textwrap
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from qgraph.graph.names import ModelName
from qgraph.pipeline.pass_api import PassClass


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
        lines += [*wrap_text(" ".join(paragraph.split()), width, "  "), ""]
    lines.append("options:")
    for row in option_rows(cls.config_class):
        head = f"  {row.name}: {row.type}" + (f" = {row.default}" if row.default else "")
        lines += wrap_text(head, width, "", "      ")
        lines += wrap_text(row.description, width, "      ")
    lines += ["", "example:", "  passes:", f"    - pass: {cls.name}"]
    # A config whose defaults alone are not a valid entry (float_fallback needs nodes or auto) gives its own.
    own = getattr(cls.config_class, "recipe_example", None)
    example = ([f"{k}: {_yaml_flow(v)}" for k, v in own.items()] if isinstance(own, dict)
               else _example_lines(cls.config_class))
    for line in example:
        # Flow collections may continue on lines indented deeper than their key: still valid YAML.
        indent = "      " + " " * (len(line) - len(line.lstrip()))
        lines += wrap_text(line.strip(), width, indent, indent + "    ")
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


def wrap_text(text: str, width: int, indent: str, subsequent: str | None = None) -> list[str]:
    """``text`` wrapped to ``width`` columns, never breaking a word or a hyphenated name."""
    if not text:
        return []
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=subsequent or indent,
                         break_long_words=False, break_on_hyphens=False) or [indent]
