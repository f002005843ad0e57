"""A small BERT-like (post-LayerNorm) encoder built with onnx.helper, shaped like real exporter output."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.testing._common import add_initializer, add_node, new_model


class _Encoder:
    """Appends encoder nodes to a graph; one instance builds one model."""

    def __init__(self, model: onnx.ModelProto, opset: int, seed: int) -> None:
        self.graph = model.graph
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self.outliers: tuple[np.ndarray, np.ndarray] | None = None  # (channels, gains) of every LayerNorm

    def const(self, name: str, array: np.ndarray) -> str:
        add_initializer(self.graph, name, array)
        return name

    def node(self, op_type: str, name: str, inputs: list[str], **attrs: object) -> str:
        add_node(self.graph, op_type, inputs, [f"{name}_out"], name, **attrs)
        return f"{name}_out"

    def linear(self, name: str, x: str, fan_in: int, fan_out: int) -> str:
        """MatMul with a Xavier-normal weight followed by Add with a small bias (as exporters emit)."""
        std = np.sqrt(2.0 / (fan_in + fan_out))
        weight = self.rng.standard_normal((fan_in, fan_out), dtype=np.float32) * np.float32(std)
        bias = self.rng.normal(0.0, 0.02, fan_out).astype(np.float32)
        y = self.node("MatMul", f"{name}/matmul", [x, self.const(f"{name}.weight", weight)])
        return self.node("Add", f"{name}/add", [y, self.const(f"{name}.bias", bias)])

    def split_heads(self, name: str, x: str, width: int, perm: list[int]) -> str:
        """Projection, Reshape to ``[batch, seq, heads, head_dim]`` and Transpose by ``perm``."""
        y = self.node("Reshape", f"{name}_split", [self.linear(name, x, width, width), "const/heads_shape"])
        return self.node("Transpose", f"{name}_heads", [y], perm=perm)

    def layer_norm(self, name: str, x: str, width: int) -> str:
        gamma = self.rng.uniform(0.8, 1.2, width).astype(np.float32)
        beta = self.rng.normal(0.0, 0.05, width).astype(np.float32)
        if self.outliers is not None:
            channels, gains = self.outliers
            gamma[channels] *= gains
        scale, shift = self.const(f"{name}.weight", gamma), self.const(f"{name}.bias", beta)
        if self.opset >= 17:
            return self.node("LayerNormalization", name, [x, scale, shift], axis=-1, epsilon=1e-12)
        # Exporters decompose LayerNormalization below opset 17.
        mean = self._reduce_mean(f"{name}/mean", x)
        centered = self.node("Sub", f"{name}/sub", [x, mean])
        squared = self.node("Pow", f"{name}/pow", [centered, "const/two"])
        var = self._reduce_mean(f"{name}/var", squared)
        std = self.node("Sqrt", f"{name}/sqrt", [self.node("Add", f"{name}/add_eps", [var, "const/eps"])])
        normed = self.node("Div", f"{name}/div", [centered, std])
        return self.node("Add", f"{name}/add", [self.node("Mul", f"{name}/mul", [normed, scale]), shift])

    def _reduce_mean(self, name: str, x: str) -> str:
        if self.opset >= 18:
            return self.node("ReduceMean", name, [x, "const/axes_last"], keepdims=1)
        return self.node("ReduceMean", name, [x], axes=[-1], keepdims=1)

    def gelu(self, name: str, x: str) -> str:
        """Erf-based Gelu exactly as torch.onnx emits it at opset 17: 0.5 * x * (1 + erf(x / sqrt(2)))."""
        erf = self.node("Erf", f"{name}/erf", [self.node("Div", f"{name}/div", [x, "const/sqrt2"])])
        plus = self.node("Add", f"{name}/add", [erf, "const/one"])
        product = self.node("Mul", f"{name}/mul", [x, plus])
        return self.node("Mul", f"{name}/mul_half", [product, "const/half"])


def transformer_encoder(
    opset: int = 17,
    layers: int = 2,
    d_model: int = 64,
    heads: int = 4,
    seq: int = 16,
    *,
    vocab: int | None = None,
    ffn: int | None = None,
    seed: int = 0,
    dynamic: bool = True,
    mask_value: float = -10000.0,
    outlier_channels: int = 0,
) -> onnx.ModelProto:
    """Build a small BERT-like (post-LN) encoder with onnx.helper for transformer quantization tests.

    Inputs: ``embeddings [batch, seq, d_model]`` float (or ``input_ids [batch, seq]`` int64 followed by
    word + position embedding Gathers and a LayerNorm when ``vocab`` is given) and ``attention_mask
    [batch, seq]`` float (1 = keep, 0 = pad), turned into an additive mask ``(1 - mask) * mask_value`` as
    real exporters do. With ``dynamic`` the batch and seq dims are the symbols ``batch``/``seq``; ``seq``
    is then only the size of the position table (and of the inputs when not dynamic).

    Each layer: Q/K/V MatMul+Add → Reshape/Transpose to heads → MatMul → Div(sqrt(d_k)) → Add(mask) →
    Softmax → MatMul → Transpose/Reshape → output projection → residual Add → LayerNormalization →
    MatMul+Add → erf Gelu (Div, Erf, Add, Mul, Mul) → MatMul+Add → residual Add → LayerNormalization.
    LayerNormalization is the opset-17 op; below 17 it is decomposed (ReduceMean/Sub/Pow/Sqrt/Div) as
    exporters do. Weights are seeded Xavier-normal, biases N(0, 0.02). Output: ``last_hidden_state``.
    ``outlier_channels`` > 0 multiplies the LayerNorm γ of that many fixed (seeded) channels by 20-100x, the
    systematic activation outliers of trained BERT-style encoders (what SmoothQuant targets).
    Supports opset 13 and later.
    """
    if opset < 13:
        raise ValueError(f"transformer_encoder needs opset >= 13 (Unsqueeze with axes input), got {opset}")
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
    head_dim = d_model // heads
    ffn = ffn or 4 * d_model
    model = new_model(opset, f"transformer_encoder_{layers}x{d_model}")
    enc = _Encoder(model, opset, seed)
    if outlier_channels:
        pick = np.random.default_rng([seed, 11])
        channels = pick.choice(d_model, size=min(outlier_channels, d_model), replace=False)
        enc.outliers = (channels, pick.uniform(20.0, 100.0, channels.size).astype(np.float32))
    graph = model.graph
    batch_dim: int | str = "batch" if dynamic else 1
    seq_dim: int | str = "seq" if dynamic else seq

    scalars = {"one": 1.0, "half": 0.5, "two": 2.0, "eps": 1e-12, "mask_value": mask_value}
    scalars.update(sqrt2=float(np.sqrt(2.0)), sqrt_dk=float(np.sqrt(head_dim)))
    for name, value in scalars.items():
        enc.const(f"const/{name}", np.array(value, dtype=np.float32))
    enc.const("const/axes_last", np.array([-1], dtype=np.int64))
    enc.const("const/mask_axes", np.array([1, 2], dtype=np.int64))
    enc.const("const/heads_shape", np.array([0, 0, heads, head_dim], dtype=np.int64))
    enc.const("const/merge_shape", np.array([0, 0, d_model], dtype=np.int64))

    if vocab is None:
        emb_shape: list[int | str] = [batch_dim, seq_dim, d_model]
        graph.input.append(helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, emb_shape))
        x = "embeddings"
    else:
        ids_shape: list[int | str] = [batch_dim, seq_dim]
        graph.input.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, ids_shape))
        word_table = enc.rng.normal(0.0, 1.0, (vocab, d_model)).astype(np.float32)
        position_table = enc.rng.normal(0.0, 0.5, (seq, d_model)).astype(np.float32)
        words = enc.const("embeddings/word.weight", word_table)
        table = enc.const("embeddings/position.weight", position_table)
        word = enc.node("Gather", "embeddings/word", [words, "input_ids"], axis=0)
        shape = enc.node("Shape", "embeddings/shape", ["input_ids"])
        one = enc.const("const/one_i64", np.array(1, np.int64))
        zero = enc.const("const/zero_i64", np.array(0, np.int64))
        length = enc.node("Gather", "embeddings/seq_len", [shape, one], axis=0)
        positions = enc.node("Range", "embeddings/positions", [zero, length, one])
        pos = enc.node("Gather", "embeddings/position", [table, positions], axis=0)
        x = enc.layer_norm("embeddings/ln", enc.node("Add", "embeddings/add", [word, pos]), d_model)
    mask_shape: list[int | str] = [batch_dim, seq_dim]
    graph.input.append(helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, mask_shape))

    mask = enc.node("Unsqueeze", "mask/unsqueeze", ["attention_mask", "const/mask_axes"])
    inverted = enc.node("Sub", "mask/invert", ["const/one", mask])
    additive = enc.node("Mul", "mask/scale", [inverted, "const/mask_value"])

    for i in range(layers):
        p = f"layer{i}"
        q = enc.split_heads(f"{p}/attn/q", x, d_model, [0, 2, 1, 3])
        k = enc.split_heads(f"{p}/attn/k", x, d_model, [0, 2, 3, 1])
        v = enc.split_heads(f"{p}/attn/v", x, d_model, [0, 2, 1, 3])
        scores = enc.node("MatMul", f"{p}/attn/qk", [q, k])
        scores = enc.node("Div", f"{p}/attn/scale", [scores, "const/sqrt_dk"])
        scores = enc.node("Add", f"{p}/attn/mask", [scores, additive])
        probs = enc.node("Softmax", f"{p}/attn/softmax", [scores], axis=-1)
        context = enc.node("MatMul", f"{p}/attn/pv", [probs, v])
        context = enc.node("Transpose", f"{p}/attn/merge_heads", [context], perm=[0, 2, 1, 3])
        context = enc.node("Reshape", f"{p}/attn/merge", [context, "const/merge_shape"])
        attn = enc.linear(f"{p}/attn/out", context, d_model, d_model)
        x = enc.layer_norm(f"{p}/attn/ln", enc.node("Add", f"{p}/attn/residual", [attn, x]), d_model)
        hidden = enc.gelu(f"{p}/ffn/gelu", enc.linear(f"{p}/ffn/up", x, d_model, ffn))
        down = enc.linear(f"{p}/ffn/down", hidden, ffn, d_model)
        x = enc.layer_norm(f"{p}/ffn/ln", enc.node("Add", f"{p}/ffn/residual", [down, x]), d_model)

    last = graph.node[len(graph.node) - 1]
    assert last.output[0] == x, "the final LayerNorm must be the last node"
    last.output[0] = "last_hidden_state"
    out_shape: list[int | str] = [batch_dim, seq_dim, d_model]
    graph.output.append(helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, out_shape))
    return model


def transformer_encoder_inputs(
    n: int,
    seed: int = 0,
    *,
    batch: int = 1,
    seq: int = 16,
    d_model: int = 64,
    vocab: int | None = None,
    vary_seq: bool = False,
) -> list[dict[str, np.ndarray]]:
    """``n`` realistic feeds for :func:`transformer_encoder` (pass the same ``seq``/``d_model``/``vocab``).

    Each row of each feed has a random valid length in ``[seq // 4, seq]``; positions past it are padding:
    ``attention_mask`` 0 there and the input is the pad token (id 0, or one fixed seeded "pad" embedding
    vector). Valid embeddings are N(0, 1), valid ids uniform in ``[1, vocab)``. With ``vary_seq`` each
    feed also gets its own sequence length in ``[seq // 2, seq]`` (exercises the dynamic seq dim;
    feeds then cannot be concatenated along the batch axis).
    """
    rng = np.random.default_rng(seed)
    pad_vector = np.random.default_rng([seed, 7]).standard_normal(d_model, dtype=np.float32)
    feeds: list[dict[str, np.ndarray]] = []
    for _ in range(n):
        length = int(rng.integers(max(1, seq // 2), seq + 1)) if vary_seq else seq
        valid = rng.integers(max(1, length // 4), length + 1, size=batch)
        mask = (np.arange(length)[None, :] < valid[:, None]).astype(np.float32)
        feed: dict[str, np.ndarray] = {}
        if vocab is None:
            emb = rng.standard_normal((batch, length, d_model), dtype=np.float32)
            emb[mask == 0] = pad_vector
            feed["embeddings"] = emb
        else:
            ids = rng.integers(1, vocab, size=(batch, length)).astype(np.int64)
            ids[mask == 0] = 0
            feed["input_ids"] = ids
        feed["attention_mask"] = mask
        feeds.append(feed)
    return feeds
