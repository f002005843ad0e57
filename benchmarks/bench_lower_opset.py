"""Opset conformance benchmark: qgraph's lower_model vs onnx.version_converter on the ONNX node tests.

Generates the backend node-test corpus into a cache folder (never committed), runs every original in
onnxruntime, lowers each test whose original runs correctly to 17, 13 and 11 (where lower than its own
opset) with both engines, runs the results and compares them with the expected outputs. Writes
``docs/opset_conformance.md``.

    python benchmarks/bench_lower_opset.py [--cache DIR] [--workers 2] [--out docs/opset_conformance.md]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "conformance"))
sys.path.insert(0, str(ROOT))

import opset_corpus as oc  # noqa: E402

TARGETS = (17, 13, 11)
ENGINES = ("qgraph", "version_converter")
_OP_RE = re.compile(r"^- (\w+) node")


def _baseline(name: str, root: str) -> tuple[str, int, str, str]:
    case = Path(root) / name
    model, _, _ = oc.load_case(case)
    try:
        status, detail = oc.baseline(case)
    except Exception as exc:  # harness-level problem: count as ORT failure
        status, detail = "fails", repr(exc)[:200]
    return name, oc.default_opset(model), status, detail


def _classify(args: tuple[str, str, int, str]) -> tuple[str, int, str, str, str]:
    name, root, target, engine = args
    try:
        status, detail = oc.classify(Path(root) / name, target, engine)
    except Exception as exc:
        status, detail = "crash", f"harness: {exc!r}"[:300]
    return name, target, engine, status, detail


def _ops(root: str, name: str) -> list[str]:
    import onnx

    m = onnx.load(str(Path(root) / name / "model.onnx"))
    return sorted({n.op_type for n in m.graph.node})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", default=os.environ.get("QGRAPH_OPSET_CORPUS", "/tmp/qgraph_opset_corpus"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "docs" / "opset_conformance.md"))
    parser.add_argument("--limit", type=int, default=0, help="only the first N tests (smoke runs)")
    args = parser.parse_args()
    t0 = time.time()
    root = Path(args.cache) / "node"
    if not root.is_dir() or len(list(root.iterdir())) < 1000:
        oc.generate_corpus(args.cache)
    t_gen = time.time() - t0
    names = sorted(p.name for p in root.iterdir() if (p / "model.onnx").exists())
    if args.limit:
        names = names[: args.limit]
    with Pool(args.workers) as pool:
        base = pool.starmap(_baseline, [(n, str(root)) for n in names], chunksize=8)
        opset = {b[0]: b[1] for b in base}
        ok = [b[0] for b in base if b[2] == "ok"]
        too_new = [b[0] for b in base if b[2] == "too_new"]
        jobs = [(n, str(root), t, e) for t in TARGETS for e in ENGINES for n in ok if opset[n] > t]
        jobs += [(n, str(root), t, "qgraph") for t in TARGETS for n in too_new]
        results = pool.map(_classify, jobs, chunksize=4)
    elapsed = time.time() - t0
    ok_set = set(ok)
    table: dict[tuple[int, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    refusals: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    nonpass: dict[int, list[tuple[str, str, str]]] = collections.defaultdict(list)
    rescued: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for name, target, engine, status, detail in results:
        if name in ok_set:
            table[(target, engine)][status] += 1
            if engine == "qgraph" and status != "pass":
                m = _OP_RE.match(detail)
                refusals[target][m.group(1) if m else "?"] += 1
                nonpass[target].append((name, status, detail))
        else:
            rescued[target][status] += 1
    lines = _render(base, table, refusals, rescued, nonpass, elapsed, t_gen, len(names))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    for t in TARGETS:
        for e in ENGINES:
            c = table[(t, e)]
            print(f"opset {t:>2} {e:<18} " + " ".join(f"{k}={c[k]}" for k in ("pass", "refused", "wrong", "crash")))
    print(f"total {elapsed:.0f}s; wrote {args.out}")
    bad = sum(table[(t, "qgraph")][k] for t in TARGETS for k in ("wrong", "crash"))
    return 1 if bad else 0


def _render(
    base: list[tuple[str, int, str, str]],
    table: dict[tuple[int, str], collections.Counter[str]],
    refusals: dict[int, collections.Counter[str]],
    rescued: dict[int, collections.Counter[str]],
    nonpass: dict[int, list[tuple[str, str, str]]],
    elapsed: float,
    t_gen: float,
    n_tests: int,
) -> list[str]:
    import onnx
    import onnxruntime

    status = collections.Counter(b[2] for b in base)
    out = [
        "# Opset conformance (generated)",
        "",
        "Generated by `python benchmarks/bench_lower_opset.py`; do not edit by hand.",
        "",
        f"Corpus: the {n_tests} ONNX backend node tests shipped with onnx {onnx.__version__}, run in onnxruntime "
        f"{onnxruntime.__version__} (CPU). A lowered test **passes** when onnxruntime runs it and matches the expected "
        "outputs (rtol 1e-3, atol 1e-7). **refused**: qgraph raised a `PassError` naming the node and reason "
        "(for version_converter: it raised). **wrong**: ran but gave different outputs. **crash**: any other "
        "failure (invalid model, onnxruntime cannot load or run it, unexpected exception).",
        "",
        f"Run time: {elapsed:.0f} s on 2 workers (corpus generation {t_gen:.0f} s).",
        "",
        "## Originals",
        "",
        f"- run correctly in onnxruntime: {status['ok']} (these are the conformance set)",
        f"- opset/IR newer than onnxruntime supports: {status['too_new']}",
        f"- onnxruntime cannot run (missing kernel, unsupported dtype feed, ...): {status['fails']}",
        f"- onnxruntime runs but disagrees with the expected outputs: {status['wrong']}",
        "",
        "## Lowering results (tests whose original runs correctly, lowered where the target is below their opset)",
        "",
        "| target | engine | tests | pass | refused | wrong | crash | pass rate |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in TARGETS:
        for e in ENGINES:
            c = table[(t, e)]
            n = sum(c.values())
            rate = f"{100 * c['pass'] / n:.1f}%" if n else "-"
            out.append(f"| {t} | {e} | {n} | {c['pass']} | {c['refused']} | {c['wrong']} | {c['crash']} | {rate} |")
    out += [
        "",
        "## Originals onnxruntime cannot load because their opset is too new, lowered by qgraph",
        "",
        "| target | tests | runnable and correct | refused | wrong | crash |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in TARGETS:
        c = rescued[t]
        out.append(f"| {t} | {sum(c.values())} | {c['pass']} | {c['refused']} | {c['wrong']} | {c['crash']} |")
    out += [
        "",
        "## qgraph refusals by op type",
        "",
        "| op type | " + " | ".join(f"opset {t}" for t in TARGETS) + " |",
        "| --- | " + " | ".join("---:" for _ in TARGETS) + " |",
    ]
    ops = sorted({op for t in TARGETS for op in refusals[t]}, key=lambda o: (-sum(refusals[t][o] for t in TARGETS), o))
    for op in ops:
        out.append(f"| {op} | " + " | ".join(str(refusals[t][op]) for t in TARGETS) + " |")
    out += ["", "## Every qgraph non-pass at opset 11 (reason)", "", "<details><summary>show</summary>", ""]
    for name, st, detail in sorted(nonpass[11]):
        out.append(f"- `{name}` — {st}: {detail.replace('|', '/')}")
    out += ["", "</details>", "", "## Originals onnxruntime cannot run", "", "<details><summary>show</summary>", ""]
    for name, _, st, detail in sorted(base):
        if st in ("too_new", "fails"):
            out.append(f"- `{name}` — {st}: {detail.replace('|', '/')[:160]}")
    out += ["", "</details>"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
