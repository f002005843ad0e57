"""What a chosen node of a quantized model becomes instead: float, 16-bit activations, 16-bit weights.

Owns: `fallback` (a node back to float, Q/DQ pairs bypassed, float weights restored), `widen` (16-bit activations),
`widen_weights` (16-bit weights), `apply` (any of them, in the top graph and inside If/Loop bodies). May import:
`errors`, `options`, `graph`, `quant`, `runtime`, never `pipeline`, `analysis` or `cli`.
"""
