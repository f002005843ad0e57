"""Loading and saving ONNX models: external data, sane IR versions, atomic writes, fingerprints.

Rules enforced here so no pass has to think about them:
- the input file is only ever read;
- outputs are written to a temporary folder beside the target and renamed into place (an interrupted run leaves
  no partial file), with external data beside the model when it is too large for one protobuf (2 GB);
- the IR version written is one the target runtime loads (onnxruntime 1.31 loads IR <= 13; onnx 1.23's
  ``make_model`` writes 14).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from qgraph.errors import ModelError, WriteError
from qgraph.graph.checks import check_unique_names
from qgraph.graph.naming import named_nodes
from qgraph.io.inputs import input_file_problem
from qgraph.io.outputs import temporary_file, write_atomic
from qgraph.io.proto_stream import read_header, serialized_size, tensor_size, write_streamed

__all__ = ["external_data_files", "file_fingerprint", "load_model", "model_fingerprint", "read_header", "save_model",
           "serialized_size", "tensor_size", "write_streamed"]

#: Protobuf's hard limit; beyond it tensors must live in external data.
PROTOBUF_LIMIT = 2**31 - 1
#: Tensors at least this large go to external data when a model is saved with external data.
EXTERNAL_DATA_THRESHOLD = 1024


def load_model(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Load an ONNX model with its external data, raising `ModelError` with a fix for every failure mode."""
    p = Path(path)
    problem = input_file_problem(p)
    if problem is not None:
        raise ModelError(f"model {p}: {problem}.")
    if not p.exists():
        raise ModelError(f"model file not found: {p}. Check the path (relative paths start at {Path.cwd()}).")
    if p.is_dir():
        raise ModelError(f"{p} is a directory, not an .onnx file.")
    if p.suffix.lower() in (".yaml", ".yml"):  # a recipe where a model goes: the arguments swapped
        raise ModelError(f"{p} is a recipe (YAML), not an ONNX model. Give the .onnx file here; commands take "
                         "the recipe before the model: `qgraph run RECIPE.yaml MODEL.onnx -o OUT`.")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelError(
            f"{p} is not a readable ONNX model ({type(exc).__name__}: {exc}). The file is truncated, corrupt "
            "or not ONNX: re-export it or check the download."
        ) from exc
    if not model.graph.node and not model.graph.output:
        raise ModelError(f"{p} parsed as an empty ONNX model (no nodes, no outputs): it is probably not ONNX.")
    if not model.opset_import:
        raise ModelError(f"{p} declares no opset_import: it is not a valid ONNX model.")
    check_unique_names(model)
    _check_external_locations(model, p)
    try:
        # External data paths are relative to the model's folder, never the current directory.
        onnx.load_external_data_for_model(model, str(p.parent))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"{p}: cannot read its external data ({exc}). Keep the .data file(s) beside the model."
        ) from exc
    _check_tensor_data(model, p)
    return model


#: The typed value fields of a TensorProto (besides ``raw_data``).
_VALUE_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")


def _check_tensor_data(model: onnx.ModelProto, path: Path) -> None:
    """`ModelError` for a tensor whose dims say it holds values but that stores none (every reader would fail on
    it deep inside, reshaping nothing into its shape). Reads no tensor's bytes (``HasField`` and field lengths)."""
    for t in _all_tensors(model):
        if t.HasField("raw_data") or any(len(getattr(t, f)) for f in _VALUE_FIELDS):
            continue
        count = int(np.prod([int(d) for d in t.dims])) if len(t.dims) else 1
        if count:
            raise ModelError(f"{path}: tensor {t.name!r} declares dims {list(t.dims)} ({count} value(s)) but holds "
                             "no data: the file is truncated or was written without its weights. Re-export it.")


def _external_entries(model: onnx.ModelProto) -> list[tuple[onnx.TensorProto, str]]:
    out = []
    for t in _all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in t.external_data if e.key == "location"), "")
            out.append((t, location))
    return out


def _check_external_locations(model: onnx.ModelProto, path: Path) -> None:
    """Every external-data file must be a regular file inside the model's folder (no ``..``, absolute paths or
    symlinks leading out): a model file must not make qgraph read arbitrary files."""
    folder = path.parent.resolve()
    for tensor, location in _external_entries(model):
        where = f"{path}: tensor {tensor.name!r} stores its data in {location!r}"
        if not location:
            raise ModelError(f"{where}: the location is empty. Re-save the model with its external data.")
        if Path(location).is_absolute() or location.startswith(("/", "\\")):
            raise ModelError(f"{where}: an absolute path. External data must sit in the model's folder; re-save "
                             "the model (onnx.save_model(..., location='model.onnx.data')).")
        target = (path.parent / location).resolve()
        if folder not in target.parents:
            raise ModelError(f"{where}: outside the model's folder {folder} (through '..' or a symlink). Move the "
                             "file beside the model and re-save it with a relative location.")
        if not target.exists():
            raise ModelError(f"{where}: that file does not exist beside the model. Copy the .data file next to "
                             f"{path.name}.")
        if not target.is_file():
            raise ModelError(f"{where}: that is not a regular file.")


def external_data_files(path: str | os.PathLike[str]) -> list[str]:
    """The external-data locations a model file references (read without loading the data)."""
    model = onnx.load(str(path), load_external_data=False)
    return sorted({location for _, location in _external_entries(model)})


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 of a model file plus every external data file it references (hex)."""
    p = Path(path)
    h = hashlib.sha256()
    h.update(p.read_bytes())
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception:
        return h.hexdigest()
    locations = sorted(
        {
            entry.value
            for t in _all_tensors(model)
            if t.data_location == onnx.TensorProto.EXTERNAL
            for entry in t.external_data
            if entry.key == "location"
        }
    )
    for loc in locations:
        data_path = p.parent / loc
        if data_path.exists():
            with data_path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
    return h.hexdigest()


def model_fingerprint(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> str:
    """sha256 of the graph's content (nodes, initializers, I/O, opsets), independent of metadata; nodes as qgraph
    names them (`qgraph.graph.naming`), so a model and qgraph's export of it (unnamed nodes named) hash the same.

    Streams piece by piece, so it works for models over the 2 GB protobuf limit. ``weights`` gives the values of
    a weightless model's top-level placeholders (`qgraph.graph.detach`): the hash is the filled model's.
    """
    h = hashlib.sha256()
    g = model.graph
    for part in (*g.input, *g.output, *named_nodes(g), *g.sparse_initializer):
        h.update(part.SerializeToString(deterministic=True))
    for t in g.initializer:
        h.update(f"{t.name}:{t.data_type}:{list(t.dims)};".encode())
        if weights is not None and t.name in weights and t.data_location == onnx.TensorProto.EXTERNAL:
            h.update(np.ascontiguousarray(weights[t.name]).data)  # = raw_data once filled
        elif t.HasField("raw_data"):
            h.update(t.raw_data)
        else:
            h.update(t.SerializeToString(deterministic=True))
    for o in model.opset_import:
        h.update(f"{o.domain}:{o.version};".encode())
    return h.hexdigest()


def _all_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    from onnx.external_data_helper import _get_all_tensors

    return list(_get_all_tensors(model))


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike[str],
    *,
    external_data: bool | None = None,
) -> Path:
    """Write ``model`` to ``path`` atomically.

    ``external_data=None`` chooses automatically: tensors go to ``<name>.data`` beside the model when the
    model would exceed the 2 GB protobuf limit. An existing ``<name>.data`` is replaced atomically too. The
    model passed in is not modified (tensors are streamed to the data file one at a time, never copied whole).
    """
    target = Path(path)
    use_external = external_data if external_data is not None else _too_large(model)
    if not use_external:
        return write_atomic(target, lambda f: write_streamed(model, f))
    folder = target.parent if str(target.parent) else Path(".")
    data_name = target.name + ".data"
    folder.mkdir(parents=True, exist_ok=True)
    with temporary_file(folder, data_name) as tmp_data:
        try:
            with open(tmp_data, "wb") as f:
                restore = _externalize(model, f, data_name)
                f.flush()
                os.fsync(f.fileno())
            try:
                proto = model.SerializeToString(deterministic=True)
            finally:
                restore()
            os.replace(tmp_data, folder / data_name)
        except OSError as exc:
            raise WriteError(f"cannot write {folder / data_name}: {exc.strerror or exc}. Nothing was written.") from exc
    return write_atomic(target, proto)


def _externalize(model: onnx.ModelProto, f: IO[bytes], location: str) -> Callable[[], None]:
    """Move every tensor of at least `EXTERNAL_DATA_THRESHOLD` bytes to ``f`` (4 KiB aligned) and point it at
    ``location``; returns the function that puts the original tensors back (the caller's model is unchanged)."""
    saved: list[tuple[onnx.TensorProto, onnx.TensorProto]] = []
    for t in _all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        raw = t.raw_data if t.HasField("raw_data") else None
        if raw is None:
            if t.ByteSize() < EXTERNAL_DATA_THRESHOLD or t.data_type in (onnx.TensorProto.STRING, 0):
                continue
            raw = onnx.numpy_helper.to_array(t).tobytes()
        if len(raw) < EXTERNAL_DATA_THRESHOLD:
            continue
        original = onnx.TensorProto()
        original.CopyFrom(t)
        saved.append((t, original))
        offset = f.seek(0, os.SEEK_END)
        pad = (-offset) % 4096
        if pad:
            f.write(b"\0" * pad)
            offset += pad
        f.write(raw)
        dims, name, dtype = list(t.dims), t.name, t.data_type
        t.Clear()
        t.name, t.data_type = name, dtype
        t.dims.extend(dims)
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
            t.external_data.add(key=key, value=value)

    def restore() -> None:
        for tensor, original in saved:
            tensor.CopyFrom(original)

    return restore


def _too_large(model: onnx.ModelProto) -> bool:
    total = 0
    for t in _all_tensors(model):
        total += tensor_size(t)  # not len(raw_data) nor ByteSize(): both copy the data
        if total > PROTOBUF_LIMIT - (64 << 20):
            return True
    return False
