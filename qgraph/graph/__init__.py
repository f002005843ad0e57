"""The graph layer every pass uses: one handle on the model, graph operations, checks.

- `GraphHandle` (``handle``): the onnx-graphsurgeon graph to rewrite (``handle.graph``), a name index over the top
  graph (``handle.index``: producers, consumers, nodes, tensors) and a networkx view (``handle.nx``), both built
  once per change in O(N) and rebuilt when stale; shapes after inference (``handle.shapes()``, cached); unique
  names across every scope (``handle.unique_name``); scopes (``handle.scopes()``); Kahn toposort; export with
  provenance tags. The pipeline tags every node a pass creates with the pass's name.
- Graph operations (``ops``), O(what they touch) and valid in any scope: `const_value`, `set_const`,
  `producer`, `consumers`, `redirect` (replace every use of a tensor), `renew_const`, `detach`, `unlink`, `rebuild`,
  `graph_scopes`, `node_subgraphs`, `dependencies`, `pinned_tensors`, `topological_order`, `tensor_shape`,
  `tensor_dtype`.
- Node names (``naming``): the one rule that names unnamed nodes ``<OpType>(<first output>)`` and numbers repeated
  names (``add1#2``), applied on load (``handle.naming``) and by `proto_node_names` / `named_model` for protos.
- Fresh names (``fresh``): one rule (``base``, ``base_1``, ...) for every generated name; `GraphHandle.unique_name`
  on the graphsurgeon graph, `ProtoNames` / `fresh_name` on a ``ModelProto`` (every scope, linear time).
- Checks (``checks``): `check_model` on every input model, `check_structure` after every pass.
- Convolution affine steps (``conv_affine``): `affine_step`, `conv_params`, `set_conv_params`, `fold_after_conv`
  (what ``fuse_affine`` and ``fuse_bias`` fold).
- `NoMatch` (``match``): how a pass says "this pattern does not apply here, because ..." (the one refusal).
"""

from __future__ import annotations

from .checks import (
    check_acyclic,
    check_input_structure,
    check_model,
    check_structure,
    check_unique_names,
    cycle_message,
)
from .conv_affine import AFFINE_OPS, AffineFold, affine_step, conv_params, fold_after_conv, set_conv_params
from .detach import placeholders_as_inputs
from .fresh import ProtoNames, free_name, fresh_name, model_names
from .handle import TAG_PREFIX, GraphHandle, GraphIndex, describe
from .match import NoMatch, channel_vector
from .naming import (
    Naming,
    gs_label,
    name_graph,
    named_model,
    named_nodes,
    node_label,
    proto_label,
    proto_node_names,
    unique_names,
)
from .ops import (
    DEFAULT_DOMAINS,
    Inferred,
    Shape,
    const_dtype,
    const_value,
    constant_node_value,
    consumers,
    dependencies,
    detach,
    graph_scopes,
    insert_after_producers,
    is_default_domain,
    is_topological,
    node_subgraphs,
    onnx_type_name,
    outer_inputs,
    pinned_tensors,
    producer,
    proto_scopes,
    proto_subgraphs,
    rebuild,
    redirect,
    renew_const,
    set_const,
    tensor_dtype,
    tensor_shape,
    topological_order,
    unlink,
)

__all__ = [
    "AFFINE_OPS",
    "DEFAULT_DOMAINS",
    "TAG_PREFIX",
    "AffineFold",
    "GraphHandle",
    "GraphIndex",
    "Inferred",
    "Naming",
    "NoMatch",
    "ProtoNames",
    "Shape",
    "affine_step",
    "channel_vector",
    "check_acyclic",
    "check_input_structure",
    "check_model",
    "check_structure",
    "check_unique_names",
    "const_dtype",
    "const_value",
    "constant_node_value",
    "consumers",
    "conv_params",
    "cycle_message",
    "dependencies",
    "describe",
    "detach",
    "fold_after_conv",
    "free_name",
    "fresh_name",
    "graph_scopes",
    "gs_label",
    "insert_after_producers",
    "is_default_domain",
    "is_topological",
    "model_names",
    "name_graph",
    "named_model",
    "named_nodes",
    "node_label",
    "node_subgraphs",
    "onnx_type_name",
    "outer_inputs",
    "pinned_tensors",
    "placeholders_as_inputs",
    "producer",
    "proto_label",
    "proto_node_names",
    "proto_scopes",
    "proto_subgraphs",
    "rebuild",
    "redirect",
    "renew_const",
    "set_const",
    "set_conv_params",
    "tensor_dtype",
    "tensor_shape",
    "topological_order",
    "unique_names",
    "unlink",
]
