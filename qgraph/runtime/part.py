"""One scored piece of a graph output (`OutputPart`): the type `qgraph.runtime.compare` measures and
`qgraph.runtime.output_parts` finds, kept below both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class OutputPart:
    """One scored piece of a graph output: elements ``start:stop`` along ``axis``, written there by ``source``.

    A whole output is a part too (``axis`` None, ``source`` the output itself)."""

    output: str
    source: str
    axis: int | None = None
    start: int = 0
    stop: int = 0
    #: The output's size along ``axis`` (to cut outputs of several samples joined on axis 0).
    length: int = 0

    @property
    def whole(self) -> bool:
        """Whether this part is the whole output."""
        return self.axis is None

    @property
    def size(self) -> int:
        """Elements along the axis (0 for a whole output)."""
        return self.stop - self.start

    @property
    def label(self) -> str:
        """``output0[4:22] (/model.22/Sigmoid_output_0)`` (the range along `axis`), or the output's name for a
        whole output."""
        if self.axis is None:
            return self.output
        return f"{self.output}[{self.start}:{self.stop}] ({self.source})"

    def cut(self, value: Any) -> Any:
        """This part of ``value`` (an output of one sample, or of several joined on axis 0), as a view.

        Raises ValueError when ``value`` does not have the output's size along the axis."""
        if self.axis is None or value is None or isinstance(value, list):
            return value
        array = np.asarray(value)
        if array.ndim <= self.axis:
            raise ValueError(f"{self.label}: the output has rank {array.ndim}, no axis {self.axis}")
        n = array.shape[self.axis]
        if n == self.length:
            return array[(slice(None),) * self.axis + (slice(self.start, self.stop),)]
        if self.axis == 0 and self.length and n % self.length == 0:  # samples joined along the concat axis
            blocks = array.reshape(n // self.length, self.length, *array.shape[1:])
            return blocks[:, self.start:self.stop].reshape(-1, *array.shape[1:])
        raise ValueError(f"{self.label}: the output has {n} elements along axis {self.axis}, the model's Concat "
                         f"writes {self.length}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"output": self.output, "label": self.label, "source": self.source, "axis": self.axis,
                "start": self.start, "stop": self.stop}
