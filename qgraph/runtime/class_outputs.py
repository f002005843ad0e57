"""Which graph outputs are class scores: the only outputs that get top-1 agreement.

Top-1 agreement (the share of rows whose arg-max agrees) means something for class scores only. A regression head's
``[N, 3]`` quality scores, an embedding ``[N, 384]`` or a box tensor has the same shape as class scores, so the
shape cannot decide. The rule, applied to the float model's graph (`class_outputs`): an output ``[N, C]`` (or
``[N, C, 1, ...]``) of floats with ``C >= 2`` is *class-like* when

1. a ``Softmax`` or ``LogSoftmax`` produces it (probabilities), or
2. its name, or its producer's, says so: it contains one of `CLASS_WORDS` (``logits``, ``probs``, ``class``,
   ``label``, ``cls``, ``softmax``; case-insensitive), or
3. a classifier head produces it (``Gemm``, ``MatMul`` or ``Conv``, a bias ``Add`` after it allowed) and it has at
   least `MIN_HEAD_CLASSES` columns: a head with fewer outputs is as likely a regression as a few classes.

Shape-only ops between the producer and the output (``Reshape``, ``Flatten``, ``Squeeze``, ``Identity``, ``Cast``,
Q/DQ) are looked through. Every other output gets no top-1 agreement (cosine and SQNR say how close it is); a class
metric on such an output is what ``--metric`` is for.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from qgraph.quant.qdq import is_qdq

#: Name fragments that mark an output as class scores (rule 2).
CLASS_WORDS = ("logit", "prob", "class", "label", "cls", "softmax")
#: Ops whose output is a probability distribution over classes (rule 1).
PROBABILITY_OPS = frozenset({"Softmax", "LogSoftmax"})
#: Ops of a classifier head (rule 3), and the fewest columns such a head needs to count as class scores.
HEAD_OPS = frozenset({"Gemm", "MatMul", "Conv"})
MIN_HEAD_CLASSES = 10
#: Ops looked through on the way back from an output to what computes it.
_SHAPE_ONLY = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast"})


def class_outputs(model: onnx.ModelProto | str | Path) -> dict[str, int]:
    """Class-like outputs of ``model`` (see module docs) and the fewest columns each needs to be scored as class
    scores (2, or `MIN_HEAD_CLASSES` for a head that only its op type marks). A path is read without its weights."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    producer = {o: n for n in proto.graph.node for o in n.output if o}
    found: dict[str, int] = {}
    for out in proto.graph.output:
        node, seen = producer.get(out.name), 0
        while node is not None and seen < 16 and (node.op_type in _SHAPE_ONLY or is_qdq(node.op_type, node.domain)
                                                  or _bias_add(node, producer)):
            if _named(node.name):
                break
            node, seen = producer.get(node.input[0]) if node.input else None, seen + 1
        if _named(out.name) or (node is not None and (node.op_type in PROBABILITY_OPS or _named(node.name))):
            found[out.name] = 2
        elif node is not None and node.op_type in HEAD_OPS:
            found[out.name] = MIN_HEAD_CLASSES
    return found


def _named(name: str) -> bool:
    low = name.lower()
    return any(word in low for word in CLASS_WORDS)


def _bias_add(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto]) -> bool:
    """An ``Add`` right after a head op (its bias): looked through to the head."""
    first = producer.get(node.input[0]) if node.op_type == "Add" and node.input else None
    return first is not None and first.op_type in HEAD_OPS
