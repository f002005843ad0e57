"""What ``qgraph run`` says on real-shaped models: top-1 agreement only for class scores
(`qgraph.runtime.class_outputs`), and a plain warning line when the result is poor, with or without ``--min-sqnr``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

from qgraph.cli import main
from qgraph.runtime.class_outputs import MIN_HEAD_CLASSES, class_outputs
from qgraph.runtime.evaluation import top1_agreement

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "ort-x86-vnni.yaml"
HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _linear(out: str, n_out: int, body: str = "", seed: int = 0, zero_row: bool = False) -> onnx.ModelProto:
    """x[N, 16] -> MatMul -> ``out`` [N, n_out]; ``body``: the lines after the MatMul (its output is ``h``)."""
    w = np.random.default_rng(seed).standard_normal((16, n_out))
    if zero_row:
        w[0] = 0.0
    consts = ",".join(f"{v:.4f}" for v in w.ravel())
    lines = f"h = MatMul(x, w)\n {body}" if body else f"{out} = MatMul(x, w)"
    return onnx.parser.parse_model(f"{HEAD}g (float[N, 16] x) => (float[N, {n_out}] {out}) "
                                   f"<float[16, {n_out}] w = {{{consts}}}> {{\n {lines}\n}}")


@pytest.mark.parametrize(("model", "columns", "found", "classes"), [
    (_linear("scores", 3), 3, MIN_HEAD_CLASSES, False),  # a regression head: [N, 3] quality scores
    (_linear("output", 10), 10, MIN_HEAD_CLASSES, True),  # a head wide enough to be classes
    (_linear("logits", 3), 3, 2, True),  # its name says so
    (_linear("p", 3, "p = Softmax(h)"), 3, 2, True),  # probabilities
    (_linear("emb", 8, "n = ReduceL2(h)\n emb = Div(h, n)"), 8, None, False),  # an embedding
])
def test_class_like_outputs_by_the_documented_rule(model: onnx.ModelProto, columns: int, found: int | None,
                                                   classes: bool) -> None:
    name = model.graph.output[0].name
    assert class_outputs(model).get(name) == found
    scores = np.random.default_rng(0).standard_normal((6, columns))
    agreement = top1_agreement(scores, scores, found) if found is not None else None
    assert (agreement == 1.0) is classes and (agreement is None) is not classes


def _run(tmp_path: Path, model: onnx.ModelProto, x: np.ndarray, *extra: str) -> int:
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", x=x.astype(np.float32))
    return main(["run", str(RECIPE), str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "-q",
                 "--calibration-data", str(tmp_path / "cal.npz"), *extra])


def test_a_regression_output_gets_no_top1_agreement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(1).standard_normal((16, 16))
    assert _run(tmp_path, _linear("scores", 3), x) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "scores: SQNR " in err and "cosine" in err and "top-1" not in err
    assert _run(tmp_path, _linear("output", 12), x) == 0  # a 12-way head: classes
    err = " ".join(capsys.readouterr().err.split())
    assert "output: SQNR " in err and "top-1 agreement " in err


def _poor(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    """One column 1000x the others and unread by the weights: per-tensor activation codes lose every other."""
    x = np.random.default_rng(2).standard_normal((16, 16))
    x[:, 0] = 3000.0
    code = _run(tmp_path, _linear("scores", 3, zero_row=True), x, *extra)
    return code, " ".join(capsys.readouterr().err.split())


def test_a_poor_result_warns_without_a_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _poor(tmp_path, capsys)
    assert code == 0
    sqnr = float(err.split("scores: SQNR ")[1].split(" dB")[0])
    assert sqnr < 20
    assert (f"warning: poor result: output 'scores': SQNR {sqnr:.1f} dB (below 20 dB, about 10% relative error, "
            "measured on calibration data)") in err
    assert err.count("warning: poor result") == 1
    # a gate it passes: still warned
    code, err = _poor(tmp_path, capsys, "--min-sqnr", str(sqnr - 10))
    assert code == 0 and err.count("warning: poor result") == 1
    # a gate it fails: the error says it, once
    code, err = _poor(tmp_path, capsys, "--min-sqnr", str(sqnr + 10))
    assert code == 3 and "below --min-sqnr" in err and "warning: poor result" not in err


def test_a_good_result_prints_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(1).standard_normal((16, 16))
    assert _run(tmp_path, _linear("scores", 3), x) == 0
    err = " ".join(capsys.readouterr().err.split())
    sqnr = float(err.split("scores: SQNR ")[1].split(" dB")[0])
    assert sqnr > 20 and "warning" not in err
