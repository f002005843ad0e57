"""A YOLO-style detection head whose one output joins boxes (0..320 px) and class scores (0..1) with a Concat."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Names of the two tensors `detection_head`'s final Concat joins (boxes first, then the class scores).
BOXES, SCORES = "boxes", "scores"


def detection_head(seed: int = 0, size: int = 8, classes: int = 18, channels: int = 16,
                   batch: int | str = 1) -> onnx.ModelProto:
    """``output0 [batch, 4 + classes, size²] = Concat(axis=1)(boxes, scores)``, as YOLOv8's ``output0``.

    A stem ``Conv 3x3 → Relu`` on an image ``[batch, 3, size, size]``, then two 1x1 Conv heads: box regressions
    ``320 · Sigmoid(Conv)`` (0..320 px) and class scores ``Sigmoid(Conv)`` with logits around -8..0 (most scores
    near 0, a few up to ~0.5), each reshaped to ``[batch, C, size²]`` and joined on axis 1. The boxes carry ~10^5
    times the scores' signal power, so the whole output's SQNR is the boxes' (`qgraph.runtime.output_parts`). Opset
    17."""
    rng = np.random.default_rng(seed)
    anchors = size * size
    w0 = (rng.standard_normal((channels, 3, 3, 3)) * np.sqrt(2 / 27)).astype(np.float32)
    b0 = rng.normal(0.1, 0.1, channels).astype(np.float32)
    wb = (rng.standard_normal((4, channels, 1, 1)) * 0.4).astype(np.float32)
    wc = (rng.standard_normal((classes, channels, 1, 1)) * 0.8).astype(np.float32)
    bc = rng.uniform(-6.0, -3.0, classes).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["images", "w0", "b0"], ["stem"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["stem"], ["feat"], name="stem/relu"),
        helper.make_node("Conv", ["feat", "wb"], ["box_logit"], name="box_conv"),
        helper.make_node("Sigmoid", ["box_logit"], ["box_unit"], name="box_sigmoid"),
        helper.make_node("Mul", ["box_unit", "stride"], ["box_px"], name="box_scale"),
        helper.make_node("Reshape", ["box_px", "box_shape"], [BOXES], name="box_reshape"),
        helper.make_node("Conv", ["feat", "wc", "bc"], ["cls_logit"], name="cls_conv"),
        helper.make_node("Sigmoid", ["cls_logit"], ["cls_prob"], name="cls_sigmoid"),
        helper.make_node("Reshape", ["cls_prob", "cls_shape"], [SCORES], name="cls_reshape"),
        helper.make_node("Concat", [BOXES, SCORES], ["output0"], name="head_concat", axis=1),
    ]
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("w0", w0), ("b0", b0), ("wb", wb), ("wc", wc), ("bc", bc), ("stride", np.array(320.0, np.float32)),
        ("box_shape", np.array([-1 if isinstance(batch, str) else batch, 4, anchors], np.int64)),
        ("cls_shape", np.array([-1 if isinstance(batch, str) else batch, classes, anchors], np.int64)))]
    graph = helper.make_graph(
        nodes, "detection_head", [helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [batch, 4 + classes, anchors])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def detection_feeds(n: int, seed: int = 1, size: int = 8) -> list[dict[str, np.ndarray]]:
    """``n`` images ``[1, 3, size, size]`` of `detection_head` (uniform 0..1, as normalized pixels)."""
    rng = np.random.default_rng(seed)
    return [{"images": rng.uniform(0, 1, (1, 3, size, size)).astype(np.float32)} for _ in range(n)]
