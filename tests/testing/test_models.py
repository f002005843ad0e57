"""The shared model corpus: real structure, valid ONNX, runs in onnxruntime, realistic numbers."""

from __future__ import annotations

import collections
import importlib.util
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qgraph.testing import models
from qgraph.testing.models import (
    LIGHT_MODEL_NAMES,
    cached_light_model,
    conv_bn_net,
    conv_bn_relu_chain,
    ir_version_for_opset,
    light_model_path,
    materialize_light_model,
    matmul_add_relu_chain,
    random_feeds,
    run_ort,
    transformer_encoder,
    transformer_encoder_inputs,
)

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits"

# name -> (BatchNormalization count, data input name); models kept small enough for the test budget.
LIGHT_CASES = {
    "resnet50": (53, "gpu_0/data_0"),
    "inception_v2": (69, "data_0"),
    "shufflenet": (49, "gpu_0/data_0"),
    "densenet121": (121, "data_0"),
    "squeezenet": (0, "data_0"),
    "inception_v1": (0, "data_0"),
}


def op_counts(model: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(node.op_type for node in model.graph.node)


@pytest.fixture(scope="session")
def light_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("light_models")


@pytest.fixture(scope="session")
def digits_metric() -> ModuleType:
    spec = importlib.util.spec_from_file_location("digits_metric", DIGITS / "metric.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ir_version_matches_opset() -> None:
    assert [ir_version_for_opset(o) for o in (9, 11, 13, 17, 21, 23)] == [4, 6, 7, 8, 10, 10]


def test_light_model_path_rejects_unknown_names() -> None:
    assert light_model_path("resnet50").name == "light_resnet50.onnx"
    assert set(LIGHT_MODEL_NAMES) >= set(LIGHT_CASES)
    with pytest.raises(ValueError, match="unknown light model"):
        light_model_path("resnet51")


@pytest.mark.parametrize("name", sorted(LIGHT_CASES))
def test_materialized_light_model(name: str, light_dir: Path) -> None:
    bn_count, data_input = LIGHT_CASES[name]
    path = cached_light_model(name, light_dir)
    assert cached_light_model(name, light_dir) == path  # second call reuses the file
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    original = onnx.load(light_model_path(name))
    counts, original_counts = op_counts(model), op_counts(original)

    assert counts["ConstantOfShape"] == 0
    assert counts["BatchNormalization"] == bn_count
    for op in ("Conv", "BatchNormalization", "Relu", "Dropout", "Concat", "Softmax", "Gemm", "Mul", "Add"):
        assert counts[op] == original_counts[op], op  # topology kept, only constant subgraphs folded
    assert model.ir_version == 4 and [o.version for o in model.opset_import] == [9]
    assert [i.name for i in model.graph.input] == [data_input]
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 224, 224]
    assert all(n.name for n in model.graph.node)

    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    consumed = {name for node in model.graph.node for name in node.input}
    assert set(initializers) <= consumed
    for node in model.graph.node:  # every weight is a direct initializer input
        if node.op_type in ("Conv", "Gemm", "BatchNormalization"):
            assert all(i in initializers for i in node.input[1:]), node.name
    for tensor_name, array in initializers.items():
        if array.dtype.kind == "f" and array.size > 1:
            assert np.isfinite(array).all() and float(array.std()) > 0, tensor_name
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            scale, var = initializers[node.input[1]], initializers[node.input[4]]
            assert scale.min() >= 0.5 and scale.max() <= 1.5
            assert var.min() > 0 and not np.allclose(var, 1.0)
            assert not np.allclose(initializers[node.input[3]], 0.0)

    (output,) = run_ort(model, random_feeds(model, 1, seed=1)[0])
    assert np.isfinite(output).all()
    assert 0.0 < float(np.abs(output).max()) < 100.0
    if counts["Softmax"]:
        assert float(output.max()) < 0.99, "final softmax saturated"
        np.testing.assert_allclose(output.reshape(len(output), -1).sum(axis=1), 1.0, rtol=1e-4)


def test_light_model_is_deterministic_per_seed() -> None:
    first = materialize_light_model("squeezenet", seed=3)
    again = materialize_light_model("squeezenet", seed=3)
    other = materialize_light_model("squeezenet", seed=4)
    assert first.SerializeToString() == again.SerializeToString()
    assert first.SerializeToString() != other.SerializeToString()


@pytest.mark.parametrize("blocks", [1, 10, 200])
def test_conv_bn_relu_chain(blocks: int) -> None:
    model = conv_bn_relu_chain(blocks, channels=4, spatial=6, opset=13)
    onnx.checker.check_model(model, full_check=True)
    counts = op_counts(model)
    assert len(model.graph.node) == 3 * blocks
    assert counts == {"Conv": blocks, "BatchNormalization": blocks, "Relu": blocks}
    (output,) = run_ort(model, random_feeds(model, 1)[0])
    assert output.shape == (1, 4, 6, 6)
    assert np.isfinite(output).all() and 0.0 < float(output.max()) < 100.0


def test_conv_bn_relu_chain_scales_to_100k_nodes() -> None:
    started = time.perf_counter()
    model = conv_bn_relu_chain(33_334)
    seconds = time.perf_counter() - started
    assert len(model.graph.node) == 100_002
    assert len({n.name for n in model.graph.node}) == 100_002
    assert seconds < 20.0, f"building 100k nodes took {seconds:.1f}s"


def test_conv_bias_variant() -> None:
    model = conv_bn_relu_chain(3, conv_bias=True)
    assert all(len(n.input) == 3 for n in model.graph.node if n.op_type == "Conv")


def test_matmul_add_relu_chain() -> None:
    model = matmul_add_relu_chain(1000, width=16)
    onnx.checker.check_model(model, full_check=True)
    assert len(model.graph.node) == 3000
    assert op_counts(model) == {"MatMul": 1000, "Add": 1000, "Relu": 1000}
    (output,) = run_ort(model, random_feeds(model, 1)[0])
    assert output.shape == (1, 16)
    assert np.isfinite(output).all() and float(output.max()) > 0.0

    dynamic = matmul_add_relu_chain(5, batch="batch")
    (output,) = run_ort(dynamic, random_feeds(dynamic, 1, dynamic_dim=7)[0])
    assert output.shape == (7, 16)


def test_transformer_encoder_structure_and_numbers() -> None:
    model = transformer_encoder(opset=17, layers=2, d_model=64, heads=4)
    onnx.checker.check_model(model, full_check=True)
    counts = op_counts(model)
    assert counts["LayerNormalization"] == 4 and counts["Softmax"] == 2 and counts["Erf"] == 2
    assert counts["MatMul"] == 16 and counts["Transpose"] == 8 and counts["Reshape"] == 8
    assert model.ir_version == 8
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims == {"embeddings": ["batch", "seq", 64], "attention_mask": ["batch", "seq"]}
    mask_consts = [t for t in model.graph.initializer if t.name == "const/mask_value"]
    assert float(numpy_helper.to_array(mask_consts[0])) == -10000.0

    feeds = transformer_encoder_inputs(4, seed=0, batch=2)
    for feed in feeds:
        assert feed["embeddings"].shape == (2, 16, 64) and feed["attention_mask"].shape == (2, 16)
        assert feed["attention_mask"][:, 0].all()
    assert any((f["attention_mask"] == 0).any() for f in feeds)
    (out,) = run_ort(model, feeds[0])
    assert out.shape == (2, 16, 64) and np.isfinite(out).all()
    assert 0.5 < float(out.std()) < 2.0

    # Padding is masked: changing padded embeddings leaves the valid positions unchanged.
    feed = feeds[0]
    valid = feed["attention_mask"].astype(bool)
    changed = dict(feed, embeddings=np.where(valid[..., None], feed["embeddings"], 5.0).astype(np.float32))
    (out2,) = run_ort(model, changed)
    np.testing.assert_allclose(out2[valid], out[valid], atol=1e-4)

    for feed in transformer_encoder_inputs(3, seed=1, vary_seq=True):
        (out,) = run_ort(model, feed)
        assert out.shape == (1, feed["attention_mask"].shape[1], 64)


def test_transformer_encoder_variants() -> None:
    feed = transformer_encoder_inputs(1, seed=2)[0]
    (reference,) = run_ort(transformer_encoder(opset=17), feed)
    lowered = transformer_encoder(opset=13)  # LayerNormalization decomposed as exporters do below 17
    onnx.checker.check_model(lowered, full_check=True)
    assert op_counts(lowered)["LayerNormalization"] == 0 and op_counts(lowered)["ReduceMean"] == 8
    (out,) = run_ort(lowered, feed)
    np.testing.assert_allclose(out, reference, atol=1e-4)

    with_ids = transformer_encoder(opset=17, vocab=50, dynamic=False)
    onnx.checker.check_model(with_ids, full_check=True)
    assert op_counts(with_ids)["Gather"] == 3
    (out,) = run_ort(with_ids, transformer_encoder_inputs(1, seed=3, vocab=50)[0])
    assert out.shape == (1, 16, 64) and np.isfinite(out).all()


@pytest.mark.parametrize("opset", [9, 13, 17, 21])
def test_conv_bn_net(opset: int) -> None:
    model = conv_bn_net(opset)
    onnx.checker.check_model(model, full_check=True)
    counts = op_counts(model)
    assert counts["BatchNormalization"] == 4 and counts["Conv"] == 4
    for op in ("Add", "MaxPool", "GlobalAveragePool", "Flatten", "Gemm"):
        assert counts[op] == 1, op
    assert model.opset_import[0].version == opset and model.ir_version == ir_version_for_opset(opset)
    (logits,) = run_ort(model, random_feeds(model, 1)[0])
    (reference,) = run_ort(conv_bn_net(17), random_feeds(model, 1)[0])
    assert logits.shape == (1, 10) and np.isfinite(logits).all()
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)


def test_random_feeds_and_run_ort_levels() -> None:
    model = transformer_encoder()
    feeds = random_feeds(model, 2, seed=5, dims={"seq": 12}, dynamic_dim=3)
    assert len(feeds) == 2
    assert feeds[0]["embeddings"].shape == (3, 12, 64) and feeds[0]["embeddings"].dtype == np.float32
    assert not np.array_equal(feeds[0]["embeddings"], feeds[1]["embeddings"])
    again = random_feeds(model, 2, seed=5, dims={"seq": 12}, dynamic_dim=3)
    for first, second in zip(feeds, again, strict=True):
        for key in first:
            np.testing.assert_array_equal(first[key], second[key])
    net = conv_bn_net()
    feed = random_feeds(net, 1)[0]
    outputs = [run_ort(net, feed, level)[0] for level in ("disable", "basic", "extended", "all")]
    for output in outputs[1:]:
        np.testing.assert_allclose(output, outputs[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="optimization_level"):
        run_ort(net, feed, "fast")


def test_digits_example(digits_metric: ModuleType) -> None:
    model = onnx.load(DIGITS / "model.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version <= 10 and model.opset_import[0].version == 17
    assert op_counts(model)["BatchNormalization"] == 3
    (graph_input,) = model.graph.input
    assert graph_input.name == "input"
    assert graph_input.type.tensor_type.shape.dim[0].dim_param  # dynamic batch

    calibration = digits_metric.load_calibration()
    assert list(calibration) == ["input"]
    assert calibration["input"].shape == (200, 1, 8, 8) and calibration["input"].dtype == np.float32
    feeds, labels = digits_metric.load_eval()
    assert feeds["input"].shape[0] == labels.shape[0] >= 400
    assert set(np.unique(labels)) == set(range(10))

    accuracy = digits_metric.evaluate(DIGITS / "model.onnx")
    assert accuracy >= 0.95
    (logits,) = run_ort(model, feeds)
    assert digits_metric.top1([logits], labels) == pytest.approx(accuracy)
    assert digits_metric.top1(logits, labels) == pytest.approx(accuracy)
    assert len(digits_metric.calibration_feeds(batch_size=50)) == 4


def test_public_api_is_exported() -> None:
    import qgraph.testing

    assert set(models.__all__) == set(qgraph.testing.__all__)
    for name in models.__all__:
        assert getattr(qgraph.testing, name) is getattr(models, name)


def test_mobilenet_v2_has_the_inverted_residual_pattern() -> None:
    from qgraph.testing import mobilenet_v2

    model = mobilenet_v2(width=0.5, resolution=64, classes=10)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    weights = {t.name: t.dims for t in model.graph.initializer}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    depthwise = [n for n in convs if next(a.i for a in n.attribute if a.name == "group") == weights[n.input[1]][0] > 1]
    assert len(depthwise) == 17 and ops["Add"] == 10 and ops["Clip"] == 35 and ops["BatchNormalization"] == len(convs)
    assert all(weights[n.input[1]][1] == 1 for n in depthwise)  # one input channel per group
    out = run_ort(model, random_feeds(model, 1)[0])[0]
    assert out.shape == (1, 10) and np.isfinite(out).all() and 0.1 < float(out.std()) < 100
    assert onnx.checker.check_model(model, full_check=True) is None
