"""Segmented calibration (long graphs run slice by slice) gives the ranges of one session."""

from __future__ import annotations

import pytest

import qgraph.calibrate.collector as collector
from qgraph.calibrate import collect_ranges, make_observer, observe
from qgraph.runtime.segments import observe_segmented, plan_segments
from qgraph.testing import transformer_encoder, transformer_encoder_inputs


def _encoder():
    m = transformer_encoder(17, layers=2, d_model=32, seq=8)
    feeds = transformer_encoder_inputs(3, seq=8, d_model=32)
    names = [*[n.output[0] for n in m.graph.node][::2], "embeddings"]
    return m, feeds, names


def test_segmented_calibration_matches_one_session() -> None:
    m, feeds, names = _encoder()
    whole = {n: make_observer("minmax", n) for n in names}
    sliced = {n: make_observer("minmax", n) for n in names}
    observe(m, whole, feeds, optimize=False)
    import onnxruntime as ort

    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert observe_segmented(m, sliced, feeds, size=7, optimization=level) == 3
    assert len(plan_segments(m, names, 7)[0]) == -(-len(m.graph.node) // 7)
    for n in names:
        a, b = whole[n].compute(), sliced[n].compute()
        assert (a.rmin, a.rmax) == (b.rmin, b.rmax)


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_long_graphs_are_segmented_automatically(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    m, feeds, names = _encoder()
    reference = collect_ranges(m, names, feeds, method, optimize=False, robust_percentile=99.0)
    seen: list[int] = []
    real = collector.observe_segmented

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("qgraph.runtime.segments.SEGMENT_THRESHOLD", 10)
    monkeypatch.setattr("qgraph.runtime.segments.SEGMENT_NODES", 7)
    monkeypatch.setattr(collector, "observe_segmented", spy)
    progress: list[tuple[int, int | None]] = []
    segmented = collect_ranges(m, names, feeds, method, optimize=False, robust_percentile=99.0,
                               progress=lambda d, t: progress.append((d, t)))
    assert seen == [1]
    assert progress == [(1, 3), (2, 3), (3, 3)]
    for n in names:
        a, b = reference[n], segmented[n]
        assert (a.range.rmin, a.range.rmax) == (b.range.rmin, b.range.rmax), n
        assert a.robust_absmax == b.robust_absmax and a.num_values == b.num_values


def test_slices_run_on_one_thread_like_one_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice's session uses one thread, as `make_session` does: the same reduction order on every host whatever
    its core count (onnxruntime splits a reduction across its intra-op threads)."""
    import onnxruntime as ort

    m, feeds, names = _encoder()
    seen: list[tuple[int, int]] = []
    real = ort.InferenceSession

    def spy(model: object, opts: ort.SessionOptions, **kwargs: object) -> object:
        seen.append((opts.intra_op_num_threads, opts.inter_op_num_threads))
        return real(model, opts, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    observe_segmented(m, {n: make_observer("minmax", n) for n in names}, feeds, size=7)
    assert len(seen) == -(-len(m.graph.node) // 7) and set(seen) == {(1, 1)}
