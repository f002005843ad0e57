"""Example plug-in passes for qgraph: a peephole rewrite (`neg_to_mul`) and an analysis (`critical_path`)."""
