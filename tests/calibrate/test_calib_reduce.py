"""In-graph min/max (qgraph.calibrate.reduce): the fetch path's results, exact derivations, NaN anywhere caught."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qgraph.calibrate.collector as collector
from qgraph.calibrate import RobustMagnitude, collect_ranges, make_observer, observe
from qgraph.calibrate.reduce import plan_derivations, resolve_ranges
from qgraph.cli.calibrate_command import float_activations
from qgraph.errors import DataError, ModelError
from qgraph.testing.models import cached_light_model

CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
chain (float[N, 6] x, float[1] lim) => (float[N, 3, 2] t, float[N, 6] k, float[N, 18] cc)
<float[1] lo = {-0.5}, float[1] hi = {1.5}, int64[3] shape = {3, -1, 2}> {
  a = Mul(x, x)
  b = Sub(a, x)
  c = Relu(b)
  d = Clip(b, lo, hi)
  e = Reshape(d, shape)
  t = Transpose<perm = [1, 0, 2]>(e)
  k = Clip(b, lim)
  cc = Concat<axis = 1>(c, k, c)
}
"""
CHAIN_NAMES = ["x", "a", "b", "c", "d", "e", "t", "k", "cc"]


def _chain_feeds(n: int = 5) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [
        {"x": (rng.standard_normal((3 * (i + 1), 6)) * 2).astype(np.float32), "lim": np.array([0.25], np.float32)}
        for i in range(n)
    ]


def _fetched(model: onnx.ModelProto, names: list[str], feeds: list, optimize: bool) -> dict[str, tuple]:
    """Ranges, counts and robust magnitudes through the fetch path (whole tensors to numpy)."""
    obs = {n: make_observer("minmax", n) for n in names}
    rob = {n: RobustMagnitude() for n in names}

    class Both:
        def __init__(self, n: str) -> None:
            self.n = n

        def update(self, x, i=None) -> None:
            obs[self.n].update(x, i)
            rob[self.n].update(x, i)

    observe(model, {n: Both(n) for n in names}, feeds, optimize=optimize)
    return {n: (obs[n].compute().rmin, obs[n].compute().rmax, obs[n].num_values, rob[n].value()) for n in names}


def _summary(cal: dict) -> dict[str, tuple]:
    return {n: (c.range.rmin, c.range.rmax, c.num_values, c.robust_absmax) for n, c in cal.items()}


def test_derivation_plan() -> None:
    model = onnx.parser.parse_model(CHAIN)
    plan = plan_derivations(model, CHAIN_NAMES, keep_order=False)
    assert sorted(plan) == ["c", "cc", "d", "e", "t"]  # k clips to a non-constant bound: reduced itself
    relu, clip, none = (0.0, np.inf), (-0.5, 1.5), (-np.inf, np.inf)
    assert {n: (d.inputs, d.clamp, d.root) for n, d in plan.items()} == {
        "c": (("b",), relu, "b"),
        "d": (("b",), clip, "b"),
        "e": (("b",), clip, "b"),  # Reshape(d): the chain is composed back to its reduced root
        "t": (("b",), clip, "b"),
        "cc": (("c", "k", "c"), none, None),  # a Concat keeps its direct inputs (duplicates counted)
    }
    assert sorted(n for n, d in plan.items() if not d.same_order) == ["cc", "t"]
    assert sorted(plan_derivations(model, CHAIN_NAMES, keep_order=True)) == ["c", "d", "e"]  # t, cc reorder
    # only between calibrated tensors: without b, c and d are reduced and e derives from d
    assert {n: d.inputs for n, d in plan_derivations(model, ["x", "c", "d", "e"], keep_order=False).items()} == {
        "e": ("d",)
    }
    old = onnx.parser.parse_model("""
    <ir_version: 7, opset_import: ["" : 6]>
    g (float[4] x) => (float[4] y) { y = Clip<min = -1.0, max = 3.0>(x) }
    """)
    assert plan_derivations(old, ["x", "y"], keep_order=True)["y"].clamp == (-1.0, 3.0)


def test_clip_chains_compose_and_concat_chains_stay_linear() -> None:
    """Clip(Relu(Clip(x))) is one clamp from x; a 1,000-deep concat-of-concat chain keeps direct inputs only and
    resolves in one pass (a flattened representation would hold 500,000 parts)."""
    chained = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] z) <float[1] a = {-2.0}, float[1] b = {0.5}, float[1] c = {0.25}, float[1] d = {9.0}> {
      y1 = Clip(x, a, d)
      y2 = Relu(y1)
      z = Clip(y2, c, b)
    }
    """)
    assert plan_derivations(chained, ["x", "y1", "y2", "z"], keep_order=True)["z"].clamp == (0.25, 0.5)
    depth = 1000
    nodes = [helper.make_node("Concat", ["x", "x"], ["c0"], axis=0)]
    nodes += [helper.make_node("Concat", [f"c{i - 1}", "x"], [f"c{i}"], axis=0) for i in range(1, depth)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info(f"c{depth - 1}", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    names = ["x", *(f"c{i}" for i in range(depth))]
    plan = plan_derivations(model, names, keep_order=False)
    assert len(plan) == depth and max(len(d.inputs) for d in plan.values()) == 2
    ranges = resolve_ranges(plan, {"x": (-1.5, 2.0, 3)})
    assert ranges[f"c{depth - 1}"] == (-1.5, 2.0, 3 * (depth + 1))
    assert resolve_ranges(plan, {"x": (np.inf, -np.inf, 0)})["c7"] == (np.inf, -np.inf, 0)  # nothing observed


@pytest.mark.parametrize("optimize", [False, True])
def test_chain_equals_fetch_path(optimize: bool) -> None:
    model = onnx.parser.parse_model(CHAIN)
    feeds = _chain_feeds()
    fast = collect_ranges(model, CHAIN_NAMES, feeds, robust_percentile=99.99, optimize=optimize)
    assert _summary(fast) == _fetched(model, CHAIN_NAMES, feeds, optimize)
    x = np.concatenate([f["x"].ravel() for f in feeds]).astype(np.float64)
    b = x * x - x
    assert fast["d"].range.rmin == pytest.approx(b.min(), rel=1e-6) and fast["d"].range.rmax == 1.5  # min(b) = -1/4
    assert fast["c"].range.rmin == 0.0 and fast["c"].range.rmax == pytest.approx(b.max(), rel=1e-6)
    assert fast["k"].range.rmin == 0.25 and fast["t"].num_values == x.size  # Clip(b, lim): lim is the lower bound
    assert (fast["cc"].range.rmin, fast["cc"].range.rmax) == (0.0, fast["k"].range.rmax)
    assert fast["cc"].num_values == 3 * x.size


@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    return onnx.load(cached_light_model("squeezenet", tmp_path_factory.mktemp("light")))


def _image_feeds(model: onnx.ModelProto, n: int) -> list[dict[str, np.ndarray]]:
    inp = model.graph.input[0]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    return [{inp.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def test_squeezenet_in_graph_equals_fetch_path(squeezenet: onnx.ModelProto) -> None:
    names = float_activations(squeezenet)
    relus = [n.output[0] for n in squeezenet.graph.node if n.op_type == "Relu"]
    concats = [n.output[0] for n in squeezenet.graph.node if n.op_type == "Concat"]
    assert len(relus) == 26 and set(plan_derivations(squeezenet, names, keep_order=True)) == set(relus)
    assert len(concats) == 8 and set(plan_derivations(squeezenet, names, keep_order=False)) >= set(relus + concats)
    feeds = _image_feeds(squeezenet, 3)
    fast = collect_ranges(squeezenet, names, feeds, robust_percentile=99.99, optimize=False)
    assert _summary(fast) == _fetched(squeezenet, names, feeds, optimize=False)
    plain = collect_ranges(squeezenet, names, feeds, optimize=False)  # no subsamples: Concat outputs derived too
    assert {n: (c.range.rmin, c.range.rmax, c.num_values) for n, c in plain.items()} == {
        n: v[:3] for n, v in _summary(fast).items()
    }
    # with onnxruntime's optimizations the kernels change: ranges move by float rounding only
    opt = collect_ranges(squeezenet, names, feeds, robust_percentile=99.99)
    for n in names:
        scale = max(abs(fast[n].observed.rmin), abs(fast[n].observed.rmax), 1e-6)
        assert abs(opt[n].range.rmin - fast[n].range.rmin) <= 1e-5 * scale, n
        assert abs(opt[n].range.rmax - fast[n].range.rmax) <= 1e-5 * scale, n


def test_minmax_equals_onnxruntime_calibrator(squeezenet: onnx.ModelProto, tmp_path: Path) -> None:
    from onnxruntime.quantization.calibrate import CalibrationDataReader, CalibrationMethod, create_calibrator

    path = tmp_path / "model.onnx"
    onnx.save(squeezenet, path)
    feeds = _image_feeds(squeezenet, 4)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    cal = create_calibrator(
        path, augmented_model_path=str(tmp_path / "aug.onnx"), calibrate_method=CalibrationMethod.MinMax
    )
    cal.collect_data(Reader())
    theirs = {
        k: (float(np.ravel(v.range_value[0])[0]), float(np.ravel(v.range_value[1])[0]))
        for k, v in cal.compute_data().data.items()
    }
    ours = collect_ranges(squeezenet, list(theirs), feeds, optimize=False)
    assert len(theirs) >= 50
    assert {k: (c.range.rmin, c.range.rmax) for k, c in ours.items()} == theirs


def _add_one(dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    one = helper.make_tensor("one", dtype, [], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"]), helper.make_node("Relu", ["y"], ["r"])],
        "add_one",
        [helper.make_tensor_value_info("x", dtype, ["n", "m"])],
        [helper.make_tensor_value_info("r", dtype, ["n", "m"])],
        [one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 37, 1999])
def test_non_finite_anywhere_is_named_with_its_sample(bad: float, where: int) -> None:
    feeds = [{"x": np.linspace(-3, 3, 2000, dtype=np.float32).reshape(1, -1)} for _ in range(3)]
    feeds[2]["x"][0, where] = bad
    with pytest.raises(DataError, match=r"'y'.*sample 2"):
        collect_ranges(_add_one(), ["y", "r"], feeds)


def test_empty_tensors_count_no_values() -> None:
    feeds = [{"x": np.full((2, 3), v, np.float32)} for v in (-2.0, 4.0)]
    feeds.insert(1, {"x": np.zeros((0, 3), np.float32)})
    cal = collect_ranges(_add_one(), ["x", "y", "r"], feeds)
    assert (cal["y"].range.rmin, cal["y"].range.rmax) == (-1.0, 5.0)
    assert (cal["r"].range.rmin, cal["r"].range.rmax) == (0.0, 5.0)
    assert cal["y"].num_values == 12 and cal["y"].num_updates == 3


@pytest.mark.parametrize(("dtype", "np_dtype"), [(TensorProto.FLOAT16, np.float16), (TensorProto.DOUBLE, np.float64)])
def test_other_float_types_reduce_in_graph(monkeypatch: pytest.MonkeyPatch, dtype: int, np_dtype: type) -> None:
    monkeypatch.setattr(collector, "observe", lambda *a, **k: pytest.fail("took the fetch path"))
    rng = np.random.default_rng(1)
    feeds = [{"x": (rng.standard_normal((4, 5)) * 3).astype(np_dtype)} for _ in range(3)]
    cal = collect_ranges(_add_one(dtype), ["x", "y", "r"], feeds)
    x = np.concatenate([f["x"] for f in feeds])
    y = (x + np_dtype(1)).astype(np.float64)
    assert (cal["x"].range.rmin, cal["x"].range.rmax) == (float(x.min()), float(x.max()))
    assert (cal["y"].range.rmin, cal["y"].range.rmax) == (y.min(), y.max())
    assert (cal["r"].range.rmin, cal["r"].range.rmax) == (max(y.min(), 0.0), y.max())


def test_unloadable_reductions_fall_back_to_fetching(monkeypatch: pytest.MonkeyPatch) -> None:
    real = collector.calibration_session
    calls: list[int] = []

    @contextmanager
    def refuse_reductions(model, additions, **kwargs):
        calls.append(len(additions.nodes))
        if additions.nodes:
            raise ModelError("no kernel for the reductions")
        with real(model, additions, **kwargs) as sess:
            yield sess

    model = onnx.parser.parse_model(CHAIN)
    feeds = _chain_feeds(3)
    expected = _summary(collect_ranges(model, CHAIN_NAMES, feeds, robust_percentile=99.99))
    monkeypatch.setattr(collector, "calibration_session", refuse_reductions)
    got = _summary(collect_ranges(model, CHAIN_NAMES, iter(feeds), robust_percentile=99.99))  # one-shot data
    assert calls[0] > 0 and calls[1] == 0
    assert got == expected


@pytest.mark.parametrize("runs", ["1", "3"])
def test_overflowing_sentinel_is_confirmed_once_then_zeroed(runs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Legitimate huge values (a finfo.min mask): the sentinel sum overflows while min/max stay finite.  The tensor is
    fetched once to rule out NaN, the session is rebuilt with the x*0 sentinel for it, and the ranges stay exact.
    With 3 runs at once, the samples read ahead for the replaced session are run again by the new one."""
    monkeypatch.setenv("QGRAPH_THREADS", runs)
    real = collector.calibration_session
    sessions: list[str] = []

    @contextmanager
    def spy(model, additions, **kwargs):
        ops = {n.op_type for n in additions.nodes}
        sessions.append("fetch" if not additions.nodes else ("zeroed" if "Mul" in ops else "sum"))
        with real(model, additions, **kwargs) as sess:
            yield sess

    monkeypatch.setattr(collector, "calibration_session", spy)
    big = np.finfo(np.float32).max * 0.75  # two of them overflow a float32 sum
    feeds = [{"x": np.array([[v, -1.0, big, big]], np.float32)} for v in (0.5, -3.0, 2.0, 7.0)]
    cal = collect_ranges(_add_one(), ["x", "y"], feeds)
    assert sessions == ["sum", "fetch", "zeroed"]  # no second confirmation for the later samples
    x = np.concatenate([f["x"] for f in feeds]).astype(np.float64)
    y = (np.concatenate([f["x"] for f in feeds]) + np.float32(1)).astype(np.float64)
    assert (cal["x"].range.rmin, cal["x"].range.rmax) == (x.min(), x.max())
    assert (cal["y"].range.rmin, cal["y"].range.rmax) == (y.min(), y.max())
    assert cal["x"].num_values == 16 and cal["x"].num_updates == 4
    feeds[3]["x"][0, 1] = np.nan  # and NaN after the rebuild is still caught by the zeroed sentinel
    with pytest.raises(DataError, match=r"'x'.*sample 3"):
        collect_ranges(_add_one(), ["x", "y"], feeds)


def test_models_below_opset_11_take_the_fetch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _add_one()
    model.opset_import[0].version = 10
    monkeypatch.setattr(collector, "_collect_in_graph", lambda *a, **k: pytest.fail("reductions need opset 11"))
    feeds = [{"x": np.array([[-2.0, 3.5]], np.float32)}, {"x": np.array([[0.25, -4.0]], np.float32)}]
    cal = collect_ranges(model, ["x", "y", "r"], feeds)
    assert {n: (c.range.rmin, c.range.rmax) for n, c in cal.items()} == {
        "x": (-4.0, 3.5), "y": (-3.0, 4.5), "r": (0.0, 4.5)
    }


def test_names_the_model_already_uses_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model holding initializers named like the reductions' (``qgraph_calib/extremes``, its shared constant
    ``qgraph_calib/one``) is still reduced in the graph, to the same ranges: the reductions take a free namespace
    (`qgraph.graph.ProtoNames.prefix`). Initializers are names too: the check once looked at node outputs only."""
    model = onnx.parser.parse_model(CHAIN)
    feeds = _chain_feeds(3)
    clean = _summary(collect_ranges(model, CHAIN_NAMES, feeds, robust_percentile=99.99))
    squatted = onnx.ModelProto()
    squatted.CopyFrom(model)
    squatted.graph.initializer.extend(numpy_helper.from_array(np.array([7.0], np.float32), f"qgraph_calib/{k}")
                                      for k in ("extremes", "scalars", "one", "sizes", "subsamples", "0/min"))
    monkeypatch.setattr(collector, "observe", lambda *a, **k: pytest.fail("took the fetch path"))
    assert _summary(collect_ranges(squatted, CHAIN_NAMES, feeds, robust_percentile=99.99)) == clean
