"""Typed details of a pass result: `PassDetails`, the base of every pass's details record.

A pass reports what it measured and chose (counts, per-node numbers) in ``PassResult.details``. A plain dict is
still accepted (plug-ins written before this existed), but a pass that declares its details as a frozen dataclass
deriving from `PassDetails` gets them checked by ``mypy --strict``: a misspelt key or a wrong type is an error
where the pass builds them, not a surprise in a report. The JSON form is the same either way::

    @dataclass(frozen=True)
    class FuseBiasDetails(PassDetails):
        folded: int

    res.details = FuseBiasDetails(folded=res.rewritten)      # to_dict() -> {"folded": 3}

Rules of the JSON form (`PassDetails.to_dict`), chosen so a typed record writes exactly the dict a pass used to
build by hand:

- the keys are the fields, in declaration order;
- a field whose value is ``None`` is left out: an optional key the pass did not report (a field that must be
  written as ``null`` says so with ``field(metadata=KEEP_NONE)``);
- values are made JSON-ready recursively: nested records by their ``to_dict``, any other dataclass by its fields,
  tuples as lists, mappings key by key.

A record is also a read-only mapping of that JSON form (``details["key"]``, ``details.get``, ``"key" in details``),
so code written against the dict keeps working; new code reads the typed attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

#: ``field(metadata=KEEP_NONE)``: write this field as ``null`` when it is None instead of leaving it out.
KEEP_NONE: Mapping[str, bool] = {"keep_none": True}


def json_ready(value: Any) -> Any:
    """``value`` with every record, dataclass and tuple inside it turned into dicts and lists (scalars as they are)."""
    if isinstance(value, PassDetails):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)  # a record with its own JSON form (`Skipped`) keeps it
        if callable(to_dict):
            return to_dict()
        return {f.name: json_ready(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class PassDetails(Mapping[str, Any]):
    """Base of a pass's typed details (module docs): subclass it as a frozen dataclass, one field per key."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form: fields in declaration order, None fields left out (module docs)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and not f.metadata.get("keep_none", False):
                continue
            out[f.name] = json_ready(value)
        return out

    # The read-only mapping view: `details["key"]` as on the dict a pass used to build (module docs).
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def details_dict(details: PassDetails | Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-ready form of a result's details: a record's `PassDetails.to_dict`; a dict (or `TypedDict`) as it
    is, so its key order and its identity (a report holds the pass's own dict) stay."""
    if isinstance(details, PassDetails):
        return details.to_dict()
    return details if isinstance(details, dict) else dict(details)
