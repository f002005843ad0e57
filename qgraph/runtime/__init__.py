"""Running models in onnxruntime, and the arithmetic of the CPU they run on.

Owns: `compare` (sessions, feeds, output metrics), `evaluation` (held-out data, labels, metrics), `output_parts`
(outputs a final Concat joins, scored part by part), `streaming` (recurrent models run with their own state),
`layer_data` and `channel_means` (per-layer statistics in onnxruntime), `bodies` (If/Loop bodies run as models
of their own), `latency` (timing and the cost table's format), `kernels` (CPU families, the AVX2 emulation,
`Kernels`: how accuracy is measured), `executor` (local processes or Ray). May import: `qgraph.errors`, `qgraph.graph`,
`qgraph.io`, `qgraph.data`, `qgraph.quant`, `qgraph.options`.
"""
