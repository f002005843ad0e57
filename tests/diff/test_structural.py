"""Structural diff on tiny models written as ONNX text: matching, renames, attributes, weights, QDQ coverage."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import numpy_helper

from qgraph.analysis.diff import qdq_coverage, structural_diff
from qgraph.analysis.diff.protos import ModelIndex
from qgraph.analysis.diff.structural import match_nodes

CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4] x) => (float[1,4] y) {
  w = Constant <value = float[4,4] {1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1}> ()
  m = MatMul (x, w)
  r = Relu (m)
  s = Sigmoid (r)
  y = LeakyRelu <alpha = 0.1> (s)
}
"""


def _chain(names: list[str], alpha: float = 0.1, out_names: tuple[str, ...] = ("m", "r", "s")) -> onnx.ModelProto:
    m = onnx.parser.parse_model(CHAIN)
    for node, name in zip(m.graph.node, names, strict=True):
        node.name = name
    m.graph.node[4].attribute[0].f = alpha
    # rename intermediate tensors when asked (renamed chain: step 4 must follow the wiring)
    mapping = dict(zip(("m", "r", "s"), out_names, strict=True))
    for node in m.graph.node:
        node.input[:] = [mapping.get(t, t) for t in node.input]
        node.output[:] = [mapping.get(t, t) for t in node.output]
    return m


def test_identical_models_have_no_changes() -> None:
    a = _chain(["w", "mm", "relu", "sig", "leaky"])
    d = structural_diff(a, a)
    assert (len(d.added), len(d.removed), len(d.changed), d.unchanged) == (0, 0, 0, 5)
    assert d.op_delta() == {} and d.initializers == []
    assert d.short() == "+0 -0 ~0 nodes"


def test_attribute_change_is_reported_with_values() -> None:
    a = _chain(["w", "mm", "relu", "sig", "leaky"])
    b = _chain(["w", "mm", "relu", "sig", "leaky"], alpha=0.2)
    d = structural_diff(a, b)
    assert d.attribute_changes == 1
    (c,) = d.changed
    assert c.node == "leaky"
    assert len(c.changes) == 1 and c.changes[0].startswith("attribute alpha: 0.1") and "→ 0.2" in c.changes[0]


def test_renamed_nodes_are_matched_structurally() -> None:
    a = _chain(["w", "mm", "relu", "sig", "leaky"])
    # Same tensors, new node names: matched by outputs (step 2).
    b = _chain(["W", "MM", "RELU", "SIG", "LEAKY"])
    d = structural_diff(a, b)
    assert d.renamed == 5 and not d.added and not d.removed
    assert {c.node: c.new_name for c in d.changed} == {"w": "W", "mm": "MM", "relu": "RELU", "sig": "SIG",
                                                       "leaky": "LEAKY"}
    # New node names and new intermediate tensor names: matched by wiring (steps 3-4), link by link.
    c = _chain(["W", "MM", "RELU", "SIG", "LEAKY"], out_names=("m2", "r2", "s2"))
    d2 = structural_diff(a, c)
    assert d2.renamed == 5 and not d2.added and not d2.removed
    assert {ch.node for ch in d2.changed} == {"w", "mm", "relu", "sig", "leaky"}
    relu = next(ch for ch in d2.changed if ch.node == "relu")
    assert relu.changes == ["renamed: relu → RELU", "input 0: m → m2", "output 0: r → r2"]


def test_unnamed_nodes_match_structurally() -> None:
    a = _chain(["", "", "", "", ""])
    b = _chain(["", "", "", "", ""])
    mapping = match_nodes(ModelIndex.build(a), ModelIndex.build(b))
    assert {i: r.index for i, r in mapping.items()} == {i: i for i in range(5)}
    assert structural_diff(a, b).unchanged == 5


def test_tagged_nodes_are_added_not_renamed() -> None:
    a = _chain(["w", "mm", "relu", "sig", "leaky"])
    b = _chain(["w", "mm", "relu/new", "sig", "leaky"])
    b.graph.node[2].doc_string = "qgraph:some_pass"
    d = structural_diff(a, b)
    assert [(e.node, e.pass_name) for e in d.added] == [("relu/new", "some_pass")]
    assert [e.node for e in d.removed] == ["relu"]
    assert d.added_by_pass() == {"some_pass": 1}


def test_op_replaced_under_the_same_name() -> None:
    a = _chain(["w", "mm", "relu", "sig", "leaky"])
    b = _chain(["w", "mm", "relu", "sig", "leaky"])
    b.graph.node[3].op_type = "Tanh"
    d = structural_diff(a, b)
    (c,) = d.changed
    assert c.node == "sig" and c.changes == ["op: Sigmoid → Tanh"]
    assert d.op_delta() == {"Sigmoid": -1, "Tanh": 1}


def _mlp(weight: np.ndarray, opset: int = 17, ir: int = 8) -> onnx.ModelProto:
    m = onnx.parser.parse_model(f"""
    <ir_version: {ir}, opset_import: ["" : {opset}]>
    g (float[1,4] x) => (float[1,4] y) {{
      y = MatMul (x, w)
    }}
    """)
    m.graph.node[0].name = "mm"
    m.graph.initializer.append(numpy_helper.from_array(weight.astype(np.float32), "w"))
    return m


def test_initializers_opsets_ir_and_sizes() -> None:
    a = _mlp(np.eye(4))
    b = _mlp(np.eye(4) * 2, opset=13, ir=7)
    b.graph.initializer.append(numpy_helper.from_array(np.zeros(10, np.int8), "extra"))
    d = structural_diff(a, b)
    kinds = {(i.name, i.kind, i.before, i.after, i.bytes_before, i.bytes_after) for i in d.initializers}
    assert kinds == {("w", "changed", "float32[4, 4]", "float32[4, 4]", 64, 64),
                     ("extra", "added", "", "int8[10]", 0, 10)}
    assert (d.a.opsets, d.b.opsets, d.a.ir_version, d.b.ir_version) == ({"ai.onnx": 17}, {"ai.onnx": 13}, 8, 7)
    assert d.b.initializer_bytes - d.a.initializer_bytes == 10
    assert d.summary()["opsets_changed"] is True
    # raw vs typed storage of the same values is not a change
    c = _mlp(np.eye(4))
    c.graph.initializer[0].CopyFrom(onnx.helper.make_tensor("w", onnx.TensorProto.FLOAT, [4, 4],
                                                            np.eye(4, dtype=np.float32).ravel().tolist()))
    assert structural_diff(a, c).initializers == []


QDQ = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4] x, float[1,4] z) => (float[1,4] y, float[1,4] v, float[1,4] u) {
  s = Constant <value = float {0.1}> ()
  zp = Constant <value = uint8 {128}> ()
  ws = Constant <value = float {0.01}> ()
  wz = Constant <value = int8 {0}> ()
  wq = Constant <value = int8[4,4] {1,2,3,4, 5,6,7,8, 9,10,11,12, 13,14,15,16}> ()
  xq = QuantizeLinear (x, s, zp)
  xdq = DequantizeLinear (xq, s, zp)
  wdq = DequantizeLinear (wq, ws, wz)
  y = MatMul (xdq, wdq)
  v = Add (xdq, z)
  u = Mul (x, z)
}
"""


def test_qdq_coverage_is_detected_structurally() -> None:
    m = onnx.parser.parse_model(QDQ)
    for i, node in enumerate(m.graph.node):
        node.name = f"n{i}_{node.op_type}"
    cov = qdq_coverage(m, reasons={"n10_Mul": "kept float by the recipe"})
    status = {n.node: (n.status, n.dtypes, n.reason) for n in cov.nodes}
    assert status == {
        "n8_MatMul": ("int8", "uint8×int8", ""),
        "n9_Add": ("partial", "uint8", "not quantized: z"),
        "n10_Mul": ("float", "", "kept float by the recipe"),
    }
    assert (cov.quantize_nodes, cov.dequantize_nodes) == (1, 2)
    assert cov.by_op() == {"Add": {"int8": 0, "partial": 1, "float": 0},
                           "MatMul": {"int8": 1, "partial": 0, "float": 0},
                           "Mul": {"int8": 0, "partial": 0, "float": 1}}
    assert abs(cov.fraction - 1 / 3) < 1e-9


def test_provenance_metadata_is_read_back() -> None:
    a = _mlp(np.eye(4))
    b = _mlp(np.eye(4))
    stats = [{"pass": "p1", "matched": 1, "rewritten": 1, "skipped": 0, "nodes_before": 1, "nodes_after": 1,
              "skipped_nodes": [{"node": "mm", "reason": "too small"}]}]
    b.metadata_props.add(key="qgraph.passes", value=json.dumps(stats))
    b.metadata_props.add(key="qgraph.recipe", value=json.dumps({"name": "r", "passes": []}))
    d = structural_diff(a, b)
    assert d.recipe == "r" and d.provenance[0]["pass"] == "p1"
    assert d.coverage_b.nodes[0].reason == "p1: too small"
    assert set(d.metadata_changes) == {"qgraph.passes", "qgraph.recipe"}
    assert json.loads(json.dumps(d.to_dict()))["summary"]["unchanged"] == 1
