"""The numeric diff and the culprit ranking inside If/Loop bodies (`qgraph.analysis.diff.bodies`).

The If model (`qgraph.testing.mode_switched_net`: Conv + Relu in each branch, chosen by ``mode``) is quantized by
``insert_qdq`` on data taking both branches, so both are quantized statically; one pair inside the then-branch
then gets a step 20x too small (it clips), and the diff must name that body pair first, with the output SQNR it
causes alone, and say that the else-branch did not run on mode-1 inputs.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from rich.console import Console

from qgraph import Pipeline
from qgraph.analysis.diff import attribute, diff_files, numeric_diff
from qgraph.analysis.diff.render import diff_html, diff_json, print_numeric
from qgraph.data import CallableSource
from qgraph.pipeline.pass_api import get_pass
from qgraph.testing import mode_feeds, mode_switched_net
from qgraph.testing.control_flow import LOOP_TRIPS, loop_net, nested_feeds, nested_switched_net

THEN = "switch.then_branch"
ELSE = "switch.else_branch"
SHRINK = 0.05  # the planted defect: the then-branch's input pair gets a step 20x too small


def _both_modes(n: int) -> list[dict[str, np.ndarray]]:
    return mode_feeds(n, mode=1) + mode_feeds(n, mode=0, seed=2)


@pytest.fixture(scope="module")
def models() -> tuple[onnx.ModelProto, onnx.ModelProto, onnx.ModelProto]:
    """(float A, quantized B, B with the planted defect)."""
    a = mode_switched_net()
    data = CallableSource(lambda: _both_modes(16), "16 samples of each mode")
    b = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(a, calibration_data=data).model
    bad = onnx.ModelProto()
    bad.CopyFrom(b)
    switch = next(n for n in bad.graph.node if n.op_type == "If")
    then = next(at.g for at in switch.attribute if at.name == "then_branch")
    scale = next(t for t in then.initializer if t.name == "x/scale")  # shared by the branch's x/q and x/dq
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(SHRINK), scale.name))
    return a, b, bad


def _output_sqnr(a: onnx.ModelProto, b: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    sa, sb = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (a, b))
    ref = np.concatenate([sa.run(None, f)[0] for f in feeds]).astype(np.float64)
    got = np.concatenate([sb.run(None, f)[0] for f in feeds]).astype(np.float64)
    return float(10 * np.log10((ref**2).sum() / ((got - ref) ** 2).sum()))


def test_both_branches_are_quantized(models: tuple[onnx.ModelProto, ...]) -> None:
    _, b, _ = models
    switch = next(n for n in b.graph.node if n.op_type == "If")
    for at in switch.attribute:
        assert sum(n.op_type == "QuantizeLinear" for n in at.g.node) >= 2, at.name


def test_the_planted_body_pair_is_the_top_culprit_and_the_other_branch_not_run(
        models: tuple[onnx.ModelProto, ...]) -> None:
    a, _, bad = models
    feeds = mode_feeds(4)
    att = attribute(a, bad, feeds)
    top = att.culprits[0]
    assert (top.point.kind, top.point.tensor, top.point.scope) == ("activation", "x", THEN)
    assert top.point.dq_node == f"{THEN}/x/dq#2" and top.point.node == f"{THEN}/then/conv"  # both branches: x/dq, #2
    assert top.stats.clip_fraction() > 0.5  # a 20x too small step clips most of a standard normal input
    # Alone, the pair costs what the whole model loses (it is the only large error), a real number.
    assert top.alone_sqnr_db is not None and math.isfinite(top.alone_sqnr_db)
    whole = _output_sqnr(a, bad, feeds)
    assert top.alone_sqnr_db < 15 and abs(top.alone_sqnr_db - whole) < 1.5
    assert top.contribution is not None and top.contribution > 0.7
    others = [c.alone_sqnr_db for c in att.culprits[1:] if c.alone_sqnr_db is not None]
    assert others and min(others) > top.alone_sqnr_db + 15
    # Body pairs and top pairs are ranked together; nothing from the branch that did not run.
    assert {c.point.scope for c in att.culprits} == {"", THEN}
    assert len(att.not_run) == 1 and att.not_run[0].startswith(f"{ELSE} did not run on these inputs (4 sample(s))")
    assert "Q/DQ pair(s) are not ranked" in att.not_run[0]
    assert "then/conv" in (att.headline() or "")


def test_numeric_diff_compares_body_tensors_by_their_scoped_names(models: tuple[onnx.ModelProto, ...]) -> None:
    a, b, bad = models
    feeds = mode_feeds(4)
    good, broken = numeric_diff(a, b, feeds), numeric_diff(a, bad, feeds)
    for d in (good, broken):
        by_tensor = {x.tensor: x for x in d.layers}
        assert by_tensor["then_c"].node == f"{THEN}/then/conv"
        assert "else_c" not in by_tensor and "else_y" not in by_tensor  # not run: absent, never "no error"
        assert d.bodies[THEN] == "observed on 4 execution(s)"
        assert d.bodies[ELSE].startswith("did not run on these inputs") and d.not_run() == [ELSE]
    conv_good = next(x for x in good.layers if x.tensor == "then_c")
    conv_bad = next(x for x in broken.layers if x.tensor == "then_c")
    assert 30 < conv_good.sqnr_db < 60 and conv_bad.sqnr_db < 15
    # The error enters inside the branch: the body Conv reads exact outer inputs and is where it first jumps;
    # the If's output inherits it from the branch (small drop), it does not introduce it.
    assert broken.first_jump is conv_bad and conv_bad.input_sqnr_db == math.inf
    h = next(x for x in broken.layers if x.tensor == "h")
    assert h.input_sqnr_db < 15 and h.drop_db < 3


def test_both_branches_observed_on_mixed_data(models: tuple[onnx.ModelProto, ...]) -> None:
    a, b, _ = models
    d = numeric_diff(a, b, _both_modes(3))
    assert d.bodies == {THEN: "observed on 3 execution(s)", ELSE: "observed on 3 execution(s)"}
    assert {"then_c", "else_c"} <= {x.tensor for x in d.layers}
    att = attribute(a, b, _both_modes(3))
    assert not att.not_run and {c.point.scope for c in att.culprits} == {"", THEN, ELSE}


def test_loop_body_is_observed_on_every_iteration() -> None:
    a = loop_net()
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(16)]
    b = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(
        a, calibration_data=CallableSource(lambda: feeds, "16 samples")).model
    d = numeric_diff(a, b, feeds[:2])
    assert d.bodies == {"loop.body": f"observed on {2 * LOOP_TRIPS} execution(s)"}
    inner = {x.tensor: x for x in d.layers if x.node.startswith("loop.body/")}
    assert {"mm", "pre"} <= set(inner) and all(30 < x.sqnr_db < 80 for x in inner.values())
    att = attribute(a, b, feeds[:2])
    assert any(c.point.scope == "loop.body" and c.alone_sqnr_db is not None for c in att.culprits)


def test_diff_files_json_says_which_body_ran(models: tuple[onnx.ModelProto, ...], tmp_path: Path) -> None:
    a, _, bad = models
    onnx.save(a, tmp_path / "a.onnx")
    onnx.save(bad, tmp_path / "b.onnx")
    feeds = mode_feeds(3)
    np.savez(tmp_path / "in.npz", x=np.concatenate([f["x"] for f in feeds]), mode=np.ones(3, np.int64))
    structural, numeric = diff_files(tmp_path / "a.onnx", tmp_path / "b.onnx", inputs=tmp_path / "in.npz",
                                     samples=3)
    data = diff_json(structural, numeric)
    assert data["numeric"]["bodies"][THEN] == "observed on 3 execution(s)"
    assert data["attribution"]["not_run"][0].startswith(ELSE)
    assert data["culprits"][0]["scope"] == THEN and data["culprits"][0]["dq_node"] == f"{THEN}/x/dq#2"
    assert numeric is not None
    console = Console(width=200, record=True)
    print_numeric(console, numeric)
    text = console.export_text()
    assert f"body {ELSE}: did not run on these inputs (3 sample(s)); nothing inside it is compared" in text
    assert f"not run: {ELSE} did not run on these inputs" in text
    assert f"culprit: most output error comes from the Q/DQ pair on activation x (read by {THEN}/then/conv)" in text
    page = diff_html(structural, numeric)
    assert f"body {ELSE}: did not run on these inputs" in page and f"not run: {ELSE}" in page


def test_a_body_the_candidate_inlined_is_said_not_compared() -> None:
    a = mode_switched_net()
    data = CallableSource(lambda: mode_feeds(8), "8 samples, mode 1")
    b = Pipeline([get_pass("specialize_inputs")(inputs={"mode": 1}), get_pass("insert_qdq")(preset="ort-x86-vnni")]
                 ).run(a, calibration_data=data).model
    assert not any(n.op_type == "If" for n in b.graph.node)
    d = numeric_diff(a, b, mode_feeds(2))
    assert set(d.bodies) == {THEN, ELSE} and d.not_run() == [THEN, ELSE]
    assert all(s.startswith("not compared: B has no such body") for s in d.bodies.values())
    assert [o.tensor for o in d.outputs] == ["y"] and 20 < d.outputs[0].sqnr_db < 60


def test_nested_bodies_are_reached_one_level_at_a_time() -> None:
    a = nested_switched_net()
    data = CallableSource(lambda: nested_feeds(16), "16 samples down both then-branches")
    b = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(a, calibration_data=data).model
    inner = "outer.then_branch/inner.then_branch"
    d = numeric_diff(a, b, nested_feeds(3))
    assert d.bodies["outer.then_branch"] == d.bodies[inner] == "observed on 3 execution(s)"
    assert d.bodies["outer.then_branch/inner.else_branch"] == (
        "did not run on these inputs (3 execution(s) of the enclosing body)")
    assert d.bodies["outer.else_branch"] == "did not run on these inputs (3 sample(s))"
    c2 = next(x for x in d.layers if x.tensor == "c2")
    assert c2.node == f"{inner}/inner/conv" and 25 < c2.sqnr_db < 60
    att = attribute(a, b, nested_feeds(3))
    deep = [c for c in att.culprits if c.point.scope == inner]
    assert {c.point.tensor for c in deep} >= {"nw2", "h1"}
    assert all(c.alone_sqnr_db is not None and 25 < c.alone_sqnr_db < 80 for c in deep)
