"""Models with optional- and sequence-typed values (ONNX node tests test_identity_opt, test_if_opt,
test_loop16_seq_none) round-trip through every float-preserving pass, or are refused with a PassError that names
the node (issue #12 item 4). graphsurgeon alone drops their `type` attributes and crashes on their value types."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

from qgraph.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance"))
import opset_corpus as oc

CASES = ["test_identity_opt", "test_if_opt", "test_loop16_seq_none"]
PREP = "name: prep\npasses:\n  - pass: fold_constants\n  - pass: fuse_batchnorm\n  - pass: cleanup\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return oc.generate_corpus(tmp_path_factory.mktemp("optional_types"), CASES)


def _types(model: onnx.ModelProto) -> list[str]:
    return [str(v.type) for v in [*model.graph.input, *model.graph.output]]


@pytest.mark.parametrize("case", CASES)
def test_preparation_recipe_keeps_results_and_types(corpus: Path, tmp_path: Path, case: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "prep.yaml"
    recipe.write_text(PREP)
    out = tmp_path / "out.onnx"
    assert main(["run", str(recipe), str(corpus / case / "model.onnx"), "-o", str(out), "--verify", "-q"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    original, feeds, expected = oc.load_case(corpus / case)
    result = onnx.load(str(out))
    onnx.checker.check_model(result, full_check=True)
    assert _types(result) == _types(original)  # optional(seq(tensor)) survives, not a plain tensor
    for got, want in zip(oc.run_ort(result, feeds), expected, strict=True):
        assert oc._close(want, got)


@pytest.mark.parametrize("case", CASES)
def test_opset_conversion_round_trips_or_names_the_node(corpus: Path, tmp_path: Path, case: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    src = corpus / case / "model.onnx"
    raised = tmp_path / "raised.onnx"
    assert main(["lower", str(src), "--opset", "18", "-o", str(raised), "--verify"]) == 0
    _, feeds, expected = oc.load_case(corpus / case)
    for got, want in zip(oc.run_ort(onnx.load(str(raised)), feeds), expected, strict=True):
        assert oc._close(want, got)
    capsys.readouterr()
    # Optional ops and optional-typed Identity do not exist before opset 15/16: refused, naming the node.
    code = main(["lower", str(src), "--opset", "13", "-o", str(tmp_path / "low.onnx")])
    text = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in text
    assert "has no exact form at opset 13" in text or "no exact form" in text
    assert "node '" in text
    assert not (tmp_path / "low.onnx").exists()
