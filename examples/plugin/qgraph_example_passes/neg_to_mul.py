"""``neg_to_mul``: rewrite ``Neg(x)`` as ``Mul(x, -1)`` (a peephole rewrite; keeps float results exactly)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult
from qgraph.graph import is_default_domain, tensor_dtype


class NegToMulConfig(PassConfig):
    """Options of `NegToMul`."""

    factor: float = Field(default=-1.0, description="The constant Neg becomes a multiplication by.")


class NegToMul(Pass[NegToMulConfig]):
    """Rewrite every Neg(x) (any scope) as Mul(x, factor); Neg on an integer tensor is left alone."""

    name = "neg_to_mul"
    config_class = NegToMulConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Rewrite in place; the pipeline measures nodes added/removed and tags nothing new (the node is kept)."""
        res = PassResult()
        for scope in graph.scopes():
            for node in scope.nodes:
                if node.op != "Neg" or not is_default_domain(node.domain):
                    continue
                res.matched += 1
                dtype = tensor_dtype(node.inputs[0], graph.shapes())
                if dtype is None or dtype.kind != "f":
                    res.skip(node.name, f"input dtype {dtype} is not a float type")
                    continue
                factor = gs.Constant(graph.unique_name(f"{node.name}/factor"), np.array(self.config.factor, dtype))
                node.op = "Mul"
                node.inputs.append(factor)
                res.rewritten += 1
        return res
