"""Typed report sections (core.runtime.report.Section): fields in order are the JSON keys, and
0.1's dict access still reads them."""

from __future__ import annotations

import json
from typing import ClassVar

from ckpttool.core.runtime.report import Section, document, jsonable, section


@section
class _Inner(Section):
    KEYS: ClassVar[dict[str, str]] = {"source": "from"}

    source: str
    count: int


@section
class _Outer(Section):
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"extra"})

    name: str
    inner: _Inner
    items: tuple[_Inner, ...]
    maybe: int | None = None
    extra: str | None = None


def test_fields_in_order_are_the_json_keys() -> None:
    s = _Outer("x", _Inner("a", 1), (_Inner("b", 2),))
    doc = s.to_json()
    assert list(doc) == ["name", "inner", "items", "maybe"]  # extra: None and omitted
    assert doc["inner"] == {"from": "a", "count": 1}
    assert doc["items"] == [{"from": "b", "count": 2}]
    assert doc["maybe"] is None
    assert json.loads(json.dumps(jsonable(s))) == doc
    s.extra = "here"
    assert list(s.to_json())[-1] == "extra"


def test_read_like_the_dicts_of_0_1() -> None:
    s = _Inner("a", 1)
    assert s["from"] == "a" and s.get("count") == 1 and s.get("nope", 7) == 7
    assert "from" in s and "source" not in s
    assert s == {"from": "a", "count": 1} and s == _Inner("a", 1) and s != _Inner("a", 2)
    assert dict(zip(s, (s[k] for k in s), strict=True)) == s.to_json()


def test_document_puts_schema_and_command_first() -> None:
    class Report:
        def __init__(self) -> None:
            self.a = 1
            self.b = [_Inner("z", 0)]

    doc = document("merge", Report())
    assert list(doc)[:2] == ["schema", "command"] and doc["b"] == [{"from": "z", "count": 0}]
