"""Per-node range statistics are reduced inside onnxruntime (bounded memory) and equal what numpy computes from
the fetched activations with the pairs' own parameters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from qgraph import GraphHandle, Recipe
from qgraph.analysis.sensitivity.stats import _add_reductions, range_stats
from qgraph.quant.math import fake_quantize_counted
from qgraph.quant.qdq_graph import qparams
from qgraph.runtime.compare import make_session, session_run

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"


def test_in_graph_statistics_match_numpy() -> None:
    qdq = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").pipeline().run(
        DIGITS / "model.onnx", calibration_data=DIGITS / "calibration.npz").model
    with np.load(DIGITS / "eval.npz") as z:
        feeds = [{"input": z["input"][i : i + 1].astype(np.float32)} for i in range(6)]
    names = [n.name for n in qdq.graph.node if n.op_type in ("Conv", "Gemm")]
    stats = range_stats(qdq, feeds, names)
    assert set(stats) == set(names)
    # numpy reference: fetch each float source tensor and fake-quantize it with its Q node's parameters
    handle = GraphHandle(qdq)
    q_of = {n.inputs[0].name: n for n in handle.index.nodes if n.op == "QuantizeLinear"}
    row = stats[names[1]]["inputs"][0]
    q = q_of[row["tensor"]]
    params = qparams(handle, q)
    assert params is not None
    x = _fetch(qdq, row["tensor"], feeds)
    fq, clipped = fake_quantize_counted(x, params.scale, params.zero_point, params.qmin, params.qmax)
    sqnr = 10 * np.log10(np.sum(x.astype(np.float64) ** 2) / np.sum((fq - x).astype(np.float64) ** 2))
    assert abs(row["sqnr_db"] - sqnr) < 1e-3
    assert row["observed_max"] == float(x.max())
    lo, hi = params.representable
    assert row["clip_fraction"] == np.count_nonzero((x < lo) | (x > hi)) / x.size
    assert clipped == np.count_nonzero((x < lo) | (x > hi))


def _fetch(model: onnx.ModelProto, name: str, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    extra = onnx.ModelProto()
    extra.CopyFrom(model)
    extra.graph.output.append(onnx.helper.make_value_info(name, onnx.TypeProto()))
    sess = make_session(extra)
    return np.concatenate([session_run(sess, [name], f)[0].ravel() for f in feeds]).astype(np.float32)


def test_reductions_sit_right_after_their_pair() -> None:
    qdq = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").pipeline().run(
        DIGITS / "model.onnx", calibration_data=DIGITS / "calibration.npz").model
    handle = GraphHandle(qdq)
    from qgraph.analysis.sensitivity.stats import _pairs_feeding

    found = _pairs_feeding(handle, {n.name for n in qdq.graph.node if n.op_type == "Conv"})
    assert found is not None
    model = handle.to_onnx()
    _add_reductions(model, found[0])
    nodes = list(model.graph.node)
    for _src, fq, _params, _relu in found[0].values():
        made = next(i for i, n in enumerate(nodes) if fq in n.output)
        stats = next(i for i, n in enumerate(nodes) if fq in n.input and n.output[0].startswith("qgraph_stats/"))
        assert made < stats <= made + 3  # reduced right after its pair, not at the end of the graph
