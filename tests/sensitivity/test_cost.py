"""Latency-aware fallback ranking: the modelled cost of a fallback set (Q/DQ boundaries counted), the order that
buys output error cheapest, and the pass's reporting of modelled and measured latency."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qgraph import Pipeline
from qgraph.analysis.sensitivity.cost import CostSpec, LatencyModel, cost_aware_order
from qgraph.analysis.sensitivity.noise import NoiseModel
from qgraph.analysis.sensitivity.options import SearchOptions
from qgraph.analysis.sensitivity.probe import LocalError
from qgraph.analysis.sensitivity.search import auto_fallback
from qgraph.analysis.sensitivity.targets import parse_target
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.runtime.compare import TensorDiff
from qgraph.runtime.latency import TABLE_VERSION, CostEntry, LatencyTable, PresetTable

C, S = 16, 32  # channels, spatial size
Q_NS = 1.0  # ns per element of a QuantizeLinear / DequantizeLinear


def _table() -> LatencyTable:
    """Dense 3x3 convs 10x faster in int8; Relu as fast either way."""
    conv = CostEntry(kind="Conv/dense/3x3", bucket="ci16-co16-hw1024", work=1e6, float_us=1000.0, int8_us=100.0,
                     samples=1)
    relu = CostEntry(kind="Relu", bucket="e16384", work=1e4, float_us=1.0, int8_us=1.0, samples=1)
    preset = PresetTable(quantize_ns=Q_NS, dequantize_ns=Q_NS, entries=(conv, relu))
    return LatencyTable(version=TABLE_VERSION, host="test", runtime="test", threads=1, presets={"p": preset})


def _qdq_chain() -> onnx.ModelProto:
    """x → Q/DQ → big (3x3 Conv, int8 weight) → Q/DQ → relu1 → Q/DQ → relu2 → Q/DQ → graph output."""
    nodes, inits = [], []
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "s")
    zp = numpy_helper.from_array(np.array(128, np.uint8), "zp")
    w = numpy_helper.from_array(np.ones((C, C, 3, 3), np.int8), "w_q")
    wscale = numpy_helper.from_array(np.array(0.01, np.float32), "ws")
    wzp = numpy_helper.from_array(np.array(0, np.int8), "wzp")
    inits += [scale, zp, w, wscale, wzp]

    def qdq(t: str) -> str:
        nodes.append(helper.make_node("QuantizeLinear", [t, "s", "zp"], [f"{t}_q"], name=f"{t}/q"))
        nodes.append(helper.make_node("DequantizeLinear", [f"{t}_q", "s", "zp"], [f"{t}_dq"], name=f"{t}/dq"))
        return f"{t}_dq"

    nodes.append(helper.make_node("DequantizeLinear", ["w_q", "ws", "wzp"], ["w"], name="w/dq"))
    nodes.append(helper.make_node("Conv", [qdq("x"), "w"], ["big_out"], name="big", pads=[1, 1, 1, 1]))
    nodes.append(helper.make_node("Relu", [qdq("big_out")], ["relu1_out"], name="relu1"))
    nodes.append(helper.make_node("Relu", [qdq("relu1_out")], ["relu2_out"], name="relu2"))
    y = qdq("relu2_out")
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, S, S])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, C, S, S])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _noise(etas: dict[str, float], sqnr_db: float = 10.0) -> NoiseModel:
    errors = {n: LocalError(n, err=e, sig=1.0, weights=[1.0]) for n, e in etas.items()}
    return NoiseModel(errors, [TensorDiff("y", 1.0, 1.0, 0.99, sqnr_db)])


def _smallest_meeting_prefix(noise: NoiseModel, order: list[str], goal_db: float) -> list[str]:
    scores = noise.prefix_scores(parse_target(f"sqnr:{goal_db}"), order)
    m = next(m for m, s in enumerate(scores) if s >= goal_db)
    return order[:m]


def test_boundaries_make_a_node_next_to_float_nodes_cheaper() -> None:
    lat = LatencyModel(_qdq_chain(), _table(), "p")
    elems_us = C * S * S * Q_NS / 1e3  # one conversion of one activation
    # relu1 alone: a DQ on its input (big stays int8) and a Q on its output (relu2 stays int8)
    assert lat.delta("relu1") == pytest.approx(2 * elems_us)
    # big: its float time minus its int8 time (MACs x rate); the graph input's Q goes, a Q on its output comes
    macs = C * S * S * C * 9
    assert lat.delta("big") == pytest.approx(macs * (1000.0 - 100.0) / 1e6)
    lat.set_float("relu1")
    # relu2 next to the float relu1: its input Q and its output DQ go away
    assert lat.delta("relu2") == pytest.approx(-2 * elems_us)
    assert lat.predict(["relu2"]) == pytest.approx(lat.total() - 2 * elems_us)


def test_latency_order_buys_the_same_error_cheaper_than_the_error_order() -> None:
    """``big`` has the most noise, relu1 + relu2 together as much: removing either half meets +3 dB. The error
    order takes ``big`` (the expensive conv); the latency order takes the two Relus, which cost far less."""
    noise = _noise({"big": 0.6, "relu1": 0.3, "relu2": 0.3})
    lat = LatencyModel(_qdq_chain(), _table(), "p")
    goal = 10.0 + 10 * math.log10(2.0) - 1e-6
    by_error = _smallest_meeting_prefix(noise, noise.order(), goal)
    by_latency = _smallest_meeting_prefix(noise, cost_aware_order(noise, lat), goal)
    assert by_error == ["big"]
    assert sorted(by_latency) == ["relu1", "relu2"]
    base = lat.predict([])
    assert lat.predict(by_latency) - base < (lat.predict(by_error) - base) / 10
    assert base == pytest.approx(lat.total())  # the order left the model's state as it was


def test_gain_per_added_time_with_the_free_node_price() -> None:
    """relu2 writes the graph output: in float its input needs a DQ but the output's DQ goes, so it costs
    nothing; it is priced at δ = 5% of the mean positive single-node cost. big (10x slower in float) comes last
    although it has the most noise; relu1 (two conversions) before relu2 when its gain per µs is higher."""
    lat = LatencyModel(_qdq_chain(), _table(), "p")
    assert lat.delta("relu2") == pytest.approx(0.0)
    price = 0.05 * (lat.delta("relu1") + lat.delta("big")) / 2
    for relu1, relu2 in ((0.5, 0.2), (0.5, 0.05)):
        noise = _noise({"relu1": relu1, "relu2": relu2, "big": 0.6})
        assert noise.order() == ["big", "relu1", "relu2"]
        first = "relu1" if relu1 / (lat.delta("relu1") + price) > relu2 / price else "relu2"
        assert cost_aware_order(noise, lat) == [first, "relu2" if first == "relu1" else "relu1", "big"]


@pytest.fixture(scope="module")
def fragile(tmp_path_factory: pytest.TempPathFactory) -> tuple[onnx.ModelProto, onnx.ModelProto, str]:
    from qgraph.testing import ort_quantize_static
    from qgraph.testing.synthetic import fragile_resnet

    folder = tmp_path_factory.mktemp("cost")
    model = fragile_resnet(blocks=6, fragile={2: 30.0, 4: 60.0})
    onnx.save(model, folder / "float.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"input": rng.standard_normal((1, 8, 16, 16)).astype(np.float32)} for _ in range(8)]
    qdq = ort_quantize_static(folder / "float.onnx", folder / "qdq.onnx", feeds)
    np.savez(folder / "eval.npz", input=np.concatenate([f["input"] for f in feeds]))
    return model, qdq, str(folder / "eval.npz")


def test_auto_reports_modelled_and_measured_latency(fragile: tuple[onnx.ModelProto, onnx.ModelProto, str]) -> None:
    model, qdq, data = fragile
    r = auto_fallback(model, qdq, data, "sqnr:30", SearchOptions(
        costs=CostSpec(_table(), "p"), latency_rounds=1, float_weights=ReferenceWeights(model)))
    assert r.target_met and r.nodes, r.message()
    lat = r.latency
    assert lat["modelled_float_us"] > 0 and lat["modelled_chosen_ratio"] > lat["modelled_int8_ratio"]
    assert lat["measured_chosen"] > 0 and lat["measured_float_ms"] > 0
    assert "Latency of the chosen model: modelled (cost table)" in r.message() and "measured" in r.message()


def test_no_op_when_the_target_is_already_met(fragile: tuple[onnx.ModelProto, onnx.ModelProto, str]) -> None:
    model, qdq, data = fragile
    r = auto_fallback(model, qdq, data, "sqnr:-100", SearchOptions(costs=CostSpec(_table(), "p"), latency_rounds=3))
    assert r.target_met and r.nodes == [] and r.latency == {} and r.evaluations == 1
    assert r.stop_reason == "the INT8 model already meets the target"


def _fallback_after_qdq(tmp_path: Path, auto: str) -> tuple[onnx.ModelProto, Any]:
    """insert_qdq then float_fallback auto (``target: sqnr:35`` plus ``auto``) in one recipe on a residual net
    with one fragile block: the float model and the pipeline result."""
    from qgraph import Recipe
    from qgraph.testing.synthetic import fragile_resnet

    model = fragile_resnet(blocks=4, fragile={1: 60.0})
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "cal.npz", input=rng.standard_normal((8, 8, 16, 16)).astype(np.float32))
    recipe = Recipe.from_text(
        "name: r\npasses:\n  - pass: insert_qdq\n    preset: ort-x86-vnni\n  - pass: float_fallback\n"
        f"    auto: {{target: 'sqnr:35', {auto}}}\n")
    return model, Pipeline(recipe.passes, recipe=recipe).run(model, calibration_data=str(tmp_path / "cal.npz"))


def test_pass_summary_shows_latency_and_restores_float_weights(tmp_path: Path) -> None:
    """insert_qdq then float_fallback auto in one recipe: the summary line gives the latency of the chosen
    model, and the nodes that went back to float read the float model's weights, not the rounded ones."""
    model, result = _fallback_after_qdq(tmp_path, "latency_rounds: 1")
    res = result.records[-1].result
    assert res.details["auto"]["target_met"] and res.rewritten > 0
    assert any("Latency of the chosen model: modelled (cost table)" in d for d in res.decisions)
    restored = res.details.get("float_weights_restored", [])
    assert restored, "float weights should come from the float reference"
    floats = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    conv = res.details["fallen_back"][0]
    weight = out[next(n for n in restored if n.startswith(f"{conv}/float_input1"))]
    assert any(np.array_equal(weight, v) for v in floats.values() if v.shape == weight.shape)


def test_max_latency_bounds_the_search(fragile: tuple[onnx.ModelProto, onnx.ModelProto, str]) -> None:
    """A latency bound below what the target needs stops the search there and says why."""
    model, qdq, data = fragile
    free = auto_fallback(model, qdq, data, "sqnr:30", SearchOptions(
        costs=CostSpec(_table(), "p"), float_weights=ReferenceWeights(model)))
    lat = LatencyModel(qdq, _table(), "p", {"input": (1, 8, 16, 16)})
    needed = lat.predict(free.nodes) / lat.all_float()
    bounded = auto_fallback(model, qdq, data, "sqnr:30", SearchOptions(
        costs=CostSpec(_table(), "p"), float_weights=ReferenceWeights(model), max_latency=0.9 * needed))
    assert not bounded.target_met and "max_latency reached" in bounded.stop_reason
    assert bounded.latency["modelled_chosen_us"] <= 0.9 * needed * lat.all_float() + 1e-6


def test_max_latency_needs_latency_costs() -> None:
    from qgraph import Recipe, RecipeError

    with pytest.raises(RecipeError, match="max_latency"):
        Recipe.from_text("name: r\npasses:\n  - pass: float_fallback\n"
                         "    auto: {target: 'sqnr:30', cost: error, max_latency: 1.0}\n")


def test_cli_cost_choice_orders_the_search_by_latency_or_error(
    fragile: tuple[onnx.ModelProto, onnx.ModelProto, str], tmp_path: Path
) -> None:
    """``qgraph sensitivity --cost latency`` ranks with insert_qdq's cost table (the result models latency);
    ``--cost error`` ranks by error alone (no cost table); anything else is a usage error."""
    from typer.testing import CliRunner

    from qgraph.cli import app

    _, _, data = fragile
    folder = Path(data).parent
    runs = {}
    for cost in ("latency", "error"):
        out = tmp_path / f"{cost}.json"
        result = CliRunner().invoke(app, ["sensitivity", str(folder / "float.onnx"), str(folder / "qdq.onnx"),
                                          "--data", data, "--target", "sqnr:30", "--exact-top", "2", "--cost", cost,
                                          "--json", str(out), "-q"])
        assert result.exit_code in (0, 1), result.output
        runs[cost] = json.loads(out.read_text())
    lat = runs["latency"]["latency"]
    assert lat["modelled_float_us"] > 0 and lat["modelled_int8_ratio"] > 0
    assert runs["error"]["latency"] == {}
    bad = CliRunner().invoke(app, ["sensitivity", str(folder / "float.onnx"), str(folder / "qdq.onnx"),
                                   "--data", data, "--cost", "speed", "-q"])
    assert bad.exit_code == 2 and "speed" in bad.output


def test_measure_latency_is_the_engine_timer_as_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search's timing is `qgraph.runtime.latency.time_models` (turns of ~150 ms whose first two runs are not
    counted), given as ratios to the first model: the runs right after a session switch read YOLOv8n's INT8 model
    at 0.48-0.97x float where the steady state is 0.6-0.7x."""
    import qgraph.runtime.latency as latency
    from qgraph.analysis.sensitivity.cost import measure_latency

    seen: dict[str, object] = {}

    def fake(models: dict[str, object], feed: object, rounds: int, threads: int, budget_seconds: float
             ) -> dict[str, float]:
        seen.update(labels=list(models), rounds=rounds, threads=threads, budget=budget_seconds)
        return {"float": 8.0, "int8": 5.0, "chosen": 7.2}

    monkeypatch.setattr(latency, "time_models", fake)
    model = onnx.ModelProto()
    out = measure_latency({"float": model, "int8": model, "chosen": model}, {}, rounds=7, budget_seconds=9.0)
    assert seen == {"labels": ["float", "int8", "chosen"], "rounds": 7, "threads": 2, "budget": 9.0}
    assert out == {"float": 1.0, "float_ms": 8.0, "int8": 0.625, "int8_ms": 5.0, "chosen": 0.9, "chosen_ms": 7.2}


def test_pass_flags_a_chosen_model_measured_slower_than_float(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wired into the pass: with the timing replaced by a slow one, the summary's attention line says so."""
    import qgraph.analysis.sensitivity.search as search

    monkeypatch.setattr(search, "measure_latency", lambda models, feed, rounds: {
        "int8": 0.5, "chosen": 1.3, "float_ms": 2.0, "int8_ms": 1.0, "chosen_ms": 2.6})
    res = _fallback_after_qdq(tmp_path, "latency_rounds: 1")[1].records[-1].result
    assert res.details["auto"]["target_met"] and res.details["auto"]["nodes"]
    assert res.details["auto"]["latency"]["measured_chosen"] == 1.3
    flagged = [a for a in res.attention if "1.30x the float reference as measured here" in a]
    assert flagged and "beyond float's own latency" in flagged[0], res.attention


def test_the_search_cuts_back_a_prefix_timed_over_max_latency(
        fragile: tuple[onnx.ModelProto, onnx.ModelProto, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost table models the chosen set within ``max_latency``; onnxruntime (here a stand-in that charges 0.1x
    float per Q/DQ node the fallback removes, on top of 0.5x) times it over the bound: the search keeps the largest
    prefix timed within it, scores that model, and says so in the stop reason."""
    model, qdq, data = fragile
    options = dict(costs=CostSpec(_table(), "p"), float_weights=ReferenceWeights(model), latency_rounds=1)
    free = auto_fallback(model, qdq, data, "sqnr:30", SearchOptions(**options))  # type: ignore[arg-type]
    assert free.target_met and len(free.nodes) >= 2
    counted = len(qdq.graph.node)

    def charge(models: dict[str, onnx.ModelProto], feed: Any, rounds: int) -> dict[str, float]:
        # a node back in float always drops Q/DQ nodes: the INT8 model alone keeps the count
        back = abs(counted - len(models["chosen"].graph.node))
        return {"float": 1.0, "chosen": 0.5 + 0.1 * back}

    import qgraph.analysis.sensitivity.measured_cap as measured_cap

    monkeypatch.setattr(measured_cap, "measure_latency", charge)
    bound = 0.5 + 0.1 * 0.5  # timed within it only with no Q/DQ removed: the INT8 model
    capped = auto_fallback(model, qdq, data, "sqnr:30", SearchOptions(**options, max_latency=bound))  # type: ignore[arg-type]
    assert capped.stop_reason.startswith("max_latency reached as measured"), capped.stop_reason
    assert capped.nodes == [] and not capped.target_met
    assert math.isclose(capped.score, capped.int8_score) and capped.score < 30
    assert any("max_latency reached as measured" in n for n in capped.notes)
    relaxed = auto_fallback(model, qdq, data, "sqnr:30", SearchOptions(**options, max_latency=10.0))  # type: ignore[arg-type]
    assert relaxed.target_met and relaxed.nodes == free.nodes and "as measured" not in relaxed.stop_reason
