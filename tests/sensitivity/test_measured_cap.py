"""``max_latency`` held as measured (`qgraph.analysis.sensitivity.measured_cap`): the bisection on its own (the
search cutting its prefix back is in test_cost.py, beside the fixture it runs on)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.analysis.sensitivity.measured_cap import cap_by_measurement


def test_within_the_bound_the_prefix_is_timed_once_and_kept() -> None:
    cap = cap_by_measurement(40, 0.9, lambda m: 0.5 + m / 100)
    assert (cap.size, cap.trimmed, cap.timings) == (40, False, [(40, 0.9)])


def test_over_the_bound_the_largest_prefix_timed_within_it_is_kept() -> None:
    timed: list[int] = []

    def ratio(m: int) -> float:
        timed.append(m)
        return 0.5 + m / 100  # 0.9 at 40 nodes

    cap = cap_by_measurement(100, 0.9, ratio, resolution=1)
    assert cap.trimmed and cap.size == 40 and timed[0] == 100
    assert len(timed) <= 1 + math.ceil(math.log2(100))
    assert "kept the 40 whose timing is within it" in cap.reason(100) and "100 node(s) 1.50x" in cap.reason(100)


def test_no_time_left_keeps_the_int8_end() -> None:
    """With the budget spent after the first timing, what is kept was never timed over the bound: the INT8 model."""
    cap = cap_by_measurement(64, 0.9, lambda m: 0.5 + m / 100, has_time=lambda: False)
    assert cap.trimmed and cap.size == 0 and [m for m, _ in cap.timings] == [64]


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 500), knee=st.integers(0, 600), resolution=st.integers(1, 20))
def test_bisection_finds_the_knee_within_its_resolution(size: int, knee: int, resolution: int) -> None:
    """Monotone timings: ratio <= 1 up to ``knee`` nodes. The kept size is timed within the bound (or is 0), lies
    within ``resolution`` of the largest such size, and took O(log(size / resolution)) timings."""
    cap = cap_by_measurement(size, 1.0, lambda m: 0.8 if m <= knee else 1.2, resolution=resolution)
    best = min(size, knee)
    assert cap.size <= best and best - cap.size <= (0 if knee >= size else resolution)
    assert len(cap.timings) <= 2 + math.ceil(math.log2(max(1, size / resolution)))

