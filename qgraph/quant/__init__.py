"""Quantization math and Q/DQ structure, in one place.

Owns: `math` (dtypes and their integer ranges, scales, zero points, rounding, quantize/dequantize, int32 biases:
"how is a scale computed"), `qdq` (Q/DQ recognition with the domain check, pairs in protos, onnxruntime's fusion
report), `qdq_graph` (the same on the graphsurgeon graph: predicates, `QParams`, float sources), `layers` (quantized
weighted layers as the weight corrections see them), `reference_weights` (the float weight behind a quantized node),
`rescaling` (per-channel factors recorded in a model). May import: `qgraph.errors`, `qgraph.graph`.
"""
