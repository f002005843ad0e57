"""The arithmetic of the integer kernels a quantized model deploys on, and measuring models with it.

- `qgraph.runtime.kernels.host`: this host's CPU flags and what onnxruntime's u8 x s8 kernels compute here (probed);
- `qgraph.runtime.kernels.pairs`: AVX2's int16 pair sums, and which weight pairs can overflow;
- `qgraph.runtime.kernels.emulate` (with `expand` and `corrections`): a model rewritten so onnxruntime computes a target
  CPU's integer arithmetic on any host;
- `qgraph.runtime.kernels.measure`: `Kernels`, how qgraph runs a model when it measures accuracy (the host's deployed
  kernels, or a target's arithmetic emulated), and the choice between them.

This package imports onnx and onnxruntime lazily where it can; it depends on `qgraph.pipeline.target`,
`qgraph.quant.qdq`, `qgraph.graph.ops` and `qgraph.runtime.compare` only.
"""
