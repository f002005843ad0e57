"""Block-wise weight quantization math: one scale (and zero point) per block of ``block_size`` input channels.

The one place where block layouts, scales, zero points and the packing of 4-bit codes are defined (the
``quantize_weights`` pass and `qgraph diff` read them from here). A weight ``W [K, N]`` (MatMul: K input
channels, N outputs) is cut, per output column ``n``, into ``nb = ceil(K / B)`` blocks of ``B`` input channels
(the last one zero-padded), held as ``blocks [N, nb, B]``. Codes live in the unsigned domain ``0 .. 2^b - 1``:

    q = clamp(round(w / s) + z, 0, 2^b - 1),      w' = (q - z) · s

- asymmetric (zero points): ``lo = r · min(min_k w, 0)``, ``hi = r · max(max_k w, 0)``, ``s = (hi - lo) / (2^b - 1)``,
  ``z = clamp(round(-lo / s), 0, 2^b - 1)`` (0 is always in range so ``z`` is a code);
- symmetric: ``z = 2^(b-1)`` (8 for 4 bits, implied by MatMulNBits when no zero point is given),
  ``s = r · max_k |w| / (2^(b-1) - 1)``.

``r`` (the clip ratio, 1 = the block's full range) is chosen per block by `search_clip`: the ratio of a grid
minimising the block's expected output error ``Σ_k h_k Δ_k² + (Σ_k √h_k Δ_k)² / B`` (``Δ = w' - w``; ``h``
optional per-input-channel weights, e.g. the Hessian diagonal ``E[x_k²]``: an error on a large input counts more).
The second term is why clipping is not free: rounding errors are unbiased and cancel over a dot product, clipping
errors all shrink the block toward zero and add up coherently wherever inputs have a mean (GELU and softmax outputs
are positive); it is ``E[(Σ x_k Δ_k)²]`` for inputs whose mean equals their spread.

Layouts (exactly onnxruntime's ``com.microsoft.MatMulNBits``): ``B [N, nb, B·b/8]`` uint8, 4-bit codes two per
byte, element ``2i`` in the low nibble and ``2i + 1`` in the high one; ``scales [N, nb]`` (stored flat);
``zero_points [N, ceil(nb·b/8)]`` uint8, 4-bit ones packed two per byte the same way (or float ``[N, nb]``, which
the kernel also reads). ONNX ``INT4``/``UINT4`` tensors (blocked ``DequantizeLinear``) pack two codes per byte,
the first in the low nibble: `pack_int4`. Signed storage (``int4``/``int8``) holds ``q - 2^(b-1)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from qgraph.quant.math import QuantDtype, dtype_range, symmetric_zero_point

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

#: Clip ratios tried per block by default (1 = the block's full range).
DEFAULT_RATIOS: tuple[float, ...] = tuple(round(1.0 - 0.025 * i, 3) for i in range(17))  # 1.0 .. 0.6
#: Smallest scale produced (a block of zeros gets this, any scale represents it exactly).
MIN_BLOCK_SCALE = 1e-12
#: Rows of ``blocks`` handled at once: bounds the temporaries of a search to a few MB per layer.
_CHUNK_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class BlockFormat:
    """Bits (4 or 8), block size (16..256, a power of two) and symmetry of a block-quantized weight."""

    bits: int
    block_size: int
    symmetric: bool

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        bs = self.block_size
        if bs < 16 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two in 16..256, got {bs}")

    @property
    def qmax(self) -> int:
        """Largest unsigned code, ``2^b - 1``."""
        return dtype_range(self.unsigned)[1]

    @property
    def mid(self) -> int:
        """The symmetric zero point ``2^(b-1)`` (also the offset between signed and unsigned storage)."""
        return symmetric_zero_point(self.unsigned)

    @property
    def unsigned(self) -> QuantDtype:
        """The unsigned type the codes are stored in (uint4 or uint8)."""
        return QuantDtype(f"uint{self.bits}")

    def n_blocks(self, k: int) -> int:
        """Blocks per output column for ``k`` input channels."""
        return -(-k // self.block_size)


@dataclass
class BlockQuant:
    """A quantized weight: unsigned ``codes [N, nb, B]``, ``scale [N, nb]`` and ``zero_point [N, nb]`` (integer
    codes, or float for HQQ-style zero points), for ``k`` input channels."""

    fmt: BlockFormat
    k: int
    codes: U8
    scale: F32
    zero_point: npt.NDArray[np.float32]

    @property
    def integer_zero_points(self) -> bool:
        """Whether every zero point is a code (storable as uint4/uint8)."""
        z = self.zero_point
        return bool(np.all(z == np.round(z)) and z.min() >= 0 and z.max() <= self.fmt.qmax)

    def dequantize(self) -> F32:
        """``W' [K, N]`` in float32."""
        return from_blocks(dequantize_blocks(self.codes, self.scale, self.zero_point), self.k)


def to_blocks(w: npt.NDArray[np.floating], block_size: int) -> F32:
    """``W [K, N]`` as ``[N, nb, B]`` float32 blocks along K (the last block zero-padded)."""
    k, n = w.shape
    nb = -(-k // block_size)
    out = np.zeros((n, nb * block_size), np.float32)
    out[:, :k] = np.asarray(w, np.float32).T
    return out.reshape(n, nb, block_size)


def from_blocks(blocks: npt.NDArray[np.floating], k: int) -> F32:
    """Inverse of `to_blocks`: ``[N, nb, B]`` back to ``W [K, N]``."""
    n = blocks.shape[0]
    return np.ascontiguousarray(np.asarray(blocks, np.float32).reshape(n, -1)[:, :k].T)


def block_params(blocks: F32, fmt: BlockFormat, ratio: float | F32 = 1.0) -> tuple[F32, F32]:
    """``(scale, zero_point)`` ``[N, nb]`` of each block at clip ratio ``ratio`` (a number or ``[N, nb]``)."""
    r = np.asarray(ratio, np.float32)
    if fmt.symmetric:
        amax = np.abs(blocks).max(axis=-1) * r
        scale = np.maximum(amax / (fmt.mid - 1), MIN_BLOCK_SCALE).astype(np.float32)
        return scale, np.full(scale.shape, fmt.mid, np.float32)
    lo = np.minimum(blocks.min(axis=-1), 0.0) * r
    hi = np.maximum(blocks.max(axis=-1), 0.0) * r
    scale = np.maximum((hi - lo) / fmt.qmax, MIN_BLOCK_SCALE).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, fmt.qmax).astype(np.float32)
    return scale, zero


def quantize_blocks(blocks: F32, scale: F32, zero_point: F32, qmax: int) -> U8:
    """Unsigned codes ``clamp(round(w / s + z), 0, qmax)`` (round half to even, as QuantizeLinear; a fractional
    HQQ zero point rounds with the value)."""
    q = np.rint(blocks / scale[..., None] + zero_point[..., None])  # = round(w/s) + z for integer z
    codes: U8 = np.clip(q, 0, qmax).astype(np.uint8)
    return codes


def dequantize_blocks(codes: U8, scale: F32, zero_point: F32) -> F32:
    """``(q - z) · s`` per block, float32."""
    return ((codes.astype(np.float32) - zero_point[..., None]) * scale[..., None]).astype(np.float32)


def block_error(blocks: F32, scale: F32, zero_point: F32, qmax: int, weights: F32 | None = None) -> F32:
    """``Σ_k h_k Δ_k² + (Σ_k √h_k Δ_k)² / B`` per block ``[N, nb]``, ``Δ = w' - w`` (``weights`` ``h`` as
    ``[nb, B]``, None: all 1): the expected squared error of the block's share of ``x · w`` for inputs whose mean
    is as large as their spread (module docstring)."""
    q = np.clip(np.rint(blocks / scale[..., None] + zero_point[..., None]), 0, qmax)
    d = (q - zero_point[..., None]) * scale[..., None] - blocks
    if weights is not None:
        d *= np.sqrt(weights)[None]
    bias = d.sum(axis=-1)
    d *= d
    return np.asarray(d.sum(axis=-1) + bias * bias / blocks.shape[-1], np.float32)


def channel_weights(h: npt.NDArray[np.floating] | None, k: int, block_size: int) -> F32 | None:
    """Per-input-channel error weights ``h [K]`` laid out as ``[nb, B]`` (zeros on padding), or None."""
    if h is None:
        return None
    nb = -(-k // block_size)
    out = np.zeros(nb * block_size, np.float32)
    out[:k] = np.asarray(h, np.float32)
    return out.reshape(nb, block_size)


def _best_ratio(part: F32, fmt: BlockFormat, ratios: Sequence[float], weights: F32 | None) -> tuple[F32, F32]:
    """`search_clip` on one chunk of rows, single-threaded."""
    best_s, best_z = block_params(part, fmt, ratios[0])
    if len(ratios) == 1:  # nothing to compare: no error to compute
        return best_s, best_z
    best_err = block_error(part, best_s, best_z, fmt.qmax, weights)
    for r in ratios[1:]:
        s, z = block_params(part, fmt, r)
        err = block_error(part, s, z, fmt.qmax, weights)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s, best_z = np.where(better, s, best_s), np.where(better, z, best_z)
    return best_s, best_z


def _over_rows(n: int, step: int, work: Callable[[int, int], None]) -> None:
    """``work(lo, hi)`` for every chunk of ``step`` rows of ``n``, on every core: numpy releases the GIL, and each
    chunk writes its own rows, so the result does not depend on the threads."""
    starts = range(0, n, step)
    if len(starts) < 2:
        work(0, n)
        return
    with ThreadPoolExecutor(max_workers=min(len(starts), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda lo: work(lo, min(lo + step, n)), starts))


def search_clip(blocks: F32, fmt: BlockFormat, ratios: Sequence[float] = DEFAULT_RATIOS,
                weights: F32 | None = None) -> tuple[F32, F32]:
    """Per block, the ``(scale, zero_point)`` of the ratio in ``ratios`` with the least `block_error`, in chunks of
    rows (memory O(chunk), not O(weight) per candidate)."""
    n, nb, bs = blocks.shape
    scale = np.empty((n, nb), np.float32)
    zero = np.empty((n, nb), np.float32)

    def work(lo: int, hi: int) -> None:
        scale[lo:hi], zero[lo:hi] = _best_ratio(blocks[lo:hi], fmt, ratios, weights)

    _over_rows(n, max(1, _CHUNK_ELEMENTS // max(1, nb * bs)), work)
    return scale, zero


def quantize_weight(w: npt.NDArray[np.floating], fmt: BlockFormat, ratios: Sequence[float] = (1.0,),
                    h: npt.NDArray[np.floating] | None = None) -> BlockQuant:
    """Round-to-nearest block quantization of ``W [K, N]`` with the per-block clip search of `search_clip`, by
    chunks of output columns (blocks, parameters and codes of one chunk at a time, on every core)."""
    k, n = w.shape
    nb, bs = fmt.n_blocks(k), fmt.block_size
    weights = channel_weights(h, k, bs)
    codes = np.empty((n, nb, bs), np.uint8)
    scale = np.empty((n, nb), np.float32)
    zero = np.empty((n, nb), np.float32)

    def work(lo: int, hi: int) -> None:
        blocks = to_blocks(w[:, lo:hi], bs)
        s, z = _best_ratio(blocks, fmt, ratios, weights)
        codes[lo:hi], scale[lo:hi], zero[lo:hi] = quantize_blocks(blocks, s, z, fmt.qmax), s, z

    _over_rows(n, max(1, _CHUNK_ELEMENTS // max(1, nb * bs)), work)
    return BlockQuant(fmt, k, codes, scale, zero)


def pack_nibbles(codes: U8) -> U8:
    """4-bit codes (last axis even) two per byte: element ``2i`` low nibble, ``2i + 1`` high nibble."""
    c = codes.astype(np.uint8)
    packed: U8 = np.ascontiguousarray((c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4))
    return packed


def unpack_nibbles(packed: U8, count: int | None = None) -> U8:
    """Inverse of `pack_nibbles` (the last axis doubled, cut to ``count`` when given)."""
    p = np.asarray(packed, np.uint8)
    out = np.empty((*p.shape[:-1], p.shape[-1] * 2), np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out if count is None else out[..., :count]


def pack_codes(codes: U8, bits: int) -> U8:
    """MatMulNBits ``B [N, nb, B·bits/8]`` from codes ``[N, nb, B]``."""
    return pack_nibbles(codes) if bits == 4 else np.ascontiguousarray(codes, np.uint8)


def unpack_codes(packed: U8, bits: int) -> U8:
    """Codes ``[N, nb, B]`` from MatMulNBits ``B``."""
    return unpack_nibbles(packed) if bits == 4 else np.asarray(packed, np.uint8)


def pack_zero_points(zero_point: F32, bits: int) -> U8:
    """MatMulNBits ``zero_points [N, ceil(nb·bits/8)]`` uint8 from integer zero points ``[N, nb]``."""
    z = np.asarray(zero_point).astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(z)
    if z.shape[1] % 2:  # an odd block count: the unused high nibble of the last byte
        z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
    return pack_nibbles(z)


def unpack_zero_points(packed: U8, bits: int, n_blocks: int) -> F32:
    """Zero points ``[N, nb]`` (float32) from MatMulNBits' packed form."""
    z = unpack_nibbles(packed, n_blocks) if bits == 4 else np.asarray(packed)[:, :n_blocks]
    return z.astype(np.float32)


def pack_int4(values: npt.NDArray[np.integer]) -> bytes:
    """ONNX ``INT4``/``UINT4`` raw data: the row-major values two per byte, the first in the low nibble."""
    flat = np.asarray(values).astype(np.uint8).ravel() & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return bytes(flat[0::2] | (flat[1::2] << 4))


def unpack_int4(raw: bytes, count: int, signed: bool) -> npt.NDArray[np.int16]:
    """Values of ONNX ``INT4``/``UINT4`` raw data (sign-extended when ``signed``)."""
    v: npt.NDArray[np.int16] = unpack_nibbles(np.frombuffer(raw, np.uint8)[None], count)[0].astype(np.int16)
    return np.where(v > 7, v - 16, v).astype(np.int16) if signed else v


def qdq_layout(bq: BlockQuant, signed: bool) -> tuple[npt.NDArray[np.integer], F32, npt.NDArray[np.integer] | None]:
    """Blocked DequantizeLinear operands along axis 0: codes ``[K, N]``, scales ``[nb, N]``, zero points ``[nb, N]``
    (None when symmetric and signed: 0 is the default). Signed storage shifts codes and zero points by
    ``-2^(b-1)``."""
    fmt = bq.fmt
    shift = fmt.mid if signed else 0
    codes = from_blocks(bq.codes.astype(np.float32), bq.k).astype(np.int16) - shift
    scale = np.ascontiguousarray(bq.scale.T)
    if fmt.symmetric and signed:
        return codes, scale, None
    return codes, scale, np.ascontiguousarray(np.round(bq.zero_point.T)).astype(np.int16) - shift
