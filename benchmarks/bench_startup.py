"""Benchmark: how long the ``qgraph`` command takes before it does anything (start-up), against onnxruntime's
own command-line tool in the same run.

    python benchmarks/bench_startup.py [--runs 10]

Each command runs ``--runs`` times as a fresh process (the way a user types it); the table shows the median and
the slowest, against the target: ``--help`` and usage errors under 0.3 s, ``validate`` and ``passes`` under
0.8 s (these load the pass registry: pydantic configs, onnx). The reference row is
``python -m onnxruntime.quantization.preprocess --help``, what a user of onnxruntime's quantizer waits for.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
QGRAPH = [sys.executable, "-c", "import sys; from qgraph.cli import main; sys.exit(main())"]

#: (label, argv, target seconds or None for the reference)
CASES: list[tuple[str, list[str], float | None]] = [
    ("qgraph --help", [*QGRAPH, "--help"], 0.3),
    ("qgraph run --help", [*QGRAPH, "run", "--help"], 0.3),
    ("qgraph nosuch (usage error)", [*QGRAPH, "nosuch"], 0.3),
    ("qgraph run (missing arguments)", [*QGRAPH, "run"], 0.3),
    ("qgraph validate recipes/ort-cpu.yaml", [*QGRAPH, "validate", str(ROOT / "recipes" / "ort-cpu.yaml")], 0.8),
    ("qgraph passes", [*QGRAPH, "passes"], 0.8),
    ("onnxruntime preprocess --help (reference)",
     [sys.executable, "-m", "onnxruntime.quantization.preprocess", "--help"], None),
]


def timed(argv: list[str], runs: int) -> list[float]:
    """Wall seconds of ``runs`` fresh processes of ``argv`` (output discarded)."""
    env = {**os.environ, "COLUMNS": "80"}
    seconds = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
        seconds.append(time.perf_counter() - t)
    return seconds


def main() -> int:
    """Print the start-up table; exit 1 when a qgraph command misses its target."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    cpu = platform.processor() or platform.machine()
    table = Table(title=f"start-up, median of {args.runs} fresh processes ({cpu}, {os.cpu_count()} CPUs, "
                  f"load {os.getloadavg()[0]:.1f})")
    for col in ("command", "median s", "max s", "target s", "ok"):
        table.add_column(col, justify="left" if col == "command" else "right")
    missed = 0
    for label, argv, target in CASES:
        seconds = timed(argv, args.runs)
        median = statistics.median(seconds)
        ok = "" if target is None else ("yes" if median < target else "NO")
        missed += ok == "NO"
        table.add_row(label, f"{median:.3f}", f"{max(seconds):.3f}", "-" if target is None else f"{target:.1f}", ok)
    Console().print(table)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
