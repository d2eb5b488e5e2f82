"""``print_json``'s layout: each object of a top-level list is one line, exactly its
``json.dumps`` (the rows are written a column at a time, not by the encoder), and the whole
document parses back to itself."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.cli.common import _layout

_FILES = [f"__{i}_0.distcp" for i in range(64)]


def _rows_of(text: str, key: str) -> list[str]:
    start = text.index(json.dumps(key) + ": [\n") + len(json.dumps(key)) + 4
    end = text.index("\n  ]", start)
    return [line.removeprefix("    ").removesuffix(",") for line in text[start:end].split("\n")]


def _check(doc: dict[str, Any]) -> None:
    text = _layout(doc)
    assert json.loads(text) == doc
    for key, value in doc.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            assert _rows_of(text, key) == [json.dumps(v) for v in value]


def test_rows_are_their_json_dumps() -> None:
    rows = [
        {"name": "a.weight", "shape": [2, 3], "bytes": 12, "files": _FILES, "stats": None,
         "ok": True, "x": 1.5, "%s key \"q\" é": "ünï\"code\\%s\n"},
        {"name": "b", "shape": [True, 1], "bytes": -(1 << 70), "files": _FILES[:2],
         "stats": {"min": 1.0}, "ok": False, "x": float("inf"), "%s key \"q\" é": ""},
        {"name": "c", "shape": [1.0, 1], "bytes": 0, "files": [*_FILES[:63], "\u2028"],
         "stats": None, "ok": None, "x": 2, "%s key \"q\" é": "%%"},
        {"name": "d", "shape": [], "bytes": 1, "files": [], "stats": [], "ok": 1, "x": [1],
         "%s key \"q\" é": "x"},
    ]
    _check({"schema": 1, "tensors": rows, "empty": [], "notes": ["n"]})
    _check({"tensors": [rows[0], {**rows[1], "extra": 1}]})  # keys that differ
    _check({"tensors": [{"shape": [1]}, {"shape": [True]}, {"shape": [1.0]}]})
    _check({"tensors": [{"files": [[1], [2]]}, {"files": [[1], [True]]}]})
    _check({"tensors": [{"files": [{"a": 1}]}, {"files": [{"a": 1}]}]})  # unhashable
    _check({"tensors": [{}, {}]})
    assert _layout({}) == "{}"


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                     st.text(max_size=8))
_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=4),
                    st.lists(st.sampled_from(["a", "b", "é"]), min_size=16, max_size=20))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["name", "shape", "%s", "é"]), _VALUES,
                                max_size=4), min_size=1, max_size=5))
def test_any_rows_are_their_json_dumps(rows: list[dict[str, Any]]) -> None:
    _check({"rows": rows})
