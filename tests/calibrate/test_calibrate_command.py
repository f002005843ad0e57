"""`qgraph calibrate`: ranges of the graph the recipe quantizes, tied to that graph's fingerprint."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from qgraph import DataError, Recipe
from qgraph.calibrate import read_ranges
from qgraph.cli import main
from qgraph.cli.calibrate_command import float_activations, prepared_model
from qgraph.io.model_io import load_model, model_fingerprint

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"
RECIPE = ROOT / "recipes" / "ort-x86-vnni.yaml"


def test_calibrate_writes_ranges_of_the_prepared_graph(tmp_path: Path) -> None:
    out = tmp_path / "ranges.json"
    code = main(["calibrate", str(RECIPE), str(DIGITS / "model.onnx"), "-o", str(out),
                 "--calibration-data", str(DIGITS / "calibration.npz"), "--method", "minmax"])
    assert code == 0
    prepared = prepared_model(Recipe.from_yaml(RECIPE), DIGITS / "model.onnx", DIGITS / "calibration.npz")
    assert sum(n.op_type == "BatchNormalization" for n in prepared.graph.node) == 0  # after fuse_batchnorm
    ranges = read_ranges(out, model_fingerprint(prepared))
    names = float_activations(prepared)
    assert set(ranges.tensors) == set(names)
    # minmax over the data equals the brute-force min/max of the input tensor itself.
    x = np.load(DIGITS / "calibration.npz")[prepared.graph.input[0].name]
    got = ranges.ranges()[prepared.graph.input[0].name]
    assert float(got.rmin) == pytest.approx(min(float(x.min()), 0.0))
    assert float(got.rmax) == pytest.approx(max(float(x.max()), 0.0))
    # Reusing the file for another graph (the unprepared model) is an error, not a silent mismatch.
    with pytest.raises(DataError, match=r"fingerprint|different model"):
        read_ranges(out, model_fingerprint(load_model(DIGITS / "model.onnx")))


def test_recipe_reuses_ranges_file_and_refuses_a_foreign_one(tmp_path: Path) -> None:
    from qgraph import QGraphError

    out = tmp_path / "ranges.json"
    # Without data, correct_bias cannot measure (it says so and does nothing) and smooth_quant refuses (its
    # per-channel maxima are not in a ranges file): compare insert_qdq's ranges alone.
    base = re.sub(r"\n  - pass: correct_bias[^\n]*", "", RECIPE.read_text())
    base = re.sub(r"\n  - pass: smooth_quant\n    nodes: [^\n]*\n    alpha: auto\n    insert_mul: true", "", base)
    assert "smooth_quant" not in base
    (tmp_path / "base.yaml").write_text(base)
    assert main(["calibrate", str(tmp_path / "base.yaml"), str(DIGITS / "model.onnx"), "-o", str(out),
                 "--calibration-data", str(DIGITS / "calibration.npz")]) == 0
    text = base.replace("\npasses:", f"\ncalibration: {{ranges: {out}}}\npasses:", 1)
    assert "calibration:" in text
    recipe = Recipe.from_text(text, "reuse.yaml")
    result = recipe.pipeline().run(DIGITS / "model.onnx")  # no data needed: every range comes from the file
    assert sum(n.op_type == "QuantizeLinear" for n in result.model.graph.node) > 0
    with_data = Recipe.from_text(base, "base.yaml").pipeline().run(
        DIGITS / "model.onnx", calibration_data=DIGITS / "calibration.npz"
    )
    assert result.model.graph.SerializeToString() == with_data.model.graph.SerializeToString()
    # The same file on a different graph (no BN fusion before quantizing) is refused.
    foreign = Recipe.from_text(text.replace("  - pass: fuse_batchnorm\n", ""), "foreign.yaml")
    with pytest.raises(QGraphError, match=r"fingerprint|different model|computed for"):
        foreign.pipeline().run(DIGITS / "model.onnx")


def test_calibrate_reports_where_calibration_is_fragile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    monkeypatch.setattr("qgraph.cli._app.out", Console(width=250))  # whole tensor names on one line
    out = tmp_path / "ranges.json"
    assert main(["calibrate", str(RECIPE), str(DIGITS / "model.onnx"), "-o", str(out),
                 "--calibration-data", str(DIGITS / "calibration.npz"), "--method", "percentile"]) == 0
    printed = capsys.readouterr().out
    assert "most values clipped" in printed and "largest max|x| / p99.99" in printed
    tensors = read_ranges(out).tensors
    assert all(t.robust_absmax is not None and t.robust_absmax >= 0 for t in tensors.values())
    worst = max(tensors.values(), key=lambda t: t.clip_fraction)
    assert worst.clip_fraction > 0 and worst.name in printed


def test_calibrate_auto_prints_and_records_the_chosen_methods(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    monkeypatch.setattr("qgraph.cli._app.out", Console(width=250))
    out = tmp_path / "ranges.json"
    assert main(["calibrate", str(RECIPE), str(DIGITS / "model.onnx"), "-o", str(out),
                 "--calibration-data", str(DIGITS / "calibration.npz"), "--method", "auto"]) == 0
    printed = capsys.readouterr().out
    assert "method auto chose:" in printed and "where auto's choice mattered most" in printed
    doc = read_ranges(out)
    assert doc.method == "auto"
    chosen = [t.choice for t in doc.tensors.values()]
    assert all(c is not None for c in chosen)
    assert doc.options["dtype"] == "uint8" and doc.options["symmetric"] is False  # the recipe's activation grid
    best = max(doc.tensors.values(), key=lambda t: t.choice.gain_db)  # type: ignore[union-attr]
    assert best.name in printed and best.chosen_method.replace("percentile:", "p") in printed
    for t in doc.tensors.values():
        c = t.choice
        assert c is not None and (float(t.range.rmin), float(t.range.rmax)) == c.ranges[c.winner]
