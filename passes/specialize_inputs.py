"""``specialize_inputs``: fix graph inputs to values, fold what they decide, and inline the ``If`` branches chosen.

Rewrite::

    before: inputs (x, sr);  c = Equal(sr, 16000);  y = If(c) {then: A(x)} {else: B(x)}
    after:  inputs (x);      y = A(x)        (with  specialize_inputs: {inputs: {sr: 16000}})

Models that pick their compute with a control input (a sample rate, a mode flag) keep their convolutions and
LSTMs inside ``If`` bodies, where calibration cannot reach and nothing is quantized. Fixing the input makes every
condition it decides a constant: ``fold_constants`` evaluates them, and each ``If`` with a constant condition is
replaced by the nodes of the branch it selects (outer-scope references resolve as before; branch outputs are
renamed to the ``If``'s outputs). This repeats until no ``If`` with a constant condition is left (nested ``If``
bodies are inlined once their parent is). The specialized model computes exactly what the original computes for
those input values (verified with ``--verify`` on that value), and no longer takes the fixed inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from pydantic import Field, field_validator

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassDetails, PassError, PassResult, get_pass, register
from qgraph.data import exact_array, model_inputs, plain_value_problem
from qgraph.graph import const_value, tensor_dtype
from qgraph.graph.names import GraphInputName

_ROUNDS = 16  # nested If depth handled (each round inlines one level)


@dataclass(frozen=True)
class SpecializeInputsDetails(PassDetails):
    """The inputs `SpecializeInputs` fixed (sorted), the If nodes it inlined and those still left."""

    inputs: list[str]
    ifs_inlined: int
    ifs_left: int


class SpecializeInputsConfig(PassConfig):
    """Which graph inputs to fix, and to what."""

    inputs: dict[GraphInputName, Any] = Field(
        description="Graph input name -> value (a number or a nested list with the input's shape), e.g. "
        "{sr: 16000}. The input is removed from the model's interface.",
    )

    @field_validator("inputs")
    @classmethod
    def _plain_values(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Every value is a finite number, a bool or a rectangular nested list of them (whatever the model)."""
        for name, given in value.items():
            problem = plain_value_problem(given)
            if problem is not None:
                raise ValueError(f"input {name!r}: {problem}")
        return value


@register
class SpecializeInputs(Pass[SpecializeInputsConfig]):
    """Fix inputs to constants, fold, and inline every ``If`` whose condition becomes constant."""

    name = "specialize_inputs"
    config_class = SpecializeInputsConfig
    preserves_float = False  # the model takes fewer inputs: `--verify` cannot feed the original the same way
    keeps_float_values = True  # same values for the inputs kept: weight correction compares against the result

    def option_issues(self, model: onnx.ModelProto) -> list[tuple[tuple[int | str, ...], str]]:
        """A value that does not fit its input's dtype exactly (16000.7 or true on an int64, 1e40 on a float32)."""
        specs = {s.name: s for s in model_inputs(model)}
        out: list[tuple[tuple[int | str, ...], str]] = []
        for name, given in self.config.inputs.items():
            if name in specs:
                try:
                    exact_array(given, specs[name].dtype)
                except ValueError as exc:
                    out.append((("inputs", name), f"input {name!r} is {specs[name].dtype}: {exc}."))
        return out

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        """Every named input exists and its value fits the input's dtype and shape."""
        names = [t.name for t in graph.graph.inputs]
        for name in self.config.inputs:
            if name not in names:
                raise PassError(f"specialize_inputs: the model has no input {name!r}; its inputs are {names}.")

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Turn the inputs into constants, then fold and inline until nothing changes."""
        res = PassResult()
        shapes = graph.shapes()
        fixed: dict[str, np.ndarray] = {}
        for tensor in [t for t in graph.graph.inputs if t.name in self.config.inputs]:
            dtype = tensor_dtype(tensor, shapes) or np.dtype(np.float32)
            try:  # checked before the run (`option_issues`); a model given in memory reaches here too
                value = exact_array(self.config.inputs[tensor.name], dtype)
            except ValueError as exc:
                raise PassError(f"specialize_inputs: input {tensor.name!r} is {dtype}: {exc}.") from None
            declared = tensor.shape
            if declared is not None and (len(declared) != value.ndim or any(
                    isinstance(d, int) and d >= 0 and d != v for d, v in zip(declared, value.shape, strict=False))):
                raise PassError(f"specialize_inputs: input {tensor.name!r} has shape {declared}; the value given "
                                f"has shape {list(value.shape)}. Give a value of that shape.")
            graph.graph.inputs = [t for t in graph.graph.inputs if t is not tensor]
            tensor.to_constant(value)
            fixed[tensor.name] = value
            res.decisions.append(f"input {tensor.name} fixed to {value.tolist()!r} ({dtype}); the model no longer "
                                 "takes it")
            res.matched += 1
        graph.changed()
        ctx.fix_inputs(fixed)
        fold = get_pass("fold_constants")()
        inlined = 0
        for _ in range(_ROUNDS):
            ctx.run_pass(fold, graph)
            graph.changed()
            done = _inline_constant_ifs(graph.graph, res)
            if not done:
                break
            inlined += done
            graph.graph.cleanup().toposort()
            graph.changed()
        left = [n.name for n in graph.graph.nodes if n.op == "If"]
        if left:
            res.notes.append(f"{len(left)} If node(s) still depend on other inputs: {', '.join(left[:5])}")
        res.rewritten = inlined
        res.details = SpecializeInputsDetails(inputs=sorted(self.config.inputs), ifs_inlined=inlined,
                                              ifs_left=len(left))
        return res


def _inline_constant_ifs(graph: gs.Graph, res: PassResult) -> int:
    """Replace each top-level ``If`` with a constant condition by its selected branch; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "If" or not node.inputs:
            continue
        cond = const_value(node.inputs[0])
        if cond is None:
            continue
        taken = bool(np.asarray(cond).reshape(-1)[0])
        branch: gs.Graph = node.attrs["then_branch" if taken else "else_branch"]
        outs = list(node.outputs)
        node.outputs.clear()  # free the If's outputs so the branch's producers can write them
        node.inputs.clear()
        for out_if, out_b in zip(outs, branch.outputs, strict=True):
            producer = out_b.inputs[0] if out_b.inputs else None
            if producer is not None and producer in branch.nodes:
                producer.outputs[producer.outputs.index(out_b)] = out_if
            else:  # the branch returns an outer tensor or a constant as is
                branch.nodes.append(gs.Node("Identity", name=f"{node.name}/identity_{out_if.name}",
                                            inputs=[out_b], outputs=[out_if]))
        position = graph.nodes.index(node)
        graph.nodes[position:position + 1] = list(branch.nodes)
        res.decisions.append(f"{node.name}: condition is {taken}; inlined its {'then' if taken else 'else'} branch "
                             f"({len(branch.nodes)} nodes)")
        count += 1
    return count
