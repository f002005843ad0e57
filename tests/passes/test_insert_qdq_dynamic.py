"""insert_qdq dynamic mode, If/Loop bodies, and local CPU detection for ``reduce_range: auto``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from insert_qdq_helpers import cosine, feeds_for, initializer, nodes_by_name, quantize, run, with_weights
from qgraph.passes.insert_qdq import InsertQDQConfig
from qgraph.passes.insert_qdq.cpu import resolve_reduce_range

from qgraph.quant.qdq import ort_fusion_report
from qgraph.runtime.kernels.cpu import CpuInfo, parse_cpuinfo

MLP = """
<ir_version: 8, opset_import: ["" : 17]>
mlp (float[1,6,32] x) => (float[1,6,32] y) {
  h = MatMul(x, w1)
  hb = Add(h, b1)
  r = Relu(hb)
  g = Gemm<transB=1, alpha=0.5>(r2, w2, b2)
  r2 = Reshape(r, shape)
  y = Reshape(g, shape_out)
}
"""


def mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    text = MLP.replace(
        "  g = Gemm<transB=1, alpha=0.5>(r2, w2, b2)\n  r2 = Reshape(r, shape)\n",
        "  r2 = Reshape(r, shape)\n  g = Gemm<transB=1, alpha=0.5>(r2, w2, b2)\n",
    )
    return with_weights(
        text,
        {
            "w1": rng.normal(0, 0.2, (32, 64)).astype(np.float32),
            "b1": rng.normal(0, 0.1, (64,)).astype(np.float32),
            "w2": rng.normal(0, 0.2, (32, 64)).astype(np.float32),
            "b2": rng.normal(0, 0.1, (32,)).astype(np.float32),
            "shape": np.array([6, 64], np.int64),
            "shape_out": np.array([1, 6, 32], np.int64),
        },
    )


def test_dynamic_matmul_and_gemm_structure_and_fusion() -> None:
    m = mlp()
    res = quantize(m, None, mode="dynamic", op_types=["MatMul", "Gemm"])
    q = res.model
    nodes = nodes_by_name(q)
    assert nodes["x/dynq"].op_type == "DynamicQuantizeLinear" and nodes["r2/dynq"].op_type == "DynamicQuantizeLinear"
    assert initializer(q, "w1/q").dtype == np.int8 and initializer(q, "w1/scale").shape == (64,)
    # Gemm: transB folded into the stored weight, alpha into its scale, beta*C added after
    assert initializer(q, "w2/q").shape == (64, 32)
    assert [o.name for o in q.graph.output] == ["y"] and "h" in {o for n in q.graph.node for o in n.output}
    rep = ort_fusion_report(q)
    assert rep.ops["DynamicQuantizeMatMul"] + rep.ops["MatMulIntegerToFloat"] == 2 and rep.ops["MatMulInteger"] == 0
    feeds = feeds_for(m, 4)
    assert cosine([run(m, f)[0] for f in feeds], [run(q, f)[0] for f in feeds]) > 0.999
    assert res.records[0].result.details["quantized_ops"] == {"MatMul": 1, "Gemm": 1}


def test_dynamic_needs_no_data_and_is_idempotent() -> None:
    q = quantize(mlp(), None, preset="transformer-ort-x86-vnni").model
    again = quantize(q, None, preset="transformer-ort-x86-vnni")
    assert again.records[0].result.rewritten == 0 and len(again.model.graph.node) == len(q.graph.node)


IF_MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
branchy (bool c, float[1,16] x) => (float[1,16] y) {
  y = If(c) <
    then_branch = t () => (float[1,16] ty) { ty = MatMul(x, w) },
    else_branch = e () => (float[1,16] ey) { eh = MatMul(x, w) ey = Relu(eh) }
  >
}
"""


def test_if_bodies_get_dynamic_matmuls() -> None:
    rng = np.random.default_rng(0)
    m = with_weights(IF_MODEL, {"w": rng.normal(0, 0.3, (16, 16)).astype(np.float32)})
    x = rng.standard_normal((1, 16)).astype(np.float32)
    feeds = [{"c": np.array(True), "x": x}, {"c": np.array(False), "x": x}]
    res = quantize(m, feeds, preset="ort-x86-vnni", subgraphs="dynamic")
    r = res.records[0].result
    assert r.details["subgraph_nodes_quantized"] == 2
    bodies = [a.g for a in res.model.graph.node[-1].attribute]
    assert all("MatMulInteger" in [n.op_type for n in g.node] for g in bodies)
    for f in feeds:
        assert cosine(run(m, f), run(res.model, f)) > 0.999
    skipped = quantize(m, feeds, preset="ort-x86-vnni", subgraphs="skip").records[0].result
    assert skipped.details["subgraph_nodes_quantized"] == 0
    assert sum("If/Loop/Scan body" in s.reason for s in skipped.skipped) == 2
    # The default (subgraphs: static): each branch is calibrated on the samples that take it, quantized statically.
    static = quantize(m, feeds, preset="ort-x86-vnni")
    assert static.records[0].result.details["subgraph_nodes_quantized_static"] == 2
    for g in (a.g for a in static.model.graph.node[-1].attribute):
        matmul = next(n for n in g.node if n.op_type == "MatMul")
        producers = {o: n.op_type for n in g.node for o in n.output}
        assert [producers.get(i) for i in matmul.input] == ["DequantizeLinear", "DequantizeLinear"]
    for f in feeds:
        assert cosine(run(m, f), run(static.model, f)) > 0.999


@pytest.mark.parametrize(
    ("flags", "machine", "expected"),
    [
        ("fpu avx2 avx512f avx512_vnni", "x86_64", CpuInfo("x86", True, True)),
        ("fpu avx2 avx_vnni", "x86_64", CpuInfo("x86", True, True)),
        ("fpu sse4_2 avx2 fma", "x86_64", CpuInfo("x86", False, True)),
        ("fp asimd asimddp", "aarch64", CpuInfo("arm", False, False)),
    ],
)
def test_cpuinfo_parsing(flags: str, machine: str, expected: CpuInfo) -> None:
    text = f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: none\n"
    if machine == "aarch64":
        text = text.replace("flags", "Features")
    got = parse_cpuinfo(text, machine)
    assert (got.arch, got.vnni, got.avx2) == (expected.arch, expected.vnni, expected.avx2)


def test_reduce_range_auto_follows_the_cpu() -> None:
    cfg = InsertQDQConfig()  # default: u8 activations, s8 weights, reduce_range auto, saturation auto
    avx2 = CpuInfo("x86", vnni=False, avx2=True)
    on, why = resolve_reduce_range(cfg, avx2)
    assert not on and "avoided per layer" in why  # saturation: auto protects just the channels at risk
    plain = InsertQDQConfig(saturation="off")  # without it, 7-bit weights everywhere
    on, why = resolve_reduce_range(plain, avx2)
    assert on and "without" not in why and "saturate" in why
    off, why = resolve_reduce_range(cfg, CpuInfo("x86", vnni=True, avx2=True))
    assert not off and "VNNI" in why
    assert not resolve_reduce_range(cfg, CpuInfo("arm", False, False))[0]
    # s8 activations saturate on AVX2 too: onnxruntime shifts them to u8 before the same kernel
    assert resolve_reduce_range(InsertQDQConfig(activations={"dtype": "int8"}, saturation="off"), avx2)[0]
    assert not resolve_reduce_range(InsertQDQConfig(preset="ort-x86-avx2"), CpuInfo("x86", True, True))[0]
