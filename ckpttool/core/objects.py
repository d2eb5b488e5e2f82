"""Non-tensor entries (step counters, configs, param groups): read with weights-only
semantics, and described the same way in every report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpttool.formats.base import ObjectEntry, Reader, UnreadableObject


@dataclass(frozen=True)
class Unreadable:
    """An entry not read: its pickle names a class or function (never executed), or it is too
    large to walk. ``why`` says which."""

    why: str


def read(reader: Reader, entry: ObjectEntry) -> Any:
    """The entry's value, or :class:`Unreadable` naming the global it would need."""
    try:
        return reader.read_object(entry)
    except UnreadableObject as e:
        return Unreadable(e.why)


def describe(name: str, value: Any) -> dict[str, Any]:
    """``{"name", "readable": true, "value"}``, or ``{"name", "readable": false, "note"}``."""
    if isinstance(value, Unreadable):
        return {"name": name, "readable": False, "note": f"{value.why}; not executed, not read"}
    return {"name": name, "readable": True, "value": jsonable(value)}


def jsonable(value: Any) -> Any:
    """Plain JSON values; anything else (a tensor placeholder...) as its string."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
