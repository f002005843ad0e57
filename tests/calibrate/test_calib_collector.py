"""collect_ranges end to end on small onnx.helper models (static and dynamic shapes)."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qgraph.calibrate import collect_ranges, make_observer, observe
from qgraph.errors import DataError, ModelError

RNG = np.random.default_rng(5)
W1 = (RNG.standard_normal((8, 16)) * 0.4).astype(np.float32)
B1 = (RNG.standard_normal(16) * 0.1).astype(np.float32)
W2 = (RNG.standard_normal((16, 4)) * 0.3).astype(np.float32)
TENSORS = ["x", "h", "r", "y"]


def mlp(seq_dim: str | int = "seq", with_log: bool = False) -> onnx.ModelProto:
    """x[batch, seq, 8] -> MatMul W1 -> Add B1 (h) -> Relu (r) -> MatMul W2 (y)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m"]),
        helper.make_node("Add", ["m", "B1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq_dim, 4])]
    if with_log:
        nodes.append(helper.make_node("Log", ["h"], ["logh"]))
        outputs.append(helper.make_tensor_value_info("logh", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq_dim, 8])],
        outputs,
        [
            numpy_helper.from_array(W1, "W1"),
            numpy_helper.from_array(B1, "B1"),
            numpy_helper.from_array(W2, "W2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def ref_activations(x: np.ndarray) -> dict[str, np.ndarray]:
    h = x @ W1 + B1
    r = np.maximum(h, 0)
    return {"x": x, "h": h, "r": r, "y": r @ W2}


def var_feeds(n: int = 9) -> list[dict[str, np.ndarray]]:
    """Variable batch and sequence lengths."""
    rng = np.random.default_rng(11)
    return [{"x": (rng.standard_normal((1 + i % 3, 3 + 5 * i, 8)) * (1 + i)).astype(np.float32)} for i in range(n)]


def _concat_flat(feeds: list[dict[str, np.ndarray]], name: str) -> np.ndarray:
    return np.concatenate([ref_activations(f["x"])[name].ravel() for f in feeds])


def _order_stat(values: np.ndarray, q: float) -> float:
    """The ceil(q * N)-th smallest value: the histogram inverse CDF lies in the same bin."""
    return float(np.sort(values)[max(int(np.ceil(q * values.size)) - 1, 0)])


def test_minmax_matches_numpy_on_variable_shapes() -> None:
    feeds = var_feeds()
    calls: list[tuple[int, int | None]] = []
    cal = collect_ranges(mlp(), TENSORS, feeds, "minmax", progress=lambda d, t: calls.append((d, t)))
    assert calls == [(i + 1, len(feeds)) for i in range(len(feeds))]
    for name in TENSORS:
        ref = _concat_flat(feeds, name)
        c = cal[name]
        assert c.range.rmin == pytest.approx(float(ref.min()), rel=1e-5, abs=1e-6)
        assert c.range.rmax == pytest.approx(float(ref.max()), rel=1e-5, abs=1e-6)
        assert c.num_values == ref.size and c.num_updates == len(feeds) and c.clip_fraction == 0.0
    assert cal["r"].range.rmin == 0.0


def test_per_channel_axis() -> None:
    feeds = var_feeds(4)
    cal = collect_ranges(mlp(), ["h"], feeds, "minmax", per_channel_axes={"h": -1})
    ref = np.concatenate([ref_activations(f["x"])["h"].reshape(-1, 16) for f in feeds])
    np.testing.assert_allclose(cal["h"].range.rmax, ref.max(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cal["h"].range.rmin, ref.min(axis=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("entropy", {"num_bins": 2048, "num_levels": 128}),
        ("percentile", {"percentile": 99.9, "num_bins": 2048}),
        ("percentile", {"percentile": 99.0, "symmetric": True}),
    ],
)
def test_dynamic_sequence_histogram_methods(method: str, options: dict[str, object]) -> None:
    """Dynamic sequence axis, variable-length inputs, histogram methods."""
    feeds = var_feeds(12)
    model = mlp()
    cal = collect_ranges(model, ["h", "r", "y"], feeds, method, options=options)
    # reference: the same observers fed with activations from a separately built session
    ref_model = mlp()
    ref_model.graph.output.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("h", "r")])
    sess = ort.InferenceSession(ref_model.SerializeToString(), providers=["CPUExecutionProvider"])
    for name in ("h", "r", "y"):
        obs = make_observer(method, name, **options)
        for i, f in enumerate(feeds):
            obs.update(sess.run([name], f)[0], i)
        r = obs.compute()
        assert (cal[name].range.rmin, cal[name].range.rmax) == (r.rmin, r.rmax)
        assert cal[name].clip_fraction == obs.clip_fraction()
        flat = _concat_flat(feeds, name)
        width = cal[name].histogram.width if cal[name].histogram else 0.0
        if method == "percentile" and options.get("symmetric"):
            assert abs(cal[name].range.rmax - _order_stat(np.abs(flat), 0.99)) <= width
        elif method == "percentile":
            assert abs(cal[name].range.rmax - _order_stat(flat, 0.9995)) <= width
            assert abs(cal[name].range.rmin - _order_stat(flat, 0.0005)) <= width
        else:
            assert 0 < cal[name].range.rmax <= float(np.abs(flat).max()) + 1e-5
            assert abs(cal[name].clip_fraction - np.mean(np.abs(flat) > cal[name].range.rmax)) < 1e-3
        assert cal[name].histogram is not None and sum(cal[name].histogram.counts) == flat.size
    assert cal["r"].range.rmin == 0.0 or method == "percentile"


def test_same_ranges_for_any_batching() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((12, 6, 8)).astype(np.float32)
    singles = [{"x": x[i : i + 1]} for i in range(12)]
    sevens = [{"x": x[:7]}, {"x": x[7:]}]
    for method in ("minmax", "percentile", "entropy", "mse"):
        a = collect_ranges(mlp(), TENSORS, singles, method)
        b = collect_ranges(mlp(), TENSORS, lambda: iter(sevens), method)
        for n in TENSORS:
            assert a[n].range.rmin == pytest.approx(b[n].range.rmin, rel=1e-5, abs=1e-6)
            assert a[n].range.rmax == pytest.approx(b[n].range.rmax, rel=1e-5, abs=1e-6)


def test_external_data_path_gives_same_result_and_keeps_model() -> None:
    model = mlp()
    before = model.SerializeToString()
    feeds = var_feeds(3)
    a = collect_ranges(model, TENSORS, feeds, "entropy")
    b = collect_ranges(model, TENSORS, feeds, "entropy", large_model_bytes=0)
    assert model.SerializeToString() == before
    for n in TENSORS:
        assert (a[n].range.rmin, a[n].range.rmax) == (b[n].range.rmin, b[n].range.rmax)


def test_non_finite_activation_names_tensor_and_sample() -> None:
    feeds = var_feeds(4)
    with pytest.raises(DataError, match=r"'logh'.*sample 0"):
        collect_ranges(mlp(with_log=True), ["logh"], feeds, "minmax")  # log of negative -> NaN
    feeds[2]["x"][0, 0, 0] = np.inf
    with pytest.raises(DataError, match=r"'x'.*sample 2"):
        collect_ranges(mlp(), ["x"], feeds, "percentile")


def test_errors() -> None:
    with pytest.raises(ModelError, match="nope"):
        collect_ranges(mlp(), ["nope"], var_feeds(1))
    with pytest.raises(ModelError, match="initializer"):
        collect_ranges(mlp(), ["W1"], var_feeds(1))
    with pytest.raises(DataError, match="empty"):
        collect_ranges(mlp(), ["h"], [])
    with pytest.raises(DataError, match=r"missing: \['x'\]"):
        collect_ranges(mlp(), ["h"], [{"input": np.zeros((1, 2, 8), np.float32)}])
    with pytest.raises(DataError, match=r"sample 0.*onnxruntime"):
        collect_ranges(mlp(), ["h"], [{"x": np.zeros((1, 2, 5), np.float32)}])
    with pytest.raises(ValueError, match="unknown calibration method"):
        collect_ranges(mlp(), ["h"], var_feeds(1), "kl")


def test_unloaded_external_data_is_a_model_error() -> None:
    model = mlp()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    entry = w.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    with pytest.raises(ModelError, match="external data that is not loaded"):
        collect_ranges(model, ["h"], var_feeds(1), large_model_bytes=0)


def test_data_hasher_and_mixed_observers() -> None:
    feeds = var_feeds(3)
    h = hashlib.sha256()
    observers = {"h": make_observer("minmax", "h"), "y": make_observer("entropy", "y")}
    assert observe(mlp(), observers, feeds, data_hasher=h) == 3
    ref = hashlib.sha256()
    for f in feeds:
        arr = np.ascontiguousarray(f["x"])
        ref.update(f"x:{arr.dtype}:{arr.shape};".encode())
        ref.update(arr.tobytes())
    assert h.hexdigest() == ref.hexdigest()
    assert observers["y"].num_updates == 3


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_extra_observers_ride_the_same_pass_and_leave_the_main_results_alone(method: str) -> None:
    feeds = var_feeds(4)
    passes: list[int] = []
    side = {"h": make_observer("minmax", "h", -1), "m": make_observer("minmax", "m", -1)}
    cal = collect_ranges(mlp(), ["h", "y"], feeds, method, extra=side,
                         progress=lambda d, t: passes.append(d))
    assert passes == [1, 2, 3, 4]  # one pass over the data
    plain = collect_ranges(mlp(), ["h", "y"], feeds, method)
    for name in ("h", "y"):
        assert cal[name].range.rmin == pytest.approx(plain[name].range.rmin, rel=1e-6, abs=1e-7)
        assert cal[name].range.rmax == pytest.approx(plain[name].range.rmax, rel=1e-6, abs=1e-7)
    ref = np.concatenate([ref_activations(f["x"])["h"].reshape(-1, 16) for f in feeds])
    np.testing.assert_allclose(side["h"].observed().rmax, ref.max(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(side["h"].observed().rmin, ref.min(axis=0), rtol=1e-5, atol=1e-6)
    assert side["m"].num_updates == 4  # a tensor only the extra observers asked for
