"""Test and benchmark support: the shared model corpus (see :mod:`qgraph.testing.models`)."""

from __future__ import annotations

from qgraph.testing.models import (
    LIGHT_MODEL_NAMES,
    cached_light_model,
    conv_bn_net,
    conv_bn_relu_chain,
    graph_inputs,
    ir_version_for_opset,
    light_model_path,
    make_session,
    materialize_light_model,
    matmul_add_relu_chain,
    random_feeds,
    run_ort,
    transformer_encoder,
    transformer_encoder_inputs,
)

__all__ = [
    "LIGHT_MODEL_NAMES",
    "cached_light_model",
    "conv_bn_net",
    "conv_bn_relu_chain",
    "graph_inputs",
    "ir_version_for_opset",
    "light_model_path",
    "make_session",
    "materialize_light_model",
    "matmul_add_relu_chain",
    "random_feeds",
    "run_ort",
    "transformer_encoder",
    "transformer_encoder_inputs",
]
