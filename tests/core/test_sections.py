"""Typed report sections (core.runtime.report.Section): fields in order are the JSON keys;
they are read by attribute, not by key."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

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


def test_equal_by_json_and_read_by_attribute() -> None:
    s = _Inner("a", 1)
    assert s == _Inner("a", 1) and s != _Inner("a", 2)
    assert s != {"from": "a", "count": 1}  # a section is not a dict: compare its to_json()
    assert s.to_json() == {"from": "a", "count": 1}
    for read in (lambda: s["from"], lambda: "from" in s, lambda: list(s)):
        with pytest.raises(TypeError):
            read()


def test_document_puts_schema_and_command_first() -> None:
    class Report:
        def __init__(self) -> None:
            self.a = 1
            self.b = [_Inner("z", 0)]

    doc = document("merge", Report())
    assert list(doc)[:2] == ["schema", "command"] and doc["b"] == [{"from": "z", "count": 0}]


def test_tensor_row_json_is_the_sections() -> None:
    """inspect's TensorRow writes its fields out (15,000 rows): the same document as
    Section's walk, with and without --stats."""
    from ckpttool.core.inspect import TensorRow
    from ckpttool.core.values import TensorStats

    rows = [TensorRow("a.weight", "model.a.weight", "model", [4, 2], "BF16", 16, 2,
                      "Shard(0) x2", ["__0_0.distcp", "__1_0.distcp"]),
            TensorRow("b", "b", "model", [], "F32", 4, 1, "whole", [],
                      TensorStats(min=-1.0, max=2.0, mean=0.5, abs_max=2.0, nan=1, inf=0,
                                  all_zero=False))]
    for row in rows:
        assert row.to_json() == Section.to_json(row)
        assert list(row.to_json()) == list(Section.to_json(row))


def test_print_json_encodes_long_name_lists_once() -> None:
    """The lines of a top-level list are json.dumps of each item, also where a long list of
    names is encoded once for every item that holds it, and where an item's strings look
    like a stand-in (the rows are not encoded by json; tests/cli/test_json_layout.py has more)."""
    from ckpttool.cli.common import _layout

    _HOLE = "\x00ckpttool-names\x00"  # noqa: N806 - what an earlier layout used

    files = [f"__{i}_0.distcp" for i in range(64)]
    items = [{"name": "a", "files": files, "stats": None},
             {"name": "b", "files": list(files), "stats": {"min": 1.5}},
             {"name": _HOLE, "files": list(files)},
             {"name": "c", "files": [*files[:20], 3]},
             {"name": f'x"{_HOLE}"', "files": files[:30], "other": files[:17]},
             {"name": "d", "files": files[:3]}]
    text = _layout({"schema": 1, "tensors": items})
    assert json.loads(text) == {"schema": 1, "tensors": items}
    lines = text.splitlines()[3:-2]
    assert [line.strip().rstrip(",") for line in lines] == [json.dumps(v) for v in items]
    same = [{"name": n, "files": files if n != "b" else files[:17]} for n in ("a", "b", _HOLE)]
    text = _layout({"tensors": same})  # one set of keys: written a column at a time
    assert [line.strip().rstrip(",") for line in text.splitlines()[2:-2]] == [
        json.dumps(v) for v in same]
