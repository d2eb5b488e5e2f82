"""Non-tensor entries (step counters, configs, param groups): read with weights-only
semantics, and described the same way in every report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpttool.core.runtime.report import Section, section
from ckpttool.formats.base import ObjectEntry, Problem, Reader, UnreadableObject, error, warning
from ckpttool.formats.codecs import policy, torchsave


@dataclass(frozen=True)
class Unreadable:
    """An entry not read: its pickle names a class or function (never executed), or it is too
    large to walk. ``why`` says which."""

    why: str
    qualname: str | None = None  # the global the pickle asks for first
    names: tuple[str, ...] = ()  # every global it names


def read(reader: Reader, entry: ObjectEntry) -> Any:
    """The entry's value, or :class:`Unreadable` naming the global it would need."""
    try:
        return reader.read_object(entry)
    except UnreadableObject as e:
        return Unreadable(e.why, e.qualname, tuple(e.names))


def problem(name: str, value: Any, where: str | None) -> Problem | None:
    """What ``verify`` says of a non-tensor entry it could not read (None when it could): an
    error when it asks for code to run, a warning for another class."""
    if not isinstance(value, Unreadable):
        return None
    q = runs_code(value.names)
    if q is not None:
        return error("code-in-checkpoint", f"entry '{name}' asks for '{q}', which runs code or "
                     "reaches the system when unpickled; ckpttool did not execute it. Do not "
                     "load this checkpoint with torch.load(weights_only=False)", file=where)
    return warning("object-not-read", f"entry '{name}': {value.why}; not executed, not read",
                   file=where)


def runs_code(names: tuple[str, ...]) -> str | None:
    """The first of ``names`` (``module.name``, each global a pickle names) that runs code
    when unpickled, by the one pickle policy (:func:`ckpttool.formats.codecs.policy.kind`),
    or None. A global the weights-only reader builds itself (``torch._utils`` rebuilders,
    storages) is never it: named beside a refused one, it is not what asks for code."""
    for qualname in names:
        module, _, name = qualname.rpartition(".")
        if not module or torchsave.record_global(module, name) is not None:
            continue
        if policy.kind(module, name) == policy.RUNS_CODE:
            return qualname
    return None


@section
class Entry(Section):
    """A non-tensor entry as reports give it: ``{"name", "readable": true, "value", "part"}``,
    or ``{"name", "readable": false, "note", "part"}`` for one not read (a pickle that would
    run code, an entry too large to walk)."""

    name: str
    readable: bool
    value: Any = None  # plain JSON values (readable only)
    note: str = ""  # why it was not read (unreadable only)
    part: str = "other"  # the checkpoint part it belongs to (core.checkpoint.parts)

    def to_json(self) -> dict[str, Any]:
        said = {"value": self.value} if self.readable else {"note": self.note}
        return {"name": self.name, "readable": self.readable, **said, "part": self.part}


def describe(name: str, value: Any, *, part: str) -> Entry:
    """The entry ``name`` of ``part`` holding ``value`` (an :class:`Unreadable` when not read)."""
    if isinstance(value, Unreadable):
        return Entry(name, False, note=f"{value.why}; not executed, not read", part=part)
    return Entry(name, True, plain_json(value), part=part)


def plain_json(value: Any) -> Any:
    """Plain JSON values; anything else (a tensor placeholder...) as its string."""
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
