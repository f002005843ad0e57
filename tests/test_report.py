"""Run reports: JSON content, the HTML page in a real headless Chromium, and ``qgraph run --report``."""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from diff.handmade_recipe import FoldBatchNorm, InsertQDQ, NoOptions, RemoveDropout

from qgraph import GraphHandle, Pass, PassContext, PassResult, Pipeline, Recipe
from qgraph.analysis.report import build_report, report_html, stage_fidelity, write_report
from qgraph.errors import QGraphError
from qgraph.io.model_io import save_model
from qgraph.pipeline import pass_api
from qgraph.runtime.compare import random_feeds
from qgraph.testing.models import conv_bn_net

CHROMIUM = Path("/usr/bin/chromium")


class FakeFallback(Pass[NoOptions]):
    """Stands in for float_fallback: reports its decisions in details, changes nothing."""

    name = "test_float_fallback"
    config_class = NoOptions
    preserves_float = False

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        res = PassResult(matched=1)
        res.details = {"fallen_back": ["gemm"], "target": {"metric": "cosine", "goal": 0.99}, "target_met": True}
        res.notes.append("patch: float_fallback names [gemm]")
        return res


def _passes() -> list[Pass[Any]]:
    return [RemoveDropout(), FoldBatchNorm(), InsertQDQ(), FakeFallback()]


@pytest.fixture(scope="module")
def run_result() -> tuple[Recipe, Any]:
    model = conv_bn_net(opset=17)
    recipe = Recipe("report-test", _passes(), description="hand-made recipe for the report tests")
    return recipe, recipe.pipeline().run(model, keep_stages=True, verify=True)


def test_report_data(run_result: tuple[Recipe, Any]) -> None:
    recipe, result = run_result
    assert len(result.stages) == len(result.records) == 4  # the pipeline's keep_stages hook
    assert all(isinstance(m, onnx.ModelProto) for m in result.stages) and result.calibration_data is None
    report = build_report(recipe, result)
    assert report.notes == []  # stages were kept: no re-run
    assert [p["pass"] for p in report.passes] == [p.name for p in _passes()]
    fold = report.passes[1]
    n_bn = sum(n.op_type == "BatchNormalization" for n in result.input_model.graph.node)
    assert fold["structural"]["removed"] == 2 * n_bn and fold["structural"]["added"] == n_bn
    assert fold["verify_worst_relative"] is not None and fold["verify_worst_relative"] < 1e-4
    qdq = report.passes[2]
    assert qdq["structural"]["op_delta"]["DequantizeLinear"] == qdq["details"]["activations"] + qdq["details"][
        "weights"]
    stages = [r["stage"] for r in report.fidelity]
    assert stages == ["float original", "after #0 test_remove_dropout", "after #1 test_fold_bn", "after #2 test_qdq",
                      "after #3 test_float_fallback", "final"]
    by_stage = {r["stage"]: r for r in report.fidelity}
    assert by_stage["float original"]["sqnr_db"] == math.inf
    assert by_stage["after #1 test_fold_bn"]["sqnr_db"] > 100  # BN folding is float-exact up to rounding
    assert 15 < by_stage["final"]["sqnr_db"] < 100
    assert by_stage["final"]["top1_agreement"] is not None  # logits [N, classes]
    assert report.layers is not None and report.layers.first_jump is not None
    assert report.coverage.counts()["int8"] == sum(n.op_type in ("Conv", "Gemm") for n in result.model.graph.node)
    assert report.fallback == [{"pass": "test_float_fallback",
                                "details": {"fallen_back": ["gemm"], "target": {"metric": "cosine", "goal": 0.99},
                                            "target_met": True},
                                "notes": ["patch: float_fallback names [gemm]"]}]
    data = json.loads(json.dumps(report.to_dict(), default=str).replace("Infinity", '"inf"'))
    assert data["recipe"]["name"] == "report-test" and "test_qdq" in data["recipe"]["yaml"]


def test_report_files_and_formats(run_result: tuple[Recipe, Any], tmp_path: Path) -> None:
    recipe, result = run_result
    write_report(tmp_path / "r.json", recipe, result)

    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in JSON")

    data = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert data["fidelity"][0]["sqnr_db"] == "inf" and len(data["passes"]) == 4
    with pytest.raises(QGraphError, match="unknown report format"):
        write_report(tmp_path / "r.txt", recipe, result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def report_layers(result: Any) -> int:
    """Tensors compared by the report's per-layer diff (one bar each)."""
    return sum(1 for n in result.input_model.graph.node for t in n.output if t and n.op_type != "Constant"
               and any(t in m.output for m in result.model.graph.node))


def _dump_dom(html: Path, tmp: Path) -> str:
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
           "--dump-dom", html.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (/usr/bin/chromium); CI installs it "
                    "with `apt-get install -y chromium`")
def test_html_report_renders_in_headless_chromium(run_result: tuple[Recipe, Any], tmp_path: Path) -> None:
    recipe, result = run_result
    page = tmp_path / "report.html"
    write_report(page, recipe, result)
    text = page.read_text()
    assert not re.search(r"https?://", text), "the report must not reference any URL (no network, no CDN)"
    assert "<script" not in text and "<link" not in text and "@import" not in text
    dom = _dump_dom(page, tmp_path)
    for table_id in ("passes", "fidelity", "outputs", "introduced", "worst", "qdq-coverage", "skipped"):
        assert re.search(rf'<table id="{table_id}">', dom), table_id
    chart = re.search(r'<svg id="layer-chart".*?</svg>', dom, re.S)
    assert report_layers(result) >= 10
    assert chart is not None and chart.group(0).count("<rect") == report_layers(result)
    passes_table = re.search(r'<table id="passes">.*?</table>', dom, re.S)
    assert passes_table is not None and passes_table.group(0).count("<tr") == 1 + 4
    fidelity = re.search(r'<table id="fidelity">.*?</table>', dom, re.S)
    assert fidelity is not None and "after #1 test_fold_bn" in fidelity.group(0)
    assert "fallen_back" in dom and "Fallback decisions" in dom


@pytest.fixture
def registered() -> Iterator[None]:
    pass_api.discover()
    classes = [type(p) for p in _passes()]
    for cls in classes:
        pass_api.register(cls)
    yield
    for cls in classes:
        pass_api._REGISTRY.pop(cls.name, None)


def test_cli_run_report_uses_the_stages_of_the_run(registered: None, tmp_path: Path) -> None:
    from qgraph.cli import main

    model = save_model(conv_bn_net(opset=17), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", input=rng.standard_normal((5, 3, 32, 32)).astype(np.float32))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: cli-report\npasses:\n" + "".join(f"  - pass: {p.name}\n" for p in _passes()))
    code = main(["run", str(recipe), str(model), "-o", str(tmp_path / "out.onnx"), "-q",
                 "--calibration-data", str(tmp_path / "calib.npz"), "--report", str(tmp_path / "rep.json")])
    assert code == 0
    data = json.loads((tmp_path / "rep.json").read_text())
    assert not any(n.startswith("stages recomputed") for n in data["notes"])  # the CLI keeps stages
    assert data["data"].startswith("5 sample(s) of") and "calib.npz (the calibration data: not held out" in data["data"]
    assert [r["stage"] for r in data["fidelity"]][-1] == "final" and len(data["fidelity"]) == 6
    out = onnx.load(str(tmp_path / "out.onnx"))
    assert sum(n.op_type == "QuantizeLinear" for n in out.graph.node) == data["passes"][2]["details"]["activations"]


def test_report_without_stages_from_python(run_result: tuple[Recipe, Any]) -> None:
    recipe, _ = run_result
    result = Pipeline(_passes()).run(conv_bn_net(opset=17))
    assert result.stages == []
    page = report_html(build_report(recipe, result))
    assert "stages recomputed" in page and 'id="fidelity"' in page
    fallback = page[page.index('id="fallback-section"'):page.index('id="skipped-section"')]
    assert "test_float_fallback" in fallback and "fallen_back" in fallback and "target_met" in fallback


def test_stage_that_cannot_run_gets_an_error_row() -> None:
    reference = conv_bn_net(opset=17)
    broken = onnx.ModelProto()
    broken.CopyFrom(reference)
    broken.graph.node[0].op_type = "NoSuchOp"
    rows = stage_fidelity(reference, [("ok", reference), ("broken", broken)], random_feeds(reference, 2))
    assert rows[0]["stage"] == "ok" and rows[0]["sqnr_db"] == math.inf and rows[0]["top1_agreement"] == 1.0
    assert rows[1]["stage"] == "broken" and "NoSuchOp" in rows[1]["error"]
