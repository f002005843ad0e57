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
import shutil
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from qgraph.errors import ModelError

#: Highest IR version qgraph writes unless the opsets need more. onnxruntime 1.31 loads up to 13; 10 is what
#: opsets up to 22 need and what older runtimes (TensorRT, ORT 1.16+) also load.
MAX_RUNTIME_IR_VERSION = 10
#: Protobuf's hard limit; beyond it tensors must live in external data.
PROTOBUF_LIMIT = 2**31 - 1
#: Tensors at least this large go to external data when a model is saved with external data.
EXTERNAL_DATA_THRESHOLD = 1024


def load_model(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Load an ONNX model with its external data, raising `ModelError` with a fix for every failure mode."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"model file not found: {p}. Check the path (relative paths start at {Path.cwd()}).")
    if p.is_dir():
        raise ModelError(f"{p} is a directory, not an .onnx file.")
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
    try:
        # External data paths are relative to the model's folder, never the current directory.
        onnx.load_external_data_for_model(model, str(p.parent))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"{p}: cannot read its external data ({exc}). Keep the .data file(s) beside the model."
        ) from exc
    return model


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


def model_fingerprint(model: onnx.ModelProto) -> str:
    """sha256 of the graph's content (nodes, initializers, I/O, opsets), independent of metadata.

    Streams piece by piece, so it works for models over the 2 GB protobuf limit.
    """
    h = hashlib.sha256()
    g = model.graph
    for part in (*g.input, *g.output, *g.node, *g.sparse_initializer):
        h.update(part.SerializeToString(deterministic=True))
    for t in g.initializer:
        h.update(f"{t.name}:{t.data_type}:{list(t.dims)};".encode())
        if t.HasField("raw_data"):
            h.update(t.raw_data)
        else:
            h.update(t.SerializeToString(deterministic=True))
    for o in model.opset_import:
        h.update(f"{o.domain}:{o.version};".encode())
    return h.hexdigest()


def _all_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    from onnx.external_data_helper import _get_all_tensors

    return list(_get_all_tensors(model))


def required_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version valid for the model's opsets, at least 4 (initializers need not be inputs)."""
    opsets = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    try:
        needed = int(onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    except (ValueError, TypeError):
        needed = 7
    return max(needed, 4)


def normalize_ir_version(model: onnx.ModelProto, max_ir: int = MAX_RUNTIME_IR_VERSION) -> None:
    """Set an IR version that the opsets need and the runtime loads (in place)."""
    needed = required_ir_version(model)
    model.ir_version = max(min(max(model.ir_version, needed), max_ir), needed)


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike[str],
    *,
    external_data: bool | None = None,
) -> Path:
    """Write ``model`` to ``path`` atomically.

    ``external_data=None`` chooses automatically: tensors go to ``<name>.data`` beside the model when the
    model would exceed the 2 GB protobuf limit. The model passed in is not modified.
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    use_external = external_data if external_data is not None else _too_large(model)
    data_name = target.name + ".data"
    tmp_dir = Path(tempfile.mkdtemp(prefix=".qgraph-", dir=folder))
    try:
        tmp_model = tmp_dir / target.name
        if use_external:
            to_write = onnx.ModelProto()
            to_write.CopyFrom(model)
            onnx.save_model(
                to_write,
                str(tmp_model),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=data_name,
                size_threshold=EXTERNAL_DATA_THRESHOLD,
            )
            os.replace(tmp_dir / data_name, folder / data_name)
        else:
            with tmp_model.open("wb") as f:
                f.write(model.SerializeToString(deterministic=True))
        os.replace(tmp_model, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return target


def _too_large(model: onnx.ModelProto) -> bool:
    total = 0
    for t in _all_tensors(model):
        total += len(t.raw_data) if t.HasField("raw_data") else t.ByteSize()
        if total > PROTOBUF_LIMIT - (64 << 20):
            return True
    return False
