"""crc32_rows: the CRC-32 of every row of a byte matrix at once, as zlib gives it per row."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from ckpttool.formats.codecs.crc import _across_rows, crc32_rows


@pytest.mark.parametrize("rows", [97, 5000])  # one call per row; across rows from 64 x width
@pytest.mark.parametrize("width", [0, 1, 2, 3, 4, 5, 7, 8, 40, 63, 64, 65, 4096])
def test_matches_zlib_on_random_rows(width: int, rows: int) -> None:
    m = np.random.default_rng(width).integers(0, 256, (rows, width), dtype=np.uint8)
    want = [zlib.crc32(r.tobytes()) for r in m]
    assert crc32_rows(m).tolist() == want
    assert _across_rows(m).tolist() == want  # whichever crc32_rows chose


def test_strided_rows_and_one_row() -> None:
    """Columns of a wider matrix (a view, as fill_rows passes them) and a single row."""
    big = np.random.default_rng(7).integers(0, 256, (50, 300), dtype=np.uint8)
    view = big[:, 17:81]
    for crc in (crc32_rows, _across_rows):
        assert crc(view).tolist() == [zlib.crc32(r.tobytes()) for r in view]
        assert crc(big[:1]).tolist() == [zlib.crc32(big[0].tobytes())]


def test_no_rows() -> None:
    assert crc32_rows(np.zeros((0, 12), dtype=np.uint8)).tolist() == []
    assert _across_rows(np.zeros((0, 12), dtype=np.uint8)).tolist() == []
