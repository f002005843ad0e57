"""The fidelity check at the end of ``qgraph run`` (`qgraph.analysis.fidelity`): the printed numbers are compare_models'
numbers on the same samples, NaN/Inf never reads as a match, --min-sqnr exits 3 with the model written."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

from qgraph.analysis.fidelity import CHECK_SAMPLES, check_fidelity, first_samples
from qgraph.cli import main
from qgraph.data import open_data_source
from qgraph.runtime.compare import compare_models
from qgraph.runtime.kernels.measure import choose, model_target

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
RECIPE = ROOT / "recipes" / "ort-x86-vnni.yaml"


def _digits_run(tmp_path: Path, *extra: str) -> list[str]:
    return ["run", str(RECIPE), str(DIGITS / "model.onnx"), "-o", str(tmp_path / "d.int8.onnx"), "-q",
            "--calibration-data", str(DIGITS / "calibration.npz"), *extra]


def test_run_prints_sqnr_of_compare_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    assert main([*_digits_run(tmp_path), "--report", str(report)]) == 0
    err = capsys.readouterr().err
    assert "calibration data (not held-out" in err and f"{CHECK_SAMPLES} sample(s)" in err
    found = re.search(r"logits: SQNR (-?\d+\.\d) dB, cosine (\d\.\d+), .*top-1 agreement (\d+\.\d)%", err)
    assert found is not None, err
    model = onnx.load(str(DIGITS / "model.onnx"))
    data = open_data_source(str(DIGITS / "calibration.npz")).bind(model)
    int8 = onnx.load(str(tmp_path / "d.int8.onnx"))
    kernels = choose(model_target(int8)).kernels  # what the run measures with: the recipe's CPU, here or emulated
    (diff,) = compare_models(kernels.session(model), kernels.session(int8), first_samples(data))
    assert math.isfinite(diff.sqnr_db) and 20 < diff.sqnr_db < 80  # quantized: real error, not identity
    assert float(found.group(1)) == pytest.approx(diff.sqnr_db, abs=0.051)
    assert float(found.group(2)) == pytest.approx(diff.cosine, abs=1e-5)
    check = json.loads(report.read_text())["check"]
    assert check["held_out"] is False and check["outputs"][0]["sqnr_db"] == pytest.approx(diff.sqnr_db)


def test_run_on_eval_data_with_min_sqnr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _digits_run(tmp_path, "--eval-data", str(DIGITS / "eval.npz"))
    assert main([*args, "--min-sqnr", "20"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    sqnr = float(re.search(r"logits: SQNR (\d+\.\d) dB", err).group(1))  # type: ignore[union-attr]
    assert "450 sample(s) of" in err and "not held-out" not in err
    (tmp_path / "d.int8.onnx").unlink()
    assert main([*args, "--min-sqnr", str(sqnr + 5)]) == 3  # below the bar: written, exit 3
    err = " ".join(capsys.readouterr().err.split())
    assert "below --min-sqnr" in err and (tmp_path / "d.int8.onnx").exists()
    assert main([*args, "--no-check"]) == 2  # --eval-data has nothing to measure
    assert main([*_digits_run(tmp_path), "--no-check"]) == 0
    assert "SQNR" not in capsys.readouterr().err
    assert main([*_digits_run(tmp_path), "--no-check", "--min-sqnr", "20"]) == 2


def _log_net(path: Path) -> Path:
    """MatMul then Log: negative pre-activations give NaN in the float model and in its INT8 version alike."""
    w = np.random.default_rng(0).standard_normal(128)
    text = ("<ir_version: 8, opset_import: [\"\": 17]>\ng (float[N, 16] x) => (float[N, 8] y) "
            f"<float[16, 8] w = {{{','.join(f'{v:.4f}' for v in w)}}}> {{\n h = MatMul(x, w)\n y = Log(h)\n}}")
    onnx.save(onnx.parser.parse_model(text), str(path))
    return path


def test_nan_is_never_a_match(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _log_net(tmp_path / "log.onnx")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32))
    args = ["run", str(RECIPE), str(model), "-o", str(tmp_path / "o.onnx"), "-q",
            "--calibration-data", str(tmp_path / "cal.npz")]
    assert main(args) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "y: NaN/Inf in the outputs" in err and "not a match" in err and "SQNR" not in err
    assert main([*args, "--min-sqnr", "-100"]) == 3  # not comparable fails any bar
    assert "NaN/Inf values, not comparable" in capsys.readouterr().err


def test_nan_only_in_the_candidate(tmp_path: Path) -> None:
    reference = onnx.parser.parse_model("<ir_version: 8, opset_import: [\"\": 17]>\n"
                                        "g (float[N, 4] x) => (float[N, 4] y) { y = Relu(x) }")
    np.savez(tmp_path / "d.npz", x=-np.ones((3, 4), np.float32))
    data = open_data_source(str(tmp_path / "d.npz")).bind(reference)
    ok = check_fidelity(reference, reference, data)
    assert ok is not None and ok.rows[0]["sqnr_db"] == math.inf and not ok.failures(100.0)
    neg = onnx.parser.parse_model("<ir_version: 8, opset_import: [\"\": 17]>\n"
                                  "g (float[N, 4] x) => (float[N, 4] y) { y = Sqrt(x) }")
    bad = check_fidelity(reference, neg, data)
    assert bad is not None and math.isnan(bad.rows[0]["sqnr_db"]) and bad.rows[0]["nonfinite_candidate"] == 12
    assert bad.failures(-1e9) and "NaN/Inf" in bad.lines()[1]
    assert check_fidelity(reference, neg, None) is None  # no samples: no claim


def test_a_quantized_input_model_is_named_as_what_the_check_compares_with(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A patch applied to a QDQ model (the sensitivity workflow): the check compares with that QDQ model and says
    so, instead of calling it the float model."""
    assert main(_digits_run(tmp_path)) == 0
    patch = tmp_path / "p.yaml"
    patch.write_text("name: p\npasses:\n  - pass: float_fallback\n    nodes: {op_types: [Gemm]}\n")
    capsys.readouterr()
    assert main(["run", str(patch), str(tmp_path / "d.int8.onnx"), "-o", str(tmp_path / "p.onnx"),
                 "--calibration-data", str(DIGITS / "calibration.npz")]) == 0
    err = capsys.readouterr().err
    assert "check against the input model, itself quantized" in err and "against the float model" not in err
    first = check_fidelity(DIGITS / "model.onnx", tmp_path / "p.onnx",
                           open_data_source(str(DIGITS / "calibration.npz")))
    assert first is not None and first.against == "the float model"


def test_run_checks_each_part_of_an_output_a_concat_joins(detector: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A detector's boxes and class scores joined in one output: the check prints the whole output and a line per
    part, --min-sqnr holds each part to the bound, and the report's fidelity rows carry the parts."""
    out, report = tmp_path / "d.int8.onnx", tmp_path / "r.json"
    args = ["run", str(detector["recipe"]), str(detector["float"]), "-o", str(out), "-q", "--calibration-data",
            str(detector["calibration"]), "--eval-data", str(detector["eval"]), "--report", str(report)]
    assert main([*args, "--min-sqnr", "20"]) == 3  # the whole output is at > 40 dB: only its scores fail
    err = capsys.readouterr().err
    judged = err.split("  measured with")[0]  # this host's own numbers follow when it is not the target CPU
    found = re.finditer(r"^ *(output0(?:\[\d+:\d+\] \(\w+\))?): SQNR (-?\d+\.\d) dB", judged, re.M)
    lines = {m.group(1): float(m.group(2)) for m in found}
    assert list(lines) == ["output0", "output0[0:4] (boxes)", "output0[4:22] (scores)"], err
    assert "\n    output0[4:22] (scores): SQNR" in err  # indented under its output
    assert lines["output0"] > 40 and lines["output0[0:4] (boxes)"] > 40 and lines["output0[4:22] (scores)"] < 1
    assert "error: output 'output0[4:22] (scores)': SQNR 0.0 dB: below --min-sqnr 20 dB" in err
    assert "output 'output0':" not in err
    rows = [r for r in json.loads(report.read_text())["fidelity"] if r["stage"] == "final"]
    assert [r.get("part_of") for r in rows] == [None, "output0", "output0"]
    assert rows[2]["sqnr_db"] == pytest.approx(lines["output0[4:22] (scores)"], abs=0.051)
