"""Which side of a Q/DQ pair's range clips values no later code can tell apart: its activation is flat there.

insert_qdq's ``through_activation`` clips a tensor read only by an activation (SiLU ``x * Sigmoid(x)``, Sigmoid,
Tanh, HardSigmoid, HardSwish, Relu, Clip) whose output is quantized too, where the activation is within a quarter
code of its limit (`qgraph.calibrate.transfer`). A value clipped there gets the same output code as without the
clip, so measuring the pair "alone" (its readers in float) would charge it with an error the model never makes:
YOLOv8n's stem conv output, 7% clipped below -6.9 before its SiLU, read as 14% of the output error.

`flat_sides` finds these pairs in B from the graph alone (any QDQ model, whoever quantized it): the pair's readers
form one activation, that activation's output (and a SiLU's gate) goes into a QuantizeLinear, and the pair's
representable limit on a side lies where the activation still rounds to its limit's code on the output grid (and
a SiLU's gate to its zero code): whatever clipped that range (through_activation, or a calibration method). The
culprit statistics then count values beyond that limit as exact, and the probe does not clip them.
"""

from __future__ import annotations

import numpy as np

from qgraph.analysis.diff.protos import ModelIndex, NodeRef
from qgraph.calibrate.transfer import Transfer, tolerance
from qgraph.quant.qdq import is_quantize

_SINGLE = {"Sigmoid": "Sigmoid", "Tanh": "Tanh", "HardSigmoid": "HardSigmoid", "HardSwish": "HardSwish",
           "Relu": "Relu", "Clip": "Clip"}


def _const(b: ModelIndex, name: str) -> np.ndarray | None:
    return b.constant(name) if name else None


def _grid(b: ModelIndex, tensor: str) -> tuple[float, float] | None:
    """(scale, zero point) of the per-tensor QuantizeLinear reading ``tensor`` in B, or None."""
    for c in b.consumers.get(tensor, []):
        if is_quantize(c.node.op_type, c.node.domain) and c.node.input[0] == tensor:
            s = _const(b, c.node.input[1]) if len(c.node.input) > 1 else None
            z = _const(b, c.node.input[2]) if len(c.node.input) > 2 else np.zeros(())
            if s is not None and z is not None and s.size == 1 and z.size == 1:
                return float(s.reshape(())), float(z.reshape(()))
    return None


def _transfer(b: ModelIndex, node: NodeRef) -> Transfer | None:
    n, op = node.node, node.node.op_type
    attrs = {a.name: a for a in n.attribute}
    if op == "HardSigmoid":
        alpha = attrs["alpha"].f if "alpha" in attrs else 0.2
        beta = attrs["beta"].f if "beta" in attrs else 0.5
        return Transfer("HardSigmoid", alpha=alpha, beta=beta)
    if op != "Clip":
        return Transfer(_SINGLE[op])
    if "min" in attrs or "max" in attrs:
        return Transfer("Clip", low=attrs["min"].f if "min" in attrs else -np.inf,
                        high=attrs["max"].f if "max" in attrs else np.inf)
    bounds = []
    for i in (1, 2):
        if len(n.input) <= i or not n.input[i]:
            bounds.append(np.inf * (-1 if i == 1 else 1))
            continue
        v = _const(b, n.input[i])
        if v is None or v.size != 1:
            return None
        bounds.append(float(v.reshape(())))
    return Transfer("Clip", low=bounds[0], high=bounds[1])


def _reading(b: ModelIndex, dq_out: str) -> tuple[Transfer, tuple[float, float], tuple[float, float] | None] | None:
    """The activation reading ``dq_out`` in B with its output grid and (SiLU) gate grid, when both conditions of
    the module docs hold; else None."""
    readers = b.consumers.get(dq_out, [])
    if len(readers) == 1 and readers[0].node.op_type in _SINGLE and readers[0].node.input[0] == dq_out:
        grid = _grid(b, readers[0].node.output[0])
        transfer = _transfer(b, readers[0])
        return (transfer, grid, None) if grid is not None and transfer is not None else None
    if len(readers) != 2:
        return None
    sig = next((r for r in readers if r.node.op_type == "Sigmoid"), None)
    mul = next((r for r in readers if r.node.op_type == "Mul"), None)
    if sig is None or mul is None:
        return None
    gate = sig.node.output[0]
    gate_grid = _grid(b, gate)
    gate_in = gate
    if gate_grid is not None:  # the Mul reads the gate's DequantizeLinear
        q = next(c for c in b.consumers.get(gate, []) if is_quantize(c.node.op_type, c.node.domain))
        dq = b.consumers.get(q.node.output[0], [])
        gate_in = dq[0].node.output[0] if len(dq) == 1 else gate
    if sorted(mul.node.input) != sorted([dq_out, gate_in]):
        return None
    grid = _grid(b, mul.node.output[0])
    return (Transfer("SiLU"), grid, gate_grid) if grid is not None else None


def flat_sides(b: ModelIndex, dq_out: str, scale: np.ndarray, zero_point: np.ndarray,
               qrange: tuple[int, int]) -> tuple[bool, bool]:
    """Whether the pair dequantizing to ``dq_out`` (per tensor) clips a flat side of its activation, (low, high)."""
    if scale.size != 1:
        return False, False
    found = _reading(b, dq_out)
    if found is None:
        return False, False
    transfer, grid, gate = found
    low_limit, high_limit = transfer.limits()
    s, z = float(scale.reshape(())), float(np.asarray(zero_point).reshape(()))
    lo, hi = (qrange[0] - z) * s, (qrange[1] - z) * s
    # `tolerance` keeps a factor 2 of safety for choosing a clip; here the question is exact: does the clip point
    # still round to the limit's code (within half a code of it)?
    gate_tol = 2 * tolerance(0.0, gate) if gate is not None else None
    flat_lo, flat_hi = transfer.flat_bounds(2 * tolerance(low_limit, grid), 2 * tolerance(high_limit, grid), gate_tol)
    # half an input step of slack: the zero point's rounding moves the representable limit by up to that much
    return bool(lo <= flat_lo + 0.5 * s), bool(hi >= flat_hi - 0.5 * s)
