"""Scale equalization math shared by ``equalize_weights`` (cross-layer equalization) and ``smooth_quant``.

Both passes move a positive per-channel factor across a linear layer boundary without changing the float
function: for a channel ``i`` leaving layer 1 and entering layer 2,

    y = W2 · f(W1 · x + b1)   ==   (W2 · diag(s)) · f(diag(1/s) · (W1 · x + b1))

whenever ``f`` commutes with positive per-channel scaling (``f(x / s) = f(x) / s``: ReLU, LeakyReLU, PReLU,
max/average pooling, identity). What differs is how ``s`` is chosen:

- **Cross-layer equalization** (Nagel et al. 2019, eq. 8): with ``r1_i = max|W1[i, ...]|`` (output channel ``i``
  of layer 1) and ``r2_i = max|W2[..., i, ...]|`` (input channel ``i`` of layer 2),
  ``s_i = sqrt(r1_i · r2_i) / r2_i``, so that after the move ``r1_i / s_i = r2_i · s_i = sqrt(r1_i · r2_i)``:
  both layers' channel ranges become equal and the product ``r1_i · r2_i`` is invariant.
- **SmoothQuant** (Xiao et al. 2022, eq. 4): with ``a_j = max|X[..., j]|`` over calibration data and
  ``w_j = max|W[j, :]|``, ``s_j = a_j^α / w_j^(1-α)``; ``X ← X / s``, ``W ← diag(s) · W``. After the move
  ``a_j / s_j = a_j^(1-α) · w_j^(1-α)`` and ``w_j · s_j = a_j^α · w_j^α``: for α = 0.5 both equal
  ``sqrt(a_j · w_j)``, so running it again gives ``s = 1``.

`LinearLayer` describes where channels live in a constant weight (Conv ``[M, C/g, k...]`` with groups,
MatMul ``[K, N]``, Gemm with ``transB``) so that ranges and scaling are read and written the same way by both
passes. Everything is computed in float64 and cast back to the weight's dtype once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.graph import NoMatch, const_value, consumers, is_default_domain

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_SMALL = 1 << 16  #: weights of at most this many elements are read in one block (the default block is 32 MB)


def dead_channels(r1: np.ndarray, r2: np.ndarray, dead: float) -> np.ndarray:
    """Channels CLE leaves alone: a range on either side that is 0, not finite, or below ``dead`` times that
    side's largest range (``r1_i < dead · max r1`` or ``r2_i < dead · max r2``).

    Why: ``s_i = sqrt(r1_i / r2_i)`` degenerates there. A channel layer 1 (almost) never produces (``r1_i`` ~
    1e-34 after folding a BatchNorm with a vanishing scale) or layer 2 (almost) never reads gets ``s_i`` ~ 1e-14
    or 1e+4 per round, which equalizes nothing useful (it carries no signal) and pushes the other layer's weight
    for that channel to an extreme that only adds float rounding.
    """
    r1 = np.asarray(r1, dtype=np.float64)
    r2 = np.asarray(r2, dtype=np.float64)
    fin1, fin2 = np.isfinite(r1), np.isfinite(r2)
    top1 = float(r1[fin1].max()) if fin1.any() else 0.0
    top2 = float(r2[fin2].max()) if fin2.any() else 0.0
    ok = (r1 > 0) & (r2 > 0) & fin1 & fin2 & (r1 >= dead * top1) & (r2 >= dead * top2)
    return np.asarray(~ok)


def cle_scales(r1: np.ndarray, r2: np.ndarray, min_scale: float = 0.0, max_scale: float = np.inf,
               dead: float = 0.0) -> np.ndarray:
    """Cross-layer equalization scales ``s_i = sqrt(r1_i · r2_i) / r2_i``, clipped to ``[min_scale, max_scale]``.

    Channels where either range is 0 (or not finite, or below ``dead`` times its side's largest range:
    `dead_channels`) get ``s = 1``: there is nothing to balance.
    """
    r1 = np.asarray(r1, dtype=np.float64)
    r2 = np.asarray(r2, dtype=np.float64)
    if _all_live(r1, r2, dead):  # the usual case: every channel is balanced, no mask, no masked copies
        s = np.sqrt(r1 * r2) / r2
    else:
        ok = ~dead_channels(r1, r2, dead)
        s = np.ones(np.broadcast(r1, r2).shape, dtype=np.float64)
        s[ok] = np.sqrt(r1[ok] * r2[ok]) / r2[ok]
    # np.clip's value (s holds no NaN: live ranges are finite and positive) without its Python wrappers
    np.maximum(s, min_scale, out=s)
    clipped: np.ndarray = np.minimum(s, max_scale, out=s)
    return clipped


def _all_live(r1: np.ndarray, r2: np.ndarray, dead: float) -> bool:
    """Whether `dead_channels` is all False, from four reductions: with both sides' largest ranges finite every
    range is finite or -inf, and every channel is live iff each side's smallest range is > 0 and >= ``dead`` times
    its largest. Why: `cle_scales` runs once per pair per round, thousands of times on a long chain."""
    if r1.ndim != 1 or r1.shape != r2.shape or r1.size == 0:
        return False
    top1, top2 = float(r1.max()), float(r2.max())
    if not (math.isfinite(top1) and math.isfinite(top2)):
        return False
    low1, low2 = float(r1.min()), float(r2.min())
    return low1 > 0 and low2 > 0 and low1 >= dead * top1 and low2 >= dead * top2


def smoothing_scales(
    act_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float, min_scale: float = 0.0, max_scale: float = np.inf
) -> np.ndarray:
    """SmoothQuant scales ``s_j = a_j^α / w_j^(1-α)``, clipped to ``[min_scale, max_scale]``; 1 where a or w is 0."""
    a = np.asarray(act_absmax, dtype=np.float64)
    w = np.asarray(w_absmax, dtype=np.float64)
    ok = (a > 0) & (w > 0) & np.isfinite(a) & np.isfinite(w)
    s = np.ones(np.broadcast(a, w).shape, dtype=np.float64)
    s[ok] = a[ok] ** alpha / w[ok] ** (1.0 - alpha)
    return np.clip(s, min_scale, max_scale)


def smoothing_scales_grid(act_absmax: np.ndarray, w_absmax: np.ndarray, alphas: tuple[float, ...],
                          min_scale: float = 0.0, max_scale: float = np.inf) -> np.ndarray:
    """`smoothing_scales` for every α of ``alphas`` (same-shape 1-D maxima): ``[len(alphas), K]``, row ``i`` equal
    to ``smoothing_scales(a, w, alphas[i], ...)``; the mask and the clip are shared (``alpha: auto`` scores a grid
    of αs per group on every MatMul input), each power is the same scalar-exponent operation."""
    a = np.asarray(act_absmax, dtype=np.float64)
    w = np.asarray(w_absmax, dtype=np.float64)
    if a.shape != w.shape or a.ndim != 1:
        return np.stack([smoothing_scales(a, w, alpha, min_scale, max_scale) for alpha in alphas])
    ok = (a > 0) & (w > 0) & np.isfinite(a) & np.isfinite(w)
    s = np.ones((len(alphas), a.size), dtype=np.float64)
    a_ok, w_ok = a[ok], w[ok]
    for i, alpha in enumerate(alphas):
        s[i, ok] = a_ok**alpha / w_ok ** (1.0 - alpha)
    return np.asarray(np.clip(s, min_scale, max_scale))


def log_change(s: np.ndarray) -> float:
    """``max_i |ln s_i|``: how far a scale vector is from doing nothing (0 for all ones)."""
    return float(np.abs(np.log(s)).max()) if s.size else 0.0


@dataclass(frozen=True)
class LinearLayer:
    """A Conv / Gemm / MatMul whose weight is a constant, with where its channels live.

    Conv weight ``[M, C/g, k...]``: output channel ``m`` is ``W[m]``; input channel ``c = gi · C/g + cl`` is
    read by ``W[gi · M/g : (gi + 1) · M/g, cl]`` (depthwise: ``C/g = 1``, so ``c`` maps to its own outputs).
    MatMul weight ``[K, N]`` (Gemm ``transB = 0``): input channel ``k`` is row ``k``, output ``n`` column ``n``;
    Gemm ``transB = 1`` stores ``[N, K]``. ``bias`` is the Conv/Gemm bias input (None when absent), ``alpha`` and
    ``beta`` are Gemm's factors (bias scaling commutes with both).
    """

    node: gs.Node
    kind: str  # "conv" or "matmul"
    group: int = 1
    transposed: bool = False
    has_bias: bool = False

    @property
    def weight(self) -> gs.Tensor:
        """The weight tensor (read from the node each time: a rewrite may have renewed it)."""
        return self.node.inputs[1]

    @property
    def bias(self) -> gs.Tensor | None:
        """The bias tensor, None when absent."""
        return self.node.inputs[2] if self.has_bias else None

    @property
    def channel_axis(self) -> int:
        """Axis of the channels in the layer's input and output tensors (1 for Conv, last for matrices)."""
        return 1 if self.kind == "conv" else -1

    def value(self) -> np.ndarray:
        """The weight in float64."""
        w = const_value(self.weight)
        assert w is not None
        return w.astype(np.float64)

    def in_channels(self, w: np.ndarray) -> int:
        """Number of input channels."""
        if self.kind == "conv":
            return int(w.shape[1]) * self.group
        return int(w.shape[1] if self.transposed else w.shape[0])

    def out_channels(self, w: np.ndarray) -> int:
        """Number of output channels."""
        if self.kind == "conv":
            return int(w.shape[0])
        return int(w.shape[0] if self.transposed else w.shape[1])

    def out_ranges(self, w: np.ndarray) -> np.ndarray:
        """``max|W|`` per output channel."""
        if self.kind == "conv":
            return np.asarray(np.abs(w).reshape(w.shape[0], -1).max(axis=1))
        return np.asarray(np.abs(w).max(axis=1 if self.transposed else 0))

    def in_ranges(self, w: np.ndarray) -> np.ndarray:
        """``max|W|`` per input channel (for a grouped Conv, over the outputs of that channel's group)."""
        if self.kind == "conv":
            m, cg = w.shape[0], w.shape[1]
            per = np.abs(w).reshape(m, cg, -1).max(axis=2)  # [M, C/g]
            return np.asarray(per.reshape(self.group, m // self.group, cg).max(axis=1).reshape(-1))
        return np.asarray(np.abs(w).max(axis=0 if self.transposed else 1))

    def matrix(self, w: np.ndarray) -> np.ndarray:
        """A Gemm/MatMul weight as ``[K, N]`` (input channels x outputs)."""
        return np.asarray(w.T if self.transposed else w)

    def scale_out(self, w: np.ndarray, f: np.ndarray) -> np.ndarray:
        """``W`` with output channel ``m`` multiplied by ``f[m]``."""
        if self.kind == "conv":
            return np.asarray(w * f.reshape((-1,) + (1,) * (w.ndim - 1)))
        return np.asarray(w * (f[:, None] if self.transposed else f[None, :]))

    def scale_in(self, w: np.ndarray, s: np.ndarray) -> np.ndarray:
        """``W`` with input channel ``c`` multiplied by ``s[c]``."""
        if self.kind == "conv":
            m, cg = w.shape[0], w.shape[1]
            per = s.reshape(self.group, 1, cg).repeat(m // self.group, axis=1).reshape(m, cg)
            return np.asarray(w * per.reshape(m, cg, *((1,) * (w.ndim - 2))))
        return np.asarray(w * (s[None, :] if self.transposed else s[:, None]))

    def scaled_ranges(self, w: np.ndarray, out_f: np.ndarray, in_f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(out_ranges, in_ranges)`` of ``scale_in(scale_out(w, out_f), in_f)`` (in float64), read block by block
        along axis 0: memory O(block), never a float64 copy of the whole weight."""
        if self.kind == "conv":
            m, cg = w.shape[0], w.shape[1]
            out_r, per = np.empty(m), np.empty((m, cg))
            for lo, hi, blk in self._blocks(w, out_f, in_f):
                a = np.abs(blk)
                out_r[lo:hi] = a.reshape(hi - lo, -1).max(axis=1)
                per[lo:hi] = a.reshape(hi - lo, cg, -1).max(axis=2)
            return out_r, per.reshape(self.group, m // self.group, cg).max(axis=1).reshape(-1)
        if 0 < w.size <= _SMALL:  # one block, without the generator: read once per pair per round on long chains
            a = np.abs(self._matrix_block(w, 0, w.shape[0], out_f, in_f))
            rows, cols = a.max(axis=1), a.max(axis=0)  # both >= 0, as the block loop's np.maximum(0, ...) gives
            return (rows, cols) if self.transposed else (cols, rows)
        rows, cols = np.empty(w.shape[0]), np.zeros(w.shape[1])
        for lo, hi, blk in self._blocks(w, out_f, in_f):
            a = np.abs(blk)
            rows[lo:hi] = a.max(axis=1)
            np.maximum(cols, a.max(axis=0), out=cols)
        return (rows, cols) if self.transposed else (cols, rows)  # axis 0 holds outputs iff transposed

    def scaled(self, w: np.ndarray, out_f: np.ndarray, in_f: np.ndarray) -> np.ndarray:
        """``scale_in(scale_out(w, out_f), in_f)`` computed in float64 block by block, cast to ``w``'s dtype."""
        out = np.empty_like(w)
        for lo, hi, blk in self._blocks(w, out_f, in_f):
            out[lo:hi] = blk
        return out

    def _blocks(
        self, w: np.ndarray, out_f: np.ndarray, in_f: np.ndarray, block_bytes: int = 32 << 20
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(lo, hi, W[lo:hi] · factors)`` in float64 over axis 0 (Conv and transposed Gemm: output channels;
        MatMul / Gemm ``transB = 0``: input channels)."""
        step = max(1, block_bytes // max(1, 8 * (w.size // max(1, w.shape[0]))))
        per = None
        if self.kind == "conv":
            m, cg = w.shape[0], w.shape[1]
            per = in_f.reshape(self.group, 1, cg).repeat(m // self.group, axis=1).reshape(m, cg)
        for lo in range(0, w.shape[0], step):
            hi = min(lo + step, w.shape[0])
            if per is not None:
                blk = w[lo:hi].astype(np.float64)
                blk *= out_f[lo:hi].reshape((-1,) + (1,) * (w.ndim - 1))
                blk *= per[lo:hi].reshape(hi - lo, w.shape[1], *((1,) * (w.ndim - 2)))
            else:
                blk = self._matrix_block(w, lo, hi, out_f, in_f)
            yield lo, hi, blk

    def _matrix_block(self, w: np.ndarray, lo: int, hi: int, out_f: np.ndarray, in_f: np.ndarray) -> np.ndarray:
        """Rows ``lo:hi`` of a Gemm/MatMul weight times its factors, in float64."""
        blk = w[lo:hi].astype(np.float64)
        if self.transposed:
            blk *= out_f[lo:hi, None]
            blk *= in_f[None, :]
        else:
            blk *= in_f[lo:hi, None]
            blk *= out_f[None, :]
        return blk


def _float_const(tensor: gs.Tensor, what: str) -> np.ndarray:
    value = const_value(tensor)
    if value is None:
        raise NoMatch(f"its {what} {tensor.name!r} is not a constant")
    if value.dtype not in FLOAT_DTYPES:
        raise NoMatch(f"its {what} {tensor.name!r} has non-float dtype {value.dtype}")
    return value


def sole_use(tensor: gs.Tensor, node: gs.Node) -> bool:
    """Whether ``node`` is the only reader of ``tensor`` and reads it once (safe to rewrite in place)."""
    users = consumers(tensor)
    return len(users) == 1 and users[0] is node and sum(1 for t in node.inputs if t is tensor) == 1


def as_linear(node: gs.Node) -> LinearLayer:
    """``node`` as a `LinearLayer`, or `NoMatch` saying why it is not one (variable or shared weight, ...).

    Accepted: Conv (2-D+ constant weight, any group; bias optional), Gemm (``transA = 0``, constant 2-D B),
    MatMul (constant 2-D weight as its second input, variable first input). A weight or bias read by another
    node (or twice) is refused: scaling it would change that other reader.
    """
    if not is_default_domain(node.domain) or node.op not in ("Conv", "Gemm", "MatMul"):
        raise NoMatch(f"{node.op} is not a Conv/Gemm/MatMul")
    if len(node.inputs) < 2 or const_value(node.inputs[0]) is not None:
        raise NoMatch("its data input is a constant")
    w = _float_const(node.inputs[1], "weight")
    if not sole_use(node.inputs[1], node):
        raise NoMatch(f"its weight {node.inputs[1].name!r} is shared with other nodes")
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
    if bias is not None:
        b = _float_const(bias, "bias")
        if not sole_use(bias, node):
            raise NoMatch(f"its bias {bias.name!r} is shared with other nodes")
    if node.op == "Conv":
        if w.ndim < 3:
            raise NoMatch(f"Conv weight is {w.ndim}-D")
        group = int(node.attrs.get("group", 1))
        if group < 1 or w.shape[0] % group:
            raise NoMatch(f"Conv group {group} does not divide {w.shape[0]} output channels")
        if bias is not None and b.shape != (w.shape[0],):
            raise NoMatch(f"Conv bias has shape {b.shape}")
        return LinearLayer(node, "conv", group=group, has_bias=bias is not None)
    if w.ndim != 2:
        raise NoMatch(f"{node.op} weight is {w.ndim}-D, expected 2-D")
    if node.op == "MatMul":
        return LinearLayer(node, "matmul")
    if int(node.attrs.get("transA", 0)):
        raise NoMatch("Gemm has transA=1 (its channels are not on the last axis)")
    trans = bool(int(node.attrs.get("transB", 0)))
    n_out = w.shape[0] if trans else w.shape[1]
    if bias is not None and b.size != 1 and b.shape[-1:] != (n_out,):
        raise NoMatch(f"Gemm bias C has shape {b.shape}, not per output column")
    return LinearLayer(node, "matmul", transposed=trans, has_bias=bias is not None)


def scale_const_per_channel(value: np.ndarray, f: np.ndarray, axis: int, rank: int) -> np.ndarray | None:
    """``value * f`` where ``value`` is a constant operand broadcast against a rank-``rank`` tensor whose
    channels lie on ``axis``: ``f`` is laid out as ``[C, 1, ..., 1]`` up to the last axis. None when the
    constant has more dims than the tensor or a channel dim that is neither 1 nor ``len(f)``."""
    pos = axis % rank
    if value.ndim > rank:
        return None
    view = f.reshape((f.size,) + (1,) * (rank - 1 - pos))
    lead = rank - value.ndim
    if pos >= lead and value.shape[pos - lead] not in (1, f.size):
        return None
    out: np.ndarray = value.astype(np.float64) * view
    return out.astype(value.dtype)
