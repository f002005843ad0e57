"""insert_qdq on real topologies: the trained digits CNN, a materialized light model, a transformer encoder."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from insert_qdq_helpers import cosine, run, source
from qgraph.passes.fuse_batchnorm import FuseBatchNorm
from qgraph.passes.insert_qdq import InsertQDQ

from qgraph import Pipeline
from qgraph.quant.qdq import ort_fusion_report
from qgraph.testing import transformer_encoder, transformer_encoder_inputs

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"


@pytest.fixture(scope="module")
def digits() -> object:
    sys.path.insert(0, str(DIGITS))
    try:
        import metric  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    return metric


@pytest.mark.parametrize("preset", ["ort-x86-vnni", "ort-x86-avx2", "ort-arm"])
def test_trained_cnn_keeps_top1_within_half_a_percent(digits: object, preset: str) -> None:
    metric = digits
    model = onnx.load(str(DIGITS / "model.onnx"))
    res = Pipeline([FuseBatchNorm(), InsertQDQ(preset=preset)]).run(
        model, calibration_data=str(DIGITS / "calibration.npz")
    )
    q = res.model
    onnx.checker.check_model(q, full_check=True)
    base = metric.evaluate(model.SerializeToString())  # type: ignore[attr-defined]
    acc = metric.evaluate(q.SerializeToString())  # type: ignore[attr-defined]
    assert acc >= base - 0.005, (preset, base, acc)
    if preset != "ort-arm":  # s8 activations are not fused on x86 (onnxruntime converts them at run time)
        rep = ort_fusion_report(q)
        assert rep.integer == {"QGemm": 1, "QLinearConv": 3, "QLinearGlobalAveragePool": 1}
        assert rep.quantize == 1 and rep.dequantize == 0 and rep.float_compute == {}


def test_light_model_fuses_every_conv_and_concat(light_model: Callable[[str], onnx.ModelProto]) -> None:
    model = light_model("squeezenet")
    from qgraph.passes.lower_opset.raising import raise_model

    model = raise_model(model, 13).model
    rng = np.random.default_rng(0)
    feeds = [{"data_0": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)} for _ in range(3)]
    res = Pipeline([InsertQDQ(preset="ort-x86-vnni")]).run(model, calibration_data=source(feeds))
    q = res.model
    onnx.checker.check_model(q)
    rep = ort_fusion_report(q)
    assert rep.integer == {"QLinearConcat": 8, "QLinearConv": 26}
    op_of = {n.name: n.op_type for n in model.graph.node}
    tails = {op_of[s.node] for s in res.records[0].result.skipped if "no quantized op reads" in s.reason}
    # The final pool feeds the float Softmax; the last fire module's Concat feeds an inference Dropout (which
    # `cleanup` removes in the ready recipes), so onnxruntime fused neither before either.
    assert tails == {"GlobalAveragePool", "Concat"}
    assert rep.quantize == 1 and rep.dequantize == 1 and rep.float_compute == {}
    assert cosine(run(model, feeds[0]), run(q, feeds[0])) > 0.995


@pytest.fixture(scope="module")
def encoder() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    model = transformer_encoder(17, layers=2, d_model=64, heads=4, seq=32)
    return (
        model,
        transformer_encoder_inputs(16, seq=32, d_model=64, seed=1),
        transformer_encoder_inputs(6, seq=32, d_model=64, seed=2),
    )


def test_transformer_preset_keeps_cosine(encoder: tuple[onnx.ModelProto, list, list]) -> None:  # type: ignore[type-arg]
    model, _, evals = encoder
    res = Pipeline([InsertQDQ(preset="transformer-ort-x86-vnni")]).run(model)
    q = res.model
    onnx.checker.check_model(q, full_check=True)
    assert cosine([run(model, f)[0] for f in evals], [run(q, f)[0] for f in evals]) >= 0.99
    r = res.records[0].result
    assert r.details["quantized_ops"] == {"MatMul": 12}
    assert sum("two activations" in s.reason for s in r.skipped) == 4
    rep = ort_fusion_report(q, "all")
    assert rep.ops["DynamicQuantizeMatMul"] + rep.ops["MatMulIntegerToFloat"] == 12


def test_static_transformer_skips_the_mask_and_stays_accurate(
    encoder: tuple[onnx.ModelProto, list, list],  # type: ignore[type-arg]
) -> None:
    model, cal, evals = encoder
    # Every elementwise op quantized: the outlier screen keeps the masking Add float.
    every = Pipeline([InsertQDQ(preset="ort-x86-vnni", elementwise="always")]).run(model, calibration_data=source(cal))
    r = every.records[0].result
    masked = r.details["excluded_tensors"]
    assert masked and all("masking constants" in why for why in masked.values())
    assert any(s.node == "layer0/attn/mask" and "masking" in s.reason for s in r.skipped)
    # The default: the masking Add feeds the float Softmax, so it is not quantized in the first place.
    res = Pipeline([InsertQDQ(preset="ort-x86-vnni")]).run(model, calibration_data=source(cal))
    q = res.model
    onnx.checker.check_model(q, full_check=True)
    r = res.records[0].result
    assert any(s.node == "layer0/attn/mask" and "no quantized op reads" in s.reason for s in r.skipped)
    for quantized in (q, every.model):
        assert cosine([run(model, f)[0] for f in evals], [run(quantized, f)[0] for f in evals]) >= 0.99
