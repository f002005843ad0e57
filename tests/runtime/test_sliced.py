"""Sliced sessions (`qgraph.runtime.sliced`): a long graph run in slices gives the bits of one session, on the
deployed kernels and on emulated ones, and cuts only where no onnxruntime rewrite can span the cut."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from qgraph import Recipe
from qgraph.data import CallableSource
from qgraph.runtime.compare import make_session, session_run, session_runs
from qgraph.runtime.kernels.measure import Kernels, deployed, emulated
from qgraph.runtime.segments import sink_constants
from qgraph.runtime.sliced import SlicedSession, exact_starts, sliced_session
from qgraph.testing import matmul_add_relu_chain, mobilenet_v2, random_feeds, transformer_encoder

READY = Path(__file__).resolve().parents[2] / "recipes" / "ort-x86-vnni.yaml"


def _quantized(model: onnx.ModelProto, n: int = 8) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    feeds = random_feeds(model, n, seed=1)
    res = Recipe.from_yaml(READY).pipeline().run(model, calibration_data=CallableSource(lambda: feeds, "random"))
    return res.model, feeds


def _outputs(session: Any, model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    return [session_run(session, [o.name for o in model.graph.output], f) for f in feeds]


CASES = {
    "chain": lambda: matmul_add_relu_chain(60),
    "mobilenet_v2": mobilenet_v2,
    "transformer": lambda: transformer_encoder(17, layers=2, d_model=32, seq=8),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def quantized(request: pytest.FixtureRequest) -> tuple[str, onnx.ModelProto, list[dict[str, np.ndarray]]]:
    model, feeds = _quantized(CASES[request.param]())
    return request.param, model, feeds


@pytest.mark.parametrize("kernels", [deployed(), emulated("x86-avx2"), emulated("x86-vnni")],
                         ids=lambda k: k.label())
def test_slices_give_the_bits_of_one_session(quantized: tuple[str, onnx.ModelProto, list[dict[str, np.ndarray]]],
                                             kernels: Kernels) -> None:
    name, model, feeds = quantized
    whole = _outputs(kernels.session(model), model, feeds)
    built: list[int] = []

    def factory(m: onnx.ModelProto, w: Any) -> Any:
        built.append(len(m.graph.node))
        return kernels.session(m, weights=w)

    session = sliced_session(model, factory, above=0, size=40)
    got = _outputs(session, model, feeds)
    if name == "transformer":  # the float residual stream crosses every cut: one session
        assert not isinstance(session, SlicedSession) and built == [len(model.graph.node)]
    else:
        assert isinstance(session, SlicedSession) and session.slices >= 3, name
        assert len(built) == session.slices  # built on the first run, reused after
    for a, b in zip(whole, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y), name  # the same fused kernels: not close, equal


@pytest.mark.parametrize("over_budget", [False, True])
@pytest.mark.parametrize("single_use", [True, False])
def test_feeds_run_slice_major_give_the_same_bits_and_a_single_use_session_frees_its_slices(
        monkeypatch: pytest.MonkeyPatch, single_use: bool, over_budget: bool) -> None:
    if over_budget:  # past the first slice, the samples finish one at a time: the same bits, the same builds
        monkeypatch.setattr("qgraph.runtime.segments.SLICE_MAJOR_BYTES", 1)
    model, feeds = _quantized(matmul_add_relu_chain(60))
    whole = _outputs(deployed().session(model), model, feeds)
    built: list[int] = []

    def factory(m: onnx.ModelProto, w: Any) -> Any:
        built.append(len(m.graph.node))
        return deployed().session(m, weights=w)

    session = sliced_session(model, factory, above=0, size=40, single_use=single_use)
    assert isinstance(session, SlicedSession) and session.slices >= 3
    names = [o.name for o in model.graph.output]
    for rounds in (1, 2):
        got = list(session_runs(session, names, feeds))
        for a, b in zip(whole, got, strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
        alive = [seg.session is not None for seg in session.segments]
        assert not any(alive) if single_use else all(alive)
        # a single-use session builds its slices again when run again; a kept one builds them once
        assert len(built) == session.slices * (rounds if single_use else 1)


def _crossing(model: onnx.ModelProto, cut: int) -> set[str]:
    """Tensors produced before node ``cut`` and read at or after it (the definition, quadratic on purpose)."""
    nodes = model.graph.node
    before = {t for n in nodes[:cut] for t in n.output if t}
    return {t for n in nodes[cut:] for t in n.input if t in before}


def _integer_edge(model: onnx.ModelProto, t: str) -> bool:
    nodes = model.graph.node
    producer = next(n for n in nodes if t in n.output)
    readers = [n for n in nodes if t in n.input]
    source = [n for n in nodes if producer.input[0] in n.output]
    return (producer.op_type == "QuantizeLinear" and all(r.op_type == "DequantizeLinear" for r in readers)
            and not any(s.op_type == "DequantizeLinear" for s in source))


def test_cuts_cross_only_integer_edges(quantized: tuple[str, onnx.ModelProto, list[dict[str, np.ndarray]]]) -> None:
    name, model, _ = quantized
    sunk = onnx.ModelProto()
    sunk.CopyFrom(model)
    sink_constants(sunk)
    starts = exact_starts(sunk, size=40)
    assert starts[0] == 0 and (len(starts) == 1 if name == "transformer" else len(starts) >= 3)
    assert all(b - a >= 40 for a, b in itertools.pairwise(starts))
    for cut in starts[1:]:
        crossing = _crossing(sunk, cut)
        assert crossing, (name, cut)
        assert all(_integer_edge(sunk, t) for t in crossing), (name, cut, crossing)


def _skip_graph(spans: list[tuple[int, int]], length: int) -> onnx.ModelProto:
    """A float chain of ``length`` Relu nodes, each quantized (Relu -> Q -> DQ); ``spans`` (a, b): node b also adds
    node a's float output (a skip connection that forbids every cut in between)."""
    nodes: list[onnx.NodeProto] = []
    prev = "x"
    float_out: list[str] = []
    skips = {b: a for a, b in spans}
    for i in range(length):
        src = prev
        if i in skips:
            nodes.append(helper.make_node("Add", [prev, float_out[skips[i]]], [f"sum{i}"]))
            src = f"sum{i}"
        nodes.append(helper.make_node("Relu", [src], [f"r{i}"]))
        float_out.append(f"r{i}")
        nodes.append(helper.make_node("QuantizeLinear", [f"r{i}", "s", "z"], [f"q{i}"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"q{i}", "s", "z"], [f"d{i}"]))
        prev = f"d{i}"
    graph = helper.make_graph(
        nodes, "skips", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]), helper.make_tensor("z", TensorProto.UINT8, [], [0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 30), st.lists(st.tuples(st.integers(0, 29), st.integers(1, 29)), max_size=4),
       st.integers(1, 9))
def test_exact_starts_against_the_definition(length: int, raw: list[tuple[int, int]], size: int) -> None:
    ends = {max(a, b): min(a, b) for a, b in raw if min(a, b) < max(a, b) < length}  # one skip per reader
    model = _skip_graph([(a, b) for b, a in ends.items()], length)
    starts = exact_starts(model, size=size)
    nodes = len(model.graph.node)
    allowed = [c for c in range(1, nodes) if all(_integer_edge(model, t) for t in _crossing(model, c))]
    # greedy: the first allowed cut at least ``size`` nodes after the previous start
    expected = [0]
    for c in allowed:
        if c - expected[-1] >= size:
            expected.append(c)
    assert starts == expected
    assert exact_starts(model, size=size, anywhere=True) == list(range(0, nodes, size))


def test_small_graphs_and_subgraphs_get_one_session() -> None:
    chain = matmul_add_relu_chain(4)
    calls: list[onnx.ModelProto] = []
    sliced_session(chain, lambda m, w: calls.append(m), above=1000)
    assert calls == [chain]
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    cond = helper.make_node("If", ["c"], ["out"], then_branch=branch, else_branch=branch)
    g = helper.make_graph([cond], "if", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                         helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])])
    with_if = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    sliced_session(with_if, lambda m, w: calls.append(m), above=0)
    assert calls[-1] is with_if


def test_float_reference_slices_anywhere() -> None:
    model = transformer_encoder(17, layers=2, d_model=32, seq=8)
    feeds = random_feeds(model, 3, seed=2)
    session = sliced_session(model, lambda m, w: make_session(m, weights=w), above=0, size=9, anywhere=True)
    assert isinstance(session, SlicedSession) and session.slices >= len(model.graph.node) // 9
    for a, b in zip(_outputs(make_session(model), model, feeds), _outputs(session, model, feeds), strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_typed_slices_cut_anywhere_read_the_graphs_shapes() -> None:
    # untyped, a slice's inputs have no shape, so onnxruntime's fusions inside it (MatMul + Add -> Gemm) do not apply
    model = matmul_add_relu_chain(12)
    feeds = random_feeds(model, 2, seed=3)
    inputs: list[list[onnx.ValueInfoProto]] = []

    def factory(m: onnx.ModelProto, w: Any) -> Any:
        inputs.append(list(m.graph.input))
        return make_session(m, weights=w)

    for typed in (False, True):
        inputs.clear()
        session = sliced_session(model, factory, above=0, size=10, anywhere=True, typed=typed)
        assert isinstance(session, SlicedSession) and session.slices == 4
        outs = _outputs(session, model, feeds)
        for a, b in zip(_outputs(make_session(model), model, feeds), outs, strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
        later = [i for slice_inputs in inputs[1:] for i in slice_inputs]  # the first slice reads the model's input
        assert later and all(i.type.tensor_type.HasField("shape") == typed for i in later)
        if typed:
            assert all([d.dim_value for d in i.type.tensor_type.shape.dim] == [1, 16] for i in later)
