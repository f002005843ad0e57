"""The executor interface (`qgraph.runtime.executor`): local (serial, processes) and Ray give the same ordered results;
the shared object travels once; the time budget stops work; a Ray worker killed mid-task is retried with the same
result; a sensitivity run on Ray equals the local one; without Ray, asking for it is one sentence, exit 2."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from qgraph import DataError, Recipe
from qgraph.analysis.sensitivity.options import SearchOptions
from qgraph.analysis.sensitivity.search import auto_fallback
from qgraph.cli import main
from qgraph.runtime.executor import ExecutorSpec, LocalExecutor, RayExecutor, WorkerError, make_executor

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"


# Task functions, module level. Ray workers cannot import test modules: `local_ray` below sends this module's
# functions by value.
def _affine(shared: dict[str, Any], x: int) -> tuple[int, float]:
    return x, float(shared["a"].sum()) * x + 0.5


def _sleep(shared: float, x: int) -> int:
    time.sleep(shared if x >= 2 else 0.0)
    return x


def _fails_on_three(shared: None, x: int) -> int:
    if x == 3:
        raise DataError(f"item {x} is bad")
    return x


class _Counted:
    """A shared object that logs (pid) to a file each time it is unpickled."""

    def __init__(self, payload: bytes, log: Path) -> None:
        self.payload, self.log = payload, log

    def __setstate__(self, state: dict[str, Any]) -> None:
        with open(state["log"], "a") as f:
            f.write(f"{os.getpid()}\n")
        self.__dict__.update(state)


def _pid(shared: _Counted, x: int) -> tuple[int, int]:
    time.sleep(0.05)  # let both workers take items
    return x, os.getpid()


def _dies_once(marker: str, x: int) -> int:
    # The first attempt of item 2 kills its worker process outright (as the OOM killer would); the retry finds
    # the marker and completes.
    if x == 2 and not os.path.exists(marker):
        Path(marker).write_text("died once")
        os._exit(1)
    return x * 10


# ----------------------------------------------------------------------------- local
def test_local_serial_and_processes_return_ordered_results_with_progress() -> None:
    shared = {"a": np.arange(6, dtype=np.float64).reshape(2, 3)}
    items = list(range(5))
    expected = [(x, 15.0 * x + 0.5) for x in items]
    seen: list[tuple[int, int]] = []
    serial = LocalExecutor(1).map(_affine, items, shared=shared, progress=lambda d, t: seen.append((d, t)))
    assert serial == expected
    assert seen == [(i, 5) for i in range(1, 6)]
    with LocalExecutor(2) as ex:
        assert ex.map(_affine, items, shared=shared) == expected


def test_local_pool_is_kept_for_the_same_shared_object_and_renewed_for_another(tmp_path: Path) -> None:
    log = tmp_path / "unpickled.txt"
    first, other = _Counted(b"x", log), _Counted(b"y", log)
    with LocalExecutor(2) as ex:
        used = {pid for _, pid in ex.map(_pid, list(range(4)), shared=first) + ex.map(_pid, [4, 5], shared=first)}
        started = log.read_text().split()  # one line per worker process that unpickled `first`
        assert len(started) == len(set(started)) <= 2  # two maps, at most two workers, each received it once
        assert {str(p) for p in used} <= set(started)
        renewed = {str(pid) for _, pid in ex.map(_pid, list(range(4)), shared=other)}
        assert not renewed & set(started)  # another shared object: a new pool
    assert _no_children_left()


def _no_children_left(timeout: float = 15.0) -> bool:
    """Whether every child process is gone (terminated ones may take a moment to be reaped on a busy machine)."""
    import multiprocessing

    end = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < end:
        time.sleep(0.1)
    return not multiprocessing.active_children()


def test_deadline_returns_the_finished_items_in_order() -> None:
    start = time.monotonic()
    done = LocalExecutor(1).map(_sleep, list(range(6)), shared=0.4, deadline=start + 0.6)
    assert done[:2] == [0, 1] and len(done) < 6 and done == sorted(done)
    # no item starts after the deadline: at most the one running then finishes (a loaded machine only delays it)
    assert len(done) <= 2 + math.ceil((time.monotonic() - start) / 0.4)


def test_a_local_worker_that_dies_is_a_worker_error_and_no_process_is_left(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match="local worker process died"):
        LocalExecutor(2).map(_dies_once, list(range(4)), shared=str(tmp_path / "died"))
    assert _no_children_left()


def _writes_slowly(folder: str, x: int) -> int:
    from qgraph.io.outputs import temporary_file

    with temporary_file(Path(folder), f"out{x}.onnx"):
        Path(folder, f"started{x}").write_text("")
        time.sleep(60)
    return x


def _started(folder: str, x: int) -> int:
    return x


def test_time_budget_stops_local_workers_and_their_temporary_files_go(tmp_path: Path) -> None:
    with LocalExecutor(2) as ex:
        # the workers are up and hold the shared object before the clock starts: a loaded machine that is slow to
        # start processes must not make the budget run out before any task began
        assert ex.map(_started, [0, 1], shared=str(tmp_path)) == [0, 1]
        start = time.monotonic()
        assert ex.map(_writes_slowly, [0, 1], shared=str(tmp_path), deadline=start + 3.0) == []
        stopped = time.monotonic() - start
    assert stopped < 3.0 + 30.0  # stopped at the budget, not after the tasks' 60 s
    assert _no_children_left()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "started0" in names or "started1" in names  # a task was running when the budget ran out
    assert not [n for n in names if n.endswith(".tmp")]


def test_spec_validation_and_factory() -> None:
    with pytest.raises(ValueError, match="kind: ray"):
        ExecutorSpec(address="auto")
    assert isinstance(make_executor(None, jobs=3), LocalExecutor) and make_executor(None, jobs=3).workers == 3
    assert make_executor(ExecutorSpec(workers=2)).workers == 2
    ex = LocalExecutor(2)
    assert make_executor(ex) is ex


# ----------------------------------------------------------------------------- Ray
@pytest.fixture
def local_ray(local_ray: Any) -> Any:
    """The session's Ray, with this module's task functions pickled by value (workers cannot import tests/)."""
    local_ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return local_ray


def test_ray_matches_local_and_raises_the_tasks_own_error(local_ray: Any) -> None:
    shared = {"a": np.arange(6, dtype=np.float64).reshape(2, 3)}
    items = list(range(7))
    with RayExecutor(workers=2) as ray_ex:
        assert ray_ex.map(_affine, items, shared=shared) == LocalExecutor(1).map(_affine, items, shared=shared)
        with pytest.raises(DataError, match="item 3 is bad"):
            ray_ex.map(_fails_on_three, items, shared=None)
    assert local_ray.is_initialized()  # an executor leaves a Ray it did not start running


def _runs_here(shared: None, item: int) -> int:
    from qgraph.runtime.parallel import parallel_runs

    return parallel_runs()


def test_a_ray_task_runs_one_model_at_a_time(local_ray: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task holds one CPU of the cluster (num_cpus=1): its data passes run one sample at a time."""
    monkeypatch.delenv("QGRAPH_THREADS", raising=False)
    assert RayExecutor(workers=2).map(_runs_here, [0, 1, 2], shared=None) == [1, 1, 1]


def test_ray_puts_the_shared_object_once_and_each_worker_unpickles_it_once(
    local_ray: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    puts: list[int] = []
    real_put = local_ray.put
    monkeypatch.setattr(local_ray, "put", lambda value, **kw: puts.append(1) or real_put(value, **kw))
    log = tmp_path / "unpickled.txt"
    shared = _Counted(os.urandom(1 << 20), log)
    ex = RayExecutor(workers=2)
    out = ex.map(_pid, list(range(4)), shared=shared) + ex.map(_pid, list(range(4, 8)), shared=shared)
    assert [x for x, _ in out] == list(range(8))
    assert len(puts) == 1  # one object-store copy for 8 tasks in 2 maps
    unpickled = log.read_text().split()
    # Each worker process that ran a task unpickled the object once and reused it (not once per task).
    assert sorted(unpickled) == sorted({str(pid) for _, pid in out})
    assert 1 <= len(unpickled) <= 2


def test_ray_worker_killed_mid_task_is_retried_with_the_same_result(local_ray: Any, tmp_path: Path) -> None:
    items = list(range(5))
    marker = tmp_path / "died"
    assert RayExecutor(workers=2, max_retries=2).map(_dies_once, items, shared=str(marker)) == [x * 10 for x in items]
    assert marker.exists()  # the worker really died once
    marker.unlink()
    with pytest.raises(WorkerError, match="0 retries"):
        RayExecutor(workers=2, max_retries=0).map(_dies_once, items, shared=str(marker))


def test_ray_deadline_cancels_running_tasks(local_ray: Any) -> None:
    ex = RayExecutor(workers=2)
    assert ex.map(_sleep, [0, 1], shared=0.0) == [0, 1]  # workers up (starting one can take seconds here)
    start = time.monotonic()
    done = ex.map(_sleep, list(range(6)), shared=30.0, deadline=start + 3.0)
    assert done == [0, 1]
    assert time.monotonic() - start < 3.0 + 25.0  # cancelled at the budget, not after the tasks' 30 s


@pytest.fixture(scope="module")
def digits_qdq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits CNN quantized by qgraph's ort-x86-vnni recipe."""
    out = tmp_path_factory.mktemp("digits_qdq") / "qdq.onnx"
    rec = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml")
    rec.pipeline().run(DIGITS / "model.onnx", calibration_data=DIGITS / "calibration.npz").save(out)
    return out


def test_sensitivity_and_search_on_ray_equal_local(local_ray: Any, digits_qdq: Path) -> None:
    ref, qdq = onnx.load(DIGITS / "model.onnx"), onnx.load(digits_qdq)
    kwargs: dict[str, Any] = {"samples": 64}
    local = auto_fallback(ref, qdq, str(DIGITS / "eval.npz"), "sqnr:60", SearchOptions(**kwargs))
    ray = auto_fallback(ref, qdq, str(DIGITS / "eval.npz"), "sqnr:60", SearchOptions(
        executor=ExecutorSpec(kind="ray"), **kwargs))
    assert local.sensitivity is not None and ray.sensitivity is not None
    assert len(local.sensitivity.rows) >= 4

    def table(r: Any) -> list[tuple[str, float, float, float]]:
        return [(n.name, n.sensitivity, n.cosine, n.sqnr_db) for n in r.sensitivity.ranked()]

    assert table(ray) == table(local)  # bit-identical measurements, same ranking
    assert ray.nodes == local.nodes and ray.score == local.score
    assert ray.model.graph.SerializeToString() == local.model.graph.SerializeToString()


def test_recipe_float_fallback_on_ray_builds_the_same_graph(local_ray: Any, tmp_path: Path) -> None:
    text = ("name: ff\npasses:\n  - pass: insert_qdq\n    preset: ort-x86-vnni\n  - pass: float_fallback\n"
            "    auto: {{target: 'sqnr:45', samples: 32, data: '{data}'{executor}}}\n")
    graphs = []
    for executor in ("", ", executor: {kind: ray, workers: 2, max_retries: 1}"):
        rec = Recipe.from_text(text.format(data=DIGITS / "eval.npz", executor=executor))
        result = rec.pipeline().run(DIGITS / "model.onnx", calibration_data=DIGITS / "calibration.npz")
        assert result.records[-1].result.rewritten >= 1  # the search did fall nodes back
        graphs.append(result.model.graph.SerializeToString())
    assert graphs[0] == graphs[1]


def test_sensitivity_cli_on_ray_writes_the_same_json(local_ray: Any, digits_qdq: Path, tmp_path: Path) -> None:
    args = ["sensitivity", str(DIGITS / "model.onnx"), str(digits_qdq), "--data", str(DIGITS / "eval.npz"),
            "--samples", "32", "-q"]
    assert main([*args, "--json", str(tmp_path / "local.json")]) == 0
    assert main([*args, "--json", str(tmp_path / "ray.json"), "--executor", "ray", "--jobs", "2"]) == 0
    import json

    local, ray = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("local", "ray"))
    assert [r["name"] for r in ray["nodes"]] == [r["name"] for r in local["nodes"]]
    assert [r["sensitivity"] for r in ray["nodes"]] == [r["sensitivity"] for r in local["nodes"]]


# ----------------------------------------------------------------------------- Ray missing
def _hide_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError, as when not installed


def test_without_ray_the_cli_says_which_extra_in_one_sentence(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], digits_qdq: Path, tmp_path: Path
) -> None:
    _hide_ray(monkeypatch)
    code = main(["sensitivity", str(DIGITS / "model.onnx"), str(digits_qdq), "--data", str(DIGITS / "eval.npz"),
                 "--executor", "ray", "-q", "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "pip install 'qgraph[ray]'" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0 or len(err.strip().splitlines()) <= 2  # one sentence (wrapped at most once)
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(ValueError, match=r"qgraph\[ray\]"):
        ExecutorSpec(kind="ray")


def test_without_ray_a_recipe_asking_for_it_fails_before_any_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: ff-ray\npasses:\n  - pass: insert_qdq\n    preset: ort-x86-vnni\n  - pass: float_fallback\n"
        "    auto: {target: 'sqnr:40', executor: {kind: ray}}\n"
    )
    _hide_ray(monkeypatch)
    code = main(["run", str(recipe), str(DIGITS / "model.onnx"), "-o", str(tmp_path / "o.onnx"), "-q",
                 "--calibration-data", str(DIGITS / "calibration.npz")])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'qgraph[ray]'" in err and "Traceback" not in err
    assert not (tmp_path / "o.onnx").exists()


def test_address_without_ray_executor_is_a_usage_error(capsys: pytest.CaptureFixture[str], digits_qdq: Path) -> None:
    code = main(["sensitivity", str(DIGITS / "model.onnx"), str(digits_qdq), "--data", str(DIGITS / "eval.npz"),
                 "--address", "auto"])
    assert code == 2 and "--executor ray" in capsys.readouterr().err
