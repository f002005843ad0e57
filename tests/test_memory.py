"""Peak memory of the CLI on a generated ~150 MB model, measured in a child process (``ru_maxrss`` from ``os.wait4``):
`qgraph run` (static INT8 with calibration) and `qgraph lower` stay within the issue's ceiling ``2 x S + 300 MB``
(S = weight bytes). Not timing-based; about 10 s each. `benchmarks/bench_memory.py` measures 0.5-1.2 GB models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
WIDTH, LAYERS = 2048, 9  # 9 x 16 MB float32 weights


def _gemm_chain(folder: Path, external: bool) -> tuple[Path, Path, int]:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(LAYERS):
        w = (rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * np.float32(1 / np.sqrt(WIDTH)))
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(WIDTH, np.float32), f"b{i}")]
        nodes += [helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"g{i}"], name=f"gemm{i}"),
                  helper.make_node("Relu", [f"g{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = folder / "chain.onnx"
    onnx.save(model, str(path), save_as_external_data=external, location="chain.onnx.data")
    data = folder / "calib.npz"
    np.savez(data, x=rng.standard_normal((4, 1, WIDTH)).astype(np.float32))
    weights = sum(int(np.prod(t.dims)) * 4 for t in inits)
    return path, data, weights


#: Runs the command from a fresh, small interpreter: a child forked from pytest would count pytest's own resident
#: memory in its ``ru_maxrss``.
_LAUNCH = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
_, status, usage = os.wait4(proc.pid, 0)
sys.stderr.write(proc.stderr.read().decode())
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def _peak_mb(args: list[str]) -> float:
    qgraph = str(Path(sys.executable).with_name("qgraph"))
    done = subprocess.run([sys.executable, "-c", _LAUNCH, qgraph, *args], capture_output=True, text=True, check=True)
    code, maxrss_kb = done.stdout.split()
    assert code == "0", done.stderr
    return int(maxrss_kb) / 1024.0


@pytest.mark.parametrize("external", [False, True])
def test_run_peak_rss_within_two_model_sizes(tmp_path: Path, external: bool) -> None:
    model, data, weights = _gemm_chain(tmp_path, external)
    ceiling = 2 * weights / 2**20 + 300
    peak = _peak_mb(["run", str(ROOT / "recipes" / "ort-x86-vnni.yaml"), str(model), "-o", str(tmp_path / "q.onnx"),
                     "-q", "--calibration-data", str(data)])
    assert peak <= ceiling, f"qgraph run peaked at {peak:.0f} MB > 2 x {weights / 2**20:.0f} + 300 MB"
    q = onnx.load(str(tmp_path / "q.onnx"))
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) >= 2 * LAYERS


def test_lower_peak_rss_within_two_model_sizes(tmp_path: Path) -> None:
    model, _, weights = _gemm_chain(tmp_path, external=False)
    ceiling = 2 * weights / 2**20 + 300
    peak = _peak_mb(["lower", str(model), "--opset", "13", "-o", str(tmp_path / "low.onnx")])
    assert peak <= ceiling, f"qgraph lower peaked at {peak:.0f} MB > 2 x {weights / 2**20:.0f} + 300 MB"


def test_run_with_bias_correction_peak_rss_within_two_model_sizes(tmp_path: Path) -> None:
    """``correct_bias`` (local mode) after ``insert_qdq``: the float reference is weightless and shares the graph's
    arrays, and the float-twin session reads them in place (before: 1343 MB on this model)."""
    model, data, weights = _gemm_chain(tmp_path, external=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: memory-correct-bias\npasses:\n  - pass: insert_qdq\n    preset: ort-x86-vnni\n"
                      "  - pass: correct_bias\n")
    ceiling = 2 * weights / 2**20 + 300
    peak = _peak_mb(["run", str(recipe), str(model), "-o", str(tmp_path / "q.onnx"), "-q",
                     "--calibration-data", str(data)])
    assert peak <= ceiling, f"qgraph run + correct_bias peaked at {peak:.0f} MB > 2 x {weights / 2**20:.0f} + 300 MB"
    q = onnx.load(str(tmp_path / "q.onnx"))
    history = next(p.value for p in q.metadata_props if "passes" in p.key or "recipe" in p.key)
    assert "correct_bias" in history


@pytest.mark.parametrize("external", [False, True])
def test_calibrate_peak_rss_within_two_model_sizes(tmp_path: Path, external: bool) -> None:
    """`qgraph calibrate` on the Gemm chain (measured 406 MB, ceiling 588): the weights once as arrays plus
    onnxruntime's session copy; calibration sessions keep no prepacked copy of MatMul/Gemm weights."""
    model, data, weights = _gemm_chain(tmp_path, external)
    ceiling = 2 * weights / 2**20 + 300
    ranges = tmp_path / "ranges.json"
    peak = _peak_mb(["calibrate", str(ROOT / "recipes" / "ort-x86-vnni.yaml"), str(model), "-o", str(ranges),
                     "--calibration-data", str(data)])
    assert peak <= ceiling, f"qgraph calibrate peaked at {peak:.0f} MB > 2 x {weights / 2**20:.0f} + 300 MB"
    assert ranges.stat().st_size > 0


def _rss_mb() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024.0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_sessions_over_shared_weights_hold_no_copy_of_them() -> None:
    """Calibration and measuring sessions over a weightless model read the caller's arrays in place (fed as
    inputs): onnxruntime copies initializers given through ``add_external_initializers`` (64 MB more here) and
    prepacks MatMul weights (64 MB more again)."""
    from qgraph.calibrate.session import Additions, calibration_session
    from qgraph.graph.detach import split_weights
    from qgraph.runtime.compare import make_session, session_run

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4096, 4096), dtype=np.float32)  # 64 MB
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4096])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4096])],
                              [numpy_helper.from_array(w, "w")])
    weightless, weights = split_weights(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                          ir_version=9))
    x = rng.standard_normal((2, 4096), dtype=np.float32)
    before = _rss_mb()
    with calibration_session(weightless, Additions(), weights=weights) as sess:
        assert [i.name for i in sess.get_inputs()] == ["x"]  # the weights are not data inputs
        (y,) = session_run(sess, ["y"], {"x": x})
        grown = _rss_mb() - before
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-3)
    assert grown < 32, f"the calibration session grew RSS by {grown:.0f} MB over 64 MB of shared weights"
    before = _rss_mb()
    session = make_session(weightless, weights=weights)
    (y,) = session_run(session, ["y"], {"x": x})
    grown = _rss_mb() - before
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-3)
    assert grown < 32, f"make_session grew RSS by {grown:.0f} MB over 64 MB of shared weights"
