"""The shared model corpus for qgraph's tests and benchmarks (public API).

* real architecture graphs from the onnx wheel with seeded realistic weights:
  :func:`light_model_path`, :func:`materialize_light_model`, :func:`cached_light_model`;
* synthetic graphs: :func:`conv_bn_relu_chain`, :func:`matmul_add_relu_chain`, :func:`conv_bn_net`,
  :func:`mobilenet_v2`, :func:`offset_conv_bn_chain` (float32 noise above 1e-5 relative: ``--verify`` tests),
  :func:`transformer_encoder` (+ :func:`transformer_encoder_inputs`),
  :func:`mode_switched_net`, :func:`level_switched_net` (compute in If branches chosen by an input; + their
  ``*_feeds``);
* a detector's joined output: :func:`detection_head` (boxes and class scores in one output through a final
  Concat, as YOLOv8's ``output0``; + :func:`detection_feeds`);
* recurrent: :func:`leaky_state_net` (a leaky integrator whose error grows through its state; :data:`LEAKY_STATE`
  its feedback, :func:`leaky_feeds` data recorded by streaming it);
* running them: :func:`random_feeds`, :func:`run_ort`.

Every model built here sets its IR version explicitly (the one matching its opset, at most 10), passes
``onnx.checker.check_model(full_check=True)`` and runs in onnxruntime. Nothing is downloaded; every
output is a deterministic function of its arguments (``seed``).
"""

from __future__ import annotations

from qgraph.testing._common import ir_version_for_opset
from qgraph.testing.control_flow import level_feeds, level_switched_net, mode_feeds, mode_switched_net
from qgraph.testing.depthwise import depthwise_feeds, depthwise_float_and_qdq, depthwise_net
from qgraph.testing.detection import detection_feeds, detection_head
from qgraph.testing.light import (
    LIGHT_MODEL_NAMES,
    cached_light_model,
    light_model_path,
    materialize_light_model,
)
from qgraph.testing.mobilenet import mobilenet_v2
from qgraph.testing.recurrent import LEAKY_STATE, leaky_feeds, leaky_state_net
from qgraph.testing.runtime import (
    graph_inputs,
    make_session,
    ort_quantize_static,
    output_sqnr_db,
    random_feeds,
    run_ort,
    run_target,
    target_session,
)
from qgraph.testing.synthetic import (
    conv_bn_net,
    conv_bn_relu_chain,
    fragile_resnet,
    matmul_add_relu_chain,
    offset_conv_bn_chain,
)
from qgraph.testing.transformer import transformer_encoder, transformer_encoder_inputs

__all__ = [
    "LEAKY_STATE",
    "LIGHT_MODEL_NAMES",
    "cached_light_model",
    "conv_bn_net",
    "conv_bn_relu_chain",
    "depthwise_feeds",
    "depthwise_float_and_qdq",
    "depthwise_net",
    "detection_feeds",
    "detection_head",
    "fragile_resnet",
    "graph_inputs",
    "ir_version_for_opset",
    "leaky_feeds",
    "leaky_state_net",
    "level_feeds",
    "level_switched_net",
    "light_model_path",
    "make_session",
    "materialize_light_model",
    "matmul_add_relu_chain",
    "mobilenet_v2",
    "mode_feeds",
    "mode_switched_net",
    "offset_conv_bn_chain",
    "ort_quantize_static",
    "output_sqnr_db",
    "random_feeds",
    "run_ort",
    "run_target",
    "target_session",
    "transformer_encoder",
    "transformer_encoder_inputs",
]
