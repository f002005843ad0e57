"""Layer statistics on calibration data: in-graph channel means and sampled im2col rows."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qgraph.runtime.layer_data import RowSpec, channel_means, sample_inputs
from qgraph.testing.names import occupied
from qgraph.testing.runtime import run_ort


def _conv(strides: list[int], pads: list[int], dilations: list[int], group: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (6, 6 // group, 3, 2)).astype(np.float32)
    b = rng.normal(0, 1, 6).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=strides, pads=pads, dilations=dilations,
                            group=group)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(("strides", "pads", "dilations", "group"),
                         [([1, 1], [0, 0, 0, 0], [1, 1], 1), ([2, 1], [1, 0, 2, 1], [1, 2], 2),
                          ([1, 2], [1, 1, 1, 1], [2, 1], 6)])
def test_im2col_rows_reproduce_the_convolution(strides: list[int], pads: list[int], dilations: list[int],
                                               group: int) -> None:
    model = _conv(strides, pads, dilations, group)
    w = numpy_helper.to_array(model.graph.initializer[0])
    b = numpy_helper.to_array(model.graph.initializer[1])
    feeds = [{"x": np.random.default_rng(i).normal(0, 1, (1, 6, 9, 8)).astype(np.float32)} for i in range(3)]
    spec = RowSpec("x", w[0].size, groups=group, kernel=(3, 2), strides=tuple(strides), dilations=tuple(dilations),
                   pads=tuple(pads))
    (rows,) = sample_inputs(model, [spec], feeds, max_rows=10_000)
    y = np.concatenate([run_ort(model, f, "disable")[0] for f in feeds])  # (3, 6, oh, ow)
    per_group = 6 // group
    got = np.concatenate([rows[g] @ w[g * per_group:(g + 1) * per_group].reshape(per_group, -1).T
                          for g in range(group)], axis=1) + b
    assert rows.shape[1] == y.shape[0] * y.shape[2] * y.shape[3]  # every position sampled once
    expected = np.sort(y.transpose(1, 0, 2, 3).reshape(6, -1), axis=1)
    np.testing.assert_allclose(np.sort(got.T, axis=1), expected, rtol=1e-4, atol=1e-4)


def test_reservoir_keeps_at_most_max_rows_and_channel_means_match_numpy() -> None:
    model = _conv([1, 1], [1, 1, 1, 1], [1, 1], 1)
    feeds = [{"x": np.random.default_rng(i).normal(0, 1, (2, 6, 9, 8)).astype(np.float32)} for i in range(4)]
    (rows,) = sample_inputs(model, [RowSpec("x", 36, kernel=(3, 2), strides=(1, 1), dilations=(1, 1),
                                            pads=(1, 1, 1, 1))], feeds, max_rows=50)
    assert rows.shape == (1, 50, 36)
    means = channel_means(model, {"y": (6, True)}, feeds)["y"]
    y = np.concatenate([run_ort(model, f, "disable")[0] for f in feeds])
    np.testing.assert_allclose(means, y.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_a_tensor_counted_by_another_gets_the_same_means_from_fewer_nodes() -> None:
    """``same_rows``: a tensor's rows come from another's count (batches of different sizes weigh the same); the
    means are bit for bit those counted on their own, with its Size and Reshape nodes gone."""
    from qgraph.runtime.layer_data import ChannelMeans

    model = _conv([1, 1], [0, 0, 0, 0], [1, 1], 1)
    model.graph.node.append(helper.make_node("Relu", ["y"], ["y_relu"]))
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.normal(0, 1, (n, 6, 5, 5)).astype(np.float32)} for n in (1, 3, 2)]
    tensors = {"y": (6, True), "y_relu": (6, True)}
    alone, shared = ChannelMeans(model, tensors), ChannelMeans(model, tensors, same_rows={"y_relu": "y"})
    for name, value in alone(feeds).items():
        assert np.array_equal(shared(feeds)[name], value), name
    assert alone.run.nodes - shared.run.nodes == 2  # y_relu's Size and Reshape


def test_channel_means_of_a_long_graph_run_in_slices_give_the_same_values(monkeypatch: pytest.MonkeyPatch,
                                                                           request: pytest.FixtureRequest) -> None:
    from qgraph.runtime import channel_means as layer_means
    from qgraph.runtime import segments
    from qgraph.testing import matmul_add_relu_chain

    model = matmul_add_relu_chain(12, batch="N")
    feeds = [{"input": np.random.default_rng(i).normal(0, 1, (3, 16)).astype(np.float32)} for i in range(4)]
    tensors = {f"layer{i}/add_out": (16, False) for i in range(0, 12, 3)}
    whole = channel_means(model, tensors, feeds)
    monkeypatch.setattr(segments, "SEGMENT_THRESHOLD", 10)
    monkeypatch.setattr(layer_means, "SLICE_ABOVE", 10)
    monkeypatch.setattr(layer_means, "SLICE_NODES", 8)
    created = request.getfixturevalue("created_sessions")  # counted from here on, not the whole run's
    sliced = channel_means(model, tensors, feeds)
    # every slice gets one session for all four batches: more than one session, fewer than one per batch and slice
    assert 1 < len(created) <= (36 + 4 * 8) // 8 + 1
    for name in tensors:
        assert np.array_equal(sliced[name], whole[name]), name  # the same kernels, the same bits


def test_names_the_model_already_uses_are_not_taken() -> None:
    """A model that already holds tensors named like the helper nodes (``qgraph_layer/0/mean``) gets the same
    means: the helpers move to a free namespace."""
    model = _conv([1, 1], [0, 0, 0, 0], [1, 1], 1)
    feed = {"x": np.random.default_rng(3).normal(0, 1, (1, 6, 5, 5)).astype(np.float32)}
    old = [f"qgraph_layer/0/{t}" for t in ("shape", "flat", "axes", "mean", "size")]
    old += ["qgraph_layer/one", "qgraph_layer/means", "qgraph_layer/sizes"]
    clean, squatted = (channel_means(m, {"y": (6, True)}, [feed]) for m in (model, occupied(model, old)))
    np.testing.assert_array_equal(squatted["y"], clean["y"])
    (y,) = run_ort(model, feed, "disable")
    np.testing.assert_allclose(clean["y"], y.astype(np.float64).mean(axis=(0, 2, 3)), rtol=1e-5)


def test_constant_only_nodes_move_right_before_their_first_reader() -> None:
    """`sink_constants`: an export lists the weights' and biases' DequantizeLinear first; each moves right before
    the node that first reads it (a node reading the data input does not move), every computed node keeps its
    order, and the graph computes the same."""
    from qgraph.runtime.segments import sink_constants

    rng = np.random.default_rng(0)
    nodes, inits, dqs = [], [], []
    for i in range(3):
        inits += [numpy_helper.from_array(rng.integers(-5, 5, (4, 4)).astype(np.int8), f"w{i}"),
                  numpy_helper.from_array(np.array(0.1, np.float32), f"s{i}"),
                  numpy_helper.from_array(rng.integers(-9, 9, 4).astype(np.int32), f"b{i}")]
        dqs.append(helper.make_node("DequantizeLinear", [f"w{i}", f"s{i}"], [f"wf{i}"], name=f"dqw{i}"))
        dqs.append(helper.make_node("DequantizeLinear", [f"b{i}", f"s{i}"], [f"bf{i}"], name=f"dqb{i}"))
        prev = "x" if i == 0 else f"y{i - 1}"
        nodes += [helper.make_node("MatMul", [prev, f"wf{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"bf{i}"], [f"y{i}"], name=f"add{i}")]
    relu = helper.make_node("Relu", ["x"], ["r"], name="relu")  # reads only the data input: computed, stays
    graph = helper.make_graph([relu, *dqs, *nodes], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, [2, 4]),
                               helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [2, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    sunk = onnx.ModelProto()
    sunk.CopyFrom(model)
    sink_constants(sunk)
    order = [n.name for n in sunk.graph.node]
    assert order == ["relu", "dqw0", "mm0", "dqb0", "add0", "dqw1", "mm1", "dqb1", "add1", "dqw2", "mm2", "dqb2",
                     "add2"]
    feed = {"x": rng.normal(0, 1, (2, 4)).astype(np.float32)}
    onnx.checker.check_model(sunk)
    for a, b in zip(run_ort(model, feed, "disable"), run_ort(sunk, feed, "disable"), strict=True):
        assert np.array_equal(a, b)
