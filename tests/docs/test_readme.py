"""The README leads and says only what is true: short, every relative link (README and docs/) resolves, every
command in its code blocks parses against the real CLI, the tour runs as written from a fresh directory, the
recipe validates and the pass example rewrites a real graph with float results kept."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import onnx
import pytest
import typer
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _blocks(kind: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text(encoding="utf-8")) if lang == kind]


def _inline_commands() -> list[list[str]]:
    """Every ``qgraph ...`` the README's text and tables quote in backticks (placeholders such as ``MODEL`` are
    arguments; a quote with ``...`` is an outline, not a command)."""
    quoted = re.findall(r"`(qgraph [^`]+)`", README.read_text(encoding="utf-8"))
    # an optional part ``[--eval-data DATA]`` is parsed as given
    # (and a number placeholder ``N`` as a number)
    return [["13" if w == "N" else w for w in shlex.split(q.replace("[", " ").replace("]", " "))[1:]]
            for q in quoted if "..." not in q]


def _commands() -> list[list[str]]:
    """Every ``qgraph ...`` command line of the README's bash blocks (continuations joined, comments dropped)."""
    out = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words and words[0] == "qgraph":
                    out.append(words[1:])
    return out


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_a_guide_not_a_manual() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200
    assert [n for n, line in enumerate(lines, 1) if len(line) > 120 and not line.startswith("python -m pip")] == []


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target} (no {file})"
        if anchor and file.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(encoding="utf-8"), re.M)}
            assert anchor in headings, f"{page.name}: link to {target}: no heading #{anchor} in {file.name}"


def test_every_readme_command_parses() -> None:
    from qgraph.cli import app

    group = typer.main.get_command(app)
    commands = _commands() + _inline_commands()
    assert len(commands) >= 15
    for args in commands:
        if args[:1] == ["--help"]:
            continue
        sub = group.get_command(None, args[0])  # type: ignore[arg-type]
        assert sub is not None, f"README: qgraph {args[0]}: no such command"
        try:
            sub.make_context(args[0], list(args[1:]), resilient_parsing=False)
        except Exception as exc:  # click's usage errors
            pytest.fail(f"README: qgraph {shlex.join(args)}: {exc}")


def test_the_tour_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from qgraph.cli import main

    for name in ("examples", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    tour = [c for c in _commands() if c[0] in ("run", "diff", "check", "inspect")]
    # the set-up command's main job, then the tour in its order
    assert [c[0] for c in tour] == ["run", "inspect", "inspect", "run", "diff", "check"]
    for args in tour:
        assert main(args) == 0, (args, capsys.readouterr().err[-2000:])
    text = capsys.readouterr()
    assert (tmp_path / "digits.int8.onnx").exists() and (tmp_path / "report.html").exists()
    measured = re.search(r"metric (0\.\d+) \(float 0\.9889\)", text.err)
    assert measured and float(measured.group(1)) >= 0.98  # what the README quotes holds on this host
    assert "culprit:" in text.out


def test_the_readme_recipe_validates(tmp_path: Path) -> None:
    from qgraph import Recipe

    (yaml_block,) = _blocks("yaml")
    path = tmp_path / "r.yaml"
    path.write_text(yaml_block, encoding="utf-8")
    recipe = Recipe.from_yaml(path)
    assert [p.name for p in recipe.passes] == ["fold_constants", "fuse_batchnorm", "insert_qdq"]


def test_the_readme_pass_rewrites_a_graph_and_keeps_float_results() -> None:
    import onnxruntime as ort

    from qgraph import Pipeline

    (code,) = [b for b in _blocks("python") if "class NegToMul" in b]
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["n"], name="neg"),
                               helper.make_node("Relu", ["n"], ["r"], name="relu"),
                               helper.make_node("Neg", ["r"], ["y"], name="neg2")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = Pipeline([namespace["NegToMul"]()]).run(model)  # type: ignore[operator]
    out = result.model
    assert [n.op_type for n in out.graph.node] == ["Mul", "Relu", "Mul"]
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}

    def run(m: onnx.ModelProto) -> np.ndarray:
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return np.asarray(sess.run(None, feed)[0])

    np.testing.assert_allclose(run(out), run(model), rtol=0, atol=1e-6)
