"""Chunk geometry, pure: does a set of chunks tile a tensor, and which byte runs of a chunk land
where in the full (C-ordered) tensor."""

from __future__ import annotations

import math
import operator
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


def coverage_problem(
    shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> str | None:
    """Why ``boxes`` (offsets, sizes) do not tile ``shape`` exactly, or None if they do."""
    total = math.prod(shape)
    covered = 0
    nonempty = []
    for offsets, sizes in boxes:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return (f"a chunk has {len(offsets)} offsets and {len(sizes)} sizes for a tensor of "
                    f"{len(shape)} dimensions")
        for o, s, n in zip(offsets, sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > n:
                return (f"chunk at offsets {list(offsets)} with sizes {list(sizes)} lies outside "
                        f"the tensor's shape {list(shape)}")
        covered += math.prod(sizes)
        if math.prod(sizes):
            nonempty.append((tuple(offsets), tuple(sizes)))
    overlap = _first_overlap(nonempty)
    if overlap is not None:
        a, b = overlap
        return f"chunks at offsets {list(a)} and {list(b)} overlap"
    if covered < total:
        return f"chunks cover {covered} of {total} elements; {total - covered} are missing"
    return None


def rows_tile(length: int, offsets: Sequence[int], sizes: Sequence[int]) -> bool:
    """True if the ranges ``[offsets[i], offsets[i] + sizes[i])`` tile ``[0, length)`` exactly
    (empty ones anywhere inside it): a tiling of row chunks, checked on columns. False says
    only "not certainly": :func:`coverage_problem` then explains."""
    if min(offsets, default=0) < 0 or min(sizes, default=0) < 0:
        return False
    if offsets and min(sizes) > 0:  # in order, none empty (the usual case): compared in C
        ends = list(map(operator.add, offsets, sizes))
        if offsets[0] == 0 and ends[-1] == length and list(offsets[1:]) == ends[:-1]:
            return True
    pos = 0
    for o, s in sorted(zip(offsets, sizes, strict=True)):
        if not s:
            if o > length:
                return False
        elif o != pos:
            return False
        else:
            pos = o + s
    return pos == length


def _first_overlap(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if len(boxes) < 2:
        return None
    if not boxes[0][0]:  # 0-dim: two non-empty chunks of one element overlap
        return boxes[0][0], boxes[1][0]
    # Sweep along the dimension the chunks are split on most (dim 0 for Shard(0), dim 1 for
    # Shard(1)...): only boxes whose ranges on it intersect need a full comparison, which keeps
    # a real layout near-linear.
    ndim = len(boxes[0][0])
    d = max(range(ndim), key=lambda k: len({o[k] for o, _ in boxes}))
    order = sorted(boxes, key=lambda b: (b[0][d], b[0]))
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in order:
        start = box[0][d]
        active = [a for a in active if a[0][d] + a[1][d] > start]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1
                   for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1], strict=True)):
                return other[0], box[0]
        active.append(box)
    return None


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


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in a tensor


def intersect(a: Box, b: Box) -> Box | None:
    """The box two boxes of one tensor share, or None when they share no element."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def sub_runs(inner: Box, a: Box, b: Box) -> list[tuple[int, int, int]]:
    """Contiguous runs of the box ``inner``, which lies inside boxes ``a`` and ``b`` (each
    C-ordered on its own: a stored chunk and a selection written out in C order).

    Returns ``(element in a, element in b, num_elements)`` in C order of ``inner``: one run
    per index of the dims before the first from which ``inner`` spans both ``a`` and ``b``
    whole (Megatron's layer or row slices of a chunk: one run; a slice of a chunk cut along
    its last dim: one run per row).
    """
    offsets, sizes = inner
    ndim = len(sizes)
    if not math.prod(sizes):
        return []
    k = ndim
    while k > 0 and all(sizes[d] == a[1][d] == b[1][d] for d in range(k, ndim)):
        k -= 1
    if k == ndim:  # 0-dim
        return [(0, 0, 1)]
    sa, sb = strides(a[1]), strides(b[1])
    base_a = sum((o - ao) * s for o, ao, s in zip(offsets, a[0], sa, strict=True))
    base_b = sum((o - bo) * s for o, bo, s in zip(offsets, b[0], sb, strict=True))
    run = math.prod(sizes[k:])
    starts = [(base_a, base_b)]
    for d in range(k):  # dim by dim: one addition per run, not a sum over dims
        if sizes[d] > 1:
            starts = [(x + i * sa[d], y + i * sb[d]) for x, y in starts for i in range(sizes[d])]
    return [(x, y, run) for x, y in starts]
