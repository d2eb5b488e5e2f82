"""Whole tensors over their chunks, for every format: element ranges in C order, block
streams, identity, and where an element is stored. The one implementation of each.

A format's :class:`~ckpttool.formats.base.Reader` decodes chunks (core asks it through its
one verb, :meth:`~ckpttool.formats.base.Reader.read`); the geometry of how chunks make up a
tensor (:mod:`ckpttool.core.checkpoint.geometry`) is core's.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from ckpttool.core.checkpoint import geometry
from ckpttool.errors import InputError
from ckpttool.formats.base import (
    Blocks,
    Chunk,
    ChunkColumns,
    Decode,
    Elements,
    Into,
    Payload,
    Reader,
    Span,
    Tensor,
    row_starts,
    stored_order,
)
from ckpttool.storage.store import truncated

__all__ = ["BLOCK_BYTES", "HEAD_BYTES", "Boxes", "blocks", "box_pieces", "first_difference",
           "identical", "locate", "payload", "read_boxes", "read_range", "release_grids",
           "row_starts", "selection_blocks", "stored_order", "stored_whole", "unravel"]

# Bytes read per step when data is streamed: memory stays flat whatever the tensor size.
BLOCK_BYTES = 16 << 20
# Bytes compared first by :func:`identical`.
HEAD_BYTES = 64 << 10


def payload(reader: Reader, tensor: Tensor, chunk: Chunk) -> Payload:
    """Where ``chunk``'s elements are (a :class:`~ckpttool.formats.base.Decode` of one)."""
    return next(reader.read(Decode(((tensor, chunk),))))


def read_range(reader: Reader, tensor: Tensor, start: int, stop: int) -> bytearray:
    """Elements ``[start, stop)`` of the C-ordered full tensor, read from the chunks that hold
    them (only the overlapping bytes of each chunk are read)."""
    item = tensor.dtype.itemsize
    out = bytearray((stop - start) * item)
    for c in tensor.chunks:
        if not c.numel:
            continue
        p: Payload | None = None
        whole: bytes | None = None
        for src, dst, n in geometry.runs(tensor.shape, c.offsets, c.sizes):
            lo, hi = max(dst, start), min(dst + n, stop)
            if lo >= hi:
                continue
            p = p or payload(reader, tensor, c)
            src_elem = src + lo - dst
            if p.start is not None:
                data = reader.read(Span(p.file, p.start + src_elem * item, (hi - lo) * item,
                                        f"tensor '{tensor.name}'"))
            else:
                whole = whole or reader.read(Elements(tensor, c))
                data = whole[src_elem * item : (src_elem + hi - lo) * item]
            out[(lo - start) * item : (hi - start) * item] = data
    return out


# A selection: boxes of a tensor whose elements, each box in its C order, one box after the
# other, make an output tensor (a layer of a stacked [L, ...] tensor, one q/k/v part per query
# group, one expert's gate half...).
Boxes = tuple[geometry.Box, ...]


def box_pieces(tensor: Tensor, boxes: Boxes
               ) -> list[tuple[Chunk, int, list[tuple[int, int, int]]]]:
    """Where the elements of a selection are: ``(chunk, first element of its box in the
    selection, runs)`` per chunk a box overlaps, each run ``(element in the chunk, element in
    the box, num_elements)`` (:func:`~ckpttool.core.checkpoint.geometry.sub_runs`); per box,
    its chunks in the tensor's order.

    The chunks a box overlaps are looked up in the tensor's grid (:class:`_Grid`) where its
    chunks tile one: a selection costs what it overlaps, not a pass over every chunk (a
    stacked ``[L, E, ...]`` expert tensor has L x E chunks, and as many selections: a pass per
    selection made a merge quadratic in the number of experts)."""
    out = []
    pos = 0
    grid = _grid(tensor)
    chunks = tensor.chunks
    for box in boxes:
        if grid is not None:
            found: Iterable[int] = grid.overlapping(box)
        else:
            found = (k for k, c in enumerate(chunks) if c.numel)
        for k in found:
            c = chunks[k]
            chunk_box = (c.offsets, c.sizes)
            inner = geometry.intersect(chunk_box, box)
            if inner is not None:
                out.append((c, pos, geometry.sub_runs(inner, chunk_box, box)))
        pos += math.prod(box[1])
    return out


class _Grid:
    """The chunks of a tensor that tile it as a grid (every chunk one cell of the cuts along
    each dimension: Megatron's stacked layers and experts, tensor-parallel halves): the cells
    a box overlaps found by bisection, their chunks by cell. ``None`` from :func:`_grid` for
    any other tiling (the caller then passes over every chunk)."""

    __slots__ = ("cells", "cuts")

    def __init__(self, cuts: list[list[int]], cells: dict[tuple[int, ...], int]) -> None:
        self.cuts = cuts  # per dimension, the sorted offsets where chunks begin and end
        self.cells = cells  # cell (its index along each dimension) -> chunk number

    def overlapping(self, box: geometry.Box) -> list[int]:
        """The numbers of the chunks ``box`` overlaps, in the tensor's order."""
        ranges = []
        for cuts, o, n in zip(self.cuts, box[0], box[1], strict=True):
            if not n:
                return []
            ranges.append(range(max(0, bisect.bisect_right(cuts, o) - 1),
                                bisect.bisect_left(cuts, o + n)))
        cells = self.cells
        return sorted(k for cell in itertools.product(*ranges)
                      if (k := cells.get(cell)) is not None)


# The grids of the tensors selections were last taken from (id of the chunks -> the chunks,
# kept so that the id stays theirs, and the grid or None): a merge takes hundreds of
# selections from each stacked tensor, from a few threads.
_GRIDS: collections.OrderedDict[int, tuple[object, _Grid | None]] = collections.OrderedDict()
_GRIDS_KEPT = 64
_grids_lock = threading.Lock()


def _grid(tensor: Tensor) -> _Grid | None:
    chunks = tensor.chunks
    key = id(chunks)
    with _grids_lock:
        got = _GRIDS.get(key)
        if got is not None and got[0] is chunks:
            _GRIDS.move_to_end(key)
            return got[1]
    grid = _make_grid(tensor)
    with _grids_lock:
        _GRIDS[key] = (chunks, grid)
        while len(_GRIDS) > _GRIDS_KEPT:
            _GRIDS.popitem(last=False)
    return grid


def release_grids() -> None:
    """Forget the grids kept (and the chunks they hold on to): at the end of a merge."""
    with _grids_lock:
        _GRIDS.clear()


def _make_grid(tensor: Tensor) -> _Grid | None:
    chunks = tensor.chunks
    if len(chunks) < 8 or not tensor.shape:  # a pass over them costs as little
        return None
    boxes = chunks.boxes() if isinstance(chunks, ChunkColumns) else \
        [(c.offsets, c.sizes) for c in chunks]
    ndim = len(tensor.shape)
    cuts = [sorted({o[d] for o, _ in boxes} | {o[d] + n[d] for o, n in boxes})
            for d in range(ndim)]
    where = [{x: i for i, x in enumerate(c)} for c in cuts]
    cells: dict[tuple[int, ...], int] = {}
    for k, (o, n) in enumerate(boxes):
        if not math.prod(n):
            continue
        cell = tuple(where[d][o[d]] for d in range(ndim))
        # One cell each: the chunk ends at the next cut in every dimension, no two share one.
        if any(cuts[d][cell[d] + 1] != o[d] + n[d] for d in range(ndim)) or cell in cells:
            return None
        cells[cell] = k
    return _Grid(cuts, cells)


def read_boxes(reader: Reader, tensor: Tensor, boxes: Boxes, *,
               pieces: list[tuple[Chunk, int, list[tuple[int, int, int]]]] | None = None,
               out: memoryview | None = None, buf: memoryview | None = None) -> memoryview:
    """The elements of a selection (:data:`Boxes`), box after box. Each chunk a box overlaps
    is read once, from its first to its last element in that box (for a slice of rows, or of
    a chunk cut along its last dim, exactly the box's bytes), block by block (a ``Blocks``
    read: mapped from the page cache for a local file, else read into ``buf``), and its runs
    placed. ``pieces``: :func:`box_pieces`, if known.

    ``out`` (at least the selection's bytes) and ``buf`` (any size, a multiple of the item
    size) are a caller's buffers kept from one selection to the next: a fresh buffer costs a
    page fault per 4 KB of it (measured on a 1 GB Megatron merge: allocating the row-parallel
    layers' buffers anew took a fifth of the worker threads' samples). Memory: the selection
    plus one block. Returns the selection's bytes (a view of ``out`` when given)."""
    item = tensor.dtype.itemsize
    nbytes = sum(math.prod(sizes) for _, sizes in boxes) * item
    view = memoryview(bytearray(nbytes)) if out is None else out[:nbytes]
    for c, pos, runs in box_pieces(tensor, boxes) if pieces is None else pieces:
        first, last = runs[0][0] * item, (runs[-1][0] + runs[-1][2]) * item
        p = payload(reader, tensor, c)
        if p.start is None:  # compressed or strided: the chunk whole
            whole = memoryview(reader.read(Elements(tensor, c)))
            _place(view, [whole[first:last]], runs, pos, item, first)
            continue
        if buf is None:
            buf = memoryview(bytearray(min(last - first, BLOCK_BYTES)))
        got = _place(view, reader.read(Blocks(p.file, p.start + first, last - first, buf)),
                     runs, pos, item, first)
        if got != last - first:
            raise truncated(reader.path(p.file), p.start + first + got,
                            f"tensor '{tensor.name}'")
    return view


def selection_blocks(reader: Reader, tensor: Tensor,
                     pieces: list[tuple[Chunk, int, list[tuple[int, int, int]]]],
                     payloads: Sequence[Payload], buf: memoryview) -> Iterator[memoryview]:
    """The bytes of a selection (:func:`box_pieces`, each chunk's stored bytes raw at
    ``payloads[i].start``) in consecutive blocks of ``len(buf)`` bytes, each made in ``buf``
    and valid until the next is asked for: what a caller writes out block by block, each
    block written while it is in the cache (measured on a 1 GB Megatron merge, 2-core VM at
    load 5-6: 276 MB of row-parallel layers gathered whole into a 25 MB buffer, then written,
    cost 0.87-1.05 s of CPU; in 1 MB blocks 0.53-0.75 s).

    In a block, a chunk's runs that lie back to back in its file (a row-parallel layer's rows,
    in each rank's file) are one scattered read (an ``Into`` read: the kernel places each
    run; Python makes a view per run, nothing more). Memory: ``buf``, whatever the
    selection's size.

    Raises:
        InputError: a file ends before the bytes its metadata promises.
    """
    item = tensor.dtype.itemsize
    # Per chunk: its file, where its bytes begin, its runs, where each run begins in the
    # selection (bytes, ascending), and whether the runs lie back to back in the file.
    plans: list[tuple[str, int, list[tuple[int, int, int]], list[int], bool]] = []
    total = 0
    for (_, pos, runs), p in zip(pieces, payloads, strict=True):
        assert p.start is not None
        plans.append((p.file, p.start, runs, [(pos + b) * item for _, b, _ in runs],
                      all(x[0] + x[2] == y[0] for x, y in itertools.pairwise(runs))))
        if runs:  # the runs of all chunks tile the selection
            total = max(total, plans[-1][3][-1] + runs[-1][2] * item)
    size = len(buf)
    for lo in range(0, total, size):
        hi = min(total, lo + size)
        for file, start, runs, at, back_to_back in plans:
            # The runs that overlap [lo, hi): i .. j-1.
            i, j = max(0, bisect.bisect_right(at, lo) - 1), bisect.bisect_left(at, hi)
            if i < j and at[i] + runs[i][2] * item <= lo:
                i += 1
            if i >= j:
                continue
            # Each run's bytes as (source, view), the first and last cut to the block.
            first = max(at[i], lo)
            src = start + runs[i][0] * item + first - at[i]
            if back_to_back:
                views = [buf[x - lo : x - lo + n * item]
                         for x, (_, _, n) in zip(at[i:j], runs[i:j], strict=True)]
                views[0] = buf[first - lo : at[i] + runs[i][2] * item - lo]
                views[-1] = views[-1][: hi - max(at[j - 1], lo)]
                end = start + (runs[j - 1][0] + runs[j - 1][2]) * item \
                    - max(0, at[j - 1] + runs[j - 1][2] * item - hi)
                _read_views(reader, file, src, views, end - src, tensor)
                continue
            for k in range(i, j):
                x0, x1 = max(at[k], lo), min(at[k] + runs[k][2] * item, hi)
                _read_views(reader, file, start + runs[k][0] * item + x0 - at[k],
                            [buf[x0 - lo : x1 - lo]], x1 - x0, tensor)
        yield buf[: hi - lo]


def _read_views(reader: Reader, file: str, offset: int, views: list[memoryview], want: int,
                tensor: Tensor) -> None:
    """``want`` bytes from ``offset`` into ``views`` (of that many bytes in all)."""
    got = reader.read(Into(file, offset, views))
    if got != want:
        raise truncated(reader.path(file), offset + got, f"tensor '{tensor.name}'")


def _place(view: memoryview, blocks: Iterable[memoryview], runs: list[tuple[int, int, int]],
           pos: int, item: int, first: int) -> int:
    """The ``runs`` of a chunk (:func:`box_pieces`: element in the chunk, element in the box,
    num_elements; ascending) copied from consecutive ``blocks`` of its bytes from byte
    ``first`` into ``view`` (the box at element ``pos``), a run cut where a block ends;
    returns the bytes the blocks held."""
    i, base = 0, first  # the next run; the chunk byte where the block begins
    for block in blocks:
        end = base + len(block)
        while i < len(runs):
            a, b, n = runs[i]
            src, dst = a * item, (pos + b) * item
            lo, hi = max(src, base), min(src + n * item, end)
            if lo < hi:
                view[dst + lo - src : dst + hi - src] = block[lo - base : hi - base]
            if src + n * item > end:
                break  # the rest of the run is in the next block
            i += 1
        base = end
    return base - first


def blocks(reader: Reader, tensor: Tensor, block_bytes: int = BLOCK_BYTES
           ) -> Iterator[tuple[int, bytearray]]:
    """The tensor's bytes in C order, ``(first element, bytes)`` per block."""
    step = max(1, block_bytes // tensor.dtype.itemsize)
    for start in range(0, tensor.numel, step):
        yield start, read_range(reader, tensor, start, min(start + step, tensor.numel))


def stored_whole(tensor: Tensor, *, sharded: bool) -> bool:
    """Stored as one full chunk in a sharded checkpoint: replicated (a buffer, a scalar), so a
    reshard keeps it whole. Full weights (``sharded`` False) are always split."""
    return sharded and len([c for c in tensor.chunks if c.numel]) == 1 and any(
        c.sizes == tensor.shape for c in tensor.chunks)


def identical(reader_a: Reader, a: Tensor, reader_b: Reader, b: Tensor,
              progress: Callable[[int], None] | None = None,
              block_bytes: int = BLOCK_BYTES) -> bool:
    """True if ``a`` and ``b`` hold the same bytes (same dtype and shape required), compared
    block by block, stopping at the first difference."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # Two different weights (an untied lm_head beside its embedding) differ in their first
    # bytes: a small head first. A whole first block is 16 MB of each read before the first
    # compare (measured once, pages not yet cached: 0.1 s in a merge's critical path, before
    # any byte is written; 64 KB: under a millisecond).
    head = min(a.numel, HEAD_BYTES // a.dtype.itemsize)
    if head < a.numel and read_range(reader_a, a, 0, head) != read_range(reader_b, b, 0, head):
        return False
    for start, block in blocks(reader_a, a, block_bytes):
        if progress is not None:
            progress(2 * len(block))
        stop = start + len(block) // a.dtype.itemsize
        if read_range(reader_b, b, start, stop) != block:
            return False
    return True


def first_difference(a: memoryview | bytes | bytearray, b: memoryview | bytes | bytearray
                     ) -> int:
    """Index of the first differing byte (the two differ), by halving: O(log n) compares."""
    lo, hi = 0, min(len(a), len(b))
    if bytes(a[:hi]) == bytes(b[:hi]):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] != b[lo:mid]:
            hi = mid
        else:
            lo = mid
    return lo


def unravel(element: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of flat element ``element`` in C order."""
    index = []
    for n in reversed(shape):
        index.append(element % n if n else 0)
        element = element // n if n else 0
    return tuple(reversed(index))


def locate(reader: Reader, tensor: Tensor, element: int) -> tuple[str | None, int | None]:
    """The file holding element ``element`` of ``tensor`` and its byte offset there (None
    where the chunk is not one contiguous run of bytes, or cannot be decoded)."""
    index = unravel(element, tensor.shape)
    for c in tensor.chunks:
        if all(o <= i < o + s for i, o, s in zip(index, c.offsets, c.sizes, strict=True)):
            try:
                p = payload(reader, tensor, c)
            except InputError:  # the damage itself is reported elsewhere
                return c.file, None
            if p.start is None:
                return c.file, None
            within = sum(i * s for i, s in zip(
                (i - o for i, o in zip(index, c.offsets, strict=True)),
                geometry.strides(c.sizes), strict=True))
            return c.file, p.start + within * tensor.dtype.itemsize
    return None, None
