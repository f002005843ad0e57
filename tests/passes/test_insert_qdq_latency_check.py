"""``latency.check``: the latency decision timed on the whole model (`latency_check.py`).

The logic is tested with timers that price a model by what it keeps float (deterministic); the pass with
`time_models` patched the same way; real timing only for the shape of `time_models`' answer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from insert_qdq_helpers import feeds_for, quantize, source, tiny_cnn
from qgraph.passes.insert_qdq import latency_check
from qgraph.passes.insert_qdq.latency import LatencyOptions
from qgraph.passes.insert_qdq.latency_check import Region, check_decision

from qgraph import Recipe
from qgraph.runtime.kernels.cpu import CPU_FLAGS_ENV, host_cpu
from qgraph.runtime.latency import time_models


def _regions(*groups: list[str]) -> list[Region]:
    return [Region({hash(n): "slow" for n in g}, list(g), 10.0 * i) for i, g in enumerate(groups)]


def _builder(regions: list[Region]) -> Any:
    names = {k: n for r in regions for k, n in zip(r.nodes, r.names, strict=True)}

    def build(float_nodes: dict[int, str]) -> bytes:
        return json.dumps(sorted(names[k] for k in float_nodes)).encode()

    return build


def _timer(cost: Mapping[str, float], base: float = 10.0, calls: list[int] | None = None) -> Any:
    """A model's time: ``base`` plus, for every unit it keeps float, that unit's ``cost`` (ms, may be negative)."""

    def timer(models: Mapping[str, bytes], budget: float) -> dict[str, float]:
        if calls is not None:
            calls.append(len(models))
        return {k: base + sum(cost[n] for n in json.loads(v)) for k, v in models.items()}

    return timer


def test_a_decision_that_is_faster_stands() -> None:
    regions = _regions(["a"], ["b"])
    out = check_decision(regions, _builder(regions), _timer({"a": -1.0, "b": -0.5}), LatencyOptions(), "host")
    assert set(out.float_nodes) == {hash("a"), hash("b")}
    assert out.details["result"] == "confirmed"
    assert "runs 8.50 ms, all-int8 10.00 ms: the decision stands" in out.decisions[0]


def test_one_region_slower_than_all_int8_is_quantized() -> None:
    regions = _regions(["dfl"])
    out = check_decision(regions, _builder(regions), _timer({"dfl": 3.0}), LatencyOptions(), "host")
    assert out.float_nodes == {}
    assert out.details["quantized_after_check"] == ["dfl"]
    assert "23% faster, beyond the 5% margin): 1 unit(s) quantized after all (dfl); 0 stay float" in out.decisions[0]


def test_each_region_is_tried_and_only_the_slow_one_is_quantized() -> None:
    # "shuffle" is a good float decision (saves 2 ms), "dfl" a bad one (costs 4 ms)
    regions = _regions(["shuffle_a", "shuffle_b"], ["dfl"])
    cost = {"shuffle_a": -1.0, "shuffle_b": -1.0, "dfl": 4.0}
    out = check_decision(regions, _builder(regions), _timer(cost), LatencyOptions(), "host")
    assert set(out.float_nodes) == {hash("shuffle_a"), hash("shuffle_b")}
    assert out.details["quantized_after_check"] == ["dfl"]
    tried = [t for t in out.details["trials"] if "region" in t]
    assert [(t["region"], t["quantized"]) for t in tried] == [(["shuffle_a", "shuffle_b"], False), (["dfl"], True)]


def test_a_gain_within_the_margin_keeps_the_decision() -> None:
    regions = _regions(["a"])
    out = check_decision(regions, _builder(regions), _timer({"a": 0.4}), LatencyOptions(check_margin=0.05), "h")
    assert set(out.float_nodes) == {hash("a")}  # all-int8 is 3.8% faster: noise for a 5% margin
    out = check_decision(regions, _builder(regions), _timer({"a": 0.4}), LatencyOptions(check_margin=0.02), "h")
    assert out.float_nodes == {}


def test_the_budget_bounds_the_trials() -> None:
    regions = _regions(*[[f"u{i}"] for i in range(20)])
    calls: list[int] = []
    slow_timer = _timer({f"u{i}": 1.0 for i in range(20)}, calls=calls)

    def timer(models: Mapping[str, bytes], budget: float) -> dict[str, float]:
        import time

        time.sleep(0.02)
        return dict(slow_timer(models, budget))

    out = check_decision(regions, _builder(regions), timer, LatencyOptions(check_seconds=0.1), "h")
    assert any("stopped" in t for t in out.details["trials"])
    assert len(calls) < 12  # 1 first comparison + a few trials + the final comparison, not 20 trials
    assert out.float_nodes == {}  # the final comparison with all-int8 still settles what was left


# ---------------------------------------------------------------------------------------------- the pass
def _table(tmp_path: Path, presets: tuple[str, ...] = ("ort-x86-vnni",)) -> Path:
    """A table saying int8 convs are 50x slower than float: the model keeps both convs of `tiny_cnn` float."""
    entry = {"kind": "Conv/dense/3x3", "bucket": "c8-hw64", "work": 8 * 64 * 27, "float_us": 10.0,
             "int8_us": 500.0, "samples": 1}
    data = {"version": 1, "host": "test", "runtime": "test", "threads": 2,
            "presets": {p: {"quantize_ns": 1.0, "dequantize_ns": 1.0, "entries": [entry]} for p in presets}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    return path


def _patch_timer(monkeypatch: pytest.MonkeyPatch, int8_faster: bool) -> list[list[int]]:
    """`time_models` pricing a model by its float Conv nodes: each costs +1 ms (or -1 ms) against int8."""
    seen: list[list[int]] = []

    def fake(models: Mapping[str, bytes], feeds: Mapping[str, np.ndarray], **_: Any) -> dict[str, float]:
        out = {}
        counts = []
        for k, blob in models.items():
            m = onnx.load_from_string(blob)
            producers = {o: n.op_type for n in m.graph.node for o in n.output}
            floats = sum(n.op_type == "Conv" and producers.get(n.input[1]) != "DequantizeLinear" for n in m.graph.node)
            counts.append(floats)
            out[k] = 10.0 + floats * (1.0 if int8_faster else -1.0)
        seen.append(counts)
        return out

    monkeypatch.setattr(latency_check, "time_models", fake)
    return seen


def _float_convs(model: onnx.ModelProto) -> int:
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    return sum(n.op_type == "Conv" and producers.get(n.input[1]) != "DequantizeLinear" for n in model.graph.node)


def test_the_pass_quantizes_what_timing_overrules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _patch_timer(monkeypatch, int8_faster=True)
    model = tiny_cnn()
    res = quantize(model, feeds_for(model, 4), preset="ort-x86-vnni",
                   latency={"mode": "table", "check": True, "table": str(_table(tmp_path))})
    result = res.records[0].result
    assert seen[0] == [2, 0]  # the twins: as decided (both convs float) and all-int8, built by the pass's code
    assert _float_convs(res.model) == 0
    line = next(d for d in result.decisions if d.startswith("latency check on this host"))
    assert "runs 12.00 ms, all-int8 10.00 ms" in line and "2 unit(s) quantized after all" in line
    assert line in result.attention  # overruling the cost model is shown first in the summary
    assert not [s for s in result.skipped if s.reason.startswith("kept float for speed")]
    assert result.details["latency"]["check"]["result"] == "changed"


def test_the_pass_keeps_a_decision_timing_confirms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_timer(monkeypatch, int8_faster=False)
    model = tiny_cnn()
    res = quantize(model, feeds_for(model, 4), preset="ort-x86-vnni",
                   latency={"mode": "table", "check": True, "table": str(_table(tmp_path))})
    result = res.records[0].result
    assert _float_convs(res.model) == 2
    assert any("the decision stands" in d for d in result.decisions)
    assert result.details["latency"]["check"]["result"] == "confirmed"


def test_check_false_and_a_foreign_target_time_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _patch_timer(monkeypatch, int8_faster=True)
    model = tiny_cnn()
    for check in ({}, {"check": False}):  # off unless asked for: a host-dependent choice
        res = quantize(model, feeds_for(model, 4), preset="ort-x86-vnni",
                       latency={"mode": "table", "table": str(_table(tmp_path)), **check})
        assert _float_convs(res.model) == 2 and not seen
    # a declared target this host is not: another architecture, or the same without the target's VNNI
    for target, preset, flags in (("arm" if host_cpu().arch != "arm" else "x86-vnni", None, None),
                                  ("x86-vnni", "ort-x86-vnni", "fpu sse4_2 avx2 fma")):
        preset = preset or ("ort-arm" if target == "arm" else "ort-x86-vnni")
        if flags:
            monkeypatch.setenv(CPU_FLAGS_ENV, flags)
        table = _table(tmp_path, (preset,))
        recipe = Recipe.from_text(
            f"name: t\ntarget: {{runtime: onnxruntime, cpu: {target}}}\npasses:\n  - pass: insert_qdq\n"
            f"    preset: {preset}\n    latency: {{mode: table, check: true, table: {table}}}\n")
        result = recipe.pipeline().run(model, calibration_data=source(feeds_for(model, 4))).records[0].result
        assert not seen
        assert any(d.startswith(f"latency check skipped: the recipe targets {target}") for d in result.decisions)


def test_time_models_answers_per_model_in_ms() -> None:
    model = tiny_cnn()
    feeds = feeds_for(model, 1)[0]
    blob = model.SerializeToString()
    times = time_models({"a": blob, "b": blob}, feeds, rounds=3, budget_seconds=0.5)
    assert set(times) == {"a", "b"} and all(0 < t < 1000 for t in times.values())
