"""Each thread's work buffers (core/runtime/scratch): on a cache line, kept, grown when asked
for more, never handed out for another thread, given back by ``release``."""

from __future__ import annotations

import ctypes
import threading

import pytest

from ckpttool.core.runtime import scratch


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_buffers_are_kept_aligned_grown_and_released() -> None:
    scratch.release()
    a = scratch.buffer("t", 100)
    assert len(a) == 100 and _address(a) % scratch.CACHE_LINE == 0
    a[:3] = b"abc"
    b = scratch.buffer("t", 50)  # the same memory, kept
    assert _address(b) == _address(a) and bytes(b[:3]) == b"abc"
    assert bytes(scratch.held("t", 100)[:3]) == b"abc"
    with pytest.raises(ValueError, match="fewer"):
        scratch.held("t", 1 << 20)
    c = scratch.buffer("t", 1 << 20)  # grown: new memory; the old view still reads its own
    assert len(c) == 1 << 20 and _address(c) % scratch.CACHE_LINE == 0
    assert bytes(a[:3]) == b"abc"
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(_address(scratch.buffer("t", 100))))
    t.start()
    t.join()
    assert other[0] != _address(c)
    scratch.release()
    with pytest.raises(AttributeError):
        scratch.held("t", 1)
