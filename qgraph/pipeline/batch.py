"""One recipe over many models: each model is a task on an executor (`qgraph.runtime.executor`: local or Ray).

Every model's output is ``OUT_DIR/<stem>.int8.onnx``, where ``<stem>`` is the model's file name without its last
suffix (``nets/resnet.onnx`` → ``OUT_DIR/resnet.int8.onnx``). `plan_outputs` refuses, before any work, two models
that would write the same output and an output that is one of the inputs. A model that fails does not stop the
others: its `ModelOutcome` says why in one sentence, and nothing is written for it (outputs are written
atomically). Calibration data given as a string may contain ``{stem}`` (``calib/{stem}.npz``) to give each model
its own data.

On Ray, models, data and the output folder must be at the same paths on every node (a shared file system); the
recipe itself travels to the workers once, through the object store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from qgraph.data import DataLayout
from qgraph.errors import QGraphError, UsageError
from qgraph.io.outputs import check_outputs
from qgraph.pipeline.recipe import Recipe
from qgraph.pipeline.runner import PipelineEvent
from qgraph.runtime.executor import Executor, Progress

#: What is appended to a model's stem to name its output.
OUTPUT_SUFFIX = ".int8.onnx"

Status = Literal["ok", "goal not met", "failed"]


@dataclass(frozen=True)
class BatchJob:
    """What every task shares: the recipe and the run options (sent to each worker once)."""

    recipe: Recipe
    calibration_data: str | None = None
    samples: int | None = None
    data_layout: DataLayout = "auto"
    verify: bool = False
    verify_tolerance: float = 1e-5


@dataclass(frozen=True)
class ModelOutcome:
    """One model's row of the summary: status, passes run, seconds, the output written (or the error)."""

    model: str
    output: str
    status: Status
    passes_done: int
    passes_total: int
    seconds: float
    error: str = ""

    @property
    def written(self) -> bool:
        """Whether the output file was written (also when a recipe goal was not met)."""
        return self.status != "failed"


def output_path(model: str | Path, out_dir: str | Path) -> Path:
    """``out_dir/<model stem>.int8.onnx``."""
    return Path(out_dir) / f"{Path(model).stem}{OUTPUT_SUFFIX}"


def plan_outputs(models: Sequence[Path], out_dir: Path, other_inputs: Sequence[Path | None] = ()) -> list[Path]:
    """The output of each model, checked: no two models share one, none is an input (`UsageError`/`OutputError`)."""
    if not models:
        raise UsageError("give at least one model.")
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out-dir {out_dir}: is a file; give a folder (it is created when missing).")
    outputs = [output_path(m, out_dir) for m in models]
    seen: dict[Path, Path] = {}
    for model, out in zip(models, outputs, strict=True):
        if out in seen:
            raise UsageError(
                f"{seen[out]} and {model} would both be written to {out} (outputs are named <stem>{OUTPUT_SUFFIX}); "
                "rename one of them or run them into different --out-dir folders."
            )
        seen[out] = model
    check_outputs({f"output of {m}": o for m, o in zip(models, outputs, strict=True)},
                  inputs=[*models, *other_inputs], models=[f"output of {m}" for m in models])
    return outputs


def run_model(job: BatchJob, item: tuple[str, str]) -> ModelOutcome:
    """Run ``job.recipe`` on one model and write its output; every error becomes the outcome's sentence."""
    model, output = item
    start = time.perf_counter()
    done = 0
    total = len(job.recipe.passes) + (job.recipe.target.opset is not None)  # the opset conversion is a step

    def on_event(ev: PipelineEvent) -> None:
        nonlocal done, total
        total = ev.total
        if ev.kind == "pass_end":
            done += 1

    data = job.calibration_data.replace("{stem}", Path(model).stem) if job.calibration_data else None
    try:
        result = job.recipe.pipeline().run(
            model, calibration_data=data, verify=job.verify, verify_tolerance=job.verify_tolerance,
            on_event=on_event, samples=job.samples, data_layout=job.data_layout,
        )
        result.save(output)
    except QGraphError as exc:
        return ModelOutcome(model, output, "failed", done, total, time.perf_counter() - start, exc.message)
    except Exception as exc:  # a bug or a library error on this model must not stop the others
        return ModelOutcome(model, output, "failed", done, total, time.perf_counter() - start,
                            f"{type(exc).__name__}: {exc}")
    unmet = "; ".join(f"pass #{r.index} {r.name}: {r.result.unmet}" for r in result.records if r.result.unmet)
    return ModelOutcome(model, output, "goal not met" if unmet else "ok", done, total,
                        time.perf_counter() - start, unmet)


def run_many(
    job: BatchJob,
    models: Sequence[Path],
    outputs: Sequence[Path],
    executor: Executor,
    *,
    progress: Progress | None = None,
) -> list[ModelOutcome]:
    """`run_model` for every model on ``executor``; outcomes in the order of ``models``.

    Workers get absolute paths (a Ray worker's working folder need not be this process's); a calibration-data
    path is made absolute too."""
    items = [(str(m.absolute()), str(o.absolute())) for m, o in zip(models, outputs, strict=True)]
    data = job.calibration_data
    if data is not None and "{stem}" not in data and Path(data).exists():
        job = replace(job, calibration_data=str(Path(data).absolute()))
    elif data is not None and "{stem}" in data and not Path(data).is_absolute() and ":" not in data:
        job = replace(job, calibration_data=str(Path(data).absolute()))
    return executor.map(run_model, items, shared=job, progress=progress)
