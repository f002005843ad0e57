"""A small GPT-style decoder language model with real trained weights, for weight-only quantization benchmarks.

No PyPI wheel ships a decoder LM's weights, so this script trains one here on a real text corpus: the docstrings of
Python's own standard library (every importable stdlib module's, its classes' and functions' ``__doc__``) plus the
language reference topics of ``pydoc_data``, split by module into training (90 %) and held-out (10 %) text.

- tokenizer: byte-level BPE, 2,048 tokens (``tokenizers``), trained on the training split;
- model: 3 pre-LN transformer blocks, width 192, 4 heads, MLP 768 (GELU), context 64, learned positions,
  untied output head: ~2.1 M parameters, every linear a MatMul with a constant ``[K, N]`` weight (sized so that
  training fits in ~20 minutes on 2 CPU cores);
- training: AdamW (lr 2e-3, cosine decay, weight decay 0.1), batch 16 x 64 tokens, ``--steps`` steps (default
  1,200), torch on CPU (``pip install torch``: a benchmark tool only, never a dependency of qgraph);
- ONNX: built here from the trained weights in numpy (opset 17: LayerNormalization, causal mask as a constant),
  inputs ``input_ids [B, 64]`` int64 (a fixed window), output ``logits [B, 64, V]``; checked against the torch model.

``python benchmarks/decoder_lm.py [--steps N]`` trains (cached under ``$QGRAPH_BENCH_CACHE``) and prints the float
model's held-out perplexity; `load_decoder` is what ``bench_weight_only.py`` calls (it trains on first use).
Measured here (Python 3.11's stdlib, torch 2.13 CPU): 344,749 training and 52,857 held-out tokens; 1,200 steps in
36 min on 2 shared cores, training loss 3.66; float held-out perplexity 71.9 on 64 windows of 64 tokens (71.45 on the
benchmark's 128). The corpus depends on the Python version that builds it, so the numbers move with it.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import pkgutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, WIDTH, HEADS, LAYERS, MLP, CONTEXT, BATCH = 2048, 192, 4, 3, 768, 64, 16
SEED = 0


# ------------------------------------------------------------------------------------------------ corpus
def _docs_of(module: Any) -> list[str]:
    out = [module.__doc__ or ""]
    for _, obj in sorted(vars(module).items()):
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            out.append(obj.__doc__ or "")
            if inspect.isclass(obj):
                out += [m.__doc__ or "" for _, m in sorted(vars(obj).items()) if inspect.isfunction(m)]
    return [d.strip() for d in out if isinstance(d, str) and len(d.strip()) > 40]


def corpus() -> tuple[str, str]:
    """``(train, held_out)`` text: stdlib docstrings and reference topics, split by module name (stable)."""
    import importlib
    from pydoc_data import topics

    parts: dict[str, list[str]] = {}
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names)
    for name in names:
        if name.startswith(("_", "idlelib", "tkinter", "turtle", "antigravity", "this", "test")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:
            continue
        parts[name] = _docs_of(module)
    for key, text in sorted(topics.topics.items()):
        parts[f"topic:{key}"] = [text]
    train, held = [], []
    for key, docs in sorted(parts.items()):
        bucket = int(hashlib.sha1(key.encode()).hexdigest(), 16) % 10
        (held if bucket == 0 else train).extend(docs)
    return "\n\n".join(train), "\n\n".join(held)


def tokenizer(train_text: str, path: Path) -> Any:
    """Byte-level BPE of `VOCAB` tokens trained on ``train_text`` (cached at ``path``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([train_text], trainer)
    tok.save(str(path))
    return tok


def token_ids(tok: Any, text: str) -> np.ndarray:
    """The whole text as one int64 token stream."""
    return np.asarray(tok.encode(text).ids, np.int64)


# ------------------------------------------------------------------------------------------------ training
def train(ids: np.ndarray, steps: int) -> dict[str, np.ndarray]:
    """Train the decoder with torch (module docstring); the weights as float32 numpy arrays."""
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    torch.set_num_threads(2)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.fc, self.out = nn.Linear(WIDTH, MLP), nn.Linear(MLP, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
            q, k, v = (z.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2) for z in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, WIDTH))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))  # type: ignore[no-any-return]

    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = torch.from_numpy(ids)
    gen = torch.Generator().manual_seed(SEED)
    start = time.time()
    for step in range(steps):
        lr = 2e-3 * (min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        at = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=gen)
        x = torch.stack([data[i:i + CONTEXT] for i in at])
        y = torch.stack([data[i + 1:i + CONTEXT + 1] for i in at])
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    return {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ ONNX
class _Graph:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op: str, inputs: list[str], name: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def linear(self, x: str, w: dict[str, np.ndarray], key: str, name: str) -> str:
        y = self.op("MatMul", [x, self.const(f"{key}.weight", w[f"{key}.weight"].T)], f"{name}/MatMul")
        if f"{key}.bias" in w:
            y = self.op("Add", [y, self.const(f"{key}.bias", w[f"{key}.bias"])], f"{name}/Add")
        return y

    def norm(self, x: str, w: dict[str, np.ndarray], key: str) -> str:
        return self.op("LayerNormalization", [x, self.const(f"{key}.weight", w[f"{key}.weight"]),
                                              self.const(f"{key}.bias", w[f"{key}.bias"])], key, axis=-1,
                       epsilon=1e-5)


def _block(g: _Graph, w: dict[str, np.ndarray], i: int, x: str) -> str:
    p = f"blocks.{i}"
    qkv = g.linear(g.norm(x, w, f"{p}.ln1"), w, f"{p}.qkv", f"{p}.qkv")
    heads = []
    for j, part in enumerate("qkv"):
        s = g.op("Slice", [qkv, g.const(f"{p}/{part}/start", np.array([j * WIDTH])),
                           g.const(f"{p}/{part}/end", np.array([(j + 1) * WIDTH])), "axes_last"], f"{p}/{part}/slice")
        r = g.op("Reshape", [s, "heads_shape"], f"{p}/{part}/reshape")
        heads.append(g.op("Transpose", [r], f"{p}/{part}/transpose", perm=[0, 2, 1, 3]))
    q, k, v = heads
    kt = g.op("Transpose", [k], f"{p}/kT", perm=[0, 1, 3, 2])
    scores = g.op("Mul", [g.op("MatMul", [q, kt], f"{p}/QK"), "attn_scale"], f"{p}/scaled")
    masked = g.op("Add", [scores, "causal_slice"], f"{p}/masked")
    probs = g.op("Softmax", [masked], f"{p}/softmax", axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [probs, v], f"{p}/PV")], f"{p}/merge/transpose", perm=[0, 2, 1, 3])
    merged = g.op("Reshape", [ctx, "merge_shape"], f"{p}/merge/reshape")
    x = g.op("Add", [x, g.linear(merged, w, f"{p}.proj", f"{p}.proj")], f"{p}/residual1")
    h = g.linear(g.norm(x, w, f"{p}.ln2"), w, f"{p}.fc", f"{p}.fc")
    gelu = g.op("Mul", [g.op("Mul", [h, g.op("Add", [g.op("Erf", [g.op("Div", [h, "sqrt2"], f"{p}/gelu/div")],
                                                             f"{p}/gelu/erf"), "one"], f"{p}/gelu/add")],
                             f"{p}/gelu/mul"), "half"], f"{p}/gelu/half")
    return g.op("Add", [x, g.linear(gelu, w, f"{p}.out", f"{p}.out")], f"{p}/residual2")


def build_onnx(w: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The decoder as ONNX (module docstring), from `train`'s weights."""
    g = _Graph()
    g.const("axes_last", np.array([-1]))
    g.const("heads_shape", np.array([0, 0, HEADS, WIDTH // HEADS]))
    g.const("merge_shape", np.array([0, 0, WIDTH]))
    g.const("attn_scale", np.array(1 / math.sqrt(WIDTH // HEADS), np.float32))
    g.const("sqrt2", np.array(math.sqrt(2), np.float32))
    g.const("one", np.array(1, np.float32))
    g.const("half", np.array(0.5, np.float32))
    g.const("causal_slice", np.triu(np.full((CONTEXT, CONTEXT), -1e9, np.float32), 1))  # fixed length: CONTEXT
    x = g.op("Add", [g.op("Gather", [g.const("tok.weight", w["tok.weight"]), "input_ids"], "embed/tok"),
                     g.const("pos.weight", w["pos.weight"])], "embed")
    for i in range(LAYERS):
        x = _block(g, w, i, x)
    logits = g.op("MatMul", [g.norm(x, w, "ln"), g.const("head.weight", w["head.weight"].T)], "logits")
    graph = helper.make_graph(g.nodes, "decoder-lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                                                                       ["batch", CONTEXT])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["batch", CONTEXT, VOCAB])],
                              g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


# ------------------------------------------------------------------------------------------------ evaluation
def windows(ids: np.ndarray, n: int, length: int = CONTEXT) -> list[dict[str, np.ndarray]]:
    """``n`` evenly spaced windows of ``length + 1`` tokens as feeds ``{"input_ids": [1, length]}`` (the last token
    of each window is kept under ``"labels"`` for the perplexity)."""
    starts = np.linspace(0, len(ids) - length - 2, n).astype(int)
    return [{"input_ids": ids[s:s + length][None], "labels": ids[s + 1:s + length + 1][None]} for s in starts]


def perplexity(logits: list[np.ndarray], feeds: list[dict[str, np.ndarray]]) -> float:
    """``exp`` of the mean next-token cross-entropy over every position of every window."""
    total, count = 0.0, 0
    for z, feed in zip(logits, feeds, strict=True):
        z = z.reshape(-1, z.shape[-1]).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        labels = feed["labels"].reshape(-1)
        total -= float(logp[np.arange(labels.size), labels].sum())
        count += labels.size
    return math.exp(total / count)


def load_decoder(cache: Path, steps: int = 1200) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray, dict[str, Any]]:
    """``(model, train ids, held-out ids, info)``: trains on first use, then reads the cache."""
    tag = hashlib.sha1(f"{VOCAB}-{WIDTH}-{HEADS}-{LAYERS}-{MLP}-{CONTEXT}-{steps}-{SEED}".encode()).hexdigest()[:10]
    folder = cache / f"decoder-lm-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    train_text, held_text = corpus()
    tok = tokenizer(train_text, folder / "tokenizer.json")
    train_ids, held_ids = token_ids(tok, train_text), token_ids(tok, held_text)
    model_path, info_path = folder / "model.onnx", folder / "info.json"
    if not model_path.exists():
        start = time.time()
        weights = train(train_ids, steps)
        model = build_onnx(weights)
        onnx.save(model, str(model_path))
        info_path.write_text(json.dumps({"steps": steps, "train_tokens": int(train_ids.size),
                                         "held_out_tokens": int(held_ids.size), "seconds": time.time() - start}))
    info = json.loads(info_path.read_text())
    return onnx.load(str(model_path)), train_ids, held_ids, info


def main() -> None:
    """Train (or load) the decoder and print its held-out perplexity."""
    import onnxruntime as ort

    sys.path.insert(0, str(Path(__file__).parent))
    from real_models import cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    args = parser.parse_args()
    model, _, held_ids, info = load_decoder(cache_dir(), args.steps)
    feeds = windows(held_ids, 64)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = [session.run(None, {"input_ids": f["input_ids"]})[0] for f in feeds]
    print(f"decoder LM: {info['train_tokens']:,} training tokens, {info['held_out_tokens']:,} held out, "
          f"{info['steps']} steps; float held-out perplexity {perplexity(logits, feeds):.2f}")


if __name__ == "__main__":
    main()
