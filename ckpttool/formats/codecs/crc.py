"""CRC-32, the one the zip headers of torch.save records use, at memory speed where the
optional ``fast`` extra is installed: zlib-ng's is 5-6x the standard zlib's here (18 vs
3.2 GB/s on 64 MB, 72 vs 232 ns per 64-byte record entry); the same function otherwise.

:func:`crc32_rows` computes the CRC-32 of each row of a byte matrix (numpy, imported when
first called): across all rows at once for many short entries (millions of 64-byte records),
where one call of :func:`crc32` per entry costs more in calling than in computing."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # the optional "fast" extra is not installed
    from zlib import crc32

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["crc32", "crc32_rows"]

_POLY = 0xEDB88320  # CRC-32 (ISO-HDLC, zip's), reflected


@functools.cache
def _tables() -> Any:
    """The four slicing-by-4 tables: ``t[0]`` the byte-at-a-time table, ``t[k]`` one byte
    advanced ``k`` more zero bytes."""
    import numpy as np

    t0 = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        t0.append(c)
    tables = [t0]
    for _ in range(3):
        prev = tables[-1]
        tables.append([(prev[i] >> 8) ^ t0[prev[i] & 0xFF] for i in range(256)])
    return np.array(tables, dtype=np.uint32)


def crc32_rows(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint32]:
    """The CRC-32 of each row of ``rows`` (``n x k`` bytes), as :func:`crc32` gives it.

    Across rows (:func:`_across_rows`) where there are many more rows than bytes in a row;
    else one :func:`crc32` call per row, which costs less there: the numpy steps across
    rows cost about a microsecond each whatever the number of rows, so for 8 rows of 32 KB
    they took 128 ms against 0.2 ms, and they win only past about 10,000 rows of 64 bytes
    (measured here with zlib-ng)."""
    import numpy as np

    n, k = rows.shape
    if n >= 64 * k:
        return _across_rows(rows)
    return np.fromiter((crc32(r) for r in np.ascontiguousarray(rows)), dtype=np.uint32,
                       count=n)


def _across_rows(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint32]:
    """:func:`crc32_rows` table-driven across rows: one numpy step per four bytes of a row
    (slicing-by-4: the running CRC XOR the next little-endian word, then its four bytes
    looked up in four tables), over all rows at once, so the cost per row is a few
    nanoseconds per byte for any number of rows, with no Python per row."""
    import numpy as np

    t = _tables()
    n, k = rows.shape
    crc = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
    words = k // 4
    if words:
        # Column by column, each contiguous: the rows' words transposed once.
        cols = np.ascontiguousarray(rows[:, : 4 * words]).view("<u4").T.astype(np.uint32)
        x = np.empty(n, dtype=np.uint32)
        got = np.empty(n, dtype=np.uint32)
        # The bytes of ``x`` low to high (native order differs on big-endian hosts).
        as_bytes = x.view(np.uint8).reshape(n, 4)
        order = (0, 1, 2, 3) if np.little_endian else (3, 2, 1, 0)
        for j in range(words):
            np.bitwise_xor(crc, cols[j], out=x)
            np.take(t[3], as_bytes[:, order[0]], out=crc)
            for table, b in ((t[2], order[1]), (t[1], order[2]), (t[0], order[3])):
                np.take(table, as_bytes[:, b], out=got)
                np.bitwise_xor(crc, got, out=crc)
    for j in range(4 * words, k):  # the last bytes, one at a time
        low = np.bitwise_xor(crc, rows[:, j]).astype(np.uint8)
        np.right_shift(crc, 8, out=crc)
        np.bitwise_xor(crc, t[0][low], out=crc)
    return np.bitwise_xor(crc, np.uint32(0xFFFFFFFF))
