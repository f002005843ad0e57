"""The math of the accuracy-recovery passes, shared by them and by plug-ins.

Owns: `equalize` (cross-layer equalization and SmoothQuant scales), `smoothing` (the INT8 error SmoothQuant's
``alpha: auto`` scores candidates by), `rounding` (adaptive rounding), and
`weight_correction` (what bias correction and rounding optimization share: layers, batches, the fidelity guard).
May import: everything up to `qgraph.pipeline` (passes' base types), never `remedy`, `analysis` or `cli`.
"""
