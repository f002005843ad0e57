"""``quantize_weights``: weight-only block-wise quantization (INT4/INT8) of MatMul/Gemm weights.

Transformer and LLM MatMuls are bound by their weights' bytes: storing them in 4 bits with one scale (and zero
point) per block of ``block_size`` input channels cuts them to ~0.16x, and onnxruntime's kernels run the product
directly (``com.microsoft.MatMulNBits``) or from a blocked ``DequantizeLinear`` (opset 21, which onnxruntime fuses
into the same kernel). Activations stay float; no calibration is needed for ``rtn``/``hqq``.

Per selected layer (`emission`): ``W [K, N]`` → blocks of ``B`` input channels per output column →
codes/scales/zero points by the chosen algorithm (`rtn`, `hqq`, `gptq`, `awq`: formulas in each module and in
``docs/weight_only.md``; the math in `qgraph.quant.blockwise`) → the format's tensors (`packing`) → the node
rewritten in place. Layers in ``keep_8bit`` get 8-bit codes. ``gptq``/``awq`` measure every layer's input
``E[x xᵀ]`` and ``E|x|`` in one streamed calibration pass (`stats`). Models larger than memory:
`streaming.quantize_file` reads, quantizes and writes one initializer at a time (external data in and out).

A second run finds no MatMul/Gemm with a float constant weight left (they read packed codes or a
DequantizeLinear): it rewrites nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_graphsurgeon as gs

from qgraph import GraphHandle, Pass, PassContext, PassError, PassResult, get_pass, register, selected_ids
from qgraph.graph import NoMatch, const_value, rebuild
from qgraph.pipeline.target import CalibrationSpec
from qgraph.quant.blockwise import BlockFormat, BlockQuant
from qgraph.quant.rescaling import record_rescaling

from ..smooth_quant.groups import apply_fold, find_groups  # smooth_quant's fold, shared
from .awq import search_scales
from .config import QuantizeWeightsConfig
from .details import QuantizeWeightsDetails
from .emission import Layer, as_layer, emit
from .gptq import HessianFactor, inverse_hessian_factor, quantize_gptq
from .hqq import quantize_hqq
from .mixed import output_errors, promote, weight_error
from .packing import Packed, dequantize_linear, matmul_nbits
from .rtn import quantize_rtn
from .stats import InputStats, collect

__all__ = ["QuantizeWeights", "QuantizeWeightsConfig"]

#: Opset of blocked DequantizeLinear (``block_size`` attribute, int4/uint4).
QDQ_OPSET = 21


@register
class QuantizeWeights(Pass[QuantizeWeightsConfig]):
    """Weight-only block-wise INT4/INT8 of MatMul/Gemm weights (MatMulNBits or blocked DequantizeLinear)."""

    name = "quantize_weights"
    config_class = QuantizeWeightsConfig
    preserves_float = False
    quantizes = True

    def missing_data(self, calibration: CalibrationSpec) -> str | None:
        """gptq/awq measure layer inputs on calibration data; rtn/hqq need none."""
        if not self.config.needs_data:
            return None
        return (f"`algorithm: {self.config.algorithm}` measures each layer's inputs (E[x xᵀ]) on calibration data: "
                "give --calibration-data DATA (or `calibration_data=` to Pipeline.run), or use the data-free "
                "`algorithm: rtn` / `hqq`.")

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        """Refuse gptq/awq without calibration data (before anything changes)."""
        why = self.missing_data(ctx.calibration)
        if why and ctx.calibration_data is None:
            raise PassError(f"quantize_weights: {why}")

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Select, measure (gptq/awq), quantize and rewrite every layer (module docstring)."""
        cfg = self.config
        res = PassResult()
        if cfg.format == "qdq" and self._layers(graph, PassResult()):
            self._reach_opset(graph, ctx, res)
        layers = self._layers(graph, res)
        res.matched = len(layers) + len(res.skipped)
        if not layers:
            return res
        wide = self._eight_bit(graph, res) & {id(lay.node) for lay in layers}
        stats = collect(graph, ctx, sorted({str(lay.node.inputs[0].name) for lay in layers})) if cfg.needs_data \
            else {}
        scales = self._awq(graph, layers, stats, res) if cfg.algorithm == "awq" else {}
        self._factors: dict[str, HessianFactor] = {}
        self._deadline = time.monotonic() + cfg.time_budget_s if cfg.time_budget_s else None
        self._late: list[str] = []
        results = [self._quantize_layer(layer, stats, scales, 8 if id(layer.node) in wide else cfg.bits)
                   for layer in layers]
        if cfg.keep_8bit_budget > 0:
            self._promote(graph, ctx, layers, results, stats, scales, wide, res)
        self._emit_all(graph, layers, results, res)
        self._summarise(res, len(layers), [str(lay.node.name) for lay in layers if id(lay.node) in wide])
        return res

    def _quantize_layer(self, layer: Layer, stats: dict[str, InputStats],
                        scales: dict[int, npt.NDArray[np.float64]], bits: int) -> BlockQuant:
        fmt = BlockFormat(bits, self.config.block_size, self.config.symmetric)
        name = str(layer.node.inputs[0].name)
        return self._quantize(layer.matrix(), fmt, stats.get(name), scales.get(id(layer.node)), name)

    def _promote(self, graph: GraphHandle, ctx: PassContext, layers: list[Layer], results: list[BlockQuant],
                 stats: dict[str, InputStats], scales: dict[int, npt.NDArray[np.float64]], wide: set[int],
                 res: PassResult) -> None:
        """Re-quantize the layers `mixed.promote` picks within ``keep_8bit_budget`` with 8-bit codes."""
        todo = [i for i, lay in enumerate(layers) if id(lay.node) not in wide]
        measured = output_errors(graph, ctx, [(layers[i].weight_name, layers[i].stored(results[i].dequantize()))
                                              for i in todo])
        errors = measured if measured is not None else [weight_error(layers[i].matrix(), results[i]) for i in todo]
        what = "output error alone" if measured is not None else "relative weight error"
        sizes = [results[i].k * results[i].codes.shape[0] for i in todo]
        budget = self.config.keep_8bit_budget * sum(r.k * r.codes.shape[0] for r in results)
        for j in promote(errors, sizes, budget / max(sum(sizes), 1)):
            i = todo[j]
            results[i] = self._quantize_layer(layers[i], stats, scales, 8)
            wide.add(id(layers[i].node))
            res.notes.append(f"{layers[i].node.name}: 8-bit ({what} at {self.config.bits} bits {errors[j]:.2e})")

    def _emit_all(self, graph: GraphHandle, layers: list[Layer], results: list[BlockQuant],
                  res: PassResult) -> None:
        inserts: dict[int, list[gs.Node]] = {}
        before = after = 0
        for layer, bq in zip(layers, results, strict=True):
            packed = self.pack(bq, layer.weight_name, layer.dtype, layer.linear.transposed)
            before += bq.k * bq.codes.shape[0] * layer.dtype.itemsize
            after += packed.nbytes
            created = emit(graph, layer, packed)
            for node in created:
                graph.tag(node, self.name)
            if created:
                inserts[id(layer.node)] = [*created, layer.node]
            res.rewritten += 1
        for scope in graph.scopes():
            mine = {k: v for k, v in inserts.items() if any(n is v[-1] for n in scope.nodes)}
            if mine:
                rebuild(scope, replacements=mine)
        res.nodes_added = sum(len(v) - 1 for v in inserts.values())
        res.details = QuantizeWeightsDetails(weight_bytes=(before, after), algorithm=self.config.algorithm,
                                             format=self.config.format)

    def streams_file(self) -> bool:
        """rtn/hqq into MatMulNBits stream a file one initializer at a time (`streaming`)."""
        return not self.config.needs_data and self.config.format == "matmul_nbits"

    def run_file(self, src: Path, dst: Path) -> PassResult:
        """`streaming.quantize_file`."""
        from .streaming import quantize_file

        return quantize_file(src, dst, self)

    def pack(self, bq: BlockQuant, base: str, dtype: np.dtype[Any], transposed: bool) -> Packed:
        """The configured format's tensors for one quantized weight."""
        cfg = self.config
        if cfg.format == "matmul_nbits":
            return matmul_nbits(bq, base, dtype, cfg.accuracy_level)
        return dequantize_linear(bq, base, dtype, cfg.signed, transposed)

    def quantize_matrix(self, w: npt.NDArray[np.floating], fmt: BlockFormat) -> BlockQuant:
        """A data-free algorithm (rtn/hqq) on one ``W [K, N]`` (the streamed path uses it)."""
        return self._quantize(w, fmt, None, None, "")

    def _quantize(self, w: npt.NDArray[np.floating], fmt: BlockFormat, st: InputStats | None,
                  awq_s: npt.NDArray[np.float64] | None, name: str) -> BlockQuant:
        cfg = self.config
        h_diag = None
        if st is not None:
            h_diag = np.diag(st.hessian) / (awq_s**2 if awq_s is not None else 1.0)
        if fmt.bits > cfg.bits:  # a layer kept 8-bit: 16x less rounding error, the clip search is enough
            return quantize_rtn(w, fmt, cfg.clip_ratios, h_diag)
        if cfg.algorithm == "hqq":
            return quantize_hqq(w, fmt, cfg.clip_ratios, cfg.hqq_iterations, cfg.hqq_lp_norm,
                                float_zero=cfg.format == "matmul_nbits" and fmt.bits == 4)  # CPU kernel: 4-bit only
        if cfg.algorithm == "gptq" and st is not None and self._deadline is not None \
                and time.monotonic() > self._deadline:
            self._late.append(name)
        elif cfg.algorithm == "gptq" and st is not None:
            if name not in self._factors:  # Q/K/V read one input: one factorisation of its Hessian
                self._factors[name] = inverse_hessian_factor(st.hessian, cfg.damping, cfg.act_order)
            return quantize_gptq(w, fmt, self._factors[name], np.diag(st.hessian), cfg.clip_ratios, cfg.gptq_batch)
        return quantize_rtn(w, fmt, cfg.clip_ratios, h_diag)

    def _layers(self, graph: GraphHandle, res: PassResult) -> list[Layer]:
        cfg = self.config
        selected, unmatched = selected_ids(graph, cfg.nodes)
        res.unmatched.extend(unmatched)
        scopes = graph.scopes() if not cfg.needs_data else [graph.graph]  # calibration sees the top graph only
        layers: list[Layer] = []
        for scope in scopes:
            for node in scope.nodes:
                if node.op not in ("MatMul", "Gemm") or (selected is not None and id(node) not in selected):
                    continue
                if len(node.inputs) < 2 or const_value(node.inputs[1]) is None:
                    continue  # attention's X·Xᵀ, or a weight already dequantized: nothing to quantize
                try:
                    layers.append(as_layer(node, cfg.format))
                except NoMatch as why:
                    res.skip(node.name, why)
        return layers

    def _eight_bit(self, graph: GraphHandle, res: PassResult) -> set[int]:
        if self.config.keep_8bit is None:
            return set()
        chosen, unmatched = selected_ids(graph, self.config.keep_8bit)
        res.unmatched.extend(f"keep_8bit: {u}" for u in unmatched)
        if chosen is None:
            return {id(n) for g in graph.scopes() for n in g.nodes}
        return chosen

    def _awq(self, graph: GraphHandle, layers: list[Layer], stats: dict[str, InputStats],
             res: PassResult) -> dict[int, npt.NDArray[np.float64]]:
        """Search and fold AWQ scales per group of layers sharing an input (`awq`); the scale of each layer."""
        cfg = self.config
        mine = {id(lay.node) for lay in layers}
        skips: list[tuple[str, str]] = []
        groups = find_groups(graph.graph, mine, False, skips)
        out: dict[int, npt.NDArray[np.float64]] = {}
        gains: list[float] = []
        rescaled: dict[str, tuple[int, np.ndarray]] = {}
        for node, reason in skips:
            res.notes.append(f"awq: {node} quantized unscaled: {reason}")
        for group in groups:
            scalar = _scalar_fold(group)
            if scalar:
                res.notes.append(f"awq: {group.x.name} quantized unscaled: folding 1/s would turn {scalar} into a "
                                 "vector, which stops onnxruntime's fusions (GELU, LayerNorm)")
                continue
            st = stats[str(group.x.name)]
            fmt = BlockFormat(cfg.bits, cfg.block_size, cfg.symmetric)
            ws = [lay.matrix(lay.value()) for lay in group.layers]
            alpha, s, loss, base = search_scales(ws, st.hessian, st.mean_abs, fmt, cfg.awq_grid)
            if alpha == 0 or group.fold is None:
                continue
            rescaled.update(apply_fold(graph, group, s))
            gains.append(base / loss if loss > 0 else 1.0)
            for lay in group.layers:
                out[id(lay.node)] = s
        if rescaled:
            record_rescaling(graph.metadata, rescaled)  # the folded tensors, for the diff (`qgraph.quant.rescaling`)
        res.decisions.append(
            f"awq: {len(gains)} of {len(groups)} input group(s) scaled and folded upstream"
            + (f" (layer error / {min(gains):.2f}..{max(gains):.2f} vs unscaled)" if gains else "")
            + (f"; {len(skips)} layer(s) without a foldable producer quantized unscaled" if skips else ""))
        return out

    def _reach_opset(self, graph: GraphHandle, ctx: PassContext, res: PassResult) -> None:
        before = graph.opset
        if before >= QDQ_OPSET:
            return
        try:
            ctx.run_pass(get_pass("raise_opset")(opset=QDQ_OPSET), graph)
        except PassError as exc:
            raise PassError(f"quantize_weights: `format: qdq` needs opset >= {QDQ_OPSET} (blocked "
                            f"DequantizeLinear) and the model cannot be raised from opset {before}: "
                            f"{exc.message.splitlines()[0]}. Use `format: matmul_nbits` instead.") from exc
        graph.changed()
        res.decide(f"opset raised {before} -> {QDQ_OPSET}: blocked DequantizeLinear (block_size) needs opset "
                   f">= {QDQ_OPSET}")

    def _summarise(self, res: PassResult, n: int, wide: list[str]) -> None:
        cfg = self.config
        assert isinstance(res.details, QuantizeWeightsDetails)  # `_emit_all` wrote them
        before, after = res.details.weight_bytes
        what = "com.microsoft.MatMulNBits" if cfg.format == "matmul_nbits" else "blocked DequantizeLinear"
        res.decide(f"{n} weight(s) quantized by {cfg.algorithm}, {cfg.bits}-bit "
                   f"{'symmetric' if cfg.symmetric else 'with zero points'}, block {cfg.block_size}, as {what}: "
                   f"{before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({after / max(before, 1):.3f}x)")
        if self._late:
            res.decide(f"gptq: time_budget_s {cfg.time_budget_s:g} s ran out: {len(self._late)} layer(s) quantized by "
                       "rtn (clip search weighted by E[x²]) instead", attention=True)
        if wide:
            how = [w for w, on in (("keep_8bit", cfg.keep_8bit is not None),
                                   (f"keep_8bit_budget {cfg.keep_8bit_budget:g}: largest relative output error",
                                    cfg.keep_8bit_budget > 0)) if on]
            shown = ", ".join(wide[:8]) + (f" and {len(wide) - 8} more" if len(wide) > 8 else "")
            res.decide(f"{len(wide)} layer(s) kept 8-bit ({'; '.join(how)}): {shown}")


def _scalar_fold(group: Any) -> str | None:
    """The scalar constant (e.g. the 0.5 of an exported GELU) the group's fold would make per-channel, if any."""
    if group.fold is None:
        return None
    for node, index in group.fold.consts:
        value = const_value(node.inputs[index])
        if value is not None and value.size == 1:
            return f"{node.op} {node.name!r}'s constant {node.inputs[index].name!r}"
    return None
