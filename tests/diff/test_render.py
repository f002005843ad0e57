"""Rendering (terminal, JSON, HTML) and the ``qgraph diff`` command."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest
from handmade_recipe import scale_weight
from rich.console import Console

from qgraph.analysis.diff import numeric_diff, structural_diff
from qgraph.analysis.diff.render import diff_html, diff_json, dumps, print_numeric, print_structural
from qgraph.cli import main
from qgraph.io.model_io import save_model
from qgraph.runtime.compare import random_feeds
from qgraph.testing.models import conv_bn_relu_chain


@pytest.fixture(scope="module")
def pair() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    reference = conv_bn_relu_chain(4, channels=4, spatial=6)
    candidate = scale_weight(reference, "block2/conv", 1.5)
    bn = next(n for n in candidate.graph.node if n.name == "block3/bn")
    bn.attribute[0].f = 1e-3  # an attribute change (epsilon 1e-5 -> 1e-3)
    return reference, candidate


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.ids |= {v for k, v in attrs if k == "id" and v}


def test_terminal_tables(pair: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    a, b = pair
    console = Console(record=True, width=220)
    s = structural_diff(a, b)
    n = numeric_diff(a, b, random_feeds(a, 2))
    print_structural(console, s, top=3)
    print_numeric(console, n, top=3)
    text = console.export_text()
    assert "nodes +0 -0 ~1" in text and "initializers +0 -0 ~1" in text
    assert "op histogram" in text and "BatchNormalization" in text
    assert "block2/conv.weight" in text and "changed" in text
    assert "error first jumps at block2/conv (Conv)" in text
    assert "layers that introduced error" in text and "worst layers" in text


def test_html_is_self_contained_and_complete(pair: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    a, b = pair
    page = diff_html(structural_diff(a, b), numeric_diff(a, b, random_feeds(a, 1)), top=5)
    assert not re.search(r"https?://", page) and "<script" not in page and "<link" not in page
    parser = _Collector()
    parser.feed(page)
    assert {"models", "ops", "op-chart", "layer-chart", "outputs", "introduced", "worst", "first-jump"} <= parser.ids
    assert "qdq-coverage" not in parser.ids and "QDQ coverage" not in page  # both models are float
    assert parser.tags.count("svg") == 2 and parser.tags.count("rect") > 10
    assert "block2/conv" in page


def test_json_round_trip(pair: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    a, b = pair
    data = json.loads(dumps(diff_json(structural_diff(a, b), None)))
    assert data["numeric"] is None
    assert data["structural"]["summary"]["changed"] == 1
    assert data["structural"]["changed"][0]["changes"] == ["attribute epsilon: 1e-05 → 0.001"]


def test_cli_diff(pair: tuple[onnx.ModelProto, onnx.ModelProto], tmp_path: Path,
                  capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pair
    pa, pb = save_model(a, tmp_path / "a.onnx"), save_model(b, tmp_path / "b.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", input=rng.standard_normal((3, 1, 4, 6, 6)).astype(np.float32))

    assert main(["diff", str(pa), str(pb), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["structural"]["initializers"][0]["name"] == "block2/conv.weight" and data["numeric"] is None

    html, js = tmp_path / "d.html", tmp_path / "out" / "d.json"
    code = main(["diff", str(pa), str(pb), "--inputs", str(tmp_path / "data.npz"), "--samples", "2",
                 "--html", str(html), "--json", str(js), "--top", "3"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "error first jumps at block2/conv" in printed
    report = json.loads(js.read_text())
    assert report["numeric"]["samples"] == 2 and report["numeric"]["first_jump"]["node"] == "block2/conv"
    assert len(report["numeric"]["worst"]) == 3
    assert "layer-chart" in html.read_text() and not list(tmp_path.glob("**/.*.tmp"))

    assert main(["diff", str(pa), str(pb), "--inputs", "random", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["numeric"]["samples"] == 8


def test_cli_diff_bad_inputs(tmp_path: Path, pair: tuple[onnx.ModelProto, onnx.ModelProto],
                             capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = pair
    pa = save_model(a, tmp_path / "a.onnx")
    assert main(["diff", str(pa), str(tmp_path / "missing.onnx")]) == 2
    assert "model file not found" in capsys.readouterr().err
    np.savez(tmp_path / "bad.npz", wrong=np.zeros((1, 1, 4, 6, 6), np.float32))
    assert main(["diff", str(pa), str(pa), "--inputs", str(tmp_path / "bad.npz")]) == 2
    assert "input names do not match" in capsys.readouterr().err
