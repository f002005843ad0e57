"""`qgraph.runtime.row_means`: layers' mean input rows against im2col in numpy, on every path (box sums, strided
slices, the one-hot bank, matrices), and the bias-correction identity they serve."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from qgraph.runtime.compare import make_session
from qgraph.runtime.row_means import conv_rows, matrix_rows, row_means


def _conv_model(cin: int, cout: int, kernel: tuple[int, ...], attrs: dict[str, Any], opset: int = 17,
                weight: np.ndarray | None = None) -> onnx.ModelProto:
    """x -> Relu -> r -> Conv(w) -> y: the rows are read from an inner tensor, as in a real graph."""
    group = int(attrs.get("group", 1))
    w = weight if weight is not None else np.random.default_rng(0).normal(
        size=(cout, cin // group, *kernel)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Conv", ["r", "w"], ["y"], kernel_shape=list(kernel), **attrs)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _pads(size: tuple[int, ...], kernel: tuple[int, ...], strides: list[int], dilations: list[int],
          attrs: dict[str, Any]) -> list[int]:
    nd = len(kernel)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        return list(attrs.get("pads", [0] * 2 * nd))
    if auto_pad == "VALID":
        return [0] * 2 * nd
    begin, end = [], []
    for i in range(nd):
        total = max((math.ceil(size[i] / strides[i]) - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size[i],
                    0)
        small = total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else total - small)
        end.append(total - begin[-1])
    return begin + end


def _im2col_mean(feeds: list[dict[str, np.ndarray]], kernel: tuple[int, ...], attrs: dict[str, Any]) -> np.ndarray:
    """The mean receptive field ``(C_in, *kernel)`` flattened, by explicit slicing of the padded input."""
    nd = len(kernel)
    strides = list(attrs.get("strides", [1] * nd))
    dilations = list(attrs.get("dilations", [1] * nd))
    total: np.ndarray | None = None
    count = 0
    for feed in feeds:
        x = np.maximum(feed["x"].astype(np.float64), 0)
        pads = _pads(x.shape[2:], kernel, strides, dilations, attrs)
        xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[nd + i]) for i in range(nd)])
        out = [(xp.shape[2 + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
        sums = np.zeros((x.shape[1], *kernel))
        for offset in np.ndindex(*kernel):
            index = tuple(slice(o * d, o * d + s * (n - 1) + 1, s)
                          for o, d, s, n in zip(offset, dilations, strides, out, strict=True))
            sums[(slice(None), *offset)] = xp[(slice(None), slice(None), *index)].sum(axis=(0, *range(2, 2 + nd)))
        total = sums if total is None else total + sums
        count += x.shape[0] * int(np.prod(out))
    assert total is not None
    return (total / count).reshape(-1)


GEOMETRIES = [  # (kernel, attrs): box sums (stride 1), strided slices, the bank (SAME), pixelwise
    ((3, 3), {"pads": [1, 1, 1, 1]}),
    ((3, 3), {}),
    ((3, 3), {"dilations": [2, 1], "pads": [2, 0, 1, 3]}),
    ((5,), {"pads": [4, 1]}),
    ((2, 3), {"pads": [0, 2, 1, 0], "group": 2}),
    ((3, 3), {"strides": [2, 2], "pads": [1, 0, 2, 1]}),
    ((3, 1), {"strides": [1, 2], "pads": [1, 0, 1, 0]}),
    ((3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((2, 2), {"auto_pad": "SAME_LOWER"}),
    ((1, 1), {}),
    ((1, 1), {"strides": [2, 2]}),
    ((3, 3), {"auto_pad": "VALID"}),
]


@pytest.mark.parametrize(("kernel", "attrs"), GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_conv_rows_are_the_mean_im2col_row_over_batches_of_other_sizes(kernel: tuple[int, ...],
                                                                      attrs: dict[str, Any]) -> None:
    rng = np.random.default_rng(3)
    nd = len(kernel)
    sizes = [(1, 9), (2, 7), (1, 12)] if nd == 2 else [(1, 11), (3, 6)]
    feeds = [{"x": rng.normal(size=(n, 4, *([h] * nd))).astype(np.float32)} for n, h in sizes]
    model = _conv_model(4, 6, kernel, attrs)
    (got,) = row_means(model, [conv_rows("r", 4, kernel, attrs)], feeds)
    want = _im2col_mean(feeds, kernel, attrs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset", [11, 12])
def test_older_opsets_take_the_slices_or_the_bank_with_the_same_rows(opset: int) -> None:
    kernel, attrs = (3, 3), {"pads": [1, 2, 0, 1], "dilations": [1, 2]}
    feeds = [{"x": np.random.default_rng(opset).normal(size=(2, 4, 8, 9)).astype(np.float32)}]
    (got,) = row_means(_conv_model(4, 6, kernel, attrs, opset=opset), [conv_rows("r", 4, kernel, attrs)], feeds)
    np.testing.assert_allclose(got, _im2col_mean(feeds, kernel, attrs), rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 4), d=st.integers(1, 3), pb=st.integers(0, 3), pe=st.integers(0, 3),
       size=st.integers(1, 9), stride=st.integers(1, 2))
def test_every_1d_geometry_that_onnxruntime_accepts(k: int, d: int, pb: int, pe: int, size: int,
                                                    stride: int) -> None:
    if size + pb + pe - d * (k - 1) < 1:  # no output position: the layer itself cannot run
        return
    attrs = {"pads": [pb, pe], "dilations": [d], "strides": [stride]}
    feeds = [{"x": np.random.default_rng(size).normal(size=(2, 3, size)).astype(np.float32)}]
    (got,) = row_means(_conv_model(3, 2, (k,), attrs), [conv_rows("r", 3, (k,), attrs)], feeds)
    np.testing.assert_allclose(got, _im2col_mean(feeds, (k,), attrs), rtol=1e-5, atol=1e-6)


def test_the_mean_output_of_a_conv_is_its_weight_times_the_mean_row() -> None:
    """What bias correction relies on: E[conv(x, W)] per channel = W rows · mean row, groups included."""
    kernel, attrs = (3, 3), {"pads": [1, 0, 1, 2], "group": 2, "strides": [2, 1]}
    w = np.random.default_rng(5).normal(size=(6, 2, *kernel)).astype(np.float32)
    model = _conv_model(4, 6, kernel, attrs, weight=w)
    feeds = [{"x": np.random.default_rng(n).normal(size=(n, 4, 10, 8)).astype(np.float32)} for n in (1, 3)]
    (row,) = row_means(model, [conv_rows("r", 4, kernel, attrs)], feeds)
    session = make_session(model)
    outs = [session.run(None, f)[0].astype(np.float64) for f in feeds]
    rows_total = sum(o.shape[0] * o.shape[2] * o.shape[3] for o in outs)
    want = sum(o.sum(axis=(0, 2, 3)) for o in outs) / rows_total
    by_group = np.einsum("gck,gk->gc", w.reshape(2, 3, -1).astype(np.float64), row.reshape(2, -1)).reshape(-1)
    np.testing.assert_allclose(by_group, want, rtol=1e-5, atol=1e-6)


def test_matrix_rows_and_a_transposed_gemm_input() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Relu", ["a"], ["ra"])]
    graph = helper.make_graph(nodes, "g", [x, a], [helper.make_tensor_value_info("r", TensorProto.FLOAT, None),
                                                    helper.make_tensor_value_info("ra", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.normal(size=(b, t, 5)).astype(np.float32), "a": rng.normal(size=(5, m)).astype(np.float32)}
             for b, t, m in ((1, 7, 3), (2, 3, 9))]
    sources = [matrix_rows("r", 5), matrix_rows("ra", 5, transposed=True), matrix_rows("r", 5)]
    rows, cols, again = row_means(model, sources, feeds)
    relu = [{k: np.maximum(v.astype(np.float64), 0) for k, v in f.items()} for f in feeds]
    np.testing.assert_allclose(rows, np.concatenate([f["x"].reshape(-1, 5) for f in relu]).mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(cols, np.concatenate([f["a"].T for f in relu]).mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(again, rows)  # measured once, handed to both


def test_a_long_graph_run_in_slices_gives_the_same_rows(monkeypatch: pytest.MonkeyPatch,
                                                        request: pytest.FixtureRequest) -> None:
    """Sliced runs (`qgraph.runtime.channel_means.SLICE_ABOVE`) carry the box sums and their in-graph counts
    through every slice: the same rows, bit for bit, as one session."""
    from qgraph.runtime import channel_means, segments

    rng = np.random.default_rng(4)
    nodes, inits, sources = [], [], []
    x = "x"
    for i in range(6):
        kernel, attrs = ((3, 3), {"pads": [1, 1, 1, 1]}) if i % 2 == 0 else ((3, 3), {"strides": [2, 2]})
        inits.append(numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, *kernel)).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Relu", [x], [f"r{i}"]),
                  helper.make_node("Conv", [f"r{i}", f"w{i}"], [f"y{i}"], kernel_shape=list(kernel), **attrs)]
        sources.append(conv_rows(f"r{i}", 4, kernel, attrs))
        x = f"y{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [{"x": rng.normal(size=(n, 4, 70, 70)).astype(np.float32)} for n in (1, 2)]
    whole = row_means(model, sources, feeds)
    monkeypatch.setattr(segments, "SEGMENT_THRESHOLD", 10)
    monkeypatch.setattr(channel_means, "SLICE_ABOVE", 10)
    monkeypatch.setattr(channel_means, "SLICE_NODES", 20)
    monkeypatch.setattr(channel_means, "JOIN_EVERY", 3)
    created = request.getfixturevalue("created_sessions")  # counted from here on: the sliced run's alone
    sliced = row_means(model, sources, feeds)
    assert len(created) > 2  # slices, each its own session
    for a, b in zip(whole, sliced, strict=True):
        np.testing.assert_array_equal(a, b)
    layer0 = _im2col_mean(feeds, (3, 3), {"pads": [1, 1, 1, 1]})  # the first layer's input is x's Relu
    np.testing.assert_allclose(whole[0], layer0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("kernel", "attrs"), [((3, 3), {"pads": [1, 1, 1, 1]}), ((3, 3), {"strides": [2, 2]}),
                                               ((1, 1), {})])
def test_nan_in_a_layer_input_is_a_data_error_that_names_it(kernel: tuple[int, ...], attrs: dict[str, Any]) -> None:
    from qgraph.errors import DataError

    x = np.random.default_rng(0).normal(size=(1, 4, 8, 8)).astype(np.float32)
    x[0, 1, 4, 4] = np.nan
    with pytest.raises(DataError, match="layer input 'r' holds NaN/Inf on the calibration data"):
        row_means(_conv_model(4, 6, kernel, attrs), [conv_rows("r", 4, kernel, attrs)], [{"x": x}])
