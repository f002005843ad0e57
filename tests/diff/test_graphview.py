"""The visual diff: changed regions side by side, as inline SVG, rendered by headless Chromium."""

from __future__ import annotations

import re
import struct
import subprocess
import zlib
from pathlib import Path

import onnx
import pytest

from qgraph.analysis.diff.graphview import changed_regions_html, find_regions
from qgraph.analysis.diff.protos import ModelIndex
from qgraph.analysis.diff.structural import match_nodes
from qgraph.cli import main
from qgraph.testing.models import conv_bn_relu_chain

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def int8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qgraph import Recipe

    out = tmp_path_factory.mktemp("graphview") / "digits.int8.onnx"
    Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").pipeline().run(
        str(DIGITS / "model.onnx"), calibration_data=str(DIGITS / "calibration.npz")).save(out)
    return out


def test_regions_group_each_quantized_op_with_its_qdq(int8: Path) -> None:
    a, b = onnx.load(DIGITS / "model.onnx"), onnx.load(int8)
    ia, ib = ModelIndex.build(a), ModelIndex.build(b)
    regions = find_regions(ia, ib, match_nodes(ia, ib))
    removed = {ia.nodes[i].op for r in regions for i in r.changed_a}
    inserted = [ib.nodes[i].op for r in regions for i in r.changed_b]
    assert removed == {"BatchNormalization"}  # fused away
    assert inserted.count("QuantizeLinear") == 7 and inserted.count("DequantizeLinear") == 15
    assert all(len(r.changed_a) + len(r.changed_b) <= 40 for r in regions)
    # Every region has context: the matched neighbours its changed nodes attach to.
    assert all(r.anchors for r in regions)
    assert 3 <= len(regions) <= 12


def test_identical_models_have_no_region() -> None:
    m = conv_bn_relu_chain(2, channels=3, spatial=4)
    assert "No node was added, removed or changed" in changed_regions_html(m, m)


def _png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and raw (filtered) scanlines of a PNG (enough to tell a blank page from a drawing)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (/usr/bin/chromium); CI installs it "
                    "with `apt-get install -y chromium`")
def test_html_diff_renders_the_regions_in_headless_chromium(int8: Path, tmp_path: Path) -> None:
    page = tmp_path / "diff.html"
    code = main(["diff", str(DIGITS / "model.onnx"), str(int8), "--eval-data", str(DIGITS / "eval.npz"),
                 "--html", str(page), "--json", str(tmp_path / "diff.json")])
    assert code == 0
    text = page.read_text()
    assert not re.search(r"https?://", text) and "<script" not in text and "<link" not in text
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'p'}"]
    dom = subprocess.run([str(CHROMIUM), *flags, "--dump-dom", page.resolve().as_uri()], capture_output=True,
                         text=True, timeout=120, check=False)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    # Regions drawn before (A) and after (B), with the expected node labels and colours.
    befores = re.findall(r'<svg id="region-\d+-a".*?</svg>', html, re.S)
    afters = re.findall(r'<svg id="region-\d+-b".*?</svg>', html, re.S)
    assert len(befores) == len(afters) == 8  # the 8 regions with the most error; the rest are counted
    assert "more region(s) not drawn" in html
    assert any("BatchNormalization" in svg and 'class="node removed"' in svg for svg in befores)
    assert any("QuantizeLinear" in svg and "DequantizeLinear" in svg and ">Conv<" in svg
               and 'class="node qdq"' in svg for svg in afters)
    assert html.count('class="node qdq"') >= 10
    assert 'id="culprits"' in html and 'id="culprit-headline"' in html
    shot = tmp_path / "diff.png"
    done = subprocess.run([str(CHROMIUM), *flags, "--window-size=1280,4000", f"--screenshot={shot}",
                           page.resolve().as_uri()], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    width, height, raw = _png_pixels(shot)
    assert (width, height) == (1280, 4000)
    assert len(set(raw)) > 50  # not a blank page: text, boxes and colours were drawn
