"""Schema look-ups for the opset engine: op versions, type strings and target validity checks.

Everything here is derived from ``onnx.defs`` once and cached, so the engine's cost per node is constant.
"""

from __future__ import annotations

from functools import cache, lru_cache

import onnx
from onnx import defs


@cache
def op_versions(op: str, domain: str = "") -> tuple[int, ...]:
    """All ``since_version`` values of ``op`` in ascending order (empty when the op is unknown)."""
    out: set[int] = set()
    for s in _all_schemas():
        if s.name == op and s.domain == domain:
            out.add(s.since_version)
    return tuple(sorted(out))


@lru_cache(maxsize=1)
def _all_schemas() -> tuple[defs.OpSchema, ...]:
    return tuple(s for s in defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx.ml"))


@cache
def version_at(op: str, opset: int, domain: str = "") -> int | None:
    """The schema version of ``op`` that opset ``opset`` uses, or None when the op does not exist there."""
    best = None
    for v in op_versions(op, domain):
        if v <= opset:
            best = v
    return best


@cache
def schema(op: str, version: int, domain: str = "") -> defs.OpSchema:
    """The schema of ``op`` exactly at ``version`` (a since_version)."""
    return defs.get_schema(op, version, domain)


def previous_version(op: str, version: int) -> int | None:
    """The since_version just before ``version`` (None when ``version`` is the first)."""
    prev = None
    for v in op_versions(op):
        if v < version:
            prev = v
    return prev


def type_str(tp: onnx.TypeProto) -> str | None:
    """Schema-style type string of a TypeProto: ``tensor(float)``, ``seq(tensor(int64))``, ...; None if unset."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        if tp.tensor_type.elem_type == 0:
            return None
        return f"tensor({onnx.TensorProto.DataType.Name(tp.tensor_type.elem_type).lower()})"
    if kind == "sparse_tensor_type":
        if tp.sparse_tensor_type.elem_type == 0:
            return None
        return f"sparse_tensor({onnx.TensorProto.DataType.Name(tp.sparse_tensor_type.elem_type).lower()})"
    if kind == "sequence_type":
        inner = type_str(tp.sequence_type.elem_type)
        return None if inner is None else f"seq({inner})"
    if kind == "optional_type":
        inner = type_str(tp.optional_type.elem_type)
        return None if inner is None else f"optional({inner})"
    if kind == "map_type":
        inner = type_str(tp.map_type.value_type)
        key = onnx.TensorProto.DataType.Name(tp.map_type.key_type).lower()
        return None if inner is None else f"map({key}, {inner})"
    return None


def formal_index(params: list[defs.OpSchema.FormalParameter], i: int) -> int | None:
    """Index of the formal parameter that actual position ``i`` binds to (variadic last params absorb)."""
    if i < len(params):
        return i
    if params and params[-1].option == defs.OpSchema.FormalParameterOption.Variadic:
        return len(params) - 1
    return None


def max_inputs(s: defs.OpSchema) -> int:
    """How many inputs ``s`` accepts (large for variadic)."""
    return s.max_input


def max_outputs(s: defs.OpSchema) -> int:
    """How many outputs ``s`` accepts."""
    return s.max_output


def allowed_types(s: defs.OpSchema, param: defs.OpSchema.FormalParameter) -> frozenset[str]:
    """Type strings a formal parameter accepts in schema ``s``."""
    return _constraints(s).get(param.type_str, frozenset([param.type_str]))


@cache
def _constraints_key(op: str, version: int, domain: str) -> dict[str, frozenset[str]]:
    s = schema(op, version, domain)
    return {t.type_param_str: frozenset(t.allowed_type_strs) for t in s.type_constraints}


def _constraints(s: defs.OpSchema) -> dict[str, frozenset[str]]:
    return _constraints_key(s.name, s.since_version, s.domain)


def attr_default(s: defs.OpSchema, name: str) -> object | None:
    """Python value of the schema default of attribute ``name`` (None when absent or no default)."""
    a = s.attributes.get(name)
    if a is None:
        return None
    d = a.default_value
    if d is None or d.type == 0:
        return None
    value: object = onnx.helper.get_attribute_value(d)
    return value


def has_function(s: defs.OpSchema) -> bool:
    """Whether the schema carries a (context-dependent or plain) function body."""
    return bool(getattr(s, "has_function", False) or getattr(s, "has_context_dependent_function", False))
