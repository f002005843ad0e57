"""Where accuracy was lost: diffs, sensitivity, inspection, the run report and the validation gate.

Owns: `diff` (structural and numeric diffs, culprit Q/DQ pairs), `sensitivity` (ranking and the automatic fallback
search), `inspect` (a model summarised), `report` (the run report), `check` (the validation chain), `fidelity`
(``qgraph run``'s final check). May import every layer below it; only `qgraph.cli` imports it.
"""
