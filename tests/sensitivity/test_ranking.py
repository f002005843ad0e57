"""One-run ranking and the prefix search on a residual CNN with planted fragile layers (onnxruntime's QDQ):
agreement with the exact per-node measure, evaluations needed, max_time, sessions released, progress events."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qgraph.analysis.sensitivity import search as search_mod
from qgraph.analysis.sensitivity.evaluate import Evaluator, load_feeds, reference_outputs
from qgraph.analysis.sensitivity.options import SearchOptions
from qgraph.analysis.sensitivity.ranking import candidate_nodes, rank_nodes, sensitivity_report
from qgraph.analysis.sensitivity.search import auto_fallback
from qgraph.analysis.sensitivity.targets import parse_target
from qgraph.testing import fragile_resnet

BLOCKS = 12
FRAGILE = {1: 8.0, 3: 30.0, 5: 16.0, 6: 60.0, 10: 4.0}


@pytest.fixture(scope="module")
def fragile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Float model, onnxruntime QDQ (per-channel weights, per-tensor activations) and evaluation data."""
    from qgraph.testing import ort_quantize_static

    folder = tmp_path_factory.mktemp("fragile")
    onnx.save(fragile_resnet(BLOCKS, fragile=FRAGILE), folder / "float.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"input": rng.standard_normal((1, 8, 16, 16)).astype(np.float32)} for _ in range(16)]
    ort_quantize_static(folder / "float.onnx", folder / "qdq.onnx", feeds, per_channel=True)
    data = np.random.default_rng(1).standard_normal((16, 8, 16, 16)).astype(np.float32)
    np.savez(folder / "eval.npz", input=data)
    return folder


def _evaluator(folder: Path) -> Evaluator:
    ref, qdq = onnx.load(folder / "float.onnx"), onnx.load(folder / "qdq.onnx")
    batches = load_feeds(str(folder / "eval.npz"), ref)
    return Evaluator(qdq, batches, reference_outputs(ref, batches))


def test_one_run_ranking_agrees_with_the_exact_measure(fragile: Path) -> None:
    ev = _evaluator(fragile)
    target = parse_target("sqnr:99")
    cands, _ = candidate_nodes(ev.qdq)
    exact = sensitivity_report(ev, target, cands, stats=False)
    exact_order = [r.name for r in exact.ranked()]
    calls = {"n": 0}
    measure = ev.measure

    def counted(nodes: Any) -> Any:
        calls["n"] += 1
        return measure(nodes)

    ev.measure = counted  # type: ignore[method-assign]
    one = rank_nodes(ev, target, cands, measure(()))
    assert calls["n"] == 0  # no full evaluation: one probe run
    order = [r.name for r in one.ranked()]
    assert sorted(order) == sorted(n for n, _ in cands) and one.method == "one-run"
    # The planted layers whose outlier channel is active lead both rankings; the top 5 share at least 4.
    assert order[:3] == exact_order[:3] and all(n.endswith("/conv2") for n in order[:3])
    assert len(set(order[:5]) & set(exact_order[:5])) >= 4
    # Predicted single-node gains have the sign and rough size of the measured ones at the top.
    rows = {r.name: r for r in one.rows}
    for r in exact.ranked()[:2]:
        assert 0.3 * r.sensitivity < rows[r.name].sensitivity < 3 * r.sensitivity
    assert rows[order[0]].local_sqnr_db is not None and rows[order[0]].local_sqnr_db < 25


def test_exact_top_reranks_the_first_k(fragile: Path) -> None:
    ev = _evaluator(fragile)
    target = parse_target("sqnr:99")
    cands, _ = candidate_nodes(ev.qdq)
    report = rank_nodes(ev, target, cands, ev.measure(()), exact_top=4)
    rows = report.ranked()
    assert [r.measured for r in rows[:5]] == [True] * 4 + [False]
    assert [r.sensitivity for r in rows[:4]] == sorted((r.sensitivity for r in rows[:4]), reverse=True)
    assert all(np.isfinite(r.sqnr_db) for r in rows[:4])


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"n": 0}
    original = Evaluator.run

    def run(self: Evaluator, model: onnx.ModelProto, nodes: Any = ()) -> Any:
        calls["n"] += 1
        return original(self, model, nodes)

    monkeypatch.setattr(Evaluator, "run", run)
    return calls


def test_search_meets_a_reachable_target_in_few_evaluations(fragile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_runs(monkeypatch)
    ref, qdq = onnx.load(fragile / "float.onnx"), onnx.load(fragile / "qdq.onnx")
    ev = _evaluator(fragile)
    cands, _ = candidate_nodes(ev.qdq)
    floor = ev.measure(tuple(n for n, _ in cands))
    # Weights stored as integers keep their error in float: the best reachable is every node in float.
    best = min(d.sqnr_db for d in floor.diffs)
    int8 = min(d.sqnr_db for d in ev.measure(()).diffs)
    goal = int8 + 0.75 * (best - int8)
    calls["n"] = 0
    result = auto_fallback(ref, qdq, str(fragile / "eval.npz"), f"sqnr:{goal}")
    candidates = len(cands)
    assert result.target_met and result.score >= goal and 1 <= len(result.nodes) < candidates / 2
    # baseline + search (a few corrected steps, far fewer than the candidates) + confirmation
    assert calls["n"] == result.evaluations == 2 + len(result.steps) and len(result.steps) <= 6
    assert set(result.stages) == {"baseline", "ranking", "search", "confirmation"}
    msg = result.message()
    assert msg.startswith("target met") and "from one run" in msg and "confirmation" in msg
    assert f"{result.evaluations} full evaluation(s)" in msg
    # The smallest ranked prefix meeting the target: one node fewer does not.
    fewer = [s for s in result.steps if s.size == len(result.nodes) - 1]
    assert not fewer or not fewer[0].met


def test_unmet_target_keeps_the_best_model_and_says_why(fragile: Path) -> None:
    ref, qdq = onnx.load(fragile / "float.onnx"), onnx.load(fragile / "qdq.onnx")
    result = auto_fallback(ref, qdq, str(fragile / "eval.npz"), "sqnr:200", SearchOptions(max_nodes=3))
    assert not result.target_met and result.stop_reason == "max_nodes (3) reached"
    assert 1 <= len(result.nodes) <= 3 and result.score > result.int8_score
    assert result.message().startswith("target NOT met")


def test_max_time_is_respected(fragile: Path) -> None:
    ref, qdq = onnx.load(fragile / "float.onnx"), onnx.load(fragile / "qdq.onnx")
    result = auto_fallback(ref, qdq, str(fragile / "eval.npz"), "sqnr:200", SearchOptions(max_time=0.05))
    assert not result.target_met and "max_time (0.05 s) reached" in result.stop_reason
    # counted, not timed (a wall-clock bound fails on a loaded machine): the budget is spent by the baseline and
    # the one-run ranking, so no search step and no confirmation run; without the budget the same search runs both
    assert result.evaluations == 1 and not result.steps and "confirmation" not in result.stages, result.tried()
    unbounded = auto_fallback(ref, qdq, str(fragile / "eval.npz"), "sqnr:200")
    assert unbounded.steps and unbounded.evaluations > 1


def test_sessions_are_built_and_released_one_at_a_time(fragile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    live: list[weakref.ref[Any]] = []
    peak = {"n": 0}

    class Tracked(ort.InferenceSession):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            live.append(weakref.ref(self))
            peak["n"] = max(peak["n"], sum(r() is not None for r in live))

    monkeypatch.setattr(ort, "InferenceSession", Tracked)
    ref, qdq = onnx.load(fragile / "float.onnx"), onnx.load(fragile / "qdq.onnx")
    result = auto_fallback(ref, qdq, str(fragile / "eval.npz"), "sqnr:200", SearchOptions(max_nodes=20, exact_top=3))
    assert len(live) >= result.evaluations + 2  # reference, probe, every evaluation
    assert peak["n"] == 1  # each released before the next is built, whatever the node count


def test_progress_events_per_stage(fragile: Path) -> None:
    from qgraph import Pipeline, Recipe
    from qgraph.pipeline.runner import PipelineEvent

    events: list[tuple[str, int, int | None]] = []
    ref, qdq = onnx.load(fragile / "float.onnx"), onnx.load(fragile / "qdq.onnx")
    auto_fallback(ref, qdq, str(fragile / "eval.npz"), "sqnr:200", SearchOptions(
        max_nodes=4, exact_top=2, progress=lambda stage, done, total: events.append((stage, done, total))))
    stages = [e[0] for e in events]
    assert stages.index("ranking") < stages.index("exact") < stages.index("search") < stages.index("confirmation")
    ranking = [e for e in events if e[0] == "ranking"]
    assert ranking[-1][1] == ranking[-1][2] and [e[1] for e in ranking] == list(range(1, len(ranking) + 1))
    # Inside a recipe the same stages arrive as pass_progress events.
    recipe = Recipe.from_text(
        "name: fb\npasses:\n  - pass: float_fallback\n"
        f"    auto: {{target: 'sqnr:200', reference: {str(fragile / 'float.onnx')!r}, "
        f"data: {str(fragile / 'eval.npz')!r}, max_nodes: 2}}\n"
    )
    seen: list[PipelineEvent] = []
    Pipeline(recipe.passes, recipe=recipe).run(qdq, on_event=seen.append)
    tasks = {e.task for e in seen if e.kind == "pass_progress"}
    assert {"auto ranking", "auto search"} <= tasks


def test_search_module_documents_its_stages() -> None:
    assert search_mod.__doc__ is not None and "bisect" in search_mod.__doc__


def test_qgraph_run_exits_1_keeps_the_best_model_and_says_what_was_tried(
    fragile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qgraph.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: unreachable\npasses:\n  - pass: float_fallback\n"
        f"    auto: {{target: 'sqnr:200', reference: {str(fragile / 'float.onnx')!r}, "
        f"data: {str(fragile / 'eval.npz')!r}, max_nodes: 2}}\n"
    )
    out = tmp_path / "o.onnx"
    code = main(["run", str(recipe), str(fragile / "qdq.onnx"), "-o", str(out)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1 and out.exists()
    assert "target NOT met" in err and "max_nodes (2) reached" in err and "Tried: baseline" in err
    assert "ranking of" in err and "search over ranked prefixes" in err and "Traceback" not in err
    kept = onnx.load(out)
    assert sum(n.op_type == "DequantizeLinear" for n in kept.graph.node) < sum(
        n.op_type == "DequantizeLinear" for n in onnx.load(fragile / "qdq.onnx").graph.node
    )


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer transformer encoder INT8 by onnxruntime's quantize_static, and three independent eval sets."""
    from qgraph.testing import ort_quantize_static, transformer_encoder, transformer_encoder_inputs

    folder = tmp_path_factory.mktemp("encoder")
    onnx.save(transformer_encoder(layers=2, d_model=64, heads=4, seq=16), folder / "float.onnx")
    ort_quantize_static(folder / "float.onnx", folder / "qdq.onnx", transformer_encoder_inputs(16, seed=1))
    for i in range(3):
        data = transformer_encoder_inputs(16, seed=2 + 100 * i)
        np.savez(folder / f"eval{i}.npz", **{k: np.concatenate([f[k] for f in data]) for k in data[0]})
    return folder


def test_one_run_ranking_on_a_transformer_is_as_stable_as_the_exact_measure(encoder: Path) -> None:
    """Past its two Softmax pairs the encoder's exact gains are ~0.01 dB, below the measure's own noise: the
    exact top-10 changes with the evaluation set. The one-run top-10 must match the exact one at least as well
    as two exact top-10s on independent sets match each other, contain every distinguishable node, and contain
    at least 7 of the exact top-10 of the gains averaged over the sets."""
    ref, qdq = onnx.load(encoder / "float.onnx"), onnx.load(encoder / "qdq.onnx")
    target = parse_target("sqnr:99")
    cands, _ = candidate_nodes(qdq)
    gains, tops, overlaps, one_tops = [], [], [], []
    for i in range(3):
        batches = load_feeds(str(encoder / f"eval{i}.npz"), ref)
        ev = Evaluator(qdq, batches, reference_outputs(ref, batches))
        exact = sensitivity_report(ev, target, cands, stats=False)
        gains.append({r.name: r.sensitivity for r in exact.rows})
        tops.append({r.name for r in exact.ranked()[:10]})
        one_tops.append([r.name for r in rank_nodes(ev, target, cands, ev.measure(())).ranked()[:10]])
        overlaps.append(len(set(one_tops[-1]) & tops[-1]))
    self_agreement = [len(tops[a] & tops[b]) for a, b in ((0, 1), (0, 2), (1, 2))]
    assert min(self_agreement) < 10  # the exact ranking itself is unstable here
    assert np.mean(overlaps) >= np.mean(self_agreement) and min(overlaps) >= min(self_agreement)
    # Noise floor: twice the largest spread (std over the sets) of an exact top-10 gain.
    table = np.array([[g[n] for n, _ in cands] for g in gains])
    mean, std = dict(zip((n for n, _ in cands), table.mean(0), strict=True)), table.std(0, ddof=1)
    floor = 2 * max(s for (n, _), s in zip(cands, std, strict=True) if n in tops[0])
    distinct = {n for n in tops[0] if mean[n] > floor}
    assert {"layer0/attn/softmax", "layer1/attn/softmax"} <= distinct
    assert distinct <= set(one_tops[0]) and set(one_tops[0][:2]) == {"layer0/attn/softmax", "layer1/attn/softmax"}
    # Against the exact gains averaged over the three sets (a steadier exact top-10) the bar holds.
    pooled = set(sorted(mean, key=lambda n: -mean[n])[:10])
    assert min(len(pooled & set(t)) for t in one_tops) >= 7


def test_each_part_of_a_joined_output_gets_its_own_weights() -> None:
    """Output parts (`qgraph.runtime.output_parts`): a node feeding only the boxes of a detector's joined output does
    not
    reach the scores' part (κ = 0) and the other way round; the join itself, quantized with one scale for boxes and
    scores, is measured on each part, where its noise on the scores is ~10^4 times its noise on the whole output."""
    from qgraph import Pipeline
    from qgraph.analysis.sensitivity.probe import local_errors
    from qgraph.data import CallableSource
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.runtime.output_parts import find_output_parts
    from qgraph.testing import detection_feeds, detection_head

    model = detection_head()
    feeds = detection_feeds(8)
    qdq = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni", elementwise="always", joins={"keep_float": False})]
                   ).run(model, calibration_data=CallableSource(lambda: feeds, "8 images")).model
    names = [n for n, _ in candidate_nodes(qdq)[0]]
    errors, skipped, _ = local_errors(qdq, feeds, names, parts=find_output_parts(model))
    assert not skipped
    boxes, scores = 0, 1
    assert errors["box_conv"].weights[scores] == 0 < errors["box_conv"].weights[boxes]
    assert errors["cls_conv"].weights[boxes] == 0 < errors["cls_conv"].weights[scores]
    join = errors["head_concat"]
    assert join.eta * join.weights[scores] > 1e4 * join.eta  # the scores' own noise ratio, ~1 (0 dB SQNR)
    assert join.eta * join.weights[scores] == pytest.approx(1.0, rel=0.1)
    whole, _, _ = local_errors(qdq, feeds, names)
    assert whole["head_concat"].weights == [1.0] and whole["cls_conv"].weights[0] < 1e-4  # diluted by the boxes
