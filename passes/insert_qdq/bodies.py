"""Static quantization inside ``If`` branches and ``Loop`` bodies (``subgraphs: static``).

onnxruntime returns no tensor from inside a body, so each top-level body is quantized as a model of its own
(`qgraph.runtime.bodies`): its inputs at every execution on the calibration data are recorded (the outer tensors of the
samples whose condition selects a branch; the formal inputs of every loop iteration), the same ``insert_qdq``
configuration runs on it with that data, and the quantized body is grafted back. Nested bodies are reached the same
way, one level at a time. A body the data never reaches keeps the ``dynamic`` treatment (MatMul/Gemm with constant
weights quantized at run time) and the decision says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from qgraph import GraphHandle, Pass, PassContext, PassResult
from qgraph.data import CallableSource, Feed
from qgraph.graph import proto_label
from qgraph.runtime.bodies import Body, BodyError, ModelFacts, bodies, body_feeds, graft_body, standalone_body

if TYPE_CHECKING:
    from .config import InsertQDQConfig

#: Executions of one body recorded at most (a loop runs its body many times per sample).
MAX_BODY_SAMPLES = 256


def quantize_bodies(quantizer: Pass[InsertQDQConfig], graph: GraphHandle, ctx: PassContext,
                    res: PassResult) -> BodiesOutcome:
    """Quantize every top-level If/Loop body on the data that reaches it."""
    outcome = BodiesOutcome()
    if ctx.calibration_data is None or next(graph.subgraphs(), None) is None:
        return outcome
    model = graph.to_onnx()
    limit = min(MAX_BODY_SAMPLES, ctx.calibration.samples or MAX_BODY_SAMPLES)
    facts = ModelFacts.of(model)  # once for every body: shape inference and the top graph's constants
    found: list[Body] = []
    for node, attr in bodies(model):
        try:
            found.append(standalone_body(model, node, attr, facts))
        except BodyError as exc:
            res.decide(f"{proto_label(node)}.{attr}: not calibrated ({exc}); MatMul/Gemm inside are "
                       "quantized dynamically", attention=True)
    executions = body_feeds(model, found, ctx.calibration_data, limit) if found else []  # one pass for all
    for body, feeds in zip(found, executions, strict=True):
        where = f"{proto_label(body.node)}.{body.attr}"
        if not feeds:
            res.decide(f"{where}: never ran on the calibration data; MatMul/Gemm inside are quantized dynamically, "
                       "the rest stays float (add samples that take this path)", attention=True)
            continue
        inner = type(quantizer)(quantizer.config)
        sub_ctx = PassContext(
            calibration_data=CallableSource(partial(_copy, feeds), f"{where} inputs on the calibration data"),
            target=ctx.target, calibration=ctx.calibration.model_copy(update={"ranges": None}))
        handle = GraphHandle(body.model)
        result = sub_ctx.run_pass(inner, handle)
        try:
            graft_body(model, body, handle.to_onnx())
        except BodyError as exc:
            res.decide(f"{where}: left float ({exc})", attention=True)
            continue
        outcome.quantized += result.rewritten
        outcome.unmatched.append(set(result.unmatched))
        res.skipped += [type(s)(f"{where}/{s.node}", s.reason) for s in result.skipped]
        res.decisions.append(f"{where}: calibrated on {len(feeds)} execution(s) of the body; {result.rewritten} "
                             "node(s) quantized statically")
        for d in result.decisions:  # a nested body's own attention decisions stay flagged
            if not d.startswith("reduce_range"):
                res.decide(f"{where}/{d}", attention=d in result.attention)
    if outcome.quantized:
        graph.replace_model(model)
    return outcome


@dataclass
class BodiesOutcome:
    """Nodes quantized inside bodies, and each body's selector criteria that matched nothing there."""

    quantized: int = 0
    unmatched: list[set[str]] = field(default_factory=list)

    def unmatched_everywhere(self, top: list[str]) -> list[str]:
        """The top graph's unmatched criteria that no body matched either."""
        return [u for u in top if all(u in b for b in self.unmatched)]


def _copy(feeds: list[Feed]) -> list[Feed]:
    return [dict(f) for f in feeds]
