"""Sizes in bytes, read from and written for people: a ground module (it imports only
:mod:`ckpttool.errors`), shared by the options, the reports and the outputs' space checks."""

from __future__ import annotations

import re

from ckpttool.errors import InputError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"1024"`` -> 1024.

    Raises:
        InputError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not m or float(m.group(1)) <= 0:
        raise InputError(f"invalid size '{text}'; write it like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def human_bytes(n: int) -> str:
    """Bytes for a message: ``3.21 GB`` (decimal units, as :func:`parse_size` reads them);
    the one formatter, shared by the CLI's reports."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
