"""Table hygiene: names shortened from the middle (never wrapped per letter), infinities explained, float-only
diffs without QDQ sections, renamed identical initializers reported as renames."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from rich.console import Console

from qgraph import Recipe
from qgraph.analysis.diff import numeric_diff, structural_diff
from qgraph.analysis.diff.html import short_name, table
from qgraph.analysis.diff.render import print_numeric, print_structural
from qgraph.analysis.diff.tables import rich_table
from qgraph.runtime.compare import random_feeds
from qgraph.testing.models import conv_bn_relu_chain

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"
LONG = [f"/encoder/layer.{i}/attention/self/query/MatMul_output_0/DequantizeLinear_{i}" for i in range(5)]


@pytest.mark.parametrize("width", [20, 33, 48])
def test_short_name_keeps_the_distinctive_tail(width: int) -> None:
    for name in LONG:
        short = short_name(name, width)
        assert len(short) == width and "…" in short
        assert short.startswith(name[: width // 3]) and name.endswith(short.split("…")[1])
    assert short_name("conv1", width) == "conv1"


@pytest.mark.parametrize("columns", [80, 120, 150])
def test_names_never_wrap_per_letter(columns: int) -> None:
    console = Console(record=True, width=columns)
    rows = [[n, "MatMul", 12.5, "a reason with several words that may wrap at word boundaries"] for n in LONG]
    console.print(rich_table("layers", ["node", "op", "SQNR dB", "why"], rows))
    text = console.export_text()
    lines = text.splitlines()
    for i, name in enumerate(LONG):
        tail = name[-6:] if columns < 100 else f"DequantizeLinear_{i}"
        hits = [line for line in lines if tail in line]
        assert len(hits) == 1, (columns, text)  # the whole (shortened) name sits on one line, its tail intact
        assert "12.5" in hits[0]  # numbers never wrap either
    assert max(len(line) for line in lines) <= columns


def test_html_table_names_wrap_only_after_a_separator_and_keep_the_full_name_on_hover() -> None:
    html = table(["node"], [[LONG[0]]])
    assert 'class="name"' in html and f'title="{LONG[0]}"' in html
    assert short_name(LONG[0]) in html.replace("<wbr>", "")
    breaks = [html[i - 1] for i in range(len(html)) if html.startswith("<wbr>", i)]
    assert breaks and set(breaks) <= {"/", "."}  # never inside a word


def test_infinite_sqnr_is_explained() -> None:
    m = conv_bn_relu_chain(2, channels=3, spatial=4)
    console = Console(record=True, width=200)
    print_numeric(console, numeric_diff(m, m, random_feeds(m, 1)), top=3)
    text = console.export_text()
    assert "inf (exact)" in text and "identical values" in text


def test_float_only_diff_has_no_qdq_section_and_removed_nodes_no_creator(tmp_path: Path) -> None:
    passes = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").pipeline().passes
    from qgraph import Pipeline

    fused = Pipeline([p for p in passes if p.name != "insert_qdq"]).run(str(DIGITS / "model.onnx")).model
    console = Console(record=True, width=150)
    d = structural_diff(onnx.load(DIGITS / "model.onnx"), fused)
    print_structural(console, d)
    text = console.export_text()
    assert "removed nodes" in text and "BatchNormalization" in text
    assert "QDQ coverage" not in text and "not int8" not in text and not d.has_quantization()
    removed_table = text[text.index("removed nodes"):]
    assert "created by" not in removed_table.split("\n\n")[0].splitlines()[1]


def test_renamed_identical_initializers_are_renames_not_changes(tmp_path: Path) -> None:
    result = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").pipeline().run(
        str(DIGITS / "model.onnx"), calibration_data=str(DIGITS / "calibration.npz"))
    a = result.model
    b = onnx.ModelProto()
    b.CopyFrom(a)
    old = "input/zero_point"  # shared by the activation Q/DQ pairs
    for t in b.graph.initializer:
        if t.name == old:
            t.name = "shared_zero_point"
    users = 0
    for n in b.graph.node:
        for i, x in enumerate(n.input):
            if x == old:
                n.input[i] = "shared_zero_point"
                users += 1
    assert users >= 10
    d = structural_diff(a, b)
    assert d.summary()["changed"] == 0 and d.unchanged == len(a.graph.node)
    renamed = [i for i in d.initializers if i.kind == "renamed"]
    assert [r.name for r in renamed] == [f"{old} → shared_zero_point"]
    assert d.initializer_counts() == {"added": 0, "removed": 0, "changed": 0, "renamed": 1}
