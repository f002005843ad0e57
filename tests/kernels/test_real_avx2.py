"""The AVX2 emulation against onnxruntime's real AVX2 kernels: the test that catches a drift.

On an AVX2 host without VNNI the real kernels run in this process. Anywhere else on x86-64, qemu-user (Debian's
``qemu-user``; CI installs it) runs a child Python on an emulated Haswell (AVX2, no AVX-512, no VNNI), so
onnxruntime dispatches its AVX2 kernels there; the child first proves it with the saturation probe. The emulation
(built here, on whatever kernels this host has) must give what those kernels give, bit for bit: every layer shape of
`kernel_models`, and the digits CNN quantized for VNNI (where saturation costs it accuracy on AVX2). The Q/DQ-in-float
form the layer-by-layer diff reads is held to float tolerance.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from kernel_models import cases

from qgraph.runtime.kernels.emulate import emulate
from qgraph.runtime.kernels.host import probe_pair_saturation
from qgraph.runtime.kernels.measure import emulated

#: An AVX2-only x86 CPU for qemu-user (features TCG cannot emulate are switched off to keep stderr clean).
QEMU_CPU = "Haswell-noTSX,-pcid,-tsc-deadline,-x2apic,-invpcid"
DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"

CHILD = """
import sys, numpy as np, onnxruntime as ort
from qgraph.runtime.kernels.host import probe_pair_saturation
assert probe_pair_saturation(), "the child's onnxruntime kernels do not saturate: not an AVX2 CPU"
data = np.load(sys.argv[1])
out = {}
for i in range(int(data["n"])):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(sys.argv[2 + i], opts, providers=["CPUExecutionProvider"])
    out[str(i)] = session.run(None, {session.get_inputs()[0].name: data[str(i)]})[0]
np.savez(sys.argv[1] + ".out.npz", **out)
"""


def _runner() -> list[str] | None:
    """The command that runs Python on AVX2 kernels, [] for this process, None when there is no way."""
    if probe_pair_saturation():
        return []
    qemu = shutil.which("qemu-x86_64")
    if qemu is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    exe = os.path.realpath(sys.executable)
    # argv[0] stays the venv's python so the child finds this environment's packages
    return [qemu, "-cpu", QEMU_CPU, "-0", sys.executable, exe]


def _real_avx2(models: list[onnx.ModelProto], inputs: list[np.ndarray], tmp: Path) -> list[np.ndarray]:
    runner = _runner()
    if runner is None:
        pytest.skip("no AVX2 kernels to compare with: this host's kernels are exact and qemu-user is not installed "
                    "(apt-get install qemu-user)")
    if runner == []:
        outs = []
        for m, x in zip(models, inputs, strict=True):
            s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            outs.append(s.run(None, {s.get_inputs()[0].name: x})[0])
        return outs
    paths = []
    for i, m in enumerate(models):
        onnx.save(m, str(tmp / f"m{i}.onnx"))
        paths.append(str(tmp / f"m{i}.onnx"))
    data = tmp / "inputs.npz"
    np.savez(data, n=len(models), **{str(i): x for i, x in enumerate(inputs)})
    script = tmp / "child.py"
    script.write_text(CHILD)
    done = subprocess.run([*runner, str(script), str(data), *paths], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with np.load(str(data) + ".out.npz") as got:
        return [got[str(i)] for i in range(len(models))]


def _emulated(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """How qgraph measures a model for AVX2 on this host (`Kernels.session`): this host's fused kernels, the layers
    that can saturate rewritten (`qgraph.runtime.kernels.requant`)."""
    s = emulated("x86-avx2").session(model)
    return np.asarray(s.run(None, {s.get_inputs()[0].name: x})[0])


def _emulated_in_float(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """Q/DQ in float with optimizations off, the saturation as corrections (the layer-by-layer diff reads it)."""
    em = emulate(model, "x86-avx2", host_saturates=probe_pair_saturation(), count=False)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(em.model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return np.asarray(s.run(None, {s.get_inputs()[0].name: x})[0])


def test_emulation_matches_the_real_avx2_kernels(tmp_path: Path) -> None:
    layers = cases()
    digits = onnx.load(str(DIGITS / "model.onnx"))
    from qgraph import Recipe

    vnni = Recipe.from_yaml(Path(__file__).resolve().parents[2] / "recipes" / "ort-x86-vnni.yaml").pipeline().run(
        digits, calibration_data=str(DIGITS / "calibration.npz")).model
    x_digits = np.load(DIGITS / "eval.npz")["input"][:64]
    models = [c.model for c in layers] + [vnni]
    inputs = [c.x for c in layers] + [x_digits]
    real = _real_avx2(models, inputs, tmp_path)
    for case, got in zip(layers, real, strict=False):
        np.testing.assert_array_equal(_emulated(case.model, case.x), got, err_msg=case.name)  # bit for bit
        want = _emulated_in_float(case.model, case.x)
        np.testing.assert_allclose(want, got, rtol=0, atol=1e-5 * float(np.abs(got).max()), err_msg=case.name)
    logits_real = real[-1]
    np.testing.assert_array_equal(_emulated(vnni, x_digits), logits_real)
    logits_float = _emulated_in_float(vnni, x_digits)
    err = float(np.sum((logits_float - logits_real) ** 2))
    sqnr = 10 * np.log10(float(np.sum(logits_real.astype(np.float64) ** 2)) / max(err, 1e-30))
    assert sqnr > 60, f"emulated (Q/DQ in float) vs real AVX2 logits: {sqnr:.1f} dB"
    if not probe_pair_saturation():  # and saturation does change this model on AVX2 (what the emulation is for)
        exact = ort.InferenceSession(vnni.SerializeToString(), providers=["CPUExecutionProvider"])
        logits_exact = exact.run(None, {"input": x_digits})[0]
        assert float(np.abs(logits_exact - logits_real).max()) > 0.1
