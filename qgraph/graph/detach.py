"""Weights owned by the graph, not by the ModelProto it was imported from; exports that stream them.

graphsurgeon imports an initializer as a ``LazyValues`` pointing into the ModelProto. Python protobuf (upb) frees a
message's memory only when nothing refers to any part of it, so one such pointer keeps the whole protobuf (every
weight) alive, and reading ``.values`` adds a numpy copy beside it: two copies of the weights for the whole run.

`detach_constants` breaks that link once, at import: a large initializer in plain ``raw_data`` form becomes a numpy
array (read-only; the form graphsurgeon exports byte for byte as it was read: name, dims, data_type, raw_data and the
data_location it had), every other tensor is copied into a protobuf of its own (small: anything not in
``raw_data`` form). After it the source ModelProto can be freed, leaving one copy of the weights: the numpy arrays.

`weightless` swaps large constants for empty placeholders around an export (shape inference, the opset converter,
calibration sessions never need their bytes): the export is then O(nodes) in memory, and `fill_weights` writes the
values into the exported protobuf one tensor at a time.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from .ops import graph_scopes

#: Element types whose ``raw_data`` is exactly the little-endian numpy buffer (``numpy_helper.to_array`` agrees).
_PLAIN: dict[int, np.dtype] = {
    t: np.dtype(d)
    for t, d in (
        (onnx.TensorProto.FLOAT, "<f4"), (onnx.TensorProto.DOUBLE, "<f8"), (onnx.TensorProto.FLOAT16, "<f2"),
        (onnx.TensorProto.INT8, "i1"), (onnx.TensorProto.UINT8, "u1"), (onnx.TensorProto.INT16, "<i2"),
        (onnx.TensorProto.UINT16, "<u2"), (onnx.TensorProto.INT32, "<i4"), (onnx.TensorProto.UINT32, "<u4"),
        (onnx.TensorProto.INT64, "<i8"), (onnx.TensorProto.UINT64, "<u8"), (onnx.TensorProto.BOOL, "?"),
    )
}
#: Tensors at least this large (bytes) become numpy arrays at import and placeholders in weightless exports.
DETACH_BYTES = 4096
#: ``external_data`` location of a placeholder: reading its data fails loudly instead of reading zeros.
PLACEHOLDER = "qgraph-weightless-placeholder"


def constants(root: gs.Graph, attributes: bool = True) -> Iterator[gs.Constant]:
    """Every distinct constant of every scope: initializers and (with ``attributes``) tensor attributes."""
    seen: set[int] = set()
    for g in graph_scopes(root):
        for node in g.nodes:
            for t in (*node.inputs, *node.outputs, *(node.attrs.values() if attributes else ())):
                if isinstance(t, gs.Constant) and id(t) not in seen:
                    seen.add(id(t))
                    yield t


def constant_bytes(c: gs.Constant) -> int:
    """Bytes of a constant's values without loading them (a lazy initializer's from its dims; 0 when unknown)."""
    values = c._values
    return int(values.nbytes) if isinstance(values, np.ndarray) else _lazy_bytes(c)


def _materializable(t: onnx.TensorProto) -> bool:
    return (t.data_type in _PLAIN and t.HasField("raw_data") and not t.doc_string and not t.external_data
            and not t.HasField("segment") and not t.metadata_props and not t.string_data)


def _nbytes(t: onnx.TensorProto) -> int:
    return int(np.prod(t.dims, dtype=np.int64)) * _PLAIN[t.data_type].itemsize


def _lazy_bytes(c: gs.Constant) -> int:
    lazy = c._values
    if isinstance(lazy, LazyValues) and not isinstance(lazy, SparseValues) and lazy.tensor.data_type in _PLAIN:
        return _nbytes(lazy.tensor)
    return 0


def _array(t: onnx.TensorProto) -> np.ndarray:
    """A read-only array over a plain tensor's ``raw_data``: protobuf hands ``raw_data`` out as a new bytes object
    (a copy: read it once), and the array is a view of that object, not a second copy of it (which put the largest
    tensor three times in memory during the import). Passes replace weights, they never write into them."""
    raw = t.raw_data
    dtype = _PLAIN[t.data_type]
    need = _nbytes(t)
    if len(raw) != need:
        raise ValueError(f"tensor {t.name!r}: raw_data holds {len(raw)} bytes, its dims need {need}")
    return np.frombuffer(raw, dtype).reshape(tuple(t.dims))


def detach_constants(root: gs.Graph, min_bytes: int = DETACH_BYTES) -> None:
    """Make every constant of ``root`` independent of the ModelProto it was imported from (module docstring).

    Largest first: each copy briefly needs the tensor's bytes twice (protobuf hands ``raw_data`` out as a copy),
    and that is cheapest while few arrays exist yet."""
    for c in sorted(constants(root), key=_lazy_bytes, reverse=True):
        lazy = c._values
        if not isinstance(lazy, LazyValues):
            continue
        proto = lazy.tensor
        if isinstance(lazy, SparseValues):
            own = onnx.SparseTensorProto()
            own.CopyFrom(proto)
            c._values = SparseValues(own)
            continue
        if _materializable(proto) and _nbytes(proto) >= min_bytes:
            c._values = _array(proto)
            continue
        own_t = onnx.TensorProto()
        own_t.CopyFrom(proto)
        c._values = LazyValues(own_t)


def placeholder_proto(name: str, data_type: int, dims: Iterable[int]) -> onnx.TensorProto:
    """A data-less initializer: typed and shaped, ``data_location`` EXTERNAL at `PLACEHOLDER` (reading its data
    fails loudly); a session is given its value separately."""
    t = onnx.TensorProto(name=name, data_type=data_type)
    t.dims.extend(dims)
    t.data_location = onnx.TensorProto.EXTERNAL
    t.external_data.add(key="location", value=PLACEHOLDER)
    return t


def _placeholder(c: gs.Constant) -> LazyValues:
    arr = c._values
    return LazyValues(placeholder_proto(c.name, onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape))


#: What `weightless` set aside: tensor name -> (values, the data_location graphsurgeon would have written).
Held = dict[str, tuple[np.ndarray, "int | None"]]


@contextmanager
def weightless(root: gs.Graph, min_bytes: int = DETACH_BYTES) -> Iterator[Held]:
    """Inside the block, every numpy constant of at least ``min_bytes`` exports as a data-less placeholder (typed,
    shaped, ``data_location`` EXTERNAL at `PLACEHOLDER`); yields their values by name for `fill_weights`."""
    swapped: list[tuple[gs.Constant, np.ndarray]] = []
    held: Held = {}
    try:
        for c in constants(root, attributes=False):  # placeholders only where `placeholders_as_inputs` can move them
            arr = c._values
            if (isinstance(arr, np.ndarray) and arr.nbytes >= min_bytes and arr.dtype in _PLAIN.values()
                    and c._export_dtype is None and c.name not in held):
                swapped.append((c, arr))
                c._values = _placeholder(c)
                held[c.name] = (arr, c.data_location)
        yield held
    finally:
        for c, arr in swapped:
            c._values = arr


def is_placeholder(t: onnx.TensorProto) -> bool:
    """Whether ``t`` is a `weightless` placeholder."""
    return t.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == PLACEHOLDER for e in t.external_data)


def fill_weights(model: onnx.ModelProto, held: Held, consume: bool = False) -> None:
    """Write ``held`` into the placeholders of ``model`` (every scope), one tensor at a time, as graphsurgeon's
    exporter would have written them (name, dims, data_type, raw_data, and ``data_location`` when it had one).
    ``consume`` drops each entry of ``held`` after its last use, so an array whose only other owner is gone is
    freed as soon as it is written (the protobuf then grows while the arrays shrink)."""
    from .ops import proto_scopes

    targets = [t for g in proto_scopes(model.graph) for t in _placeholders(g)]
    uses = collections.Counter(t.name for t in targets)
    for t in targets:
        arr, location = held[t.name]
        t.ClearField("external_data")
        t.ClearField("data_location")
        t.raw_data = _raw(arr)
        if location is not None:
            t.data_location = location  # type: ignore[assignment]  # the enum is an int
        del arr
        uses[t.name] -= 1
        if consume and not uses[t.name]:
            del held[t.name]


def _raw(arr: np.ndarray) -> bytes:
    """``arr.tobytes()``, without the copy when ``arr`` is an imported weight (a view of its ``raw_data`` bytes)."""
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    if (isinstance(base, bytes) and len(base) == arr.nbytes and arr.flags.c_contiguous and arr.dtype.byteorder != ">"
            and arr.ctypes.data == np.frombuffer(base, np.uint8).ctypes.data):
        return base
    return arr.tobytes()


def _placeholders(g: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    for t in g.initializer:
        if is_placeholder(t):
            yield t
    for node in g.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and is_placeholder(attr.t):
                yield attr.t


def attach_weights(root: gs.Graph, held: Held) -> None:
    """Put the values of ``held`` back into the placeholders of a graph imported from a `weightless` export (after
    a rewrite of the protobuf: opset conversion); raises `ModelError` for a placeholder with no value."""
    from qgraph.errors import ModelError

    for c in constants(root):
        lazy = c._values
        if isinstance(lazy, LazyValues) and is_placeholder(lazy.tensor):
            if c.name not in held:
                raise ModelError(f"tensor {c.name!r} lost its weights in a protobuf rewrite (its placeholder was "
                                 "renamed): this is a bug in the pass that rewrote the model, please report it.")
            c._values, c.data_location = held[c.name]


def placeholders_as_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a `weightless` export the ONNX checker accepts: each placeholder initializer becomes a typed graph
    input of the same shape (cheap: the export holds no weights)."""
    from .ops import proto_scopes

    out = onnx.ModelProto()
    out.CopyFrom(model)
    for g in proto_scopes(out.graph):
        kept = [t for t in g.initializer if not is_placeholder(t)]
        if len(kept) == len(g.initializer):
            continue
        inputs = {i.name for i in g.input}
        for t in g.initializer:
            if is_placeholder(t) and t.name not in inputs:
                g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        del g.initializer[:]
        g.initializer.extend(kept)
    return out


def fill_nested(model: onnx.ModelProto,
                weights: Mapping[str, np.ndarray]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """For a session on a `weightless` export: onnxruntime's ``add_external_initializers`` reaches only the top
    graph's initializers, so the placeholders inside ``If``/``Loop`` bodies get their values written into a copy
    (only those tensors are copied). Returns the model to load (``model`` itself when no body holds one) and the
    weights left to feed (the top graph's placeholders)."""
    from .ops import proto_scopes

    nested = {t.name for g in proto_scopes(model.graph)[1:] for t in _placeholders(g)}
    if not nested & set(weights):
        top = {t.name for t in model.graph.initializer if is_placeholder(t)}
        return model, {name: value for name, value in weights.items() if name in top}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for g in proto_scopes(out.graph)[1:]:
        for t in list(_placeholders(g)):
            if t.name in weights:
                t.CopyFrom(onnx.numpy_helper.from_array(np.asarray(weights[t.name]), t.name))
    top = {t.name for t in out.graph.initializer if is_placeholder(t)}
    return out, {name: value for name, value in weights.items() if name in top}


def with_weights(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of a `weightless` export with ``weights`` written into its placeholders (for code that needs one
    self-contained protobuf)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    fill_weights(out, {name: (value, None) for name, value in weights.items()})
    return out


def split_weights(
    model: onnx.ModelProto, min_bytes: int = DETACH_BYTES
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A `weightless` copy of ``model`` (top-level initializers of at least ``min_bytes`` in plain ``raw_data`` form
    become placeholders) and those initializers' values as numpy arrays; ``model`` is not modified, and its
    weights are copied once (into the arrays), never into a second protobuf."""
    out = onnx.ModelProto()
    _copy_fields(model, out, skip="graph")
    _copy_fields(model.graph, out.graph, skip="initializer")
    weights: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if _materializable(t) and _nbytes(t) >= min_bytes and t.name not in weights:
            weights[t.name] = _array(t)
            out.graph.initializer.append(placeholder_proto(t.name, t.data_type, t.dims))
        else:
            out.graph.initializer.append(t)
    return out, weights


def _copy_fields(src: onnx.ModelProto | onnx.GraphProto, dst: onnx.ModelProto | onnx.GraphProto, skip: str) -> None:
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)
