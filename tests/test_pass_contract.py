"""The contract every discovered pass keeps (built-ins and installed plug-ins), on a generated family of models:
the output passes the ONNX checker, float-preserving passes keep results, a second run changes nothing, what a
pass reports matches what the pipeline measured, and the input model is never touched. Also: what the pipeline
does to a pass that breaks the contract (issue #15)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassError, PassResult, Pipeline
from qgraph.pipeline import pass_api
from qgraph.runtime.compare import compare_models, random_feeds

#: Options a pass needs before it can run on a float CNN (anything else runs with its defaults).
OPTIONS: dict[str, dict[str, Any]] = {
    "lower_opset": {"opset": 13},
    "raise_opset": {"opset": 18},
    "insert_qdq": {"preset": "ort-x86-vnni"},
    "float_fallback": {"nodes": {"op_types": ["Gemm"]}},
}
LAYERS = ["conv", "conv_bn", "relu", "clip", "identity", "residual", "mul_const", "transpose_pair"]


@st.composite
def cnn_models(draw: st.DrawFn) -> onnx.ModelProto:
    """A small NCHW network of 1-6 layers (Conv[+BN], Relu, Clip, Identity, residual Add, Mul by a constant,
    Transpose pairs) ending in GlobalAveragePool-Flatten-Gemm, with seeded weights."""
    c = draw(st.sampled_from([2, 4, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    nodes, inits, cur, k = [], [], "x", 0

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    for layer in draw(st.lists(st.sampled_from(LAYERS), min_size=1, max_size=6)):
        k += 1
        out = f"t{k}"
        if layer.startswith("conv"):
            w = const(f"w{k}", rng.normal(0, 0.4, (c, c, 3, 3)))
            nodes.append(helper.make_node("Conv", [cur, w, const(f"b{k}", rng.normal(0, 0.1, c))], [out],
                                          name=f"conv{k}", pads=[1, 1, 1, 1]))
            if layer == "conv_bn":
                values = (("g", rng.uniform(0.5, 1.5, c)), ("be", rng.normal(0, 0.1, c)),
                          ("m", rng.normal(0, 0.1, c)), ("v", rng.uniform(0.5, 1.5, c)))
                params = [const(f"{p}{k}", v) for p, v in values]
                nodes.append(helper.make_node("BatchNormalization", [out, *params], [f"{out}bn"], name=f"bn{k}"))
                out = f"{out}bn"
        elif layer == "relu":
            nodes.append(helper.make_node("Relu", [cur], [out], name=f"relu{k}"))
        elif layer == "clip":
            nodes.append(helper.make_node("Clip", [cur, const(f"lo{k}", np.array(0.0)), const(f"hi{k}", np.array(6.0))],
                                          [out], name=f"clip{k}"))
        elif layer == "identity":
            nodes.append(helper.make_node("Identity", [cur], [out], name=f"id{k}"))
        elif layer == "residual":
            nodes.append(helper.make_node("Add", [cur, "x"], [out], name=f"add{k}"))
        elif layer == "mul_const":
            nodes.append(helper.make_node("Mul", [cur, const(f"s{k}", rng.uniform(0.5, 2, (1, c, 1, 1)))], [out],
                                          name=f"mul{k}"))
        else:
            nodes += [helper.make_node("Transpose", [cur], [f"{out}t"], name=f"tr{k}a", perm=[0, 2, 3, 1]),
                      helper.make_node("Transpose", [f"{out}t"], [out], name=f"tr{k}b", perm=[0, 3, 1, 2])]
        cur = out
    nodes += [helper.make_node("GlobalAveragePool", [cur], ["gp"], name="gap"),
              helper.make_node("Flatten", ["gp"], ["f"], name="flatten"),
              helper.make_node("Gemm", ["f", const("fc", rng.normal(0, .3, (3, c))), const("fcb", np.zeros(3))], ["y"],
                               name="fc", transB=1)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _runnable_passes() -> list[str]:
    names = []
    for name, cls in pass_api.discover().items():
        try:
            cls(**OPTIONS.get(name, {}))
        except Exception:  # a plug-in whose required options this test cannot know
            continue
        names.append(name)
    return names


@pytest.mark.parametrize("name", _runnable_passes())
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=cnn_models())
def test_every_pass_keeps_the_contract(name: str, model: onnx.ModelProto, tmp_path_factory: Any) -> None:
    cls = pass_api.get_pass(name)
    original = model.SerializeToString()
    feeds = random_feeds(model, 4, seed=2)
    data = tmp_path_factory.mktemp("d") / "calib.npz"
    np.savez(data, x=np.stack([f["x"] for f in feeds]))
    # Weight-correction passes work on a quantized model against its float reference: quantize first (their own
    # tests check that a second run is stable; it re-measures, so it is not a fixed point by construction).
    prefix = [pass_api.get_pass("insert_qdq")()] if cls.needs_float_reference else []
    first = Pipeline([*prefix, cls(**OPTIONS.get(name, {}))]).run(model, calibration_data=data)
    assert model.SerializeToString() == original  # the input is never modified
    onnx.checker.check_model(first.model, full_check=True)
    record = first.records[-1]
    if record.result.rewritten or record.result.nodes_added or record.result.nodes_removed:
        assert record.changed  # a reported rewrite is a measured change
    if cls.preserves_float:
        for diff in compare_models(model, first.model, feeds[:2]):
            assert diff.finite and diff.max_abs <= 1e-5 * max(diff.scale, 1.0), (name, diff)
    if cls.needs_float_reference:
        return
    second = Pipeline([cls(**OPTIONS.get(name, {}))]).run(first.model, calibration_data=data).records[0]
    assert not second.changed, f"{name}: a second run changed the graph again"
    assert second.result.rewritten == 0 and second.result.nodes_added == second.result.nodes_removed == 0


# ------------------------------------------------------------------ passes that break the contract
class _Cfg(PassConfig):
    mode: str = "none"


class _Broken(Pass[_Cfg]):
    """A plug-in that breaks the graph in the way ``mode`` says."""

    name = "test_broken"
    config_class = _Cfg

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:  # type: ignore[override]
        node = next(n for n in graph.graph.nodes if n.op == "Mul")
        if self.config.mode == "one_input":
            node.inputs.pop()
        elif self.config.mode == "dangling":
            import onnx_graphsurgeon as gs

            node.inputs[1] = gs.Variable("nobody_makes_me", dtype=np.float32)
        elif self.config.mode == "cycle":
            node.inputs[0] = node.outputs[0]
        elif self.config.mode == "none_result":
            return None  # type: ignore[return-value]
        elif self.config.mode == "silent":
            node.op = "Add"
            return PassResult()  # changed the graph, reported nothing
        return PassResult(rewritten=1)


@pytest.mark.parametrize(
    ("mode", "says"),
    [("one_input", "Mul node 'm': has 1 input(s), Mul-14 takes 2..2"),
     ("dangling", "input 'nobody_makes_me' is produced by no node"),
     ("cycle", "the graph has a cycle"),
     ("none_result", "returned NoneType instead of a PassResult")],
)
def test_the_pipeline_names_a_pass_that_breaks_the_graph(mode: str, says: str) -> None:
    model = _mul_model()
    with pytest.raises(PassError, match=r"pass #0 'test_broken'") as err:
        Pipeline([_Broken(mode=mode)]).run(model)
    assert says in err.value.message
    assert err.value.exit_code == 1


def test_a_silent_change_is_recorded_as_a_change() -> None:
    record = Pipeline([_Broken(mode="silent")]).run(_mul_model()).records[0]
    assert record.changed and "the graph changed although the pass reported no rewrite" in record.result.notes


def test_new_nodes_are_tagged_with_the_pass_that_made_them() -> None:
    class AddRelu(Pass[_Cfg]):
        """Appends a Relu after the output (unnamed tag: the pipeline adds it)."""

        name = "test_add_relu"
        config_class = _Cfg

        def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:  # type: ignore[override]
            import onnx_graphsurgeon as gs

            out = graph.graph.outputs[0]
            mid = gs.Variable("pre_relu", dtype=np.float32)
            graph.producer(out).outputs[0] = mid  # type: ignore[union-attr]
            graph.graph.nodes.append(gs.Node("Relu", "extra_relu", inputs=[mid], outputs=[out]))
            return PassResult(rewritten=1)

    result = Pipeline([AddRelu()]).run(_mul_model())
    node = next(n for n in result.model.graph.node if n.name == "extra_relu")
    assert node.doc_string == "qgraph:test_add_relu"
    assert result.records[0].result.nodes_added == 1


class _RunsNested(Pass[_Cfg]):
    """Runs `_Broken` inside itself through `PassContext.run_pass`, with ``mode`` passed on."""

    name = "test_runs_nested"
    config_class = _Cfg

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:  # type: ignore[override]
        inner = ctx.run_pass(_Broken(mode=self.config.mode), graph)
        return PassResult(rewritten=inner.rewritten, decisions=[f"ran test_broken: rewrote {inner.rewritten}"])


def test_a_pass_run_inside_another_is_held_to_the_contract() -> None:
    with pytest.raises(PassError, match=r"pass #0 'test_runs_nested', in the 'test_broken' it runs inside itself") \
            as err:
        Pipeline([_RunsNested(mode="dangling")]).run(_mul_model())
    assert "input 'nobody_makes_me' is produced by no node" in err.value.message
    with pytest.raises(PassError, match="returned NoneType instead of a PassResult"):
        Pipeline([_RunsNested(mode="none_result")]).run(_mul_model())


def test_a_pass_run_inside_another_is_recorded_on_its_record() -> None:
    record = Pipeline([_RunsNested(mode="silent")]).run(_mul_model()).records[0]
    assert [(n.name, n.options) for n in record.nested] == [("test_broken", {"mode": "silent"})]
    assert record.nested[0].to_dict()["result"]["rewritten"] == record.result.rewritten
    assert record.changed  # the nested pass's change is the calling pass's, as measured by the pipeline


def test_the_built_in_passes_run_nested_passes_through_the_context() -> None:
    """fuse_activations raises the opset for HardSwish through `run_pass`: recorded, and the result checked."""
    from qgraph import get_pass

    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("three", 3.0), ("zero", 0.0), ("six", 6.0))]
    nodes = [helper.make_node("Add", ["x", "three"], ["a"], name="add"),
             helper.make_node("Clip", ["a", "zero", "six"], ["c"], name="clip"),
             helper.make_node("Mul", ["x", "c"], ["m"], name="mul"),
             helper.make_node("Div", ["m", "six"], ["y"], name="div")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    record = Pipeline([get_pass("fuse_activations")()]).run(model).records[0]
    assert [n.name for n in record.nested] == ["raise_opset"]
    assert record.nested[0].options == {"opset": 14}
    assert [n.op_type for n in Pipeline([get_pass("fuse_activations")()]).run(model).model.graph.node] == ["HardSwish"]


def _mul_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r"), helper.make_node("Mul", ["a", "x"], ["y"], name="m")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_skip_takes_a_node_by_its_name() -> None:
    import onnx_graphsurgeon as gs

    from qgraph import PassResult

    res = PassResult()
    res.skip(gs.Node("Relu", name="r1"), "why")
    res.skip("r2", "why")
    assert [s.node for s in res.skipped] == ["r1", "r2"]
    with pytest.raises(TypeError, match="node name"):
        res.skip(3, "why")  # type: ignore[arg-type]


# ------------------------------------------------------------------ passes that raise
class _Raising(Pass[_Cfg]):
    """A plug-in whose run() raises a plain Python exception (a bug in it)."""

    name = "test_raising"
    config_class = _Cfg

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:  # type: ignore[override]
        raise ValueError(f"cannot handle mode {self.config.mode!r}")


def test_an_exception_in_a_plugin_pass_names_the_pass_and_its_module() -> None:
    with pytest.raises(PassError) as err:
        Pipeline([_Broken(mode="none"), _Raising(mode="odd")]).run(_mul_model())
    message = err.value.message
    assert message.startswith("pass #1 'test_raising' failed: ValueError: cannot handle mode 'odd' at ")
    assert f"test_pass_contract.py:{_Raising.run.__code__.co_firstlineno + 1}" in message  # the raising line
    assert f"plug-in pass _Raising from module {__name__}" in message
    assert "run with --debug for the traceback" in message and "bug in qgraph" not in message
    assert err.value.exit_code == 1 and isinstance(err.value.__cause__, ValueError)


def test_an_exception_in_a_builtin_pass_is_a_qgraph_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    cleanup = pass_api.get_pass("cleanup")

    def crash(self: Any, graph: GraphHandle, ctx: PassContext) -> PassResult:
        return {}["missing"]  # type: ignore[no-any-return]

    monkeypatch.setattr(cleanup, "run", crash)
    with pytest.raises(PassError) as err:
        Pipeline([cleanup()]).run(_mul_model())
    message = err.value.message
    assert message.startswith("pass #0 'cleanup' failed: KeyError: 'missing' at ")
    assert "This is a bug in qgraph, please report it" in message and "plug-in" not in message


def test_qgraph_errors_raised_by_a_pass_pass_through_unchanged() -> None:
    class Refuses(Pass[_Cfg]):
        """Raises a typed error of its own: already a message for the user."""

        name = "test_refuses"
        config_class = _Cfg

        def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:  # type: ignore[override]
            raise PassError("no Conv to work on: add one")

    with pytest.raises(PassError) as err:
        Pipeline([Refuses()]).run(_mul_model())
    assert err.value.message == "no Conv to work on: add one"


def test_the_cli_reports_a_crashing_plugin_pass_without_a_traceback(tmp_path: Any,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from qgraph.cli import main
    from qgraph.io.model_io import save_model

    src = save_model(_mul_model(), tmp_path / "m.onnx")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: crash\npasses:\n  - pass: cleanup\n  - pass: test_raising\n    mode: odd\n")
    pass_api.discover()
    pass_api.register(_Raising)
    try:
        code = main(["run", str(recipe), str(src), "-o", str(tmp_path / "out.onnx"), "-q"])
        err = " ".join(capsys.readouterr().err.split())
        assert code == 1 and not (tmp_path / "out.onnx").exists()
        assert "error: pass #1 'test_raising' failed: ValueError: cannot handle mode 'odd'" in err
        assert "run with --debug for the traceback" in err and "Traceback" not in err
        # --debug: the traceback of the exception itself, its cause chained, and the same exit code
        assert main(["--debug", "run", str(recipe), str(src), "-o", str(tmp_path / "out.onnx"), "-q"]) == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and "ValueError: cannot handle mode 'odd'" in err and "PassError" in err
    finally:
        pass_api._REGISTRY.pop(_Raising.name, None)


def test_bad_options_in_python_read_like_recipe_errors() -> None:
    """`Pass(**options)` refuses bad options in one sentence: the field, what is wrong, the value; no pydantic
    ``Value error,`` prefix, error codes or URLs."""
    from qgraph.passes.fuse_batchnorm import FuseBatchNorm
    from qgraph.passes.insert_qdq import InsertQDQ
    from qgraph.passes.quantize_weights import QuantizeWeights

    from qgraph import RecipeError

    cases = [(lambda: FuseBatchNorm(epsilon=1), "fuse_batchnorm: invalid options: unknown option 'epsilon'."),
             (lambda: QuantizeWeights(block_size=17), "quantize_weights: invalid options: block_size must be a power "
              "of two between 16 and 256 (16, 32, 64, 128, 256), got 17."),
             (lambda: InsertQDQ(activations={"method": "bogus"}), "insert_qdq: invalid options: activations.method: "
              "Input should be 'minmax', 'percentile', 'entropy', 'mse' or 'auto' (got 'bogus').")]
    for make, message in cases:
        with pytest.raises(RecipeError) as err:
            make()
        assert str(err.value) == message
        assert "Value error" not in str(err.value) and "pydantic" not in str(err.value)


# ------------------------------------------------------------------ freeing what a pass dropped
class _ScaleWeight(Pass[_Cfg]):
    """Replaces the Mul's constant operand with a new constant (``mode: replace``) or changes nothing."""

    name = "test_scale_weight"
    config_class = _Cfg

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:  # type: ignore[override]
        import onnx_graphsurgeon as gs

        if self.config.mode != "replace":
            return PassResult()
        node = next(n for n in graph.graph.nodes if n.op == "Mul")
        node.inputs[1] = gs.Constant("w2", np.asarray(node.inputs[1].values) * 2.0)
        return PassResult(rewritten=1)


def _weighted_mul(size: int) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones(size, np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"], name="m")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(("size", "mode", "collections"), [(3 << 20, "replace", 2), (1024, "replace", 0),
                                                           (3 << 20, "none", 1)])
def test_a_full_collection_runs_only_where_weights_were_dropped(monkeypatch: pytest.MonkeyPatch, size: int,
                                                                mode: str, collections: int) -> None:
    """A full cyclic collection walks the whole graph (1.9 s at 30k nodes): it runs after a pass that dropped
    megabytes of weights (12 MB here) and at the end when the output holds that much, not after every pass."""
    from qgraph.pipeline import contract
    from qgraph.pipeline.contract import Snapshot

    calls: list[int] = []
    monkeypatch.setattr(contract.gc, "collect", lambda *a: calls.append(1) or 0)
    model = _weighted_mul(size)
    handle = GraphHandle(model)
    before = Snapshot.of(handle.graph)
    assert before.constants and sum(before.constants.values()) == 4 * size
    res = Pipeline([_ScaleWeight(mode=mode)]).run(model)
    assert len(calls) == collections
    y = np.asarray(res.model.graph.initializer[0].float_data or numpy_helper.to_array(res.model.graph.initializer[0]))
    assert float(y.ravel()[0]) == (2.0 if mode == "replace" else 1.0)


class _AppendRelu(Pass[_Cfg]):
    """Appends a Relu after the output; with ``mode: "requires"`` its `requires` also calls ``graph.changed()``."""

    name = "test_append_relu"
    config_class = _Cfg

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        if self.config.mode == "requires":
            graph.changed()

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:  # type: ignore[override]
        import onnx_graphsurgeon as gs

        out = graph.graph.outputs[0]
        mid = gs.Variable(f"pre_relu_{len(graph.graph.nodes)}", dtype=np.float32)
        graph.producer(out).outputs[0] = mid  # type: ignore[union-attr]
        graph.graph.nodes.append(gs.Node("Relu", f"relu_{len(graph.graph.nodes)}", inputs=[mid], outputs=[out]))
        return PassResult(rewritten=1)


@pytest.mark.parametrize(("mode", "walks"), [("none", 4), ("requires", 5)])
def test_a_pass_starts_from_the_snapshot_the_previous_one_left(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                               walks: int) -> None:
    """Each pass's graph is walked before and after it; the walk after one pass is the walk before the next when
    nothing called ``graph.changed()`` in between (3 passes: 4 walks, not 6; 5 when the third's `requires` did)."""
    from qgraph.pipeline import contract

    calls: list[int] = []
    real = contract.Snapshot.of.__func__  # type: ignore[attr-defined]

    def spy(cls: type[contract.Snapshot], graph: Any) -> contract.Snapshot:
        calls.append(len(graph.nodes))
        return real(cls, graph)  # type: ignore[no-any-return]

    monkeypatch.setattr(contract.Snapshot, "of", classmethod(spy))
    result = Pipeline([_AppendRelu(), _Broken(mode="ok"), _AppendRelu(mode=mode)]).run(_mul_model())
    assert len(calls) == walks
    assert [r.result.nodes_added for r in result.records] == [1, 0, 1]
    assert [r.changed for r in result.records] == [True, False, True]
