"""`qgraph.runtime.parallel`: several model runs at once, results in order, the bits of one run after another."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph import Recipe
from qgraph.calibrate import collect_ranges
from qgraph.data import CallableSource
from qgraph.errors import UsageError
from qgraph.runtime.compare import make_session, session_run, session_runs
from qgraph.runtime.executor import LocalExecutor
from qgraph.runtime.parallel import ENV, default_runs, ordered_map, parallel_runs, usable_cores
from qgraph.testing import cached_light_model, mobilenet_v2, random_feeds

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=25, deadline=None)
@given(delays=st.lists(st.integers(0, 3), min_size=0, max_size=12), runs=st.integers(1, 4))
def test_results_come_in_item_order_whatever_finishes_first(delays: list[int], runs: int) -> None:
    running, most = [0], [0]
    lock = threading.Lock()

    def work(item: tuple[int, int]) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(item[1] / 1000)
        with lock:
            running[0] -= 1
        return item[0] * 10

    got = list(ordered_map(work, enumerate(delays), runs=runs))
    assert got == [10 * i for i in range(len(delays))]
    assert most[0] <= runs  # never more runs at once than asked


@pytest.mark.parametrize(("result_bytes", "most"), [(100, 4), (400, 2), (5000, 1)])
def test_large_results_narrow_the_window_to_the_memory_budget(result_bytes: int, most: int) -> None:
    """Once the first result's size is known, at most ``budget // size`` results are in flight (at least one)."""
    running, seen = [0], [0]
    lock = threading.Lock()

    def work(i: int) -> bytes:
        with lock:
            running[0] += 1
            if i >= 4:  # the first window (4 items) starts before any size is known
                seen[0] = max(seen[0], running[0])
        time.sleep(0.003)
        with lock:
            running[0] -= 1
        return bytes(result_bytes)

    got = list(ordered_map(work, range(24), runs=4, size_of=len, budget=1000))
    assert len(got) == 24 and all(len(g) == result_bytes for g in got)
    assert 1 <= seen[0] <= most


def test_an_error_is_raised_in_order_and_no_later_item_starts() -> None:
    started: list[int] = []

    def work(i: int) -> int:
        started.append(i)
        if i == 3:
            raise ValueError("sample 3 is bad")
        time.sleep(0.002)
        return i

    got: list[int] = []
    with pytest.raises(ValueError, match="sample 3"):
        for value in ordered_map(work, range(100), runs=2):
            got.append(value)
    assert got == [0, 1, 2]
    assert max(started) <= 5  # items are read one window ahead, not all at once


def test_a_map_inside_a_mapped_function_runs_in_place() -> None:
    """A pool thread that maps again runs its items itself (a shared pool waiting on itself would deadlock)."""
    names = list(ordered_map(lambda _: [threading.current_thread().name
                                        for _ in ordered_map(lambda x: x, range(3), runs=2)], range(4), runs=2))
    assert all(len(set(inner)) == 1 and inner[0].startswith("qgraph-run") for inner in names)


def test_thread_count_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert parallel_runs() == usable_cores() >= 1
    default_runs(0)  # a worker's share is at least one run
    assert parallel_runs() == 1
    default_runs(5)  # ... and never overrides what is set
    assert parallel_runs() == 1
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(UsageError, match=f"{ENV}='{bad}'.*whole number"):
            parallel_runs()
    monkeypatch.setenv(ENV, " 3 ")
    assert parallel_runs() == 3


def _worker_runs(shared: None, item: int) -> int:
    return parallel_runs()


def test_local_workers_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with LocalExecutor(workers=2) as executor:
        got = executor.map(_worker_runs, [0, 1, 2], shared=None)
    assert got == [max(1, usable_cores() // 2)] * 3


@pytest.mark.parametrize("runs", ["1", "3"])
def test_session_runs_give_the_bits_of_one_run_after_another(runs: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SqueezeNet (onnx wheel, seeded weights) without graph optimizations: its float Conv gives other bits with
    onnxruntime's own 3 intra-op threads; 3 one-thread runs at once give exactly those of one by one."""
    model = onnx.load(str(cached_light_model("squeezenet", tmp_path)))
    feeds = random_feeds(model, n=6, seed=3)
    session = make_session(model)
    names = [o.name for o in session.get_outputs()]
    one_by_one = [session_run(session, names, f) for f in feeds]
    monkeypatch.setenv(ENV, runs)
    at_once = list(session_runs(session, names, feeds))
    assert len(at_once) == 6
    for a, b in zip(one_by_one, at_once, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_calibration_and_a_ready_recipe_do_not_depend_on_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranges of every activation and the whole ort-x86-vnni output (calibration, smooth_quant's rows, bias
    correction's means, its guard) are the same bytes with 1 and 3 runs at once."""
    model = mobilenet_v2(width=0.25, seed=1)
    feeds = random_feeds(model, n=5, seed=2)
    tensors = [n.output[0] for n in model.graph.node if n.op_type in ("Conv", "Add", "Clip")]
    recipe = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml")
    got: list[Any] = []
    for runs in ("1", "3"):
        monkeypatch.setenv(ENV, runs)
        ranges = collect_ranges(model, tensors, feeds, method="auto")
        out = recipe.pipeline().run(model, calibration_data=CallableSource(lambda: iter(feeds), "feeds"))
        got.append(({n: (c.range.rmin, c.range.rmax) for n, c in ranges.items()},
                    out.model.SerializeToString()))
    assert got[0][0] == got[1][0] and len(got[0][0]) == len(tensors)
    assert got[0][1] == got[1][1]
