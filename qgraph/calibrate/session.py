"""onnxruntime sessions over a calibration copy of a model: extra outputs (and nodes), external data above 2 GB.

The model given is never modified.  In memory, one copy is made and the additions are appended to it;
models whose protobuf would exceed 2 GB are written to a temporary folder with their initializers as
external data (one tensor in memory at a time) and loaded from there.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import TensorProto

from qgraph.errors import ModelError
from qgraph.graph.detach import fill_nested, placeholders_as_inputs, split_weights
from qgraph.runtime.compare import WeightFedSession

#: Serialized size above which the calibration model goes through external data (2 GB - 64 MB).
LARGE_MODEL_BYTES = 2**31 - 1 - (64 << 20)


@dataclass
class Additions:
    """What the calibration copy adds to the model: nodes, constants, outputs."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)


def _known_types(model: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out[vi.name] = vi.type.tensor_type.elem_type
    return out


def fetch_outputs(model: onnx.ModelProto, fetch: Sequence[str]) -> list[onnx.ValueInfoProto]:
    """Value infos exposing ``fetch`` as graph outputs: element type when known, never a shape (dynamic axes)."""
    types = _known_types(model)
    existing = {o.name for o in model.graph.output}
    infos = []
    for name in fetch:
        if name in existing:
            continue
        vi = onnx.ValueInfoProto()
        vi.name = name
        if name in types:
            vi.type.tensor_type.elem_type = types[name]
        infos.append(vi)
    return infos


def _serialized_size(model: onnx.ModelProto) -> int:
    try:
        return int(model.ByteSize())
    except Exception:  # protobuf may refuse to size > 2 GB messages
        return 2**63 - 1


def session_options(optimize: bool) -> ort.SessionOptions:
    """Quiet options; full graph optimizations unless ``optimize`` is False."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # one thread per run, samples side by side (`qgraph.runtime.parallel`): the same bits on every host
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    # Without prepacking, onnxruntime keeps no kernel-layout copy of the MatMul/Gemm weights (on a transformer or a
    # VGG's FC layers, nearly one more copy of the model). MatMul then accumulates in another order: ranges move
    # by float32 rounding only (measured <= 1.5e-6 relative on a 6-layer encoder), the same on every run.
    opts.add_session_config_entry("session.disable_prepacking", "1")
    # The reductions read every activation: a pre-planned whole-run allocation then holds them all at once (24-layer
    # encoder: 2.1 GB); allocated one by one, each is freed after its reductions (6-layer encoder 864 -> 701 MB).
    opts.enable_mem_pattern = False
    return opts


@contextmanager
def calibration_session(
    model: onnx.ModelProto,
    additions: Additions,
    *,
    optimize: bool = True,
    providers: Sequence[str] | None = None,
    large_model_bytes: int = LARGE_MODEL_BYTES,
    weights: Mapping[str, npt.NDArray[Any]] | None = None,
) -> Iterator[ort.InferenceSession]:
    """A session over ``model`` + ``additions`` (see module docstring).

    ``weights`` gives the values of a weightless export's placeholders (`qgraph.GraphHandle.weightless_export`):
    they become graph inputs fed from these arrays (`WeightFedSession`), read in place: neither the protobuf nor
    the session holds a copy.

    Raises:
        ModelError: onnxruntime cannot load the model, or an initializer's external data is not loaded.
    """
    opts = session_options(optimize)
    provs = list(providers) if providers else ["CPUExecutionProvider"]
    if weights is None:  # the session reads the weights in place; the protobuf it parses holds none
        model, weights = split_weights(model)
    if weights:
        model, weights = fill_nested(model, weights)
    extra = sum(t.ByteSize() for t in additions.initializers)
    if _serialized_size(model) + extra <= large_model_bytes:
        aug = placeholders_as_inputs(model) if weights else onnx.ModelProto()
        if not weights:
            aug.CopyFrom(model)
        aug.graph.node.extend(additions.nodes)
        aug.graph.initializer.extend(additions.initializers)
        aug.graph.output.extend(additions.outputs)
        session = create_session(aug.SerializeToString(), opts, provs)
        yield WeightFedSession(session, weights) if weights else session
        return
    with tempfile.TemporaryDirectory(prefix="qgraph-calib-") as tmp:
        path = _write_with_external_data(model, additions, Path(tmp))
        yield create_session(str(path), opts, provs)


def create_session(src: str | bytes, opts: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
    """``ort.InferenceSession`` with onnxruntime's failure turned into a :class:`ModelError`."""
    try:
        return ort.InferenceSession(src, opts, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception classes
        raise ModelError(f"onnxruntime cannot load the model for calibration: {exc}") from exc


def _write_with_external_data(model: onnx.ModelProto, additions: Additions, folder: Path) -> Path:
    """Write ``model`` + ``additions`` to ``folder`` with top-level initializers in one external file.

    The model passed in is not modified and never copied whole: the graph is rebuilt from its
    parts and each initializer's bytes are streamed to ``weights.bin``.
    """
    aug = onnx.ModelProto()
    aug.ir_version = model.ir_version
    aug.producer_name = model.producer_name
    aug.domain = model.domain
    aug.opset_import.extend(model.opset_import)
    aug.functions.extend(model.functions)
    src = model.graph
    g = aug.graph
    g.name = src.name
    g.node.extend(src.node)
    g.node.extend(additions.nodes)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.output.extend(additions.outputs)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    g.initializer.extend(additions.initializers)
    weights = folder / "weights.bin"
    offset = 0
    with weights.open("wb") as f:
        for t in src.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                raise ModelError(
                    f"initializer {t.name!r} refers to external data that is not loaded; load the model with "
                    "qgraph.load_model (or onnx.load with its external data) before calibrating"
                )
            if t.data_type == TensorProto.STRING:
                g.initializer.append(t)
                continue
            raw = t.raw_data if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).tobytes()
            f.write(raw)
            header = TensorProto()
            header.name = t.name
            header.dims.extend(t.dims)
            header.data_type = t.data_type
            for key, value in (("location", "weights.bin"), ("offset", str(offset)), ("length", str(len(raw)))):
                entry = header.external_data.add()
                entry.key, entry.value = key, value
            header.data_location = TensorProto.EXTERNAL
            g.initializer.append(header)
            offset += len(raw)
            del raw
    path = folder / "model.onnx"
    path.write_bytes(aug.SerializeToString())
    return path
