"""A recipe-like transformation written by hand for the diff/report tests (independent of the real passes).

Four small passes with the conventions of the real ones (new nodes tagged with the pass name, original float
tensor names kept, Q/DQ tensors named ``<tensor>/q`` and ``<tensor>/dq``):

- ``test_remove_dropout``: bypass Dropout/Identity;
- ``test_fold_bn``: fold BatchNormalization into the Conv before it with numpy (new node ``<conv>/bn_folded``);
- ``test_raise_opset``: opset -> 13, Softmax gets an explicit ``axis=1`` (same results on these models);
- ``test_qdq``: per-tensor uint8 activations and per-channel int8 weights on Conv/Gemm, ranges from running the
  graph on seeded random inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult
from qgraph.analysis.diff.numeric import stream_tensors
from qgraph.runtime.compare import random_feeds


class NoOptions(PassConfig):
    """No options."""


def _rewire(graph: GraphHandle, old: gs.Tensor, new: gs.Tensor) -> None:
    for consumer in list(graph.consumers(old)):
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer.inputs[i] = new


class RemoveDropout(Pass[NoOptions]):
    """Bypass Dropout and Identity nodes."""

    name = "test_remove_dropout"
    config_class = NoOptions

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        res = PassResult()
        for node in list(graph.graph.nodes):
            if node.op not in ("Dropout", "Identity") or graph.is_graph_output(node.outputs[0]):
                continue
            res.matched += 1
            _rewire(graph, node.outputs[0], node.inputs[0])
            node.outputs.clear()
            res.rewritten += 1
        before = len(graph.graph.nodes)
        graph.cleanup()
        res.nodes_removed = before - len(graph.graph.nodes)
        return res


class FoldBatchNorm(Pass[NoOptions]):
    """Fold BatchNormalization into the preceding Conv."""

    name = "test_fold_bn"
    config_class = NoOptions

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        res = PassResult()
        for bn in [n for n in graph.graph.nodes if n.op == "BatchNormalization"]:
            conv = graph.producer(bn.inputs[0])
            if conv is None or conv.op != "Conv" or len(graph.consumers(bn.inputs[0])) != 1:
                res.skip(bn.name, "not after a Conv with a single consumer")
                continue
            res.matched += 1
            scale, bias, mean, var = (np.asarray(graph.constant_value(t), dtype=np.float64) for t in bn.inputs[1:5])
            eps = float(bn.attrs.get("epsilon", 1e-5))
            w = np.asarray(graph.constant_value(conv.inputs[1]), dtype=np.float64)
            b = (np.asarray(graph.constant_value(conv.inputs[2]), dtype=np.float64) if len(conv.inputs) > 2
                 else np.zeros(w.shape[0]))
            k = scale / np.sqrt(var + eps)
            name = f"{conv.name}/bn_folded"
            w_new = gs.Constant(f"{name}/W", (w * k[:, None, None, None]).astype(np.float32))
            b_new = gs.Constant(f"{name}/B", ((b - mean) * k + bias).astype(np.float32))
            out = bn.outputs[0]
            folded = gs.Node("Conv", name, attrs=dict(conv.attrs), inputs=[conv.inputs[0], w_new, b_new],
                             outputs=[out])
            graph.tag(folded, self.name)
            bn.outputs.clear()
            conv.outputs.clear()
            graph.graph.nodes.append(folded)
            res.rewritten += 1
            res.nodes_added += 1
        before = len(graph.graph.nodes)
        graph.cleanup()
        graph.toposort()
        res.nodes_removed = before - len(graph.graph.nodes)
        return res


class RaiseOpsetConfig(PassConfig):
    """Target opset."""

    opset: int = Field(default=13, description="Opset to raise to.")


class RaiseOpset(Pass[RaiseOpsetConfig]):
    """Raise the default-domain opset (only for the ops of the test models)."""

    name = "test_raise_opset"
    config_class = RaiseOpsetConfig

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        res = PassResult(matched=1, rewritten=1)
        graph.graph.opset = self.config.opset
        # New OperatorSetIdProto objects: graphsurgeon's import_domains alias the input model's opset_import.
        graph.graph.import_domains = [
            onnx.helper.make_opsetid(d.domain, self.config.opset if d.domain in ("", "ai.onnx") else d.version)
            for d in graph.graph.import_domains or []
        ]
        for node in graph.graph.nodes:
            if node.op == "Softmax" and "axis" not in node.attrs:
                node.attrs["axis"] = 1
                res.details.setdefault("softmax_axis_set", []).append(node.name)
        return res


class InsertQDQ(Pass[NoOptions]):
    """Per-tensor uint8 activations and per-channel int8 weights on Conv and Gemm inputs."""

    name = "test_qdq"
    config_class = NoOptions
    preserves_float = False

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        res = PassResult()
        targets = [n for n in graph.graph.nodes if n.op in ("Conv", "Gemm")]
        for n in graph.graph.nodes:
            if n.op in ("Concat", "Add", "Mul", "AveragePool", "GlobalAveragePool", "Softmax"):
                res.skip(n.name, "this test recipe quantizes Conv and Gemm only")
        acts = list(dict.fromkeys(n.inputs[0].name for n in targets))
        ranges = self._ranges(graph.to_onnx(), acts, ctx)
        dq_of: dict[str, gs.Variable] = {}
        for name in acts:
            t = graph.index.tensors[name]
            lo, hi = min(ranges[name][0], 0.0), max(ranges[name][1], 0.0)
            scale = np.float32(max(hi - lo, 1e-8) / 255.0)
            zp = np.uint8(np.clip(np.rint(-lo / scale), 0, 255))
            s = gs.Constant(f"{name}/scale", np.array(scale, dtype=np.float32))
            z = gs.Constant(f"{name}/zero_point", np.array(zp, dtype=np.uint8))
            q = gs.Variable(f"{name}/q", dtype=np.uint8, shape=t.shape)
            dq = gs.Variable(f"{name}/dq", dtype=np.float32, shape=t.shape)
            self._add(graph, gs.Node("QuantizeLinear", f"{name}/QuantizeLinear", inputs=[t, s, z], outputs=[q]))
            self._add(graph, gs.Node("DequantizeLinear", f"{name}/DequantizeLinear", inputs=[q, s, z], outputs=[dq]))
            dq_of[name] = dq
        w_dq: dict[str, gs.Variable] = {}
        for node in targets:
            res.matched += 1
            node.inputs[0] = dq_of[node.inputs[0].name]
            w = node.inputs[1]
            if w.name not in w_dq:
                values = np.asarray(graph.constant_value(w), dtype=np.float32)
                axis = 0
                flat = np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1)
                scale = (np.maximum(np.abs(flat).max(axis=1), 1e-8) / 127.0).astype(np.float32)
                shape = [-1 if a == axis else 1 for a in range(values.ndim)]
                codes = np.clip(np.rint(values / scale.reshape(shape)), -127, 127).astype(np.int8)
                qw = gs.Constant(f"{w.name}/quantized", codes)
                s = gs.Constant(f"{w.name}/scale", scale)
                z = gs.Constant(f"{w.name}/zero_point", np.zeros(scale.shape, dtype=np.int8))
                out = gs.Variable(f"{w.name}/dq", dtype=np.float32, shape=list(values.shape))
                self._add(graph, gs.Node("DequantizeLinear", f"{w.name}/DequantizeLinear", attrs={"axis": axis},
                                         inputs=[qw, s, z], outputs=[out]))
                w_dq[w.name] = out
            node.inputs[1] = w_dq[w.name]
            res.rewritten += 1
        res.nodes_added = 2 * len(acts) + len(w_dq)
        res.details = {"activations": len(acts), "weights": len(w_dq)}
        graph.changed()
        graph.toposort()
        return res

    def _add(self, graph: GraphHandle, node: gs.Node) -> None:
        graph.graph.nodes.append(node)
        graph.tag(node, self.name)

    @staticmethod
    def _ranges(model: onnx.ModelProto, names: list[str], ctx: PassContext) -> dict[str, tuple[float, float]]:
        feeds: Any = ctx.calibration_data if ctx.calibration_data is not None else random_feeds(model, 2, seed=0)
        out: dict[str, tuple[float, float]] = {}
        for _, values in stream_tensors(model, [names], feeds, samples=4):
            for k, v in values.items():
                lo, hi = out.get(k, (np.inf, -np.inf))
                out[k] = (min(lo, float(v.min())), max(hi, float(v.max())))
        return out


def full_recipe() -> list[Pass[Any]]:
    """The four passes in recipe order."""
    return [RemoveDropout(), FoldBatchNorm(), RaiseOpset(), InsertQDQ()]


def scale_weight(model: onnx.ModelProto, node_name: str, factor: float) -> onnx.ModelProto:
    """A copy of ``model`` whose node ``node_name`` has its weight (input 1) multiplied by ``factor``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    node = next(n for n in out.graph.node if n.name == node_name)
    init = next(t for t in out.graph.initializer if t.name == node.input[1])
    init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * np.float32(factor), init.name))
    return out
