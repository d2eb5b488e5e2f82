"""What every operation's report shares: the JSON schema version and the progress callback."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # Python 3.10: a marker for type checkers only, nothing at run time
    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda f: f

# Version of every ``--json`` document (``"schema"``); bumped when a shape changes.
SCHEMA = 1

# Called with the number of bytes just read or written, as an operation goes.
Progress = Callable[[int], None]


class Section:
    """A typed section of a report: a dataclass whose fields, in order, are the keys of its
    ``--json`` object. Subclasses name a JSON key that is no Python name in ``KEYS``
    (``{"source": "from"}``) and the fields left out of the JSON when None in ``OMIT_NONE``.
    Two sections of one type are equal when their JSON is.
    """

    KEYS: ClassVar[dict[str, str]] = {}
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.name in self.OMIT_NONE:
                continue
            doc[self.KEYS.get(f.name, f.name)] = jsonable(value)
        return doc

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self.to_json() == other.to_json()
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


_S = TypeVar("_S", bound=type[Section])


@dataclass_transform(frozen_default=False)
def section(cls: _S | None = None, /, *, frozen: bool = False) -> Any:
    """Declare a :class:`Section` subclass: a dataclass that keeps Section's comparisons
    (``@section``, or ``@section(frozen=True)``)."""

    def make(c: _S) -> _S:
        return dataclasses.dataclass(eq=False, frozen=frozen)(c)  # type: ignore[return-value]

    return make if cls is None else make(cls)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON values: sections (anything with ``to_json``) as their
    documents, tuples as lists, containers walked."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if set(map(type, value)) <= {str}:  # names (a tensor's files): no Python per item
            return list(value)
        return [jsonable(v) for v in value]
    return value


def locked(progress: Progress | None) -> Progress:
    """``progress`` for worker threads to share: one call at a time, none for 0 bytes (a
    no-op when there is no ``progress``)."""
    lock = threading.Lock()

    def report(n: int) -> None:
        if progress is not None and n:
            with lock:
                progress(n)

    return report


def storage_note(storage: dict[str, Any]) -> str | None:
    """How a checkpoint was stored, in words, where it departs from the format's default
    (``CheckpointInfo.storage``): ``"safetensors records, zstd-compressed, rank-local
    metadata"``; None for the default."""
    words = []
    if storage.get("framework"):  # who wrote it and how it was laid out (Megatron's run)
        words.append(str(storage["framework"]))
    serialization = storage.get("serialization")
    if serialization not in (None, "torch_save"):
        words.append(f"{serialization} records")
    if storage.get("compression"):
        words.append(f"{storage['compression']}-compressed")
    if storage.get("metadata") not in (None, "global"):
        words.append(f"{storage['metadata']} metadata")
    return ", ".join(words) or None


def document(command: str, report: Any) -> dict[str, Any]:
    """A report dataclass as its command's ``--json`` document: the schema and the command,
    then every field in order, sections as their JSON."""
    return {"schema": SCHEMA, "command": command,
            **{k: jsonable(v) for k, v in vars(report).items()}}
