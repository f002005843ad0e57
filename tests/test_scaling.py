"""Scaling guard: a ~50k-node graph through the preparation recipe, with bounded whole-graph walks.

Catches accidental O(N²): every pass may walk the whole graph a constant number of times, never per node.
The time bound is generous (it guards against quadratic blow-ups, ~hours at this size, not against noise).
"""

from __future__ import annotations

import time

from qgraph import GraphHandle, PassContext
from qgraph.pipeline.pass_api import get_pass
from qgraph.testing.models import conv_bn_relu_chain

MAX_WALKS_PER_PASS = 12


def test_preparation_passes_on_50k_nodes_are_linear() -> None:
    model = conv_bn_relu_chain(16_667, channels=4, spatial=4)
    assert len(model.graph.node) >= 50_000
    handle = GraphHandle(model)
    ctx = PassContext()
    start = time.perf_counter()
    results = {}
    for name in ("fold_constants", "fuse_batchnorm", "cleanup"):
        before = sum(handle.walks.values())
        results[name] = get_pass(name)().run(handle, ctx)
        handle.changed()
        walks = sum(handle.walks.values()) - before
        assert walks <= MAX_WALKS_PER_PASS, (name, dict(handle.walks))
    elapsed = time.perf_counter() - start
    assert results["fuse_batchnorm"].rewritten == 16_667
    assert sum(n.op == "BatchNormalization" for n in handle.graph.nodes) == 0
    assert len(handle.graph.nodes) == 2 * 16_667 + (len(model.graph.node) - 3 * 16_667)
    assert elapsed < 240, f"preparation of 50k nodes took {elapsed:.0f}s: something is super-linear"
