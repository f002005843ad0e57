"""Opset conformance corpus: the ONNX backend node tests, written to disk and run in onnxruntime.

The generators ship in the onnx wheel (``onnx.backend.test.case.node``); `generate_corpus` feeds them to the
writer ``onnx.backend.test.cmd_tools.generate_data`` uses, producing ``node/<test>/model.onnx`` plus
``test_data_set_0/`` folders. `classify` lowers one test to one target (with qgraph or with
``onnx.version_converter``), runs it in onnxruntime and compares with the expected outputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

RTOL, ATOL = 1e-3, 1e-7
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def generate_corpus(out_dir: str | os.PathLike[str], names: Iterable[str] | None = None) -> Path:
    """Write the node test corpus under ``out_dir/node`` (only ``names`` when given); return that folder."""
    import onnx.backend.test.case.node as node_cases
    import onnx.backend.test.cmd_tools as cmd_tools

    wanted = set(names) if names is not None else None

    def collect() -> list[Any]:
        cases = node_cases.collect_testcases()
        return [c for c in cases if wanted is None or c.name in wanted]

    saved = cmd_tools.model_test.collect_testcases
    cmd_tools.model_test.collect_testcases = collect  # type: ignore[assignment]
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            cmd_tools.generate_data(argparse.Namespace(output=str(out_dir)))
    finally:
        cmd_tools.model_test.collect_testcases = saved  # type: ignore[assignment]
    return Path(out_dir) / "node"


def _load_value(path: Path, tp: onnx.TypeProto) -> Any:
    data = path.read_bytes()
    kind = tp.WhichOneof("value")
    if kind == "sequence_type":
        s = onnx.SequenceProto()
        s.ParseFromString(data)
        return numpy_helper.to_list(s)
    if kind == "optional_type":
        o = onnx.OptionalProto()
        o.ParseFromString(data)
        return numpy_helper.to_optional(o)
    if kind == "map_type":
        m = onnx.MapProto()
        m.ParseFromString(data)
        return numpy_helper.to_dict(m)
    t = onnx.TensorProto()
    t.ParseFromString(data)
    return numpy_helper.to_array(t)


def load_case(case_dir: Path) -> tuple[onnx.ModelProto, dict[str, Any], list[Any]]:
    """Model, input feeds and expected outputs of one test folder."""
    model = onnx.load(str(case_dir / "model.onnx"))
    ds = case_dir / "test_data_set_0"
    inits = {i.name for i in model.graph.initializer}
    ins = [i for i in model.graph.input if i.name not in inits]
    feeds = {vi.name: _load_value(ds / f"input_{j}.pb", vi.type) for j, vi in enumerate(ins)}
    expected = [_load_value(ds / f"output_{j}.pb", vi.type) for j, vi in enumerate(model.graph.output)]
    return model, feeds, expected


def run_ort(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    """Run ``model`` on the CPU provider (one thread)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))


def _close(expected: Any, got: Any) -> bool:
    if isinstance(expected, list):
        return (
            isinstance(got, list)
            and len(expected) == len(got)
            and all(_close(a, b) for a, b in zip(expected, got, strict=True))
        )
    if expected is None:
        return got is None
    a, b = np.asarray(expected), np.asarray(got)
    if a.shape != b.shape:
        return False
    if a.dtype == object or a.dtype.kind in "SU":
        return bool(a.tolist() == b.tolist())
    if a.dtype.kind == "V" or b.dtype.kind == "V":
        return bool(a.tobytes() == b.tobytes())
    try:
        np.testing.assert_allclose(
            b.astype(np.float64) if b.dtype.kind != "c" else b,
            a.astype(np.float64) if a.dtype.kind != "c" else a,
            rtol=RTOL,
            atol=ATOL,
        )
    except (AssertionError, TypeError, ValueError):
        return False
    return True


def outputs_match(expected: list[Any], got: list[Any]) -> bool:
    """Whether ``got`` equals ``expected`` within the backend-test tolerance (NaNs equal)."""
    return len(expected) == len(got) and all(_close(a, b) for a, b in zip(expected, got, strict=True))


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset."""
    return next((int(i.version) for i in model.opset_import if i.domain in ("", "ai.onnx")), 0)


def baseline(case_dir: Path) -> tuple[str, str]:
    """How onnxruntime handles the original: ``ok``, ``too_new`` (opset/IR unsupported), ``fails`` or ``wrong``."""
    model, feeds, expected = load_case(case_dir)
    try:
        got = run_ort(model, feeds)
    except Exception as exc:
        msg = str(exc)
        if "Unsupported model IR version" in msg or "is till opset" in msg or "ValidateOpsetForDomain" in msg:
            return "too_new", msg.splitlines()[0][:200]
        return "fails", msg.splitlines()[0][:200] if msg else type(exc).__name__
    return ("ok", "") if outputs_match(expected, got) else ("wrong", "original output mismatch")


def _qgraph(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    from qgraph.passes.lower_opset import lower_model

    return lower_model(model, target).model


def _version_converter(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    from onnx import version_converter

    return version_converter.convert_version(model, target)


ENGINES: dict[str, Callable[[onnx.ModelProto, int], onnx.ModelProto]] = {
    "qgraph": _qgraph,
    "version_converter": _version_converter,
}


def classify(case_dir: Path, target: int, engine: str = "qgraph") -> tuple[str, str]:
    """Lower one test to ``target`` and judge it: ``pass``, ``refused``, ``wrong`` or ``crash`` (+ detail).

    For qgraph a refusal is a `PassError`; for version_converter any exception it raises while converting.
    """
    from qgraph.errors import PassError

    model, feeds, expected = load_case(case_dir)
    try:
        lowered = ENGINES[engine](model, target)
    except PassError as exc:
        return "refused", str(exc).splitlines()[-1].strip()[:300]
    except Exception as exc:
        if engine == "qgraph":
            return "crash", f"{type(exc).__name__}: {str(exc)[:300]}"
        return "refused", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    if default_opset(lowered) > target:
        return "crash", f"result still at opset {default_opset(lowered)}"
    try:
        got = run_ort(lowered, feeds)
    except Exception as exc:
        return "crash", f"onnxruntime: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"
    if outputs_match(expected, got):
        return "pass", ""
    return "wrong", "outputs differ from the expected ones"
