"""Structural diff of real topologies against the output of a full (hand-made) recipe, pass by pass.

Expected counts are derived independently from the original graph (which nodes a pass must remove, add or
rewire), then compared with what the diff reports for the whole recipe and for every single pass.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from handmade_recipe import full_recipe

from qgraph import Pipeline, PipelineResult
from qgraph.analysis.diff import StructuralDiff, structural_diff
from qgraph.runtime.compare import compare_models, random_feeds

TOPOLOGIES = ["squeezenet", "shufflenet", "inception_v1"]


@dataclass
class Expected:
    """What each hand-made pass must do to a given graph."""

    dropouts: set[str] = field(default_factory=set)
    dropout_consumers: set[str] = field(default_factory=set)
    folds: list[tuple[onnx.NodeProto, onnx.NodeProto]] = field(default_factory=list)
    softmax: set[str] = field(default_factory=set)
    convgemm: list[onnx.NodeProto] = field(default_factory=list)
    acts: set[str] = field(default_factory=set)

    @property
    def folded_convs(self) -> set[str]:
        return {c.name for c, _ in self.folds}

    @property
    def weights_after(self) -> set[str]:
        return {f"{n.name}/bn_folded/W" if n.name in self.folded_convs else n.input[1] for n in self.convgemm}


def expectations(model: onnx.ModelProto) -> Expected:
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in nodes:
        for t in n.input:
            consumers[t].append(n)
    e = Expected()
    bypass: dict[str, str] = {}
    for n in nodes:
        if n.op_type in ("Dropout", "Identity"):
            e.dropouts.add(n.name)
            e.dropout_consumers |= {c.name for c in consumers[n.output[0]]}
            bypass[n.output[0]] = n.input[0]
    for n in nodes:
        if n.op_type == "BatchNormalization":
            p = producer.get(n.input[0])
            if p is not None and p.op_type == "Conv" and len(consumers[n.input[0]]) == 1:
                e.folds.append((p, n))
        if n.op_type == "Softmax" and not any(a.name == "axis" for a in n.attribute):
            e.softmax.add(n.name)
    e.convgemm = [n for n in nodes if n.op_type in ("Conv", "Gemm")]
    for n in e.convgemm:
        t = n.input[0]
        while t in bypass:
            t = bypass[t]
        e.acts.add(t)
    return e


@pytest.fixture(scope="module")
def recipe_runs(light_model: Callable[[str], onnx.ModelProto]) -> dict[str, tuple[onnx.ModelProto, PipelineResult]]:
    runs = {}
    for name in TOPOLOGIES:
        model = light_model(name)
        runs[name] = (model, Pipeline(full_recipe(), name="handmade").run(model, keep_stages=True))
    return runs


def _names(entries: list) -> set[str]:  # type: ignore[type-arg]
    return {e.node for e in entries}


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_whole_recipe_diff_lists_every_pass_effect(name: str, recipe_runs) -> None:  # type: ignore[no-untyped-def]
    model, result = recipe_runs[name]
    e = expectations(model)
    assert e.convgemm and (e.dropouts or e.folds)  # each topology exercises at least one preparation pass
    d = structural_diff(model, result.model)

    removed = e.dropouts | {c.name for c, _ in e.folds} | {b.name for _, b in e.folds}
    q_nodes = {f"{t}/QuantizeLinear" for t in e.acts}
    dq_nodes = {f"{t}/DequantizeLinear" for t in e.acts} | {f"{w}/DequantizeLinear" for w in e.weights_after}
    folded = {f"{c}/bn_folded" for c in e.folded_convs}
    changed = ({n.name for n in e.convgemm} - e.folded_convs) | e.dropout_consumers | e.softmax
    assert _names(d.removed) == removed
    assert _names(d.added) == folded | q_nodes | dq_nodes
    assert {c.node for c in d.changed} == changed - removed
    assert d.unchanged == len(model.graph.node) - len(removed) - len(changed - removed)
    assert d.renamed == 0
    assert d.attribute_changes == len(e.softmax)
    expected_delta = {"QuantizeLinear": len(e.acts), "DequantizeLinear": len(e.acts) + len(e.weights_after),
                      "BatchNormalization": -len(e.folds), "Dropout": -len(e.dropouts)}
    assert d.op_delta() == {k: v for k, v in expected_delta.items() if v}
    by_pass = {"test_fold_bn": len(e.folds), "test_qdq": 2 * len(e.acts) + len(e.weights_after)}
    assert d.added_by_pass() == {k: v for k, v in by_pass.items() if v}
    assert (d.a.opsets, d.b.opsets) == ({"ai.onnx": 9}, {"ai.onnx": 13})
    assert (d.a.ir_version, d.b.ir_version) == (4, 7)

    # Initializers: float weights replaced by int8 + scale + zero point; BN parameters folded away.
    init_removed = {n.input[1] for n in e.convgemm}
    init_removed |= {c.input[2] for c, _ in e.folds if len(c.input) > 2} | {t for _, b in e.folds for t in b.input[1:]}
    init_added = {f"{w}/{s}" for w in e.weights_after for s in ("quantized", "scale", "zero_point")}
    init_added |= {f"{c}/bn_folded/B" for c in e.folded_convs} | {f"{t}/{s}" for t in e.acts
                                                                   for s in ("scale", "zero_point")}
    kinds: dict[str, set[str]] = defaultdict(set)
    for i in d.initializers:
        kinds[i.kind].add(i.name)
    assert kinds["removed"] == init_removed
    assert kinds["added"] == init_added
    assert not kinds["changed"]
    assert d.b.initializer_bytes < d.a.initializer_bytes / 3  # int8 weights
    # QDQ coverage: every Conv/Gemm in integer, uint8 activations × int8 weights; the rest float, with reasons.
    cov = d.coverage_b
    assert cov.counts()["int8"] == len(e.convgemm)
    assert {n.node for n in cov.nodes if n.status == "int8"} == ({n.name for n in e.convgemm} - e.folded_convs) | folded
    assert all(n.dtypes == "uint8×int8" for n in cov.nodes if n.status == "int8")
    assert all(n.reason for n in cov.nodes if n.status != "int8")
    assert d.coverage_a.counts()["int8"] == 0
    assert (cov.quantize_nodes, cov.dequantize_nodes) == (len(q_nodes), len(dq_nodes))
    # Provenance read back from the output model's metadata.
    assert [p["pass"] for p in d.provenance] == [p.name for p in full_recipe()]
    assert d.recipe == "handmade"


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_each_stage_diff_shows_only_that_pass(name: str, recipe_runs) -> None:  # type: ignore[no-untyped-def]
    model, result = recipe_runs[name]
    e = expectations(model)
    assert len(result.stages) == 4
    before = [model, *result.stages[:-1]]
    diffs: list[StructuralDiff] = [structural_diff(a, b) for a, b in zip(before, result.stages, strict=True)]
    drop, fold, opset, qdq = diffs

    assert _names(drop.removed) == e.dropouts and not drop.added
    assert {c.node for c in drop.changed} == e.dropout_consumers

    assert _names(fold.removed) == {c.name for c, _ in e.folds} | {b.name for _, b in e.folds}
    assert _names(fold.added) == {f"{c}/bn_folded" for c in e.folded_convs}
    assert all(a.pass_name == "test_fold_bn" for a in fold.added) and not fold.changed

    assert {c.node for c in opset.changed} == e.softmax and not opset.added and not opset.removed
    assert opset.b.opsets == {"ai.onnx": 13} and opset.a.opsets == {"ai.onnx": 9}
    assert all(ch == "attribute axis: ∅ → 1" for c in opset.changed for ch in c.changes)

    assert not qdq.removed
    assert qdq.added_by_pass() == {"test_qdq": 2 * len(e.acts) + len(e.weights_after)}
    current_convgemm = ({n.name for n in e.convgemm} - e.folded_convs) | {f"{c}/bn_folded" for c in e.folded_convs}
    assert {c.node for c in qdq.changed} == current_convgemm
    # the summary line a report row shows
    assert qdq.short().startswith(f"+{len(qdq.added)} -0 ~{len(current_convgemm)} nodes; ")


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_recipe_output_runs_and_float_passes_are_exact(name: str, recipe_runs) -> None:  # type: ignore[no-untyped-def]
    model, result = recipe_runs[name]
    feeds = random_feeds(model, 1)
    float_stage = result.stages[2]  # after dropout removal, BN folding and opset raising
    (diff,) = compare_models(model, float_stage, feeds)
    assert diff.relative < 1e-4
    (q,) = compare_models(model, result.model, feeds)
    assert q.cosine > 0.9 and np.isfinite(q.sqnr_db)
