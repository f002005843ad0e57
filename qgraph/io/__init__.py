"""Files: models in and out (external data, >2 GB, streaming protobuf reads and writes) and the guard every written
output goes through (atomic writes, never an input).

Owns: `model_io` (load/save, fingerprints), `proto_stream` (field-by-field protobuf I/O), `outputs` (output guard,
atomic writer), `inputs` (regular files only, bounded reads). May import: `qgraph.errors`, `qgraph.graph`.
"""
