"""Each thread's work buffers, kept from one use to the next: the merge engine's cast and
gather buffers, and the derived tensors' work tensors (:func:`ckpttool.core.transforms.derive.
scratch` views them as torch tensors). A new buffer for every chunk or block costs a page fault
per 4 KB of it, more than the work done in it (measured: a 5632 x 2048 LoRA fold took 137 ms
with fresh tensors, 34 ms with kept ones; a cast chunk faulted in 12 MB).

Torch-free: the merge's copies and casts that need no torch use it too."""

from __future__ import annotations

import threading

# Buffers start on a cache line: torch's kernels and the BLAS load and store whole lines (a
# buffer 16 bytes off one folded 10% slower).
CACHE_LINE = 64

_held = threading.local()


def buffer(name: str, nbytes: int) -> memoryview:
    """The first ``nbytes`` of this thread's buffer ``name`` (contents undefined): made, or
    made larger, where it holds fewer; kept until :func:`release`. A larger one replaces the
    old (views of the old stay valid, on the old memory)."""
    held: tuple[bytearray, int] | None = getattr(_held, name, None)
    if held is None or len(held[0]) - held[1] < nbytes:
        setattr(_held, name, None)  # the old one goes before the new one is made
        raw = bytearray(nbytes + CACHE_LINE)
        held = (raw, -_address(raw) % CACHE_LINE)
        setattr(_held, name, held)
    raw, start = held
    return memoryview(raw)[start : start + nbytes]


def held(name: str, nbytes: int) -> memoryview:
    """The first ``nbytes`` of this thread's buffer ``name`` as it is (never made anew: the
    bytes of a view handed out before)."""
    raw, start = getattr(_held, name)
    if len(raw) - start < nbytes:
        raise ValueError(f"work buffer {name!r} holds fewer than {nbytes} bytes")
    return memoryview(raw)[start : start + nbytes]


def release() -> None:
    """Give this thread's buffers back (a worker thread that goes on)."""
    _held.__dict__.clear()


def _address(raw: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(raw))
