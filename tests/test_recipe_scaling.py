"""The ready recipes scale linearly, proven by counting (no wall time): on a MatMul/Add/Relu chain 4x longer, each
pass walks the whole graph, creates onnxruntime sessions and runs them the same number of times, and calibration
(and smooth_quant's statistics) folds each tensor a bounded number of times whatever the number of samples (issue
#34)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from qgraph.passes.smooth_quant.measure import ChannelStats

from qgraph import GraphHandle, Recipe
from qgraph.calibrate.histogram import AlignedHistogram
from qgraph.data import CallableSource
from qgraph.pipeline.runner import PipelineEvent
from qgraph.runtime.kernels.host import probe_pair_saturation
from qgraph.testing import matmul_add_relu_chain

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SAMPLES = 6


class Counts:
    """Per pass: whole-graph walks of every handle, sessions created, session runs, histogram updates, smooth_quant's
    statistics folds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now: collections.Counter[str] = collections.Counter()
        self.per_pass: dict[str, collections.Counter[str]] = {}
        self.handles: list[GraphHandle] = []
        self._start: collections.Counter[str] = collections.Counter()
        counts = self

        init, run, update = GraphHandle.__init__, ort.InferenceSession.run, AlignedHistogram.update
        fold = ChannelStats.fold
        sess_init = ort.InferenceSession.__init__

        def handle_init(self: GraphHandle, *a: Any, **k: Any) -> None:
            init(self, *a, **k)
            counts.handles.append(self)

        def session_init(self: Any, *a: Any, **k: Any) -> None:
            counts.now["sessions"] += 1
            sess_init(self, *a, **k)

        def session_run(self: Any, *a: Any, **k: Any) -> Any:
            counts.now["runs"] += 1
            return run(self, *a, **k)

        def hist_update(self: AlignedHistogram, *a: Any, **k: Any) -> None:
            counts.now["histogram_updates"] += 1
            update(self, *a, **k)

        def stats_fold(self: ChannelStats) -> None:
            counts.now["statistics_folds"] += bool(self._batches)
            fold(self)

        monkeypatch.setattr(GraphHandle, "__init__", handle_init)
        monkeypatch.setattr(ChannelStats, "fold", stats_fold)
        monkeypatch.setattr(ort.InferenceSession, "__init__", session_init)
        monkeypatch.setattr(ort.InferenceSession, "run", session_run)
        monkeypatch.setattr(AlignedHistogram, "update", hist_update)

    def total(self) -> collections.Counter[str]:
        out = collections.Counter(self.now)
        for h in self.handles:
            out["walks"] += sum(h.walks.values())
        return out

    def event(self, ev: PipelineEvent) -> None:
        if ev.kind == "pass_start":
            self._start = self.total()
        elif ev.kind == "pass_end" and ev.pass_name is not None:
            self.per_pass[ev.pass_name] = self.total() - self._start


def _run(recipe: str, layers: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, collections.Counter[str]]:
    probe_pair_saturation()  # once per process (cached): not a cost of whichever run comes first
    counts = Counts(monkeypatch)
    rng = np.random.default_rng(0)
    feeds = [{"input": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(SAMPLES)]
    pipeline = Recipe.from_yaml(RECIPES / f"{recipe}.yaml").pipeline()
    res = pipeline.run(matmul_add_relu_chain(layers), calibration_data=CallableSource(lambda: feeds, "chain"),
                       on_event=counts.event)
    assert res.float_inference is not None and res.float_inference.samples_total == SAMPLES
    monkeypatch.undo()
    return counts.per_pass


@pytest.mark.parametrize("recipe", ["ort-x86-vnni", "ort-x86-avx2"])
def test_every_pass_of_a_ready_recipe_does_the_same_work_on_a_chain_4x_longer(
        recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = _run(recipe, 12, monkeypatch), _run(recipe, 48, monkeypatch)
    assert list(small) == list(large) and "insert_qdq" in small and "correct_bias" in small
    for name in small:
        for what in ("walks", "sessions", "runs"):
            assert large[name][what] == small[name][what], (name, what, small[name], large[name])
    # a run per calibration sample, not per layer: one data pass for calibration, a bounded few for correct_bias
    assert small["insert_qdq"]["runs"] <= 2 * SAMPLES + 2
    # correct_bias: the guard's reference and before/after scores, and the layers' mean input rows
    assert small["correct_bias"]["runs"] <= 4 * SAMPLES
    # and a bounded few sessions: the float reference, the guard's two scoring sessions (and, for AVX2 emulated,
    # its fusion probe), and one session for the layers' mean input rows
    assert small["correct_bias"]["sessions"] <= 5, small["correct_bias"]
    # calibration folds each tensor's samples into its histogram together, not once per sample per tensor
    tensors_large = large["insert_qdq"]["histogram_updates"]
    assert 0 < tensors_large <= 3 * 48, large["insert_qdq"]
    # smooth_quant reduces each MatMul input's samples together (one fold per tensor), not once per sample
    assert large["smooth_quant"]["statistics_folds"] == 48 and small["smooth_quant"]["statistics_folds"] == 12
