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


@pytest.mark.parametrize("method", ["minmax", "percentile"])
@pytest.mark.parametrize("order", ["slice_major", "over_budget", "sample_major"])
def test_segmented_calibration_matches_one_session(monkeypatch: pytest.MonkeyPatch, method: str, order: str) -> None:
    m, feeds, names = _encoder()
    whole = {n: make_observer(method, n) for n in names}
    sliced = {n: make_observer(method, n) for n in names}
    observe(m, whole, feeds, optimize=False)
    import onnxruntime as ort

    # up to SLICE_MAJOR_SAMPLES samples go slice-major: every sample through a slice, whose session is then freed;
    # over SLICE_MAJOR_BYTES held at a cut, the samples finish the other slices one at a time
    slice_major = order != "sample_major"
    monkeypatch.setattr("qgraph.runtime.segments.SLICE_MAJOR_SAMPLES", 64 if slice_major else 2)
    if order == "over_budget":
        monkeypatch.setattr("qgraph.runtime.segments.SLICE_MAJOR_BYTES", 1)
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plan = plan_segments(m, names, 7)
    done: list[int] = []
    assert observe_segmented(m, sliced, feeds, size=7, optimization=level, plan=plan, after_feed=done.append) == 3
    assert done == [0, 1, 2]
    shown: list[tuple[int, int | None]] = []
    observe_segmented(m, {n: make_observer(method, n) for n in names}, feeds, size=7, optimization=level,
                      progress=lambda d, t: shown.append((d, t)))
    assert shown[-1] == (3, 3 if slice_major else None) and shown == sorted(shown, key=lambda x: x[0])
    assert len(shown) == {"slice_major": len(plan[0]), "over_budget": 2, "sample_major": 3}[order]
    assert len(plan[0]) == -(-len(m.graph.node) // 7)
    alive = [seg.session is not None for seg in plan[0]]
    assert not any(alive) if slice_major else all(alive)
    for n in names:
        a, b = whole[n].compute(), sliced[n].compute()
        assert (a.rmin, a.rmax) == (b.rmin, b.rmax)
        assert whole[n].num_values == sliced[n].num_values


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
    # slice-major (3 samples): the share of the work done after each of the slices, in samples, up to 3 of 3
    slices = -(-len(m.graph.node) // 7)
    assert progress == [(3 * k // slices, 3) for k in range(1, slices + 1)] and slices > 3
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
