"""Harness for the hostile-input suite: a workspace of user files, a CLI runner that checks the promises. (A
uniquely named module: `from conftest import` finds another folder's conftest when folders are collected together.)

Every case runs the CLI in-process on files in a temporary folder and checks: the exit code, that the message
names what and where, that no traceback is printed, that every file the user had is byte-identical afterwards,
and that no file appeared except the outputs the case names.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qgraph.cli import main

#: A command on the workspace's tiny models that has not ended after this many seconds hangs (a FIFO read, a
#: cluster that never answers): the case fails instead of stalling the suite. A hang guard, not a speed target.
HANG_SECONDS = 300


class Hung(Exception):
    """Raised in a case whose command ran past `HANG_SECONDS`."""

RECIPE_PREP = "name: prep\npasses:\n  - pass: fold_constants\n  - pass: fuse_batchnorm\n  - pass: cleanup\n"
RECIPE_INT8 = "name: int8\npasses:\n  - pass: fuse_batchnorm\n  - pass: insert_qdq\n    preset: ort-x86-vnni\n"


def conv_model(*, weight: np.ndarray | None = None, bn_var: np.ndarray | None = None, opset: int = 17,
               duplicate_initializer: bool = False) -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv(4) [-> BatchNorm] -> Relu -> GlobalAveragePool -> Flatten -> Gemm(2) -> y."""
    rng = np.random.default_rng(0)
    w = weight if weight is not None else rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "B"),
             numpy_helper.from_array(rng.standard_normal((2, 4)).astype(np.float32), "G"),
             numpy_helper.from_array(np.zeros(2, np.float32), "GB")]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    relu_in = "c"
    if bn_var is not None:
        for name, value in (("s", np.ones(4)), ("o", np.zeros(4)), ("m", np.zeros(4)), ("v", bn_var)):
            inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        nodes.append(helper.make_node("BatchNormalization", ["c", "s", "o", "m", "v"], ["bn"], name="bn"))
        relu_in = "bn"
    nodes += [
        helper.make_node("Relu", [relu_in], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "G", "GB"], ["y"], name="fc", transB=1),
    ]
    if duplicate_initializer:
        inits.append(numpy_helper.from_array(np.full((2, 4), 7, np.float32), "G"))
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def one_input_model(elem_type: int, shape: list[int | str] | None, op: str = "Identity") -> onnx.ModelProto:
    """A model with one input of the given type/shape (``shape=None``: no shape declared) and one op on it."""
    vi = helper.make_tensor_value_info("a", elem_type, shape) if shape is not None else helper.make_value_info(
        "a", helper.make_tensor_type_proto(elem_type, shape=None))
    if op == "Cast":
        node = helper.make_node("Cast", ["a"], ["out"], name="cast", to=TensorProto.FLOAT)
        out_type = TensorProto.FLOAT
    elif op == "Not":
        node = helper.make_node("Not", ["a"], ["out"], name="not")
        out_type = TensorProto.BOOL
    else:
        node = helper.make_node("Identity", ["a"], ["out"], name="id")
        out_type = elem_type
    graph = helper.make_graph([node], "one", [vi], [helper.make_value_info("out", helper.make_tensor_type_proto(
        out_type, shape=None))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def calibration(n: int = 4) -> dict[str, np.ndarray]:
    """Stacked calibration arrays for `conv_model` (axis 0 = samples)."""
    return {"x": np.random.default_rng(1).standard_normal((n, 1, 3, 8, 8)).astype(np.float32)}


@dataclass
class Outcome:
    """What a CLI run left behind."""

    code: int
    text: str


class Workspace:
    """A folder of user files; `run` calls the CLI and checks the promises common to every case."""

    def __init__(self, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.root = root
        self._capsys = capsys
        onnx.save(conv_model(), root / "model.onnx")
        (root / "prep.yaml").write_text(RECIPE_PREP)
        (root / "int8.yaml").write_text(RECIPE_INT8)
        np.savez(root / "data.npz", **calibration())

    def path(self, name: str) -> str:
        """Absolute path of ``name`` in the workspace, as a string for argv."""
        return str(self.root / name)

    def snapshot(self) -> dict[str, str]:
        """sha256 of every regular file below the workspace (symlinks by target text)."""
        out: dict[str, str] = {}
        for p in sorted(self.root.rglob("*")):
            if p.is_symlink():
                out[str(p.relative_to(self.root))] = "link:" + str(p.readlink())
            elif p.is_file():
                out[str(p.relative_to(self.root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        return out

    def run(self, *argv: str, code: int, says: tuple[str, ...] = (), outputs: tuple[str, ...] = ()) -> Outcome:
        """Run ``qgraph argv``: exit ``code``, every text of ``says`` in the message, no traceback, input files
        unchanged, and no new file but ``outputs`` (workspace-relative names)."""
        self._capsys.readouterr()
        before = self.snapshot()
        with hang_guard(HANG_SECONDS):
            got = main(list(argv))
        captured = self._capsys.readouterr()
        text = " ".join((captured.err + captured.out).split())
        after = self.snapshot()
        assert "Traceback" not in text, text
        assert got == code, f"exit {got} != {code}: {text}"
        for s in says:
            assert s in text, f"{s!r} not in: {text}"
        for name, digest in before.items():
            if name not in outputs:
                assert after.get(name) == digest, f"input file {name} was changed or removed"
        new = set(after) - set(before) - set(outputs)
        assert not new, f"stray files left behind: {sorted(new)}"
        return Outcome(got, text)


@contextlib.contextmanager
def hang_guard(seconds: int) -> Iterator[None]:
    """Raise `Hung` in the main thread when the block runs longer than ``seconds`` (no-op off the main thread)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def hung(signum: int, frame: object) -> None:
        raise Hung(f"the command did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)



Setup = Callable[[Workspace], list[str]]
