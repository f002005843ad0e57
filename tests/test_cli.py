"""CLI commands on the bundled example: inspect, passes, lower."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx

from qgraph.cli import main
from qgraph.runtime.compare import make_session, run

DIGITS = Path(__file__).resolve().parents[1] / "examples" / "digits"


def test_inspect_json(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["inspect", str(DIGITS / "model.onnx"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["opsets"]["ai.onnx"] == 17
    assert info["ops"].count("BatchNormalization") == 3
    assert info["inputs"][0]["shape"][1:] == [1, 8, 8]


def test_passes_lists_builtins(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["passes"]) == 0
    text = capsys.readouterr().out
    for name in ("fold_constants", "fuse_batchnorm", "cleanup", "lower_opset", "raise_opset", "insert_qdq"):
        assert name in text


def test_lower_cli_keeps_results(tmp_path: Path) -> None:
    out = tmp_path / "d11.onnx"
    assert main(["lower", str(DIGITS / "model.onnx"), "--opset", "11", "-o", str(out), "--verify"]) == 0
    lowered = onnx.load(str(out))
    assert [o.version for o in lowered.opset_import if o.domain in ("", "ai.onnx")] == [11]
    onnx.checker.check_model(lowered, full_check=True)
    x = np.load(DIGITS / "calibration.npz")
    feed = {k: x[k][:16] for k in x.files}
    ref = run(make_session(str(DIGITS / "model.onnx")), feed)
    got = run(make_session(lowered), feed)
    for k in ref:
        assert np.max(np.abs(ref[k] - got[k])) <= 1e-5 * np.max(np.abs(ref[k]))


def test_closed_pipe_is_quiet() -> None:
    """`qgraph passes | head -1`: the reader leaving is no error (no message, SIGPIPE's exit status 141)."""
    import subprocess
    import sys

    code = "import sys; from qgraph.cli import main; sys.exit(main(['passes']))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader leaves while qgraph still writes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141)
    assert first.strip() and "error" not in err, err
