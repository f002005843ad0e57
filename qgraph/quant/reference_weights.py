"""The float weights of a reference model, looked up by the quantized node that reads them (`ReferenceWeights`).

Falling a node back to float (`qgraph.remedy.fallback`) or widening its weights to 16 bits
(`qgraph.remedy.widen_weights`) takes the node's float weight from the model the QDQ model was made from, when there is
one. Inside a recipe that is the pipeline's float reference, made by the same passes, so its constants are exactly what
was quantized. A model the user names (``float_fallback: {float_weights: ...}``, ``qgraph sensitivity FLOAT QDQ``) is
usually the *original* float model: where the quantized model fused a BatchNorm into a Conv, its Conv's output name now
belongs to the BatchNorm in the reference (whose scale and bias sit at the Conv's weight and bias positions), and
equalization rescaled every channel under the same names. Such a reference is ``checked``: a constant is used only where
it matches the stored integers (`qgraph.quant.math.matches_codes`), else the caller keeps the dequantized codes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnx

from qgraph.graph.detach import is_placeholder
from qgraph.graph.ops import proto_scopes
from qgraph.quant.math import matches_codes

if TYPE_CHECKING:
    from qgraph.quant.qdq_graph import QParams


class ReferenceWeights:
    """Float constant inputs of a reference model's nodes, looked up by ``(first output name, input position)``.

    Built in one walk over the reference; values are converted on lookup (only the nodes that go back to float
    pay), and a weightless reference reads its placeholders from ``weights`` (shared, not copied). Picklable."""

    def __init__(self, reference: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None,
                 checked: bool = False) -> None:
        self.weights = dict(weights or {})
        #: A model given by the user (``float_weights``, sensitivity's FLOAT) may precede BatchNorm fusion or
        #: equalization: its constant is used only where it matches the codes (`qgraph.quant.math.matches_codes`).
        self.checked = checked
        inits = {t.name: t for t in reference.graph.initializer}
        floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                  onnx.TensorProto.BFLOAT16)
        self.protos: dict[tuple[str, int], onnx.TensorProto] = {}
        # Every scope: a node inside an If/Loop body reads its weights from the body's (or the outer) initializers.
        for g in proto_scopes(reference.graph):
            inits.update((t.name, t) for t in g.initializer if g is not reference.graph and t.name not in inits)
        for node in (n for g in proto_scopes(reference.graph) for n in g.node):
            if not node.output:
                continue
            for i, name in enumerate(node.input):
                proto = inits.get(name)
                if proto is not None and proto.data_type in floats:
                    self.protos[(node.output[0], i)] = proto
        self.by_name = {name: t for name, t in inits.items() if t.data_type in floats}

    def __len__(self) -> int:
        return len(self.protos)

    def get(self, output: str, position: int, stored: str = "",
            codes: tuple[np.ndarray, QParams] | None = None) -> np.ndarray | None:
        """The float constant read at input ``position`` by the reference node producing ``output``, else (a
        quantizer that fused the node with the next one renames its output) the reference constant whose name is
        ``stored`` (the integer constant's name) without a ``_quantized`` or ``/q`` suffix, if any. A ``checked``
        reference returns it only when it matches ``codes`` (the stored integers and their parameters)."""
        values = self._lookup(output, position, stored)
        if values is None or not self.checked or codes is None:
            return values
        q, p = codes
        return values if matches_codes(values, q, p.scale, p.zero_point, p.axis if p.scale.size > 1 else None) \
            else None

    def _lookup(self, output: str, position: int, stored: str) -> np.ndarray | None:
        proto = self.protos.get((output, position))
        if proto is None:
            for suffix in ("_quantized", "/q"):
                if stored.endswith(suffix) and stored[: -len(suffix)] in self.by_name:
                    proto = self.by_name[stored[: -len(suffix)]]
        if proto is None:
            return None
        if is_placeholder(proto):
            return self.weights.get(proto.name)
        return onnx.numpy_helper.to_array(proto)
