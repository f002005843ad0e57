"""A fused layer written as onnxruntime's integer kernel computes it (`qgraph.runtime.kernels.requant`): the exact
int32 sum, the int32 bias codes, then onnxruntime's requantization, gives this host's deployed outputs bit for bit,
with this host's integer kernels or with their exact float forms (what a host whose kernels saturate uses).
`test_real_avx2.py` checks the whole emulation against onnxruntime's real AVX2 kernels the same way."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from kernel_models import Case, gemm_case, requant_cases

from qgraph.runtime.kernels.corrections import ProtoEmitter
from qgraph.runtime.kernels.fusion import Constants, fused_layers
from qgraph.runtime.kernels.host import probe_pair_saturation
from qgraph.runtime.kernels.requant import IntegerForm, integer_form

#: The reference is this host's fused kernels computing exact int32 sums with MLAS's x86 requantization: on an AVX2
#: host they saturate (`test_real_avx2.py` checks the emulation there), and ARM's kernels are not checked here.
pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or probe_pair_saturation(),
    reason="needs an x86 host whose u8×s8 kernels are exact (VNNI); test_real_avx2.py covers AVX2 hosts")

CASES = {c.name: c for c in requant_cases()}
DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"


def _integer_model(model: onnx.ModelProto, *, exact_float: bool) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """Every layer onnxruntime fuses, written as its integer form; the layers written and the reasons of the rest."""
    work = onnx.ModelProto()
    work.CopyFrom(model)
    fused = fused_layers(work)
    consts = Constants(work)
    g = work.graph
    taken = {n.name for n in g.node} | {t for n in g.node for t in (*n.input, *n.output)} | \
        {t.name for t in g.initializer}
    producers = {t: n for n in g.node for t in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    opset = next(o.version for o in work.opset_import if o.domain in ("", "ai.onnx"))
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    removed: set[str] = set()
    written: list[str] = []
    reasons: list[str] = []
    for node in g.node:
        form = integer_form(node, producers, consumers, consts.get, {o.name for o in g.output}) \
            if node.name in fused and node.op_type in ("Conv", "MatMul", "Gemm") else None
        if not isinstance(form, IntegerForm):
            reasons += [form] if form else []
            nodes.append(node)
            continue
        em = ProtoEmitter(taken, opset)
        form.finish(em, form.accumulator(em, consts.get, exact_float=exact_float))
        nodes += em.nodes
        inits += em.inits
        removed |= form.replaces
        written.append(node.name)
    del g.node[:]
    g.node.extend(n for n in nodes if n.name not in removed)
    g.initializer.extend(inits)
    return work, written, reasons


def _deployed(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in s.run(None, {s.get_inputs()[0].name: x})]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("exact_float", [False, True], ids=["integer-kernels", "exact-float"])
def test_the_integer_form_is_the_fused_kernel_bit_for_bit(name: str, exact_float: bool) -> None:
    case: Case = CASES[name]
    rewritten, written, reasons = _integer_model(case.model, exact_float=exact_float)
    assert written == [next(n.name for n in case.model.graph.node if n.op_type in ("Conv", "MatMul", "Gemm"))]
    assert reasons == []
    assert written[0] not in {n.name for n in rewritten.graph.node}
    for want, got in zip(_deployed(case.model, case.x), _deployed(rewritten, case.x), strict=True):
        np.testing.assert_array_equal(got, want)
    integer_ops = {n.op_type for n in rewritten.graph.node} & {"ConvInteger", "MatMulInteger"}
    if exact_float or "s8" in name or ("weight_zero_point" in name and name.startswith("conv")):
        assert not integer_ops  # exact float forms (no integer kernel for these operands, or a saturating host)
    elif name.startswith("conv"):  # float32 Conv where every partial sum is below 2^24, ConvInteger beyond
        assert integer_ops == ({"ConvInteger"} if name == "conv_wide" else set())
    else:
        assert integer_ops == {"MatMulInteger"}


def test_a_form_it_cannot_write_says_why() -> None:
    m = gemm_case("gemm_alpha", 64, 8, alpha=0.5).model
    producers = {t: n for n in m.graph.node for t in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in m.graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    gemm = next(n for n in m.graph.node if n.op_type == "Gemm")
    assert integer_form(gemm, producers, consumers, Constants(m).get, {"y"}) == "a Gemm with transA, alpha or beta"
    assert "gemm" not in fused_layers(m)  # nor does onnxruntime fuse it


def test_every_layer_of_a_quantized_cnn_bit_for_bit() -> None:
    """The digits CNN under the VNNI recipe (Conv -> Relu -> Q layers, a Gemm head with a float output): every
    layer rewritten, the logits of 64 images identical."""
    from qgraph import Recipe

    digits = onnx.load(str(DIGITS / "model.onnx"))
    vnni = Recipe.from_yaml(Path(__file__).resolve().parents[2] / "recipes" / "ort-x86-vnni.yaml").pipeline().run(
        digits, calibration_data=str(DIGITS / "calibration.npz")).model
    x = np.load(DIGITS / "eval.npz")["input"][:64]
    rewritten, written, reasons = _integer_model(vnni, exact_float=False)
    layers = [n for n in vnni.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")]
    assert sorted(written) == sorted(n.name for n in layers) == sorted(fused_layers(vnni)) and reasons == []
    assert not any(n.op_type == "Relu" for n in rewritten.graph.node)  # each Relu folded into its requantization
    np.testing.assert_array_equal(_deployed(rewritten, x)[0], _deployed(vnni, x)[0])
