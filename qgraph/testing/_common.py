"""Small building blocks shared by the model factories in :mod:`qgraph.testing`.

Everything here writes protobuf fields directly (no ``make_model``/``make_graph`` copies) so that the
factories stay linear in the size of the graph they build.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

PRODUCER = "qgraph.testing"
MAX_IR_VERSION = 10


def ir_version_for_opset(opset: int) -> int:
    """Return the IR version that matches a default-domain ``opset`` (never above 10).

    onnx 1.23's ``make_model`` stamps IR 14, which onnxruntime 1.31 refuses; every model built here sets
    the smallest IR version that the ONNX release introducing ``opset`` used.
    """
    ir = int(helper.find_min_ir_version_for([helper.make_opsetid("", opset)]))
    return min(ir, MAX_IR_VERSION)


def new_model(opset: int, graph_name: str, doc: str = "") -> onnx.ModelProto:
    """Return an empty ModelProto with opset, IR version, producer and graph name set."""
    model = onnx.ModelProto()
    model.ir_version = ir_version_for_opset(opset)
    model.producer_name = PRODUCER
    model.producer_version = "1"
    model.opset_import.add(domain="", version=opset)
    model.graph.name = graph_name
    if doc:
        model.doc_string = doc
    return model


def add_initializer(graph: onnx.GraphProto, name: str, array: np.ndarray) -> None:
    """Append ``array`` as a raw-data initializer called ``name`` to ``graph`` (no intermediate copy)."""
    tensor = graph.initializer.add()
    tensor.name = name
    tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
    tensor.dims.extend(array.shape)
    tensor.raw_data = np.ascontiguousarray(array).tobytes()


def add_node(
    graph: onnx.GraphProto,
    op_type: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str,
    **attrs: object,
) -> onnx.NodeProto:
    """Append a node to ``graph`` and return it; attributes are converted with ``helper.make_attribute``."""
    node: onnx.NodeProto = graph.node.add()
    node.op_type = op_type
    node.name = name
    node.input.extend(inputs)
    node.output.extend(outputs)
    for key, value in attrs.items():
        node.attribute.append(helper.make_attribute(key, value))
    return node


def rng_for(seed: int, name: str) -> np.random.Generator:
    """Return a generator seeded by ``seed`` and a stable hash of ``name``.

    Each tensor gets its own stream, so values do not depend on the order tensors are visited in.
    """
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])


def check_and_return(model: onnx.ModelProto) -> onnx.ModelProto:
    """Run the full ONNX checker (with shape inference) and return ``model`` unchanged."""
    onnx.checker.check_model(model, full_check=True)
    return model
