"""Recipes and the pipeline that runs their passes.

Owns: `pass_api` (Pass, PassContext, registry), `pass_result` (PassResult, Skipped), `pass_details` (PassDetails,
the base of a pass's typed details), `contract` (what every pass is held to), `runner` (`Pipeline`), `recipe` /
`recipe_text` / `recipe_yaml` (the recipe model, its canonical text, YAML with line numbers), `target` (the target
and calibration sections of a recipe), `preflight` (options checked against the model before any pass), `verify`
(numeric verification of float-preserving passes), `provenance`, `timing`, `batch` (one recipe over many models).
May import: everything below it (`errors`, `options`, `graph`, `io`, `data`, `quant`, `runtime`, `calibrate`),
never `recovery`, `remedy`, `analysis` or `cli`.
"""
