"""Thin ``lower_opset`` pass over the proto engine (`lower_model`)."""

from __future__ import annotations

from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult, register
from qgraph.graph.opsets import MIN_OPSET, max_opset

from .details import LowerOpsetDetails
from .engine import lower_model


class LowerOpsetConfig(PassConfig):
    """Options of `LowerOpset`."""

    opset: int = Field(
        ge=MIN_OPSET, le=max_opset(), description="Target default-domain opset (lower than or equal to the model's)."
    )


@register
class LowerOpset(Pass[LowerOpsetConfig]):
    """Rewrite every node so the model is valid at an older opset and computes the same results."""

    name = "lower_opset"
    config_class = LowerOpsetConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Lower the whole model (refusals raise `LoweringError`, a `PassError`, before anything changes)."""
        model, held = graph.weightless_export()  # lowering never needs the weights' bytes
        res = lower_model(model, self.config.opset)
        del model
        out = PassResult(
            details=LowerOpsetDetails(
                source_opset=res.source_opset,
                target_opset=res.target_opset,
                adapters=dict(sorted(res.adapters.items())),
                ops=dict(sorted(res.ops.items())),
            )
        )
        if res.source_opset == res.target_opset:
            out.notes.append(f"model is already at opset {res.target_opset}")
            return out
        out.matched = sum(res.ops.values())
        out.rewritten = max(1, out.matched)  # the opset stamp is itself a rewrite, also when no node needed one
        out.nodes_added = max(0, res.nodes_after - res.nodes_before)
        out.nodes_removed = max(0, res.nodes_before - res.nodes_after)
        graph.replace_model(res.model, held)
        out.notes.append(f"opset {res.source_opset} -> {res.target_opset}")
        return out
