"""Two tensors of one shape read side by side in C order, block by block, with as few copies
as the layouts allow: where a block lies in one contiguous chunk on a side (a safetensors
tensor, a row shard of a DCP or DeepSpeed checkpoint), its bytes come straight from the page
cache (a :class:`~ckpttool.formats.base.Blocks` read: mapped for a local file); anything
else is gathered (:func:`~ckpttool.core.checkpoint.tensors.read_range`). Blocks end where
either side's chunks end, so a block never straddles two stored pieces of a side.

Equal blocks are found with one ``memcmp`` (comparing two ``memoryview`` objects goes item by
item in Python: 100x slower).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpttool.core.checkpoint import tensors
from ckpttool.core.transforms.derive import Derived
from ckpttool.errors import InputError
from ckpttool.formats.base import Blocks, Reader, Tensor

Buffer = bytearray | memoryview


@dataclass(frozen=True)
class _Segment:
    first: int  # element of the tensor (C order) where the chunk begins
    stop: int
    file: str
    start: int  # byte offset of its first element in ``file``


class Side:
    """One side's tensor: its contiguous chunks (rows of the tensor), or None where the chunks
    are not whole rows or not stored raw (compressed, strided): gathered then. A tensor a name
    map makes (a Megatron layer's slice, a q/k/v part) is made whole once, as merge makes it:
    its memory is that one tensor."""

    def __init__(self, reader: Reader, tensor: Tensor | Derived) -> None:
        self.reader, self.tensor = reader, tensor
        self.segments = _segments(reader, tensor) if isinstance(tensor, Tensor) else None
        self.firsts = [s.first for s in self.segments] if self.segments else []
        self._whole: bytes | bytearray | memoryview | None = None

    def cuts(self) -> list[int]:
        """Elements where a stored piece begins (after the first)."""
        return self.firsts[1:]

    def read(self, start: int, stop: int, buf: memoryview) -> Iterator[Buffer]:
        """Yields the elements ``[start, stop)`` once (``buf``: room for them, used where they
        are not mapped); valid until the generator is resumed."""
        item = self.tensor.dtype.itemsize
        if self.segments:
            k = bisect.bisect_right(self.firsts, start) - 1
            seg = self.segments[k]
            if seg.first <= start and stop <= seg.stop:
                size = (stop - start) * item
                offset = seg.start + (start - seg.first) * item
                views: Any = self.reader.read(Blocks(seg.file, offset, size, buf[:size]))
                try:
                    view = next(views, None)
                    if view is None or len(view) != size:
                        raise InputError(f"{self.reader.path(seg.file)}: ends before byte "
                                         f"{offset + size} (tensor '{self.tensor.name}'); "
                                         "truncated")
                    yield view
                finally:
                    views.close()
                return
        if isinstance(self.tensor, Tensor):
            yield tensors.read_range(self.reader, self.tensor, start, stop)
            return
        if self._whole is None:
            self._whole = _make(self.reader, self.tensor)
        yield memoryview(self._whole)[start * item : stop * item]


def _make(reader: Reader, derived: Derived) -> bytes | bytearray | memoryview:
    """A tensor a name map makes, whole: a selection of stored bytes (no torch), else
    computed."""
    from ckpttool.core.transforms import derive

    if derive.is_selection(derived) and derived.boxes and derived.boxes[0] is not None:
        return tensors.read_boxes(reader, derived.inputs[0], derived.boxes[0])
    return derive.materialise(reader, derived, derived.dtype)


def _segments(reader: Reader, tensor: Tensor) -> list[_Segment] | None:
    shape = tensor.shape
    row = math.prod(shape[1:]) if shape else 1
    out = []
    for c in tensor.chunks:
        if not c.numel:
            continue
        if shape and tuple(c.sizes[1:]) != tuple(shape[1:]):
            return None
        p = tensors.payload(reader, tensor, c)
        if p.start is None:
            return None
        first = c.offsets[0] * row if shape else 0
        out.append(_Segment(first, first + c.numel, p.file, p.start))
    out.sort(key=lambda s: s.first)
    return out or None


def pairs(a: Side, b: Side, block_elements: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` element ranges of at most ``block_elements`` covering the tensor,
    cut where either side's stored pieces begin."""
    numel = a.tensor.numel
    cuts = sorted({*a.cuts(), *b.cuts(), numel})
    start = 0
    for cut in cuts:
        while start < cut:
            stop = min(cut, start + block_elements)
            yield start, stop
            start = stop


@functools.cache
def _memcmp() -> Any:
    libc = ctypes.CDLL(None)
    f = libc.memcmp
    f.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    f.restype = ctypes.c_int
    return f


def equal(a: Buffer, b: Buffer) -> bool:
    """Byte-equal, by one ``memcmp`` (the GIL released)."""
    if len(a) != len(b):
        return False
    if not len(a):
        return True
    if isinstance(a, bytearray):
        return a == b  # bytearray's == is a memcmp over both buffers
    if isinstance(b, bytearray):
        return b == a
    import numpy as np

    pa = np.frombuffer(a, np.uint8).ctypes.data
    pb = np.frombuffer(b, np.uint8).ctypes.data
    return int(_memcmp()(pa, pb, len(a))) == 0
