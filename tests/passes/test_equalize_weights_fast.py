"""equalize_weights' cheaper steps give the numbers of the plain ones, bit for bit (issue #34): `cle_scales`' few-op
mask against `dead_channels` on ranges with zeros, infinities and NaN; a small weight's one-block range read
against the block loop; and the biases and shifts scaled once at the end against a step-by-step update, on a
Gemm/MatMul chain whose constants have every accepted layout."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper
from qgraph.passes import equalize_weights as ew

from qgraph import GraphHandle, PassContext
from qgraph.recovery import equalize as eq
from qgraph.recovery.equalize import LinearLayer, cle_scales, dead_channels, scale_const_per_channel

values = st.one_of(st.floats(0.0, 1e6), st.sampled_from([0.0, np.inf, -np.inf, np.nan, 1e-300, 1e-30]))


@settings(max_examples=300, deadline=None)
@given(r1=st.lists(values, min_size=1, max_size=12), data=st.data(), dead=st.sampled_from([0.0, 1e-6, 0.1, 0.9]),
       bounds=st.sampled_from([(0.0, np.inf), (1e-4, 1e4), (0.5, 2.0)]))
def test_cle_scales_match_the_dead_channel_mask(r1: list[float], data: st.DataObject, dead: float,
                                                bounds: tuple[float, float]) -> None:
    r2 = np.array(data.draw(st.lists(values, min_size=len(r1), max_size=len(r1))))
    a = np.array(r1)
    ok = ~dead_channels(a, r2, dead)
    want = np.ones(a.size)
    want[ok] = np.sqrt(a[ok] * r2[ok]) / r2[ok]
    got = cle_scales(a, r2, *bounds, dead=dead)
    assert got.tobytes() == np.clip(want, *bounds).tobytes()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(1, 20), n=st.integers(1, 20), transposed=st.booleans())
def test_a_small_weight_read_in_one_block_gives_the_block_loop_ranges(seed: int, k: int, n: int,
                                                                       transposed: bool) -> None:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    layer = LinearLayer(None, "matmul", transposed=transposed)  # type: ignore[arg-type]  # node unused here
    out_f, in_f = np.exp(rng.normal(0, 1, n)), np.exp(rng.normal(0, 1, k))
    one = layer.scaled_ranges(w, out_f, in_f)
    small = eq._SMALL
    try:
        eq._SMALL = 0  # every weight through the block loop
        loop = layer.scaled_ranges(w, out_f, in_f)
    finally:
        eq._SMALL = small
    assert [r.tobytes() for r in one] == [r.tobytes() for r in loop]
    assert one[0].shape == (n,) and one[1].shape == (k,) and np.all(one[0] > 0)


def _chain() -> onnx.ModelProto:
    """Gemm (bias [1, 6]) -> Add [6] -> Relu -> Gemm transB (scalar bias) -> Relu -> MatMul -> Add [6] -> Relu
    -> MatMul: three pairs, a bias or shift of every accepted shape, channel spreads that take several rounds."""
    text = '''<ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 5] x) => (float[2, 3] y) {
        a = Gemm (x, w1, b1)
        a2 = Add (a, c1)
        r1 = Relu (a2)
        b = Gemm <transB = 1> (r1, w2, b2)
        r2 = Relu (b)
        c = MatMul (r2, w3)
        c2 = Add (c, c3)
        r3 = Relu (c2)
        y = MatMul (r3, w4)
    }'''
    rng = np.random.default_rng(7)
    spread = np.exp(rng.uniform(-3, 3, 6))
    inits = {"w1": rng.standard_normal((5, 6)) * spread, "b1": rng.standard_normal((1, 6)),
             "c1": rng.standard_normal(6), "w2": rng.standard_normal((6, 6)) * spread[:, None],
             "b2": np.array([0.3]), "w3": rng.standard_normal((6, 6)) * spread, "c3": rng.standard_normal(6),
             "w4": rng.standard_normal((6, 3))}
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items())
    onnx.checker.check_model(model, full_check=True)
    return model


def _step_by_step(self: ew._Equalizer) -> None:
    """The update the pass made at every step before: each constant times one factor at a time."""
    for key, factors in self._divisors.items():
        axis, rank = self._layouts[key]
        for f in factors:
            scaled = scale_const_per_channel(self.values[key], f, axis, rank)
            assert scaled is not None
            self.values[key] = scaled
        factors.clear()


def _equalized(monkeypatch: pytest.MonkeyPatch, reference: bool) -> dict[str, bytes]:
    if reference:
        monkeypatch.setattr(ew._Equalizer, "_scale_values", _step_by_step)
    graph = GraphHandle(_chain())
    res = ew.EqualizeWeights(ew.EqualizeWeightsConfig(iterations=7)).run(graph, PassContext())
    monkeypatch.undo()
    assert res.rewritten == 3 and res.details.rounds == 7, res.details  # every pair moved, still moving
    return {t.name: numpy_helper.to_array(t).tobytes() for t in graph.to_onnx().graph.initializer}


def test_biases_and_shifts_scaled_at_the_end_equal_a_step_by_step_update(monkeypatch: pytest.MonkeyPatch) -> None:
    before = {t.name: numpy_helper.to_array(t).tobytes() for t in _chain().graph.initializer}
    at_end, stepwise = _equalized(monkeypatch, False), _equalized(monkeypatch, True)
    assert at_end == stepwise
    assert all(at_end[k] != before[k] for k in ("b1", "c1", "b2", "c3"))  # each constant was rescaled
