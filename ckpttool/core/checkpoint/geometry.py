"""Chunk geometry, pure: does a set of chunks tile a tensor, and where boxes meet. Which byte
runs of a chunk land where in the full (C-ordered) tensor is
:mod:`ckpttool.formats.codecs.placement`'s (readers place chunks with it), named here too for
core."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from ckpttool.formats.codecs.placement import is_single_run, runs, single_run_start, strides

__all__ = ["coverage_problem", "intersect", "is_single_run", "rows_tile", "runs",
           "single_run_start", "strides", "sub_runs"]


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
