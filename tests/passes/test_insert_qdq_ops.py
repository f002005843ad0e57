"""insert_qdq op coverage: ConvTranspose, Concat, Mul, pools, Split/Transpose groups, graph outputs, ranges files,
and linear scaling on long chains."""

from __future__ import annotations

import time

import numpy as np
import onnx
from insert_qdq_helpers import cosine, feeds_for, initializer, nodes_by_name, quantize, run, with_weights

from qgraph.calibrate import collect_ranges, write_ranges
from qgraph.io.model_io import model_fingerprint
from qgraph.quant.qdq import ort_fusion_report

OPS = """
<ir_version: 8, opset_import: ["" : 17]>
ops (float[1,4,8,8] x) => (float[1,8,16,16] y, float[1,4,8,8] z) {
  c = Conv<pads=[1,1,1,1]>(x, w, b)
  s = Sigmoid(c)
  m = Mul(c, s)
  cat = Concat<axis=1>(m, x)
  ap = AveragePool<kernel_shape=[2,2], strides=[1,1], pads=[0,0,1,1]>(cat)
  t = ConvTranspose<strides=[2,2], kernel_shape=[2,2]>(ap, wt, bt)
  y = LeakyRelu<alpha=0.1>(t)
  z = Conv(x, w1x1)
}
"""


def ops_model() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    return with_weights(
        OPS,
        {
            "w": rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32),
            "b": rng.normal(0, 0.1, (4,)).astype(np.float32),
            "wt": rng.normal(0, 0.3, (8, 8, 2, 2)).astype(np.float32),
            "bt": rng.normal(0, 0.1, (8,)).astype(np.float32),
            "w1x1": rng.normal(0, 0.3, (4, 4, 1, 1)).astype(np.float32),
        },
    )


def test_every_supported_op_is_quantized_and_runs() -> None:
    m = ops_model()
    feeds = feeds_for(m, 8)
    res = quantize(m, feeds, preset="ort-x86-vnni", elementwise="always")
    q = res.model
    d = res.records[0].result.details
    assert d["quantized_ops"] == {
        "Conv": 2,
        "Sigmoid": 1,
        "Mul": 1,
        "Concat": 1,
        "AveragePool": 1,
        "ConvTranspose": 1,
        "LeakyRelu": 1,
    }
    # ConvTranspose weights per channel on axis 1; its bias is int32 with the matching per-channel scale
    assert initializer(q, "wt/scale").shape == (8,) and nodes_by_name(q)["wt/dq"].attribute[0].i == 1
    assert initializer(q, "bt/q").dtype == np.int32
    # graph outputs keep their names: the producer writes <name>/float, the DequantizeLinear writes <name>
    assert [o.name for o in q.graph.output] == ["y", "z"]
    assert nodes_by_name(q)["z/dq"].output == ["z"] and "z/float" in nodes_by_name(q)["z/q"].input
    rep = ort_fusion_report(q)
    assert {"QLinearConv", "QLinearSigmoid", "QLinearMul", "QLinearConcat", "QLinearAveragePool"} <= set(rep.integer)
    assert rep.ops["QLinearConv"] == 2  # the graph-output Conv is fused too
    evals = feeds_for(m, 3, seed=9)
    for i in range(2):
        assert cosine([run(m, f)[i] for f in evals], [run(q, f)[i] for f in evals]) > 0.99


SPLIT = """
<ir_version: 8, opset_import: ["" : 17]>
split (float[1,8,4] x) => (float[1,4,4] y) {
  h = MatMul(x, w)
  a, b2 = Split<axis=1>(h, sizes)
  t = Transpose<perm=[0,2,1]>(a)
  u = Reshape(t, shape)
  y = MatMul(u, w2)
}
"""


def test_data_movement_groups_share_one_scale_and_drop_in_onnxruntime() -> None:
    rng = np.random.default_rng(2)
    m = with_weights(
        SPLIT,
        {
            "w": rng.normal(0, 0.5, (4, 4)).astype(np.float32),
            "w2": rng.normal(0, 0.5, (4, 4)).astype(np.float32),
            "sizes": np.array([4, 4], np.int64),
            "shape": np.array([1, 4, 4], np.int64),
        },
    )
    feeds = feeds_for(m, 4)
    q = quantize(m, feeds, preset="ort-x86-vnni").model
    nodes = nodes_by_name(q)
    assert "b2/q" not in nodes  # an unused output gets no Q/DQ
    for t in ("a", "t", "u"):  # the whole group reuses h's parameters
        assert nodes[f"{t}/q"].input[1:] == ["h/scale", "h/zero_point"]
    rep = ort_fusion_report(q)
    assert rep.ops["QLinearMatMul"] == 1 and rep.ops["MatMulIntegerToFloat"] == 1, rep.ops
    assert rep.ops["Transpose"] == 1 and rep.ops["Reshape"] == 1 and rep.float_compute == {}
    assert cosine([run(m, f)[0] for f in feeds], [run(q, f)[0] for f in feeds]) > 0.99


def test_ranges_file_is_used_instead_of_data(tmp_path: object) -> None:
    from pathlib import Path

    from insert_qdq_helpers import tiny_cnn
    from qgraph.passes.insert_qdq import InsertQDQ

    from qgraph import Pipeline
    from qgraph.pipeline.pass_api import PassContext
    from qgraph.pipeline.target import CalibrationSpec

    m = tiny_cnn()
    feeds = feeds_for(m, 4)
    cal = collect_ranges(m, ["x", "r1", "c2", "r2", "g"], feeds)
    path = Path(str(tmp_path)) / "ranges.json"
    write_ranges(path, cal, model_fingerprint=model_fingerprint(m))
    from qgraph import GraphHandle

    handle = GraphHandle(m)
    p = InsertQDQ(preset="ort-x86-vnni")
    ctx = PassContext(calibration=CalibrationSpec(ranges=str(path)))
    p.requires(handle, ctx)
    res = p.run(handle, ctx)
    assert any("read from" in n for n in res.notes)
    q = handle.to_onnx()
    ref = quantize(m, feeds, preset="ort-x86-vnni").model
    assert float(initializer(q, "r1/scale")) == float(initializer(ref, "r1/scale"))
    assert Pipeline  # imported for symmetry with the other tests


def test_long_chain_is_linear() -> None:
    from qgraph.passes.insert_qdq import InsertQDQ

    from qgraph import GraphHandle, PassContext
    from qgraph.data import CallableSource
    from qgraph.testing import matmul_add_relu_chain, random_feeds

    costs = []
    for layers in (100, 1000):
        model = matmul_add_relu_chain(layers)
        sample = random_feeds(model, 1)
        handle = GraphHandle(model)
        start = time.process_time()
        res = InsertQDQ(preset="ort-x86-vnni").run(
            handle, PassContext(calibration_data=CallableSource(lambda s=sample: s, "s"))
        )
        costs.append(time.process_time() - start)
        assert res.details["quantized_ops"] == {"MatMul": layers}
        assert handle.walks["index"] <= 4 and handle.walks["toposort"] <= 2
    assert costs[1] < 6.0  # 3,000 nodes (typically ~1.5 s of CPU; the benchmark records the exact figure)
    assert costs[1] / max(costs[0], 1e-3) < 25  # 10x the nodes, well under 25x the cost
