"""Per-node sensitivity of a quantized model and the search for the fewest nodes to give back (float or 16-bit).

Owns: `probe` / `probe_parts` / `noise` / `ranking` (one-run ranking), `evaluate` (full evaluations on an
executor), `search` / `prefix` (the search over ranked prefixes), `cost` (latency costs), `targets`, `stats`.
"""
