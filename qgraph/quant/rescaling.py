"""Per-channel rescaling of float tensors by float-preserving passes, recorded in the model.

Cross-layer equalization (``equalize_weights``) divides output channel ``c`` of a layer by ``s_c`` and multiplies
the next layer's input channel by ``s_c``: the model's outputs are unchanged, but every tensor between the two
layers now holds ``x[c] / s_c``. A layer-by-layer diff against the model before equalization compares tensors by
name and would report that rescaling as a loss. So the pass records, under the model metadata key
`RESCALED_KEY`, for every such tensor its channel axis and the factors ``f_c`` with

    value_now[..., c, ...] = f_c · value_before[..., c, ...]        (f_c = 1 / s_c for equalization)

as JSON ``{tensor: {"axis": a, "scale": [f_0, f_1, ...]}}``. Metadata survives ONNX save/load and every later
pass (`qgraph.graph.GraphHandle.metadata`); tensor names survive quantization (original float tensors keep their
names). A second rescaling of the same tensor multiplies into the record. The diff (`relative_rescaling`) divides
B's values by ``f_B / f_A`` per channel before comparing: O(recorded channels), one JSON parse per model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import onnx

#: Model metadata key of the rescaling record (see the module docs for its format).
RESCALED_KEY = "qgraph.rescaled"

Rescaling = dict[str, tuple[int, np.ndarray]]


def parse_rescaling(text: str | None) -> Rescaling:
    """The record ``{tensor: (axis, factors)}`` from its JSON text (empty for None or malformed text)."""
    if not text:
        return {}
    try:
        raw = json.loads(text)
        return {str(k): (int(v["axis"]), np.asarray(v["scale"], np.float64)) for k, v in raw.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}  # a foreign or damaged record is ignored: the diff then compares the raw values


def record_rescaling(metadata: dict[str, str], scaled: Mapping[str, tuple[int, np.ndarray]]) -> None:
    """Fold ``scaled`` (``{tensor: (axis, f)}``: the tensor's values are now ``f_c`` times what they were) into
    the record held in ``metadata`` (a model's metadata_props as a dict), multiplying earlier factors."""
    record = parse_rescaling(metadata.get(RESCALED_KEY))
    for name, (axis, f) in scaled.items():
        old = record.get(name)
        factors = np.asarray(f, np.float64)
        if old is not None and old[0] == axis and old[1].shape == factors.shape:
            factors = old[1] * factors
        record[name] = (axis, factors)
    metadata[RESCALED_KEY] = json.dumps(
        {k: {"axis": a, "scale": [float(f"{x:.9g}") for x in v]} for k, (a, v) in sorted(record.items())},
        separators=(",", ":"),
    )


def model_rescaling(model: onnx.ModelProto) -> Rescaling:
    """The rescaling record of ``model`` (empty when it has none)."""
    return parse_rescaling(next((p.value for p in model.metadata_props if p.key == RESCALED_KEY), None))


def relative_rescaling(a: onnx.ModelProto, b: onnx.ModelProto) -> Rescaling:
    """Per tensor, B's values over A's (``f_B / f_A`` per channel) where the records differ; tensors whose
    records disagree on the axis or channel count are left out (compared raw)."""
    ra, rb = model_rescaling(a), model_rescaling(b)
    out: Rescaling = {}
    for name in ra.keys() | rb.keys():
        axis_a, fa = ra.get(name, (None, None))
        axis_b, fb = rb.get(name, (None, None))
        axis = axis_b if axis_b is not None else axis_a
        assert axis is not None
        if fa is None:
            rel = fb
        elif fb is None:
            rel = 1.0 / fa
        elif axis_a == axis_b and fa.shape == fb.shape:
            rel = fb / fa
        else:
            continue
        assert rel is not None
        if not np.allclose(rel, 1.0, rtol=1e-6):
            out[name] = (axis, rel)
    return out


def channel_shape(ndim: int, axis: int, channels: int) -> list[int] | None:
    """``[1, .., channels, .., 1]`` (``channels`` at ``axis``) to broadcast factors, None when it cannot fit."""
    if ndim == 0 or not -ndim <= axis < ndim:
        return None
    shape = [1] * ndim
    shape[axis] = channels
    return shape


def undo_rescaling(value: np.ndarray, axis: int, factors: np.ndarray, *, inverse: bool = False) -> np.ndarray | None:
    """``value / factors`` along ``axis`` (``value · factors`` with ``inverse``: A's value in B's scale); None
    when the value's shape does not fit the record."""
    shape = channel_shape(value.ndim, axis, factors.size)
    if shape is None or value.shape[axis] != factors.size:
        return None
    f = factors.reshape(shape).astype(value.dtype)
    return np.asarray(value * f if inverse else value / f)
