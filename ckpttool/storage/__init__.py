"""Bytes: local files, object stores, atomic outputs. Names no format.

``SCHEMES`` is the one list of URL schemes ckpttool reads and writes (each served by a backend
module here); anything else with ``scheme://`` is not a local path either.
"""

from __future__ import annotations

# scheme -> the backend module (in this package) that serves it. Checked without importing
# the backend (and its SDK), so that local paths cost nothing.
SCHEMES: dict[str, str] = {"s3": "s3"}


def scheme_of(value: object) -> str | None:
    """The supported scheme ``value`` (a str) starts with (``"s3"``), else None."""
    if not isinstance(value, str):
        return None
    head, sep, _ = value.partition("://")
    return head if sep and head in SCHEMES else None
