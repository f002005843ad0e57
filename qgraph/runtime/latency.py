"""What onnxruntime actually spends per node: in-graph kernel profiles, op signatures and a per-host cost table.

INT8 is not uniformly faster. On x86 onnxruntime runs u8 QLinearConv in NHWC layout, so a channel shuffle
(``Reshape -> Transpose -> Reshape``) between two integer convs becomes a 5-D byte transpose moving blocks of a
few channels (ShuffleNet: ~0.5 ms int8 vs ~0.02 ms float for one shuffle at 28x28x136), and grouped/depthwise
QLinearConv can be slower than the float NCHWc kernels. Timing an op alone misses these layout effects, so
costs here are measured *in the graph*: `profile_kernels` runs the float model and its all-INT8 QDQ twin in
onnxruntime with profiling on, alternating runs so a shared machine slows both alike, and keeps each node's
median kernel time (onnxruntime names fused kernels after the node they replace, plus ``_token_<n>`` when the
layout transformer rewrote them).

`op_signature` buckets a node by kind (``Conv/depthwise/3x3``, ``Conv/grouped/1x1``, ``Gemm``, ``Add``, ...),
size (powers of two of channels and spatial size) and work (MACs or elements); a `LatencyTable` stores, per
preset, measured (float µs, int8 µs, work) per bucket plus the per-element cost of QuantizeLinear and
DequantizeLinear, and estimates a node as ``t(entry) x work / work(entry)`` from the same bucket, else from the
nearest bucket of the same kind (smallest L1 distance of the buckets' log2 numbers).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qgraph.errors import DataError

_NUMBERS = re.compile(r"\d+")
_TOKEN = re.compile(r"(_token_\d+|_nchwc)+$")
#: Format version of the cost table file.
TABLE_VERSION = 1


# ---------------------------------------------------------------------------------------------- profiling
def _session(model: onnx.ModelProto | bytes, threads: int, profile_prefix: str | None = None) -> Any:
    """An onnxruntime CPU session, ``ORT_ENABLE_ALL``, ``threads`` intra-op threads, profiling when a prefix is
    given."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    src = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def profile_kernels(
    models: Mapping[str, onnx.ModelProto | bytes],
    feeds: Mapping[str, np.ndarray],
    runs: int = 10,
    threads: int = 2,
    budget_seconds: float = 30.0,
) -> dict[str, dict[str, float]]:
    """Median kernel time (µs) per node name for each model (``label -> {node: µs}``), onnxruntime CPU,
    ``ORT_ENABLE_ALL``, ``threads`` intra-op threads. Runs alternate between the models (round-robin), at most
    ``runs`` rounds and no new round after ``budget_seconds``. Names lose onnxruntime's ``_token_<n>`` suffixes;
    kernels onnxruntime added itself (layout transposes, reorders) keep their generated names."""
    sessions = {label: _session(model, threads, str(Path(tempfile.gettempdir()) / f"qgraph-latency-{label}"))
                for label, model in models.items()}
    feed = dict(feeds)
    start = time.perf_counter()
    out: dict[str, dict[str, float]] = {}
    try:
        for sess in sessions.values():  # warm-up (the median below also drops it)
            sess.run(None, feed)
        for _ in range(max(1, runs)):
            for sess in sessions.values():
                sess.run(None, feed)
            if time.perf_counter() - start > budget_seconds:
                break
    finally:  # a failed run still ends every profile, so no profile file is left behind
        for label, sess in sessions.items():
            path = Path(sess.end_profiling())
            try:
                out[label] = _medians(json.loads(path.read_text()))
            finally:
                path.unlink(missing_ok=True)
    return out


def time_models(
    models: Mapping[str, onnx.ModelProto | bytes],
    feeds: Mapping[str, np.ndarray],
    rounds: int = 30,
    threads: int = 2,
    budget_seconds: float = 5.0,
) -> dict[str, float]:
    """Median wall time (ms) of one ``session.run`` per model, onnxruntime CPU, ``ORT_ENABLE_ALL``: the steady
    state a deployed model runs in. Models take turns of about 150 ms of consecutive runs so a shared machine
    slows them alike; the first two runs of every turn are not counted (right after another session ran, a run
    is 15-30% slower: caches and onnxruntime's parked thread pool; counting them hid a 14% difference on
    YOLOv8n). At least 3 rounds, at most ``rounds``, no new round after ``budget_seconds``."""
    sessions = {label: _session(model, threads) for label, model in models.items()}
    feed = dict(feeds)
    block = 1
    for sess in sessions.values():
        for _ in range(2):
            t0 = time.perf_counter()
            sess.run(None, feed)
        block = max(block, min(200, math.ceil(0.15 / max(time.perf_counter() - t0, 1e-6))))
    times: dict[str, list[float]] = {label: [] for label in sessions}
    start = time.perf_counter()
    for r in range(max(3, rounds)):
        if r >= 3 and time.perf_counter() - start > budget_seconds:
            break
        for label, sess in sessions.items():
            for k in range(block + 2):
                t0 = time.perf_counter()
                sess.run(None, feed)
                if k >= 2:
                    times[label].append((time.perf_counter() - t0) * 1e3)
    return {label: float(statistics.median(v)) for label, v in times.items()}


def _medians(events: list[dict[str, Any]]) -> dict[str, float]:
    per_run: dict[str, list[float]] = defaultdict(list)
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == "Node" and name.endswith("_kernel_time"):
            per_run[_TOKEN.sub("", name[: -len("_kernel_time")])].append(float(e.get("dur", 0.0)))
    return {name: float(statistics.median(durs)) for name, durs in per_run.items()}


def element_costs(threads: int = 2, elements: int = 1 << 20, runs: int = 15) -> tuple[float, float]:
    """Nanoseconds per element of a float/int8 boundary on this host: (QuantizeLinear, DequantizeLinear), each plus
    the layout change that comes with it on onnxruntime's CPU provider (u8 kernels run NHWC, float ones NCHW/NCHWc:
    a uint8 and a float32 NCHW <-> NHWC transpose). Median of ``runs`` timings on ``elements`` elements."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    shape = [1, 64, elements // (64 * 128), 128]

    def model(op: str, src: int, dst: int) -> bytes:
        attrs: dict[str, Any] = {"perm": [0, 2, 3, 1]} if op == "Transpose" else {}
        inputs = ["x"] if op == "Transpose" else ["x", "s", "z"]
        g = helper.make_graph(
            [helper.make_node(op, inputs, ["y"], **attrs)], op,
            [helper.make_tensor_value_info("x", src, shape)], [helper.make_tensor_value_info("y", dst, None)],
            [] if op == "Transpose" else [helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]),
                                          helper.make_tensor("z", TensorProto.UINT8, [], [7])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
        return bytes(m.SerializeToString())

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    f32 = np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    u8 = (np.arange(f32.size) % 251).astype(np.uint8).reshape(shape)
    cases = (("QuantizeLinear", TensorProto.FLOAT, TensorProto.UINT8, f32),
             ("DequantizeLinear", TensorProto.UINT8, TensorProto.FLOAT, u8),
             ("Transpose", TensorProto.UINT8, TensorProto.UINT8, u8),
             ("Transpose", TensorProto.FLOAT, TensorProto.FLOAT, f32))
    ns = []
    for op, src, dst, data in cases:
        sess = ort.InferenceSession(model(op, src, dst), so, providers=["CPUExecutionProvider"])
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            sess.run(None, {"x": data})
            times.append(time.perf_counter() - t)
        ns.append(statistics.median(times) * 1e9 / data.size)
    layout = ns[2] + ns[3]
    return ns[0] + layout, ns[1] + layout


# ---------------------------------------------------------------------------------------------- signatures
def _p2(x: float) -> int:
    return int(2 ** round(math.log2(max(x, 1.0))))


def _prod(shape: Sequence[int | None] | None) -> int | None:
    if shape is None or any(d is None or d <= 0 for d in shape):
        return None
    return int(np.prod([int(d) for d in shape if d is not None])) if shape else 1


def op_signature(
    op: str,
    attrs: Mapping[str, Any],
    out_shape: Sequence[int | None] | None,
    weight_shape: Sequence[int] | None = None,
    in_shape: Sequence[int | None] | None = None,
) -> tuple[str, str, float] | None:
    """``(kind, bucket, work)`` of a node, or None when its shapes are unknown (see module docs).

    Conv: kind ``Conv/{dense|grouped|depthwise}/{kh}x{kw}``, bucket ``ci{Cin}-co{Cout}-hw{Hout*Wout}`` (powers of
    two; nearest bucket = smallest L1 distance of their log2 numbers),
    work = MACs = ``|out| x Cin/group x kh x kw``; Gemm/MatMul with a weight ``[K, N]``: ``k{K}-n{N}``, work
    ``|out| x K``; Transpose: kind ``Transpose/rank{r}``; anything else: kind = op, bucket ``e{|out|}``, work
    = ``|out|`` elements."""
    elems = _prod(out_shape)
    if elems is None:
        return None
    if op in ("Conv", "ConvTranspose") and weight_shape is not None and len(weight_shape) >= 3 and out_shape:
        group = int(attrs.get("group", 1))
        c_out = int(weight_shape[0]) if op == "Conv" else int(weight_shape[1]) * group
        c_in_g = int(weight_shape[1]) if op == "Conv" else int(weight_shape[0]) // group
        kernel = [int(k) for k in weight_shape[2:]]
        style = "dense" if group == 1 else ("depthwise" if c_in_g == 1 and group == c_out else "grouped")
        spatial = elems // max(c_out, 1)
        kind = f"{op}/{style}/{'x'.join(map(str, kernel))}"
        bucket = f"ci{_p2(c_in_g * group)}-co{_p2(c_out)}-hw{_p2(spatial)}"
        return kind, bucket, float(elems * c_in_g * int(np.prod(kernel)))
    if op in ("Gemm", "MatMul") and weight_shape is not None and len(weight_shape) == 2:
        k = int(weight_shape[1] if op == "Gemm" and int(attrs.get("transB", 0)) else weight_shape[0])
        return op, f"k{_p2(k)}-n{_p2(elems)}", float(elems * k)
    if op == "Transpose":
        return f"Transpose/rank{len(out_shape or ())}", f"e{_p2(elems)}", float(elems)
    return op, f"e{_p2(elems)}", float(elems)


# ---------------------------------------------------------------------------------------------- the table
class CostEntry(BaseModel):
    """Measured in-graph cost of one (kind, bucket): total work and time over its samples."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(description="Op kind, e.g. Conv/depthwise/3x3 (see op_signature).")
    bucket: str = Field(description="Size bucket, e.g. c256-hw196.")
    work: float = Field(gt=0, description="Mean work (MACs or elements) of the samples.")
    float_us: float = Field(ge=0, description="Mean float kernel time of the samples, µs.")
    int8_us: float = Field(ge=0, description="Mean int8 (fused QDQ) kernel time of the samples, µs.")
    samples: int = Field(ge=1, description="How many nodes were measured.")

    @field_validator("work", "float_us", "int8_us")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v


class PresetTable(BaseModel):
    """Costs for one preset (dtypes/layout decide which kernels onnxruntime picks)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    quantize_ns: float = Field(gt=0, description="QuantizeLinear, ns per element.")
    dequantize_ns: float = Field(gt=0, description="DequantizeLinear, ns per element.")
    entries: tuple[CostEntry, ...] = Field(description="Measured buckets.")


class LatencyTable(BaseModel):
    """Per-preset cost tables of one host (what `benchmarks/build_latency_table.py` writes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(description="File format version.")
    host: str = Field(description="CPU the table was measured on.")
    runtime: str = Field(description="onnxruntime version.")
    threads: int = Field(ge=1, description="Intra-op threads of the measurement.")
    presets: dict[str, PresetTable] = Field(description="Preset name -> costs.")

    @field_validator("version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != TABLE_VERSION:
            raise ValueError(f"table version {v} is not {TABLE_VERSION}: rebuild it")
        return v

    def estimate(self, preset: str, kind: str, bucket: str, work: float) -> tuple[float, float, str] | None:
        """(float µs, int8 µs, which entry) for a node of ``preset``, or None when the kind was never measured."""
        table = self.presets.get(preset)
        if table is None:
            return None
        same = [e for e in table.entries if e.kind == kind]
        if not same:
            return None
        exact = [e for e in same if e.bucket == bucket]
        entry = (exact or sorted(same, key=lambda e: _distance(e, bucket, work)))[0]
        f = work / entry.work
        return entry.float_us * f, entry.int8_us * f, f"{entry.kind} {entry.bucket}" + ("" if exact else " (nearest)")


def _distance(entry: CostEntry, bucket: str, work: float) -> float:
    """L1 distance in log2 between two buckets' numbers (channels in/out, spatial size or elements), then work."""
    mine = [float(x) for x in _NUMBERS.findall(bucket)]
    theirs = [float(x) for x in _NUMBERS.findall(entry.bucket)]
    if len(mine) != len(theirs):
        return 1e9 + abs(math.log(entry.work / max(work, 1e-9)))
    return sum(abs(math.log2(max(a, 1.0)) - math.log2(max(b, 1.0))) for a, b in zip(mine, theirs, strict=True))


#: The cost table qgraph ships (measured with `benchmarks/build_latency_table.py`; per preset, per op kind):
#: ``insert_qdq``'s ``latency: table`` and the fallback search's cost model read it.
SHIPPED_TABLE = Path(__file__).with_name("latency_table.json")


def shipped_latency_table() -> LatencyTable:
    """`SHIPPED_TABLE`, loaded and validated."""
    return load_latency_table(SHIPPED_TABLE)


def load_latency_table(path: str | Path) -> LatencyTable:
    """Read and validate a cost table; a missing or malformed file is a DataError saying how to rebuild it."""
    fix = "rebuild it with `python benchmarks/build_latency_table.py --out PATH`"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"latency table {path}: cannot read it ({exc}); {fix}") from exc
    try:
        return LatencyTable.model_validate(data)
    except ValidationError as exc:
        from qgraph.options import validation_problems

        raise DataError(f"latency table {path}: {validation_problems(exc).rstrip('.')}; {fix}") from exc
