"""The fidelity guard of weight-correcting passes (qgraph.recovery.weight_correction.FidelityGuard), as a plug-in uses
it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from qgraph.passes.insert_qdq import InsertQDQ

from qgraph import GraphHandle, PassContext, PassResult, Pipeline
from qgraph.recovery.weight_correction import CorrectionPass, FidelityGuard, GuardConfig

sys.path.insert(0, str(Path(__file__).parent / "passes"))
from insert_qdq_helpers import feeds_for, source, tiny_cnn
from weight_correction_helpers import changed


class ScrambleConfig(GuardConfig):
    """Which harm to do: scale every weight code (0 zeroes them)."""

    factor: float = 0.0


class ScrambleCodes(CorrectionPass[ScrambleConfig]):
    """A "correction" that rewrites every layer's codes: the guard must notice when that hurts."""

    name = "scramble_codes"
    config_class = ScrambleConfig

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        res = PassResult()
        cands = self.start(graph, ctx, None, res)
        assert cands is not None
        guard = FidelityGuard.start(self.config, graph, ctx, cands.layers, res)
        for layer in cands.layers:
            layer.write_codes(np.rint(layer.codes() * self.config.factor).astype(np.int64))
            res.rewritten += 1
        graph.changed()
        if guard is not None and not guard.finish(graph, self.config.guard_tolerance_db):
            res.rewritten = 0
        return res


def _run(model: onnx.ModelProto, **options: object) -> tuple[onnx.ModelProto, PassResult]:
    feeds = feeds_for(model, 8)
    out = Pipeline([InsertQDQ(preset="ort-x86-vnni"), ScrambleCodes(**options)]).run(
        model, calibration_data=source(feeds))
    return out.model, out.records[1].result


def test_a_harmful_change_is_undone_and_said_so() -> None:
    m = tiny_cnn()
    base = Pipeline([InsertQDQ(preset="ort-x86-vnni")]).run(m, calibration_data=source(feeds_for(m, 8))).model
    guarded, res = _run(m)
    assert changed(base, guarded) == set() and res.rewritten == 0  # every code back as it was
    line = next(d for d in res.decisions if d.startswith("guard: output SQNR on 8 calibration sample(s)"))
    before, after = (float(v) for v in line.split("sample(s) ")[1].split(" dB")[0].split(" -> "))
    assert before > 25 and after < 0 and "undone" in line
    unguarded, res = _run(m, guard=False)
    assert changed(base, unguarded) and res.rewritten == 3 and not any(d.startswith("guard") for d in res.decisions)


def test_a_harmless_change_is_kept() -> None:
    m = tiny_cnn()
    _, res = _run(m, factor=1.0)  # the codes rewritten as they were: the score does not move
    assert res.rewritten == 3 and any(d.startswith("guard:") and d.endswith("is kept") for d in res.decisions)


def test_a_long_graph_is_scored_in_slices_with_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above `qgraph.runtime.sliced.SLICE_ABOVE` nodes the guard scores the graph (on the target's kernels) and the
    float reference in slices: the same SQNR to the last digit, the same model."""
    from qgraph.passes.correct_bias import CorrectBias

    import qgraph.runtime.sliced as sliced
    from qgraph.testing import matmul_add_relu_chain

    model = matmul_add_relu_chain(40)
    feeds = feeds_for(model, 8)

    def run() -> tuple[bytes, list[str]]:
        out = Pipeline([InsertQDQ(preset="ort-x86-vnni"), CorrectBias()]).run(model, calibration_data=source(feeds))
        return out.model.SerializeToString(), out.records[1].result.decisions

    whole_bytes, whole_lines = run()
    made: list[int] = []
    real = sliced.SlicedSession.__init__

    def spy(self: sliced.SlicedSession, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self.slices)

    monkeypatch.setattr(sliced, "SLICE_ABOVE", 50)
    monkeypatch.setattr(sliced, "SLICE_NODES", 30)
    monkeypatch.setattr(sliced.SlicedSession, "__init__", spy)
    sliced_bytes, sliced_lines = run()
    # the run's float yardstick (`qgraph.pipeline.timing`), the guard's float reference once, the graph before and
    # after the correction: each in several slices
    assert len(made) == 4 and min(made) >= 3
    assert sliced_lines == whole_lines and any("kept" in line for line in whole_lines)
    assert sliced_bytes == whole_bytes


def test_the_guard_undoes_only_a_loss_its_samples_show() -> None:
    """Codes scaled by 0.8 lose fidelity on every sample: the change's 95 % interval lies wholly below the tolerance
    and it is undone; the decision line gives that interval."""
    import re

    _, res = _run(tiny_cnn(), factor=0.8)
    line = next(d for d in res.decisions if d.startswith("guard:"))
    low, high = (float(v) for v in re.search(r"interval of the change ([-+][\d.]+) to ([-+][\d.]+) dB", line).groups())
    assert low <= high < -0.05 and "undone" in line and res.rewritten == 0


@pytest.mark.parametrize(("change", "kept"), [((-1.0, 0.5), True), ((-1.0, -0.2), False)])
def test_a_drop_within_the_interval_of_the_change_is_kept(monkeypatch: pytest.MonkeyPatch,
                                                          change: tuple[float, float], kept: bool) -> None:
    """The rule: a score that fell by more than the tolerance is undone only when the whole interval of the change
    lies below it (the interval itself is `tests/metrics/test_interval.py`'s)."""
    import qgraph.recovery.weight_correction as wc

    monkeypatch.setattr(wc, "sqnr_change", lambda before, after: change)
    _, res = _run(tiny_cnn(), factor=0.8)  # a real drop on every sample
    line = next(d for d in res.decisions if d.startswith("guard:"))
    assert (res.rewritten == 3) == kept and ("cannot tell from chance" in line) == kept
    assert ("undone" in line) != kept
