"""``fuse_batchnorm``: fold inference BatchNormalization into the linear op next to it.

With ``s = scale / sqrt(var + eps)`` and ``t = bias - mean * s`` (so ``BN(x) = x * s + t`` per channel),
see `qgraph.passes._bn_math` for the per-op formulas:

1. **BN after Conv / ConvTranspose / Gemm / MatMul** (``y = op(x); z = BN(y)`` → ``z = op'(x)``): the
   weight is scaled per output channel (``W'[m] = W[m] * s[m]``; for ConvTranspose on axis 1 of the weight,
   by groups; for Gemm along ``transB``) and the bias becomes ``b * s + t`` (created when missing; Gemm
   gets ``beta = 1``). MatMul needs a constant 2-D weight and a 2-D input (BN normalizes axis 1); its bias
   goes into the ``Add`` that already follows it, or into a new ``Add`` (``<bn>/bn_folded``).
2. **BN before an unpadded Conv / a Gemm** (``z = BN(x); y = op(z)`` → ``y = op'(x)``):
   ``W'[m, c] = W[m, c] * s[c]``, ``b'[m] = b[m] + sum_{c,k} W[m, c, k] * t[c]`` (Gemm:
   ``op(B)' = s[:, None] * op(B)``, ``C' = beta * C + alpha * t @ op(B)``). Only exact when the Conv does no
   zero padding, so padded Convs are left alone (with that reason); every consumer must accept the fold.
3. **Any other inference BN** → ``z = Add(Mul(x, s), t)`` with ``s, t`` shaped ``[C, 1, ..., 1]`` so it can be
   quantized or fused downstream (``standalone_to_mul_add``).

Skipped with a reason in the `PassResult`: training-mode BN, non-constant BN parameters, non-float dtypes,
weights shared with other consumers, producers whose output is also used elsewhere or is a graph output.
Subgraphs (If/Loop/Scan bodies) are processed too. The tensor names seen downstream are kept: the fused op
now produces the BN's output tensor. Linear time: O(1) work per BN plus the weight arithmetic.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qgraph import GraphHandle, Pass, PassContext, PassResult, register
from qgraph.graph import (
    NoMatch,
    const_value,
    consumers,
    is_default_domain,
    producer,
    rebuild,
    redirect,
    set_const,
    tensor_dtype,
    unlink,
)

from . import bn_math as bnm
from .config import FuseBatchNormConfig
from .details import FuseBatchNormDetails
from .match import BNMatcher


@register
class FuseBatchNorm(Pass[FuseBatchNormConfig]):
    """Fold inference BatchNormalization into neighbouring Conv/ConvTranspose/Gemm/MatMul, else Mul+Add.

    Rewrite (``s = scale / sqrt(var + eps)``, ``t = bias - mean * s``):
    ``Conv(x, W, b) → BN`` ⇒ ``Conv(x, W * s[m], b * s + t)``; ``BN → Conv(W, b)`` (no padding) ⇒
    ``Conv(x, W * s[c], b + Σ W·t)``; standalone ``BN(x)`` ⇒ ``Add(Mul(x, s), t)``.
    """

    name = "fuse_batchnorm"
    config_class = FuseBatchNormConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Fold every inference BN of every scope; report counts and the reason for each BN left over."""
        return _Fuser(graph, self.config, self.name).run()


class _Fuser(BNMatcher):
    # ------------------------------------------------------------------ driver
    def run(self) -> PassResult:
        if self.needs_inference():
            self.inferred()  # once, on the unmodified graph
        for g in self.scopes:
            self.run_graph(g)
        res = self.result
        res.nodes_removed = res.rewritten
        res.details = FuseBatchNormDetails(
            batchnorm_seen=res.matched,
            folded_into_preceding={k[5:]: v for k, v in sorted(self.counts.items()) if k.startswith("prev:")},
            folded_into_following={k[5:]: v for k, v in sorted(self.counts.items()) if k.startswith("next:")},
            rewritten_to_mul_add=self.counts["mul_add"],
            kept=self.counts["kept"],
            scopes=len(self.scopes),
        )
        return res

    def run_graph(self, g: gs.Graph) -> None:
        self._graph_outputs = {id(t) for t in g.outputs}
        bns = [n for n in g.nodes if n.op == "BatchNormalization" and is_default_domain(n.domain)]
        removed: list[gs.Node] = []
        replaced: dict[int, list[gs.Node]] = {}
        pending: list[tuple[gs.Node, bnm.BNAffine, str]] = []
        for bn in bns:
            self.result.matched += 1
            try:
                affine = self.params(bn)
            except NoMatch as refusal:
                self.keep(bn, str(refusal))
                continue
            reason = "not preceded by Conv/ConvTranspose/Gemm/MatMul"
            if self.cfg.into_preceding:
                try:
                    extra = self.fold_preceding(bn, affine)
                except NoMatch as refusal:
                    reason = str(refusal)
                else:
                    self.fused(bn, extra, removed, replaced)
                    continue
            pending.append((bn, affine, reason))
        # Backward folds run consumer-first so that BN → BN → Conv folds both.
        for bn, affine, reason in reversed(pending):
            why_next = "disabled"
            if self.cfg.into_following:
                try:
                    self.fold_following(bn, affine)
                except NoMatch as err:
                    why_next = str(err)
                else:
                    self.fused(bn, [], removed, replaced)
                    continue
            why = f"before: {reason}; after: {why_next}"
            if self.cfg.standalone_to_mul_add:
                try:
                    nodes = self.to_mul_add(bn, affine)
                except NoMatch as err:
                    self.keep(bn, f"{why}; not rewritten to Mul+Add: {err}")
                    continue
                self.counts["mul_add"] += 1
                self.result.skip(bn.name, f"not folded ({why}); rewritten to Mul+Add")
                self.fused(bn, nodes, removed, replaced)
            else:
                self.keep(bn, f"not folded ({why})")
        rebuild(g, removed, replaced)

    def fused(
        self, bn: gs.Node, new_nodes: list[gs.Node], removed: list[gs.Node], replaced: dict[int, list[gs.Node]]
    ) -> None:
        self.result.rewritten += 1
        if new_nodes:
            replaced[id(bn)] = new_nodes
        else:
            removed.append(bn)

    def keep(self, bn: gs.Node, reason: str) -> None:
        self.counts["kept"] += 1
        self.result.skip(bn.name, reason)

    # ------------------------------------------------------------------ 1. BN after the op
    def fold_preceding(self, bn: gs.Node, bn_aff: bnm.BNAffine) -> list[gs.Node]:
        """Fold ``bn`` into its input's producer; returns nodes replacing ``bn`` (empty: ``bn`` vanishes)."""
        y, z = bn.inputs[0], bn.outputs[0]
        op = producer(y)
        if op is None:
            raise NoMatch("its input is not produced by a node")
        if not is_default_domain(op.domain):
            raise NoMatch(f"preceded by {op.domain}.{op.op}")
        if op.op in ("Conv", "ConvTranspose"):
            self.sole_consumer(y, bn, f"{op.op} output {y.name!r}")
            w = self.weight(op.inputs[1], "weight")
            b = self.optional_const(op, 2, "bias")
            group = int(op.attrs.get("group", 1))
            transpose = op.op == "ConvTranspose"
            channels = w.shape[1] * group if transpose else w.shape[0]
            if w.ndim < 3 or channels != bn_aff.channels:
                raise NoMatch(f"{op.op} has {channels} output channels, BN has {bn_aff.channels}")
            w_new, b_new = bnm.conv_then_bn(w, b, bn_aff, group=group, transpose=transpose)
            set_const(op.inputs[1], w_new)
            self.put_const(op, 2, b_new, f"{op.name}/bias")
        elif op.op == "Gemm":
            self.sole_consumer(y, bn, f"Gemm output {y.name!r}")
            b_mat = self.weight(op.inputs[1], "weight", ndim=2)
            c = self.optional_const(op, 2, "bias C")
            trans_b = bool(op.attrs.get("transB", 0))
            if b_mat.shape[0 if trans_b else 1] != bn_aff.channels:
                raise NoMatch(f"Gemm has {b_mat.shape[0 if trans_b else 1]} outputs, BN has {bn_aff.channels}")
            beta = float(op.attrs.get("beta", 1.0))
            b_new, c_new = bnm.gemm_then_bn(b_mat, c, bn_aff, beta=beta, trans_b=trans_b)
            set_const(op.inputs[1], b_new)
            self.put_const(op, 2, c_new, f"{op.name}/bias")
            op.attrs["beta"] = 1.0
        elif op.op in ("MatMul", "Add") and self.cfg.include_matmul:
            return self.fold_matmul(bn, op, bn_aff)
        else:
            raise NoMatch(f"preceded by {op.op}")
        self.counts[f"prev:{op.op}"] += 1
        unlink(bn)
        op.outputs[0] = z
        return []

    def fold_matmul(self, bn: gs.Node, op: gs.Node, bn_aff: bnm.BNAffine) -> list[gs.Node]:
        y, z = bn.inputs[0], bn.outputs[0]
        self.sole_consumer(y, bn, f"{op.op} output {y.name!r}")
        add: gs.Node | None = None
        bias: np.ndarray | None = None
        if op.op == "Add":
            add = op
            kinds = [(const_value(t), t) for t in add.inputs]
            consts = [i for i, (v, _) in enumerate(kinds) if v is not None]
            if len(add.inputs) != 2 or len(consts) != 1:
                raise NoMatch("preceded by an Add that is not MatMul + constant bias")
            bias_index = consts[0]
            bias = kinds[bias_index][0]
            mm_out = add.inputs[1 - bias_index]
            matmul = producer(mm_out)
            if matmul is None or matmul.op != "MatMul" or not is_default_domain(matmul.domain):
                raise NoMatch("preceded by an Add that does not follow a MatMul")
            self.sole_consumer(mm_out, add, f"MatMul output {mm_out.name!r}")
        else:
            matmul = op
        w = self.weight(matmul.inputs[1], "weight", ndim=2)
        if w.shape[1] != bn_aff.channels:
            raise NoMatch(f"MatMul has {w.shape[1]} outputs, BN has {bn_aff.channels}")
        rank = self.rank(matmul.inputs[0])
        if rank != 2:
            raise NoMatch(
                f"MatMul input has rank {rank if rank is not None else 'unknown'}; BN normalizes axis 1, which "
                "is the MatMul's output features only for 2-D inputs"
            )
        if bias is not None:
            if bias.dtype not in bnm.FLOAT_DTYPES or bias.size not in (1, bn_aff.channels) or bias.ndim > 2:
                raise NoMatch(f"bias of shape {bias.shape} is not per output feature")
            if bias.ndim == 2 and bias.shape[0] != 1:
                raise NoMatch(f"bias of shape {bias.shape} is not per output feature")
        w_new, b_new = bnm.matmul_then_bn(w, bias, bn_aff)
        set_const(matmul.inputs[1], w_new)
        unlink(bn)
        self.counts[f"prev:{op.op if add is None else 'MatMul+Add'}"] += 1
        if add is not None:
            self.put_const(add, bias_index, b_new, f"{add.name}/bias")
            add.outputs[0] = z
            return []
        const = gs.Constant(self.name(f"{bn.name}/bias"), b_new)
        return [self.new_node("Add", self.name(f"{bn.name}/bn_folded"), [y, const], [z])]

    # ------------------------------------------------------------------ 2. BN before the op
    def fold_following(self, bn: gs.Node, bn_aff: bnm.BNAffine) -> None:
        x, z = bn.inputs[0], bn.outputs[0]
        if id(z) in self._graph_outputs:
            raise NoMatch(f"its output {z.name!r} is a graph output")
        users = consumers(z)
        if not users:
            raise NoMatch("its output has no consumer")
        plans = []
        for user in users:
            if user.op not in ("Conv", "Gemm") or not is_default_domain(user.domain):
                raise NoMatch(f"followed by {user.op} {user.name!r}")
            if sum(1 for t in user.inputs if t is z) != 1 or user.inputs[0] is not z:
                raise NoMatch(f"{user.name!r} reads it other than as its data input")
            w = self.weight(user.inputs[1], "weight", ndim=2 if user.op == "Gemm" else None)
            b = self.optional_const(user, 2, "bias")
            if user.op == "Conv":
                pads = [int(p) for p in user.attrs.get("pads", [])]
                auto_pad = str(user.attrs.get("auto_pad", "NOTSET"))
                if any(pads) or auto_pad not in ("NOTSET", "VALID", ""):
                    raise NoMatch(
                        f"following Conv {user.name!r} pads its input (padding BN(x) with 0 is not exact in x)"
                    )
                group = int(user.attrs.get("group", 1))
                if w.ndim < 3 or w.shape[1] * group != bn_aff.channels:
                    raise NoMatch(f"Conv {user.name!r} has {w.shape[1] * group} input channels")
                plans.append((user, bnm.bn_then_conv(w, b, bn_aff, group=group)))
            else:
                if int(user.attrs.get("transA", 0)):
                    raise NoMatch(f"Gemm {user.name!r} has transA=1 (BN axis is not its K axis)")
                trans_b = bool(user.attrs.get("transB", 0))
                if w.shape[1 if trans_b else 0] != bn_aff.channels:
                    raise NoMatch(f"Gemm {user.name!r} has K={w.shape[1 if trans_b else 0]}")
                alpha = float(user.attrs.get("alpha", 1.0))
                beta = float(user.attrs.get("beta", 1.0))
                plans.append((user, bnm.bn_then_gemm(w, b, bn_aff, alpha=alpha, beta=beta, trans_b=trans_b)))
        for user, (w_new, b_new) in plans:
            set_const(user.inputs[1], w_new)
            self.put_const(user, 2, b_new, f"{user.name}/bias")
            if user.op == "Gemm":
                user.attrs["beta"] = 1.0
            self.counts[f"next:{user.op}"] += 1
        unlink(bn)
        redirect(z, x)

    # ------------------------------------------------------------------ 3. standalone BN
    def to_mul_add(self, bn: gs.Node, bn_aff: bnm.BNAffine) -> list[gs.Node]:
        x, z = bn.inputs[0], bn.outputs[0]
        rank = self.rank(x)
        if rank is None:
            rank = self.rank(z)
        if rank is None or rank < 2:
            raise NoMatch(f"the input rank is {'unknown' if rank is None else rank}")
        dtype = tensor_dtype(x) or tensor_dtype(x, self._inferred)
        if dtype is None:
            scale = const_value(bn.inputs[1])
            dtype = scale.dtype if scale is not None else np.dtype(np.float32)
        s, t = bnm.scale_shift(bn_aff, rank, np.dtype(dtype))
        s_const = gs.Constant(self.name(f"{bn.name}/scale"), s)
        t_const = gs.Constant(self.name(f"{bn.name}/shift"), t)
        # Typed only with a known shape: a value_info with a type but no shape fails onnx's full check.
        mid = gs.Variable(self.name(f"{z.name}/scaled"))
        if x.shape is not None:
            mid.dtype, mid.shape = dtype, x.shape
        unlink(bn)
        mul = self.new_node("Mul", self.name(f"{bn.name}/mul"), [x, s_const], [mid])
        add = self.new_node("Add", self.name(f"{bn.name}/add"), [mid, t_const], [z])
        return [mul, add]
