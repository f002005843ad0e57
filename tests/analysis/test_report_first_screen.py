"""The report's first screen answers "is this model good enough, and if not, what do I change": the verdict by a
documented rule, the top culprits and their remedy as a recipe patch that `qgraph run --patch` applies; the
page fits 1280 px without sideways scrolling (headless Chromium), the chart has axis labels, no empty tables."""

from __future__ import annotations

import html
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from qgraph import Recipe
from qgraph.analysis.report import build_report
from qgraph.analysis.report_summary import first_screen_html, remedy_nodes, verdict

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"
CHROMIUM = Path("/usr/bin/chromium")


def _out(sqnr: Any, metric: float | None = None, top1: float | None = None) -> dict[str, Any]:
    return {"output": "y", "sqnr_db": sqnr, "metric": metric, "top1_agreement": top1}


@pytest.mark.parametrize(("check", "level"), [
    ({"outputs": [_out(40.0, 0.985)], "float_metric": 0.99}, "good"),          # -0.5%
    ({"outputs": [_out(40.0, 0.97)], "float_metric": 0.99}, "borderline"),     # -2.0%
    ({"outputs": [_out(40.0, 0.90)], "float_metric": 0.99}, "poor"),           # a metric beats a good SQNR
    ({"outputs": [_out(12.0, top1=0.995)]}, "good"),                            # top-1 agreement decides
    ({"outputs": [_out(31.0)]}, "good"),
    ({"outputs": [_out(25.0), _out("inf")]}, "borderline"),                     # the lowest output decides
    ({"outputs": [_out(8.0)]}, "poor"),
    ({"outputs": [_out(math.nan)]}, "poor"),                                    # NaN is never fine
    ({"outputs": [_out(40.0, math.nan)], "float_metric": 0.99}, "poor"),
    (None, "unmeasured"),
])
def test_the_verdict_follows_the_documented_rule(check: dict[str, Any] | None, level: str) -> None:
    v = verdict(check, [])
    assert v.level == level, v.reason
    assert v.reason.endswith(".")


@pytest.fixture(scope="module")
def digits_report() -> Any:
    recipe = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml")
    result = recipe.pipeline().run(str(DIGITS / "model.onnx"), calibration_data=str(DIGITS / "calibration.npz"),
                                   keep_stages=True, keep_input=True)
    return recipe, build_report(recipe, result)


def test_a_poor_model_gets_its_culprits_and_a_patch_that_applies(digits_report: Any, tmp_path: Path) -> None:
    from qgraph.cli import main

    _, report = digits_report
    assert report.attribution is not None and len(report.attribution.culprits) >= 3
    page = first_screen_html({"outputs": [_out(12.0)], "data": "eval.npz", "held_out": True}, [],
                             report.attribution)
    assert 'class="verdict poor"' in page and page.count("<li>") == 3
    patch = html.unescape(re.search(r'<pre id="remedy">(.*?)</pre>', page, re.S).group(1))  # type: ignore[union-attr]
    nodes = remedy_nodes(report.attribution)
    assert len(nodes) == 3 and all(json.dumps(n) in patch for n in nodes)
    (tmp_path / "fix.yaml").write_text(patch)
    out = tmp_path / "fixed.onnx"
    assert main(["run", str(ROOT / "recipes" / "ort-x86-vnni.yaml"), str(DIGITS / "model.onnx"), "-q", "--no-check",
                 "--calibration-data", str(DIGITS / "calibration.npz"), "--patch", str(tmp_path / "fix.yaml"),
                 "-o", str(out), "--report", str(tmp_path / "r.json")]) == 0
    fallback = [p for p in json.loads((tmp_path / "r.json").read_text())["passes"] if p["pass"] == "float_fallback"]
    assert fallback and fallback[0]["rewritten"] >= 1 and not fallback[0]["unmatched"]


def test_a_good_model_says_nothing_needs_to_change(digits_report: Any) -> None:
    _, report = digits_report
    page = first_screen_html({"outputs": [_out(40.7, 0.9867)], "float_metric": 0.9889, "held_out": False,
                              "data": "calibration"}, [], report.attribution)
    assert 'class="verdict good"' in page and "Nothing needs to change" in page and "remedy" not in page
    assert "not held-out" in page  # a verdict on calibration data says so


_PROBE = """<script>window.addEventListener('load',()=>{const over=[];
document.querySelectorAll('.scroll,svg,pre,table,section').forEach(e=>{const r=e.getBoundingClientRect();
if(e.scrollWidth>e.clientWidth+1||r.right>innerWidth+1)over.push(e.id||e.className||e.tagName)});
const p=document.createElement('pre');p.id='probe';
p.textContent=JSON.stringify({page:document.documentElement.scrollWidth,inner:innerWidth,over:over,
verdictBottom:document.getElementById('verdict').getBoundingClientRect().bottom});document.body.appendChild(p)})
</script>"""


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (/usr/bin/chromium); CI installs it "
                    "with `apt-get install -y chromium`")
def test_the_report_fits_1280_px_and_leads_with_the_verdict(tmp_path: Path) -> None:
    from qgraph.cli import main

    report = tmp_path / "report.html"
    assert main(["run", str(ROOT / "recipes" / "ort-cpu.yaml"), str(DIGITS / "model.onnx"), "-q",
                 "--calibration-data", str(DIGITS / "calibration.npz"), "-o", str(tmp_path / "m.onnx"),
                 "--eval-data", str(DIGITS / "eval.npz"), "--metric", f"{DIGITS / 'metric.py'}:top1",
                 "--report", str(report)]) == 0
    text = report.read_text()
    assert "<script" not in text  # the report itself stays script-free; the probe goes into a copy
    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", _PROBE + "</body>"))
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    measured = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1)))  # type: ignore[union-attr]
    assert measured["page"] <= measured["inner"] == 1280 and measured["over"] == [], measured
    assert measured["verdictBottom"] < 900  # on the first screen
    assert re.search(r'id="verdict" class="verdict good"><b>GOOD</b> metric 0\.98', text)
    assert 'class="axis-y"' in text and 'class="axis-x"' in text
    # "Nodes left alone": a table with at least one row, or the sentence saying there is none; never both, never
    # a table of headers only
    skipped = re.search(r'<table id="skipped">.*?</table>', text, re.S)
    said_none = "no pass skipped a node it matched" in text
    assert (skipped is None) == said_none
    assert skipped is None or "<tbody><tr>" in skipped.group(0)


def test_a_share_over_100_percent_is_said_in_words() -> None:
    from qgraph.analysis.diff.attribution import share_text

    assert share_text(0.57) == "57%"
    assert share_text(1.24) == "124% (alone more than the whole model's error: other pairs partly cancel it)"
