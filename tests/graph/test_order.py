"""Topological order and the sortedness check the pass contract uses for acyclicity."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.graph import check_structure, is_topological, topological_order


def _random_dag(seed: int, n: int, back_edge: bool) -> list[gs.Node]:
    """``n`` Add nodes, each reading the previous node's output and a random earlier tensor (graph input ``x``
    included); ``back_edge`` makes node 0 read the last node's output (a cycle). Returned shuffled."""
    rng = np.random.default_rng(seed)
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    tensors = [x]
    nodes = []
    for i in range(n):
        a, b = tensors[-1], tensors[int(rng.integers(0, len(tensors)))]
        out = gs.Variable(f"t{i}", dtype=np.float32, shape=[2])
        nodes.append(gs.Node("Add", name=f"n{i}", inputs=[a, b], outputs=[out]))
        tensors.append(out)
    if back_edge:
        nodes[0].inputs[0] = tensors[-1]
    order = rng.permutation(n)
    return [nodes[i] for i in order]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.booleans())
def test_sorted_means_acyclic_and_the_check_agrees_with_kahn(seed: int, n: int, back_edge: bool) -> None:
    nodes = _random_dag(seed, n, back_edge)
    order = topological_order(nodes)
    assert (order is None) == back_edge
    if is_topological(nodes):
        assert order is not None
    if order is not None:
        assert is_topological(order)
    x = next(t for node in nodes for t in node.inputs if t.name == "x")
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[], opset=17)
    has_cycle = any("cycle" in p for p in check_structure(graph, 17))
    assert has_cycle == back_edge


def test_a_node_reading_its_own_output_is_not_sorted() -> None:
    x, y = gs.Variable("x", dtype=np.float32), gs.Variable("y", dtype=np.float32)
    node = gs.Node("Add", name="self", inputs=[x, y], outputs=[y])
    assert not is_topological([node]) and topological_order([node]) is None
