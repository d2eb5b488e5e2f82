"""Where a stored chunk's elements go in its tensor, pure: the byte runs of a C-ordered chunk
inside the C-ordered full tensor. Readers place chunks with it (:meth:`Reader.read` of a
:class:`~ckpttool.formats.base.Whole`), and :mod:`ckpttool.core.checkpoint.geometry` builds
its tiling checks on it."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from itertools import product


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """C-order element strides of ``shape``."""
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def runs(
    shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
) -> Iterator[tuple[int, int, int]]:
    """Contiguous runs of a C-ordered chunk inside the C-ordered full tensor.

    Yields ``(chunk_element_offset, tensor_element_offset, num_elements)``. A chunk that spans
    every dimension after its first partial one (what ``Shard(0)`` gives) is a single run.
    """
    ndim = len(shape)
    if math.prod(sizes) == 0:
        return
    # k: the first dim from which the chunk, read in C order, is contiguous in the tensor.
    k = ndim
    while k > 0 and all(sizes[d] == shape[d] for d in range(k, ndim)):
        k -= 1
    # dims [k+1, ndim) are full; dim k may be partial; a run covers sizes[k:] elements.
    if k >= ndim:  # 0-dim tensor
        yield 0, 0, 1
        return
    st = strides(shape)
    run = math.prod(sizes[k:])
    base = sum(o * s for o, s in zip(offsets, st, strict=True))
    pos = 0
    for index in product(*(range(n) for n in sizes[:k])):
        yield pos, base + sum(i * s for i, s in zip(index, st, strict=False)), run
        pos += run


def is_single_run(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> bool:
    """True if the chunk is one contiguous byte range of the full tensor."""
    ndim = len(shape)
    k = ndim
    while k > 0 and all(sizes[d] == shape[d] for d in range(k, ndim)):
        k -= 1
    return all(sizes[d] == 1 for d in range(k))


def single_run_start(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
                     ) -> int | None:
    """The tensor element where the chunk begins, if it is one contiguous range of the full
    tensor (``Shard(0)`` rows, a whole tensor); None otherwise. The per-chunk question of a
    merge of millions of row chunks: answered without building the runs."""
    if not math.prod(sizes):
        return None
    if len(shape) == len(sizes) == len(offsets) and shape[1:] == sizes[1:]:
        # Rows: every dimension after the first is whole.
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        return offsets[0] * row if shape else 0
    if not is_single_run(shape, offsets, sizes):
        return None
    return next(runs(shape, offsets, sizes))[1]


def place(view: memoryview, at: int, shape: Sequence[int], offsets: Sequence[int],
          sizes: Sequence[int], itemsize: int, data: memoryview | bytes) -> None:
    """A C-ordered chunk's bytes ``data`` put where its :func:`runs` go in its C-ordered
    tensor, whose bytes begin at ``view[at]``."""
    whole = memoryview(data)
    for src, dst, n in runs(shape, offsets, sizes):
        view[at + dst * itemsize : at + (dst + n) * itemsize] = \
            whole[src * itemsize : (src + n) * itemsize]
