"""The emulation model computes a CPU's integer arithmetic in onnxruntime on any host
(`qgraph.runtime.kernels.emulate`).

Checked against an independent numpy model of the AVX2 kernels (`kernel_models.avx2_reference`): on every layer
shape the difference between the emulated AVX2 and the exact (VNNI) output is exactly what int16 pair saturation
removes. The same holds when the emulation is built for a host whose own kernels saturate (the integer ops are
then rewritten to exact float forms first). `test_real_avx2.py` compares with onnxruntime's real AVX2 kernels.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from kernel_models import Case, avx2_correction, cases, conv_case

from qgraph.runtime.kernels.emulate import emulate, has_integer_work
from qgraph.runtime.kernels.host import probe_pair_saturation

CASES = {c.name: c for c in cases()}


def _layer_output(case: Case) -> str:
    """The tensor the correction lands on: the layer's float output before any output quantization."""
    return "y" if not any(n.output and n.output[0] == "c" for n in case.model.graph.node) else "c"


def _run(case: Case, family: str, host_saturates: bool, name: str = "y") -> tuple[np.ndarray, list[float]]:
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    if name != "y":  # a layer's output read out is no longer fused by onnxruntime: only for the exact arithmetic
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    em = emulate(model, family, host_saturates=host_saturates)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(em.model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    out = session.run([name, *em.counters], {"x": case.x})
    return np.asarray(out[0], np.float64), [float(v) for v in out[1:]]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("host_saturates", [False, True], ids=["exact-host", "saturating-host"])
def test_emulated_avx2_minus_exact_is_the_pair_saturation(name: str, host_saturates: bool) -> None:
    case = CASES[name]
    avx2, counters = _run(case, "x86-avx2", host_saturates)
    layer = _layer_output(case)
    exact, none = _run(case, "x86-vnni", host_saturates, layer)
    assert none == []  # the exact arithmetic adds no counters
    want = exact + avx2_correction(case)
    if layer == "c":  # the output Q/DQ of the case (scale 0.5, zero point 128) requantizes the layer's result
        want = (np.clip(np.rint(want / 0.5) + 128, 0, 255) - 128) * 0.5
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(avx2, want, rtol=0, atol=2e-5 * scale)
    if name == "conv_depthwise":  # onnxruntime's depthwise kernel has no pairs: nothing to emulate
        assert not np.any(avx2_correction(case)) and counters == []
    else:
        assert np.abs(avx2_correction(case)).max() > 0.01 * scale  # the case does saturate
        saturated, computed = counters
        assert 0 < saturated <= computed


def test_the_exact_rewrite_gives_the_host_kernels_results_on_an_exact_host() -> None:
    """On a host whose kernels are exact, the float rewrite of MatMulInteger gives the kernel's own int32 sums."""
    if probe_pair_saturation():
        pytest.skip("this host's integer kernels saturate: their results are not the exact reference here")
    case = CASES["dynamic"]
    rewritten, _ = _run(case, "x86-vnni", host_saturates=True)
    native, _ = _run(case, "x86-vnni", host_saturates=False)
    np.testing.assert_array_equal(rewritten, native)


def test_a_float_model_is_returned_as_is() -> None:
    model = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>\ng (float[2] x) => (float[2] y) '
                                    "{ y = Relu(x) }")
    assert not has_integer_work(model)
    assert emulate(model, "x86-avx2", host_saturates=False).model is model


def test_sites_name_the_layer_its_pair_and_how_many_pairs_can_overflow() -> None:
    case = conv_case("conv", 8, 4, 3)
    em = emulate(case.model, "x86-avx2", host_saturates=False)
    (site,) = em.sites
    assert (site.node, site.op, site.activation, site.weight) == ("conv", "Conv", "xq", "w")
    assert 0 < site.pairs_at_risk < site.pairs == 4 * 36 and abs(site.worst_pair_sum) > 32767
    assert em.analysed == 1 and em.skipped == []
    again = emulate(case.model, "x86-avx2", host_saturates=False, count=False)
    assert again.counters == [] and [o.name for o in again.model.graph.output] == ["y"]
    fused = emulate(case.model, "x86-avx2", host_saturates=False, requantize=True)  # the same site, analysed once
    assert [s.node for s in fused.sites] == ["conv"] and fused.analysed == 1 and fused.requantized == ["conv"]
    assert fused.approximate == [] and "conv" not in {n.name for n in fused.model.graph.node}


def test_a_layer_onnxruntime_does_not_fuse_is_left_float() -> None:
    """A Gemm with alpha != 1 and a float bias stays DequantizeLinear -> Gemm on onnxruntime's CPU provider: it
    runs in float there, so the emulation must not saturate it."""
    text = """<ir_version: 8, opset_import: ["" : 13]>
    g (float[4, 64] x) => (float[4, 10] y) {
        xq = QuantizeLinear(x, s, z)  xd = DequantizeLinear(xq, s, z)  wd = DequantizeLinear(w, ws)
        y = Gemm<transB = 1, alpha = 0.5>(xd, wd, b) }"""
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([
        onnx.numpy_helper.from_array(np.array(np.float32(0.05)), "s"),
        onnx.numpy_helper.from_array(np.array(np.uint8(0)), "z"),
        onnx.numpy_helper.from_array(rng.integers(-128, 128, (10, 64)).astype(np.int8), "w"),
        onnx.numpy_helper.from_array(np.array(np.float32(0.01)), "ws"),
        onnx.numpy_helper.from_array(np.zeros(10, np.float32), "b")])
    assert emulate(model, "x86-avx2", host_saturates=False).sites == []


def test_fused_layers_are_remembered_by_structure_scales_and_zero_points(monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx import numpy_helper

    from qgraph.quant.qdq import is_dequantize
    from qgraph.runtime.kernels import fusion as em
    from qgraph.testing.depthwise import depthwise_float_and_qdq

    _, qdq = depthwise_float_and_qdq(seed=3)
    inits = {t.name: t for t in qdq.graph.initializer}
    dq = [n for n in qdq.graph.node if is_dequantize(n.op_type, n.domain)]
    bias = next(inits[n.input[0]] for n in dq if inits.get(n.input[0]) is not None
                and inits[n.input[0]].data_type == onnx.TensorProto.INT32)
    zero = next(inits[n.input[2]] for n in dq if len(n.input) > 2 and n.input[2] in inits
                and inits[n.input[2]].data_type == onnx.TensorProto.UINT8)

    def edited(tensor: onnx.TensorProto, change: int) -> onnx.ModelProto:
        m = onnx.ModelProto()
        m.CopyFrom(qdq)
        t = next(x for x in m.graph.initializer if x.name == tensor.name)
        value = numpy_helper.to_array(t)
        t.CopyFrom(numpy_helper.from_array((value.astype(np.int64) + change).astype(value.dtype), t.name))
        return m

    # bias codes (what a weight correction changes) do not move the key; a zero point does
    assert em.fusion_key(edited(bias, 3)) == em.fusion_key(qdq)
    assert em.fusion_key(edited(zero, 1)) != em.fusion_key(qdq)
    sessions: list[int] = []
    real = em._fused_layers
    monkeypatch.setattr(em, "_FUSED", {})
    monkeypatch.setattr(em, "_fused_layers", lambda m: sessions.append(1) or real(m))
    first = em.fused_layers(qdq)
    assert em.fused_layers(edited(bias, 3)) == first and len(sessions) == 1  # one optimizing session, not two
    assert em.fused_layers(edited(zero, 1)) is not None and len(sessions) == 2
    assert first == real(qdq) and first  # the remembered answer is onnxruntime's


def test_a_layer_it_cannot_write_as_its_fused_kernel_is_named_with_why() -> None:
    """Conv -> Clip(0, 6) -> Q fuses on onnxruntime (the Q's range is within the Clip), but the requantizing form
    knows only Conv -> [Relu] -> Q: the layer keeps its saturation as a correction on Q/DQ in float, and a
    measurement says so (`emulation_notes`)."""
    from qgraph.runtime.kernels.measure import emulated, emulation_notes

    model = onnx.ModelProto()
    model.CopyFrom(conv_case("conv", 8, 4, 3).model)
    g = model.graph
    conv = next(n for n in g.node if n.op_type == "Conv")
    conv.output[0] = "c_raw"
    lo, hi = onnx.numpy_helper.from_array(np.float32(0), "lo"), onnx.numpy_helper.from_array(np.float32(6), "hi")
    g.initializer.extend([lo, hi])
    clip = onnx.helper.make_node("Clip", ["c_raw", "lo", "hi"], ["c"], name="clip")
    g.node.insert(list(g.node).index(conv) + 1, clip)
    q = next(n for n in g.node if n.name == "c/q")
    for t in g.initializer:
        if t.name == "os":
            t.CopyFrom(onnx.numpy_helper.from_array(np.float32(6 / 255), "os"))
        if t.name == "ozp":
            t.CopyFrom(onnx.numpy_helper.from_array(np.uint8(0), "ozp"))
    assert q.input[1:] == ["os", "ozp"]
    em = emulate(model, "x86-avx2", host_saturates=False, requantize=True)
    assert em.requantized == [] and [node for node, _ in em.approximate] == ["conv"]
    (note,) = em.notes()
    assert note.startswith("conv: not written as its fused kernel (its output is not requantized") and "float" in note
    session = emulated("x86-avx2").session(model)
    assert emulation_notes(session) == [note] and len(session.run(None, {"x": CASES["conv_even"].x})[0])
    plain = emulate(conv_case("conv", 8, 4, 3).model, "x86-avx2", host_saturates=False, requantize=True)
    assert plain.notes() == []
    # a VNNI target on a host whose kernels saturate: the layer it cannot write runs this host's saturating kernel
    on_avx2 = emulate(model, "x86-vnni", host_saturates=True, requantize=True)
    (note,) = on_avx2.notes()
    assert note.startswith("conv: not written as its fused kernel") and "this host's integer kernel" in note
