"""``--verify`` against the model's own float32 noise floor (`qgraph.pipeline.verify`): a correct pass on a model whose
float32 rounding exceeds 1e-5 is accepted, a genuinely wrong pass still fails, and the raised tolerance is said."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult, Pipeline, VerificationError
from qgraph.analysis.report import build_report
from qgraph.cli import main
from qgraph.graph import const_value, set_const
from qgraph.io.model_io import save_model
from qgraph.pipeline.pass_api import get_pass
from qgraph.pipeline.verify import NOISE_FLOOR_FACTOR, VerifyTolerance, check_pass, measure_tolerance
from qgraph.runtime.compare import random_feeds
from qgraph.testing.models import conv_bn_relu_chain, offset_conv_bn_chain


class PerturbConfig(PassConfig):
    """Options of the wrong pass."""

    factor: float = Field(default=1.001, description="Multiply the first Conv weight by this.")


class PerturbWeight(Pass[PerturbConfig]):
    """A pass that claims to keep float results but scales the first Conv's weight by ``factor`` (a bug)."""

    name = "test_perturb_weight"
    config_class = PerturbConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        conv = next(n for n in graph.graph.nodes if n.op == "Conv")
        weight = const_value(conv.inputs[1])
        assert weight is not None
        set_const(conv.inputs[1], (weight * np.float32(self.config.factor)).astype(np.float32))
        return PassResult(matched=1, rewritten=1)


@pytest.fixture(scope="module")
def noisy() -> onnx.ModelProto:
    return offset_conv_bn_chain()


def test_noise_floor_of_a_model_whose_rounding_exceeds_1e5(noisy: onnx.ModelProto) -> None:
    tol = measure_tolerance(noisy, random_feeds(noisy, 2), 1e-5)
    assert len(tol.floors) == 1 and 2e-5 < tol.floors[0] < 1e-3  # measured: 6.1e-5 (onnxruntime 1.31, x86)
    assert tol.raised and tol.for_output(0) == pytest.approx(NOISE_FLOOR_FACTOR * tol.floors[0])
    assert "raised from 1e-05" in tol.describe() and "host-dependent" in tol.describe()
    # a well-conditioned chain: the floor stays far below 1e-5 and the user's tolerance applies unchanged
    quiet = conv_bn_relu_chain(4, 16, 8)
    calm = measure_tolerance(quiet, random_feeds(quiet, 2), 1e-5)
    assert calm.floors[0] < 2.5e-6 and not calm.raised and calm.for_output(0) == 1e-5


def test_fuse_batchnorm_is_accepted_on_a_noisy_model(noisy: onnx.ModelProto) -> None:
    result = Pipeline([get_pass("fuse_batchnorm")()]).run(noisy, verify=True)
    record = result.records[0]
    assert record.result.rewritten == 4 and record.verify is not None
    tol = result.verify_tolerance
    assert tol is not None and tol.raised
    # the fusion's rounding is above the old fixed 1e-5 (the reported failure) and within the raised tolerance
    assert 1e-5 < record.verify[0].relative <= tol.for_output(0)


def test_a_wrong_pass_still_fails_on_a_noisy_model(noisy: onnx.ModelProto) -> None:
    with pytest.raises(VerificationError) as info:
        Pipeline([get_pass("fuse_batchnorm")(), PerturbWeight()]).run(noisy, verify=True)
    message = info.value.message
    assert "pass #1 'test_perturb_weight' changed the model's results" in message
    found = re.search(r"relative ([0-9.e+-]+) > tolerance ([0-9.e+-]+) = max\(--tolerance 1e-05, 4 x this "
                      r"model's float32 noise floor ([0-9.e+-]+)\)", message)
    assert found is not None, message
    relative, used, floor = (float(g) for g in found.groups())
    assert relative > 1e-3 and used == pytest.approx(4 * floor, rel=1e-2) and 1e-5 < floor < 1e-3
    assert "raise --tolerance" in message


def test_check_pass_uses_the_tolerance_of_each_output() -> None:
    model = conv_bn_relu_chain(2, 8, 8)
    feeds = random_feeds(model, 2)
    wrong = PerturbWeight(factor=1.0 + 3e-5)
    after = Pipeline([wrong]).run(model).model
    moved = check_pass("p", 0, model, after, feeds, VerifyTolerance(1.0))[0].relative
    assert 1e-5 < moved < 1e-4
    with pytest.raises(VerificationError, match=r"> tolerance 1e-05 = max\(--tolerance 1e-05, 4 x this model's "
                       r"float32 noise floor 0\)"):
        check_pass("p", 0, model, after, feeds, VerifyTolerance(1e-5))
    # a fake floor of moved/2 raises the tolerance to 2x the change: accepted; moved/5 (0.8x) still fails
    accepted = check_pass("p", 0, model, after, feeds, VerifyTolerance(1e-5, (moved / 2,)))
    assert accepted[0].relative == pytest.approx(moved)
    with pytest.raises(VerificationError):
        check_pass("p", 0, model, after, feeds, VerifyTolerance(1e-5, (moved / 5,)))


def test_floor_is_capped_and_non_float_outputs_keep_the_requested_tolerance() -> None:
    tol = VerifyTolerance(1e-5, (0.0, 2e-6), note=None)
    assert [tol.for_output(i) for i in range(3)] == [1e-5, 1e-5, 1e-5] and not tol.raised
    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4] x) => (int64[2] i, float[2,4] y) {
      y = Relu(x)
      i = ArgMax<axis = 1, keepdims = 0>(y)
    }"""
    model = onnx.parser.parse_model(text)
    measured = measure_tolerance(model, random_feeds(model, 2), 1e-5)
    assert measured.floors == (0.0, 0.0) and measured.note is None


def test_cli_says_when_the_floor_raised_the_tolerance(noisy: onnx.ModelProto, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    src = save_model(noisy, tmp_path / "noisy.onnx")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: fuse\npasses:\n  - pass: fuse_batchnorm\n")
    assert main(["run", str(recipe), str(src), "-o", str(tmp_path / "out.onnx"), "--verify",
                 "--report", str(tmp_path / "r.json")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(r"verified: worst output y relative error [0-9.e+-]+ \(tolerance [0-9.e+-]+\)", err), err
    assert "verify tolerance raised from 1e-05 to" in err and "noise floor" in err
    # a tolerance above 4x the floor: nothing raised, nothing to explain
    assert main(["run", str(recipe), str(src), "-o", str(tmp_path / "out2.onnx"), "--verify", "--tolerance",
                 "1e-2"]) == 0
    err2 = " ".join(capsys.readouterr().err.split())
    assert "(tolerance 0.01)" in err2 and "raised" not in err2
    # the output model's provenance is host-independent: nothing about the floor in it
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "out.onnx")).metadata_props}
    assert "noise floor" not in meta["qgraph.passes"]


def test_report_lists_the_raised_tolerance(noisy: onnx.ModelProto) -> None:
    from qgraph import Recipe

    recipe = Recipe("fuse", [get_pass("fuse_batchnorm")()])
    result = recipe.pipeline().run(noisy, verify=True, keep_stages=True)
    report = build_report(recipe, result)
    rows = [d for d in report.decisions if d["pass"] == "--verify"]
    assert len(rows) == 1 and rows[0]["kind"] == "host-dependent" and "raised from 1e-05" in rows[0]["text"]
    assert result.verify_tolerance is not None
    assert report.passes[0]["verify_tolerance"] == pytest.approx(result.verify_tolerance.for_output(0))


def test_cli_marks_a_pass_that_fails_verify_as_failed(noisy: onnx.ModelProto, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from qgraph.pipeline import pass_api

    pass_api.discover()
    pass_api.register(PerturbWeight)
    try:
        src = save_model(noisy, tmp_path / "noisy.onnx")
        recipe = tmp_path / "r.yaml"
        recipe.write_text("name: bad\npasses:\n  - pass: fuse_batchnorm\n  - pass: test_perturb_weight\n"
                          "    factor: 1.01\n")
        code = main(["run", str(recipe), str(src), "-o", str(tmp_path / "out.onnx"), "--verify"])
    finally:
        pass_api._REGISTRY.pop(PerturbWeight.name, None)
    err = " ".join(capsys.readouterr().err.split())
    assert code != 0 and "Traceback" not in err and not (tmp_path / "out.onnx").exists()
    assert "✓ fuse_batchnorm:" in err and "✗ test_perturb_weight:" in err, err
    assert "✓ test_perturb_weight" not in err
    # the mark, then the failure that explains it
    assert err.index("✗ test_perturb_weight:") < err.index("pass #1 'test_perturb_weight'"), err
