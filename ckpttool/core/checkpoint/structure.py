"""Is a checkpoint whole? Pure checks from its description: one implementation for merge (which
raises on the first error) and verify (which reports them all).

Every data file the metadata references exists and holds every byte range placed in it; no data
file is left over; every tensor's chunks tile it exactly; plus what the format itself found in
its metadata (``CheckpointInfo.problems``: a safetensors index that disagrees with its shards).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ckpttool.core.checkpoint import geometry
from ckpttool.errors import InputError
from ckpttool.formats import base
from ckpttool.formats.base import (
    CheckpointInfo,
    Chunk,
    ChunkColumns,
    Problem,
    Tensor,
    error,
    warning,
)
from ckpttool.storage.store import missing_message


def check(info: CheckpointInfo, canonical: Mapping[str, str],
          damaged: set[str] | None = None) -> list[Problem]:
    """Every structure problem of ``info``; ``canonical`` maps stored to canonical names.

    Args:
        damaged: filled with the stored names of tensors whose bytes these problems make
            unreadable (missing or short files, bad tiling): the content pass skips them
            instead of reporting the same damage again.
    """
    problems = list(info.problems)
    sizes = {f.name: f.size for f in info.files}
    bad_files: set[str] = set()  # missing, or shorter than what the metadata places in them
    for file, placed in sorted(_placed(info, sizes).items()):
        size = sizes.get(file)
        path = info.base / file
        if size is None:
            bad_files.add(file)
            problems.append(error("missing-file", missing_message(
                path, info.metadata_name, f"{placed.count} entries, e.g. {placed.first}"),
                file=file))
        elif placed.last[0] > size:
            bad_files.add(file)
            end, what = placed.last
            problems.append(error(
                "truncated-file", f"{path}: truncated: {info.metadata_name} places {what} up to "
                f"byte {end} but the file has {size} bytes; copy the checkpoint again",
                file=file, offset=size))
    for name in info.stray:
        problems.append(warning(
            "stray-file", f"{info.base / name}: not referenced by the checkpoint's metadata; "
            "left over from another save, or the metadata belongs to a different save",
            file=name))
    tiled = _tiled_on_columns(info.tensors)
    for i, t in enumerate(info.tensors):
        reason = None if i in tiled else _coverage(t.shape, t.chunks)
        if reason is not None:
            name = canonical.get(t.name, t.name)
            problems.append(error(_coverage_code(reason),
                                  f"{info.root}: tensor '{name}': {reason}; the checkpoint is "
                                  "incomplete or corrupt", tensor=name))
        if damaged is not None and (reason is not None or (bad_files and any(
                c.file in bad_files and c.end > (sizes.get(c.file) or 0) for c in t.chunks))):
            damaged.add(t.name)
    return problems


def raise_first(problems: list[Problem]) -> None:
    """Raise the first error-severity problem as an :class:`InputError` (merge, reshard)."""
    for p in problems:
        if p.severity == "error":
            raise InputError(p.message)


@dataclass
class _Placed:
    """What the metadata places in one data file: how many entries, the first, and the
    (end byte, what) of the one that ends last."""

    count: int
    first: str
    last: tuple[int, str]


def _placed(info: CheckpointInfo, sizes: Mapping[str, int | None]) -> dict[str, _Placed]:
    """Per data file, what the metadata places in it: from a tensor's columns where it has
    them (nothing per chunk is built), else from its chunks. Tensors of a column table whose
    every row lies inside a present file are left out (one C-level pass over the table: the
    usual case, where nothing is missing or short)."""
    out: dict[str, _Placed] = {}
    tables = {id(t.chunks.table): t.chunks.table for t in info.tensors
              if isinstance(t.chunks, ChunkColumns)}
    whole = {key for key, table in tables.items() if table.inside(sizes)}

    def add(file: str, count: int, end: int, what: str) -> None:
        p = out.get(file)
        if p is None:
            out[file] = _Placed(count, what, (end, what))
        else:
            p.count += count
            p.last = max(p.last, (end, what))

    for t in info.tensors:
        what = f"tensor '{t.name}'"
        if isinstance(t.chunks, ChunkColumns):
            if id(t.chunks.table) in whole:
                continue
            for file, (count, end) in t.chunks.placed().items():
                add(file, count, end, what)
        else:
            for c in t.chunks:
                add(c.file, 1, c.end, what)
    for o in info.objects:
        if o.file is not None:
            add(o.file, 1, o.offset + o.length, f"entry '{o.name}'")
    return out


_LARGEST = 1 << 62  # dimensions above this (or below 0) are left to the check one by one


def _tiled_on_columns(tensors: Sequence[Tensor]) -> set[int]:
    """Indices of ``tensors`` whose column chunks certainly tile them: the rows of
    :meth:`ChunkColumns.rows` in order, none empty, each starting where the one before ends,
    from 0 to the first dimension (:func:`geometry.rows_tile`'s first case), checked
    for all tensors of one table and ndim by one numpy pass each (millions of chunks: about
    15 us per tensor one by one). The others go through :func:`_coverage`, which says the
    same of these."""
    groups: dict[tuple[int, int], list[tuple[int, ChunkColumns]]] = {}
    rows = 0
    for i, t in enumerate(tensors):
        c = t.chunks
        if isinstance(c, ChunkColumns) and c.num_chunks and c.ndim == len(t.shape) and \
                c.ndim and min(t.shape) >= 0 and max(t.shape) < _LARGEST:
            groups.setdefault((id(c.table), c.ndim), []).append((i, c))
            rows += c.num_chunks
    if rows < base.VECTOR_ROWS:  # a few rows: one by one
        return set()

    out: set[int] = set()
    for (_, nd), whole_group in groups.items():
        for group in _pieces(whole_group):
            out.update(_tiled_group(group, nd, tensors))
    return out


def _pieces(group: list[tuple[int, ChunkColumns]]) -> Iterator[list[tuple[int, ChunkColumns]]]:
    """``group`` in consecutive pieces of about :data:`~ckpttool.formats.base.VECTOR_BLOCK`
    rows (the numpy pass's temporaries bounded: 10M rows would take 80 MB each)."""
    piece: list[tuple[int, ChunkColumns]] = []
    rows = 0
    for item in group:
        piece.append(item)
        rows += item[1].num_chunks
        if rows >= base.VECTOR_BLOCK:
            yield piece
            piece, rows = [], 0
    if piece:
        yield piece


def _tiled_group(group: list[tuple[int, ChunkColumns]], nd: int, tensors: Sequence[Tensor]
                 ) -> list[int]:
    """The indices of ``group`` (tensors of one table and ``nd``) that certainly tile."""
    import numpy as np

    which = [i for i, _ in group]
    cols = [c for _, c in group]
    boxes = np.frombuffer(cols[0].table.boxes, dtype=cols[0].table.boxes.typecode)
    num = np.fromiter((c.num_chunks for c in cols), dtype=np.int64, count=len(cols))
    first = np.cumsum(num) - num  # each tensor's first chunk among the group's
    step = 2 * nd
    # Where each chunk's box starts: its tensor's box, plus a box per chunk before it.
    at = np.repeat(np.fromiter((c.box for c in cols), dtype=np.int64, count=len(cols))
                   - step * first, num) + step * np.arange(int(num.sum()))
    if len(boxes) < int(at.max()) + step:
        return []  # rows outside the table: one by one (they say what is wrong)
    shapes = np.array([tensors[i].shape for i in which], dtype=np.int64)
    offset, size = boxes[at], boxes[at + nd]
    ok = (offset >= 0) & (size > 0)
    for d in range(1, nd):
        ok &= (boxes[at + d] == 0) & (boxes[at + nd + d] == np.repeat(shapes[:, d], num))
    end = offset + size  # both >= 0 and below 2**63: a wrapped sum is negative, no match
    before = np.empty_like(end)
    before[1:] = end[:-1]
    before[first] = 0  # a tensor's first chunk starts at 0
    ok &= offset == before
    last = first + num - 1
    whole = np.logical_and.reduceat(ok, first) & (end[last] == shapes[:, 0])
    return list(np.asarray(which)[whole].tolist())


def _coverage(shape: tuple[int, ...], chunks: Sequence[Chunk]) -> str | None:
    if isinstance(chunks, ChunkColumns):
        rows = chunks.rows(shape)
        if rows is not None and geometry.rows_tile(shape[0], *rows):
            return None  # row chunks that tile it, seen on columns
    return geometry.coverage_problem(shape, [(c.offsets, c.sizes) for c in chunks])


def _coverage_code(reason: str) -> str:
    # coverage_problem explains in words; these are the three ways a tiling fails.
    if "overlap" in reason:
        return "chunk-overlap"
    if "missing" in reason:
        return "chunk-gap"
    return "chunk-bounds"
