"""Option values naming graph inputs, outputs and nodes are checked against the input model before any pass runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import onnx
import pytest
from pydantic import Field

from qgraph import Pass, PassConfig, PassResult, Pipeline, PipelineEvent, Recipe, get_pass, save_model
from qgraph.cli import main
from qgraph.errors import DataError, PassError, RecipeError
from qgraph.graph.names import GraphOutputName
from qgraph.pipeline.preflight import ModelNames, NameRef, name_refs, preflight
from qgraph.pipeline.recipe_yaml import RecipeValidationError
from qgraph.pipeline.target import CalibrationSpec
from qgraph.testing.models import leaky_state_net, mode_switched_net

# fold_constants first: had the check not run before the first pass, it would have started (a pass_start event)
HEAD = "name: t\npasses:\n  - pass: fold_constants\n"


def _run(text: str, model: onnx.ModelProto, tmp_path: Path) -> tuple[RecipeError, list[PipelineEvent]]:
    """Run recipe ``text`` (written to recipe.yaml) on ``model``; the error it raises and the events emitted."""
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    events: list[PipelineEvent] = []
    with pytest.raises(RecipeError) as info:
        Recipe.from_yaml(path).pipeline().run(model, on_event=events.append)
    return info.value, events


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize(
    ("step", "bad_line", "expected"),
    [
        # tune_ranges.outputs: a graph output
        ("  - pass: tune_ranges\n    outputs: [y, s_nxt]\n", "outputs:",
         ["tune_ranges", "`outputs`", "graph output 's_nxt'", "Did you mean 's_next'?", "Its outputs: y, s_next."]),
        # tune_ranges.recurrent: the key is a graph input, located at the key
        ("  - pass: tune_ranges\n    recurrent:\n      state_inputs:\n        state: s_next\n", "state: s_next",
         ["`recurrent.state_inputs`", "graph input 'state'", "Its inputs: x, s."]),
        # ... and the value a graph output
        ("  - pass: tune_ranges\n    recurrent:\n      state_inputs:\n        s: stateN\n", "s: stateN",
         ["graph output 'stateN'", "Its outputs: y, s_next."]),
        # float_fallback auto.outputs and auto.recurrent
        ("  - pass: float_fallback\n    auto:\n      target: sqnr:30\n      outputs: [Y]\n", "outputs: [Y]",
         ["float_fallback", "`auto.outputs`", "graph output 'Y'", "Did you mean 'y'?"]),
        ("  - pass: float_fallback\n    auto:\n      target: sqnr:30\n      recurrent: {state_inputs: {s: s_nex}}\n",
         "recurrent:", ["`auto.recurrent.state_inputs`", "graph output 's_nex'", "Did you mean 's_next'?"]),
        # specialize_inputs.inputs: a graph input (the key)
        ("  - pass: specialize_inputs\n    inputs:\n      sx: 1.0\n", "sx: 1.0",
         ["specialize_inputs", "`inputs`", "graph input 'sx'", "Its inputs: x, s."]),
    ],
)
def test_unknown_io_name_fails_before_any_pass(tmp_path: Path, step: str, bad_line: str,
                                               expected: list[str]) -> None:
    text = HEAD + step
    error, events = _run(text, leaky_state_net(), tmp_path)
    assert [e.kind for e in events] == []  # not even pipeline_start: fold_constants never started
    assert isinstance(error, RecipeValidationError) and len(error.issues) == 1
    issue = error.issues[0]
    assert (issue.file, issue.line) == (str(tmp_path / "recipe.yaml"), _line_of(text, bad_line))
    assert issue.path.startswith("passes[1].")
    message = " ".join(str(issue).split())
    for part in expected:
        assert part in message, message


def test_every_bad_name_is_reported_at_once(tmp_path: Path) -> None:
    text = HEAD + ("  - pass: tune_ranges\n    outputs: [yy]\n"
                   "  - pass: float_fallback\n    auto: {target: 'sqnr:30', outputs: [zz]}\n")
    error, _ = _run(text, leaky_state_net(), tmp_path)
    assert isinstance(error, RecipeValidationError)
    assert [(i.path, i.line) for i in error.issues] == [("passes[1].outputs[0] (tune_ranges)", 5),
                                                        ("passes[2].auto.outputs[0] (float_fallback)", 7)]


def test_python_pipeline_names_the_pipeline() -> None:
    passes = [get_pass("fold_constants")(), get_pass("tune_ranges")(outputs=["nope"])]
    with pytest.raises(RecipeValidationError) as info:
        Pipeline(passes, name="mine").run(leaky_state_net())
    assert str(info.value.issues[0]).startswith("pipeline 'mine': passes[1].outputs[0] (tune_ranges): ")


def test_valid_names_pass_untouched() -> None:
    model = leaky_state_net()
    passes = [get_pass("tune_ranges")(outputs=["y"], recurrent={"state_inputs": {"s": "s_next"}}),
              get_pass("float_fallback")(nodes={"names": ["fc1", "relu"]},
                                         auto={"target": "sqnr:30", "outputs": ["y", "s_next"],
                                               "recurrent": {"state_inputs": {"s": "s_next"}}}),
              get_pass("specialize_inputs")(inputs={"s": 0.0})]
    refs = [r for p in passes for r in name_refs(p.config)]
    assert len(refs) == 10  # every annotated value is found: outputs, keys, values, node names
    assert preflight(passes, model) == []


def test_name_refs_paths_and_kinds() -> None:
    config = get_pass("float_fallback")(nodes={"names": ["a"], "exclude": {"names": ["b"]}},
                                        auto={"target": "sqnr:30", "recurrent": {"state_inputs": {"s": "o"}}}).config
    assert list(name_refs(config)) == [
        NameRef(("nodes", "names", 0), "node", "a", "nodes.names"),
        NameRef(("nodes", "exclude", "names", 0), "node", "b", "nodes.exclude.names"),
        NameRef(("auto", "recurrent", "state_inputs", "s"), "input", "s", "auto.recurrent.state_inputs", is_key=True),
        NameRef(("auto", "recurrent", "state_inputs", "s"), "output", "o", "auto.recurrent.state_inputs"),
    ]


def test_unknown_node_name_is_a_warning_before_the_run(tmp_path: Path) -> None:
    # passes rename, remove and create nodes: a node name is checked by the pass when it starts, after this warning
    text = HEAD + "  - pass: float_fallback\n    nodes: {names: [fc2, relu]}\n"
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    events: list[PipelineEvent] = []
    with pytest.raises(PassError) as info:  # the pass's own check when it starts: the model has no Q/DQ
        Recipe.from_yaml(path).pipeline().run(leaky_state_net(), on_event=events.append)
    assert "no QuantizeLinear" in str(info.value)
    start = events[0]
    assert start.kind == "pipeline_start" and len(start.warnings) == 1
    assert start.warnings[0].startswith(f"{path}:5:")  # at `fc2` in the names list
    assert "node 'fc2', which the input model does not have. Did you mean 'fc1'?" in start.warnings[0]
    assert events[1].kind == "pass_start"


def test_body_node_names_count_in_either_form() -> None:
    model = mode_switched_net()
    names = ModelNames.of(model)
    assert {"then/conv", "else/relu"} <= names.nodes
    fallback = get_pass("float_fallback")(nodes={"names": ["then/conv", "switch.else_branch/else/relu"]})
    assert preflight([fallback], model) == []


class _AddsOutputConfig(PassConfig):
    """Config of the toy pass."""


class _AddsOutput(Pass[_AddsOutputConfig]):
    """Declares it adds graph outputs (a plug-in exposing an intermediate tensor)."""

    name = "toy_adds_output"
    config_class = _AddsOutputConfig
    adds_graph_io: ClassVar[bool] = True

    def run(self, graph: Any, ctx: Any) -> PassResult:
        """Nothing (only its declaration matters here)."""
        return PassResult()


class _ReadsOutputsConfig(PassConfig):
    """Config of the toy pass."""

    outputs: tuple[GraphOutputName, ...] = Field(default=(), description="Graph outputs.")


class _ReadsOutputs(Pass[_ReadsOutputsConfig]):
    """A plug-in naming graph outputs with the public annotation."""

    name = "toy_reads_outputs"
    config_class = _ReadsOutputsConfig


def test_after_a_pass_adding_graph_outputs_names_are_warnings() -> None:
    model = leaky_state_net()
    with pytest.raises(RecipeValidationError, match=r"\(toy_reads_outputs\): `outputs` names graph output 'extra'"):
        preflight([_ReadsOutputs(outputs=["extra"])], model)
    warnings = preflight([_AddsOutput(), _ReadsOutputs(outputs=["extra"])], model)
    assert [w.path for w in warnings] == ["passes[1].outputs[0] (toy_reads_outputs)"]


def test_cli_refuses_a_bad_name_without_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_model(leaky_state_net(), tmp_path / "model.onnx")
    (tmp_path / "recipe.yaml").write_text(HEAD + "  - pass: tune_ranges\n    outputs: [s_nex]\n")
    out = tmp_path / "out.onnx"
    code = main(["run", str(tmp_path / "recipe.yaml"), str(tmp_path / "model.onnx"), "-o", str(out)])
    captured = capsys.readouterr()
    text = " ".join((captured.err + captured.out).split())
    assert code == 2 and not out.exists()
    assert "Traceback" not in text
    assert "recipe.yaml:5:" in text and "graph output 's_nex'" in text and "Did you mean 's_next'?" in text
    assert "fold_constants" not in text  # no pass ran (its summary line would name it)


def test_pass_help_says_what_a_name_option_names() -> None:
    from qgraph.cli.pass_catalogue import type_name

    fields = get_pass("tune_ranges").config_class.model_fields
    assert type_name(fields["outputs"].annotation) == "list of graph output name"
    assert type_name(get_pass("float_fallback").config_class.model_fields["nodes"].annotation) == "mapping | none"


def test_a_pass_that_needs_calibration_data_fails_before_any_pass_without_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ready recipe without --calibration-data: it ran 7 passes (equalization, SmoothQuant...) and then failed
    in insert_qdq with exit 1; now it is bad input (exit 2) before the first pass, naming the pass and the fix."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out.onnx"
    code = main(["run", str(root / "recipes" / "ort-x86-vnni.yaml"), str(root / "examples" / "digits" / "model.onnx"),
                 "-o", str(out)])
    text = " ".join(capsys.readouterr().err.split())
    assert code == 2 and not out.exists() and list(tmp_path.iterdir()) == []
    assert "Traceback" not in text and "fold_constants" not in text  # no pass ran
    assert "no calibration data given: passes[7] (insert_qdq): static quantization needs calibration data" in text
    assert "--calibration-data DATA" in text
    events: list[PipelineEvent] = []
    steps = [get_pass("fold_constants")(), get_pass("insert_qdq")(), get_pass("float_fallback")(auto={
        "target": "sqnr:30"}), get_pass("tune_ranges")()]
    with pytest.raises(DataError, match=r"passes\[1\] \(insert_qdq\): .* \(2 later pass\(es\) need it too\)"):
        Pipeline(steps).run(leaky_state_net(), on_event=events.append)
    assert [e.kind for e in events] == []
    # what each pass needs follows its options: dynamic mode, a ranges file, auto.data
    assert get_pass("insert_qdq")(mode="dynamic", activations={"dtype": "uint8"}).missing_data(
        CalibrationSpec()) is None
    assert get_pass("insert_qdq")().missing_data(CalibrationSpec(ranges="r.json")) is None
    assert get_pass("float_fallback")(auto={"target": "sqnr:30", "data": "d.npz"}).missing_data(
        CalibrationSpec()) is None
    assert get_pass("float_fallback")(nodes={"op_types": ["Conv"]}).missing_data(CalibrationSpec()) is None
