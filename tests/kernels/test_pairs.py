"""The pair arithmetic of AVX2's u8×s8 kernels (`qgraph.runtime.kernels.pairs`), property-based."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qgraph.runtime.kernels.pairs import (
    INT16_MAX,
    INT16_MIN,
    exact_u8s8_matmul,
    kernel_rows,
    pair_safe_scales,
    risky_pairs,
    simulate_u8s8_matmul,
)

codes_u8 = st.integers(0, 255)
codes_s8 = st.integers(-128, 127)


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 12), n=st.integers(1, 4), data=st.data())
def test_saturation_only_ever_comes_from_the_pairs_listed_as_risky(k: int, n: int, data: st.DataObject) -> None:
    a = data.draw(hnp.arrays(np.uint8, (3, k), elements=codes_u8))
    w = data.draw(hnp.arrays(np.int8, (k, n), elements=codes_s8))
    risky = risky_pairs(w.T.astype(np.int32))
    listed = set(zip(risky.channel.tolist(), risky.first.tolist(), strict=True))
    correction = np.zeros((3, n), np.int64)
    for ch, first in listed:
        second = first + 1
        p = a[:, first].astype(np.int64) * int(w[first, ch]) + (
            a[:, second].astype(np.int64) * int(w[second, ch]) if second < k else 0)
        correction[:, ch] += np.clip(p, INT16_MIN, INT16_MAX) - p
    # the kernel's result is the exact product plus what the listed pairs lose, nothing else
    assert np.array_equal(simulate_u8s8_matmul(a, w), exact_u8s8_matmul(a, w) + correction)
    # and a listed pair does overflow for some codes in [0, 255]: the extreme codes of its own signs
    for ch, first in listed:
        w0, w1 = int(w[first, ch]), int(w[first + 1, ch]) if first + 1 < k else 0
        top = 255 * (max(w0, 0) + max(w1, 0))
        bottom = 255 * (min(w0, 0) + min(w1, 0))
        assert top > INT16_MAX or bottom < INT16_MIN


@settings(max_examples=100, deadline=None)
@given(rows=hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)),
                       elements=st.floats(-4, 4, width=32, allow_subnormal=False)))
def test_pair_safe_scales_remove_every_risky_pair_and_touch_nothing_else(rows: np.ndarray) -> None:
    scale = np.maximum(np.abs(rows).max(axis=1), 1e-3) / 127.0
    before = np.clip(np.rint(rows / scale[:, None]), -128, 127)
    raised = pair_safe_scales(rows, scale, -128, 127)
    after = np.clip(np.rint(rows / raised[:, None].astype(np.float64)), -128, 127)
    assert risky_pairs(after).count == 0
    at_risk = set(risky_pairs(before).channel.tolist())
    for ch in range(rows.shape[0]):
        if ch in at_risk:
            assert 1.0 < raised[ch] / scale[ch] <= 2.02  # never more than the bit reduce_range costs
        else:
            assert raised[ch] == np.float32(scale[ch])


def test_kernel_rows_follow_the_reduction_order() -> None:
    conv = np.arange(2 * 3 * 2 * 2).reshape(2, 3, 2, 2)  # (O, C, kh, kw)
    rows = kernel_rows(conv, "Conv")
    assert rows is not None and rows.shape == (2, 12)
    assert rows[0, :3].tolist() == conv[0, :, 0, 0].tolist()  # channels fastest at the first kernel offset
    mm = np.arange(6).reshape(3, 2)  # (K, N)
    assert np.array_equal(kernel_rows(mm, "MatMul"), mm.T)  # type: ignore[arg-type]
    assert np.array_equal(kernel_rows(mm.T, "Gemm", transposed=True), mm.T)  # type: ignore[arg-type]
