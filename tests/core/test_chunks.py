"""Chunk geometry: property tests of the pure planners."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.core.checkpoint import tensors
from ckpttool.core.checkpoint.geometry import (
    coverage_problem,
    intersect,
    is_single_run,
    rows_tile,
    runs,
    single_run_start,
    sub_runs,
)
from ckpttool.formats.base import Chunk, Tensor
from ckpttool.formats.codecs.dtypes import BY_NAME

F32 = BY_NAME["F32"]

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


@st.composite
def split_tensor(draw: st.DrawFn) -> tuple[tuple[int, ...], Boxes]:
    """A shape and a grid of chunks (cuts along some dims, possibly empty pieces)."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    cuts = []
    for n in shape:
        points = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        edges = [0, *points, n]
        cuts.append([(a, b - a) for a, b in zip(edges, edges[1:], strict=False)])
    boxes = [((), ())]
    for dim_cuts in cuts:
        boxes = [(o + (a,), s + (b,)) for o, s in boxes for a, b in dim_cuts]
    return shape, boxes


@settings(max_examples=300, deadline=None)
@given(split_tensor())
def test_runs_of_a_tiling_fill_every_element_once(case) -> None:
    shape, boxes = case
    assert coverage_problem(shape, boxes) is None
    full = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    out = np.full(full.size, -1)
    for offsets, sizes in boxes:
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        piece = full[index].reshape(-1)
        num_runs = 0
        for src, dst, n in runs(shape, offsets, sizes):
            assert (out[dst : dst + n] == -1).all()
            out[dst : dst + n] = piece[src : src + n]
            num_runs += 1
        if is_single_run(shape, offsets, sizes) and piece.size:
            assert num_runs == 1
        # The shortcut merge and verify take per chunk agrees with the runs.
        start = single_run_start(shape, offsets, sizes)
        if num_runs == 1:
            assert start == next(runs(shape, offsets, sizes))[1]
        else:
            assert start is None
    assert (out == full.reshape(-1)).all()


@settings(max_examples=300, deadline=None)
@given(split_tensor(), st.data())
def test_sub_runs_of_a_box_read_it_from_the_chunks(case, data) -> None:
    """A selection's box, assembled from the chunks' runs (each chunk C-ordered on its own),
    is the tensor's box in C order: what a Megatron slice reads or copies file to file."""
    shape, boxes = case
    full = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    offsets = tuple(data.draw(st.integers(0, n)) for n in shape)
    sizes = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, offsets, strict=True))
    box = (offsets, sizes)
    want = full[tuple(slice(o, o + s) for o, s in box_pairs(box))].reshape(-1)
    out = np.full(want.size, -1)
    for chunk in boxes:
        inner = intersect(chunk, box) if all(chunk[1]) else None
        if inner is None:
            continue
        stored = full[tuple(slice(o, o + s) for o, s in box_pairs(chunk))].reshape(-1)
        for a, b, n in sub_runs(inner, chunk, box):
            assert (out[b : b + n] == -1).all()
            out[b : b + n] = stored[a : a + n]
    assert (out == want).all()


def box_pairs(box: tuple[tuple[int, ...], tuple[int, ...]]) -> list[tuple[int, int]]:
    return list(zip(box[0], box[1], strict=True))


def test_gap_is_reported() -> None:
    problem = coverage_problem((4, 2), [((0, 0), (2, 2)), ((3, 0), (1, 2))])
    assert problem == "chunks cover 6 of 8 elements; 2 are missing"


def test_overlap_is_reported() -> None:
    problem = coverage_problem((4, 2), [((0, 0), (3, 2)), ((2, 0), (2, 2))])
    assert problem == "chunks at offsets [0, 0] and [2, 0] overlap"


def test_out_of_bounds_is_reported() -> None:
    problem = coverage_problem((4,), [((0,), (2,)), ((2,), (3,))])
    assert problem == "chunk at offsets [2] with sizes [3] lies outside the tensor's shape [4]"


def test_shard0_is_one_run_shard1_is_one_per_row() -> None:
    assert list(runs((4, 3), (2, 0), (2, 3))) == [(0, 6, 6)]
    assert list(runs((2, 4), (0, 2), (2, 2))) == [(0, 2, 2), (2, 6, 2)]
    assert list(runs((), (), ())) == [(0, 0, 1)]


@settings(max_examples=400, deadline=None)
@given(length=st.integers(0, 12), rows=st.integers(0, 3),
       pieces=st.lists(st.tuples(st.integers(-1, 13), st.integers(-1, 13)), max_size=8),
       shuffle=st.randoms())
def test_rows_tile_on_columns_agrees_with_coverage(length: int, rows: int,
                                                   pieces: list[tuple[int, int]],
                                                   shuffle: random.Random) -> None:
    """The column check of row chunks (structure's fast path) never says "tiles" where the
    full check finds a problem, and says it wherever row chunks do tile."""
    shuffle.shuffle(pieces)
    shape = (length, rows)
    boxes = [((o, 0), (s, rows)) for o, s in pieces]
    fast = rows_tile(length, [o for o, _ in pieces], [s for _, s in pieces])
    full = coverage_problem(shape, boxes) is None
    if fast:
        assert full, (shape, pieces)
    if full and rows and all(o >= 0 and s >= 0 for o, s in pieces):
        assert fast, (shape, pieces)


def test_rows_tile_of_real_splits() -> None:
    assert rows_tile(10, [0, 3, 6, 9], [3, 3, 3, 1])  # FSDP2 rows, the last one short
    assert rows_tile(10, [0, 5, 10, 10], [5, 5, 0, 0])  # empty pieces at the end
    assert rows_tile(4, [2, 0], [2, 2])  # any order
    assert not rows_tile(10, [0, 3], [3, 3])  # a gap
    assert not rows_tile(10, [0, 2, 6], [3, 4, 4])  # an overlap
    assert not rows_tile(4, [0, 2], [2, 3])  # beyond the end


def _scan_pieces(tensor: Tensor, boxes: Boxes) -> list[object]:
    """box_pieces by a pass over every chunk per box: what the grid lookup must give."""
    out: list[object] = []
    pos = 0
    for box in boxes:
        for c in tensor.chunks:
            inner = intersect((c.offsets, c.sizes), box) if c.numel else None
            if inner is not None:
                out.append((c, pos, sub_runs(inner, (c.offsets, c.sizes), box)))
        pos += int(np.prod(box[1], dtype=np.int64))
    return out


@settings(max_examples=300, deadline=None)
@given(split_tensor(), st.data())
def test_box_pieces_by_grid_are_those_of_a_pass_over_every_chunk(case, data) -> None:
    """The chunks a selection overlaps, looked up in the tensor's grid (where its chunks tile
    one; a chunk cut once more makes a tiling that is not a grid), are those a pass over
    every chunk finds, in the same order, with the same runs."""
    shape, boxes = case
    boxes = data.draw(st.permutations(boxes))
    if data.draw(st.booleans()) and boxes and shape:
        (o, s), d = boxes[0], data.draw(st.integers(0, len(shape) - 1))
        if s[d] > 1:  # cut the first chunk in two along d: not a grid any more
            half = s[d] // 2
            boxes = [(o, s[:d] + (half,) + s[d + 1 :]),
                     (o[:d] + (o[d] + half,) + o[d + 1 :], s[:d] + (s[d] - half,) + s[d + 1 :]),
                     *boxes[1:]]
    chunks = tuple(Chunk(o, s, "f", k, 1) for k, (o, s) in enumerate(boxes))
    tensor = Tensor("t", ("t",), F32, shape, chunks)
    selection = []
    for _ in range(data.draw(st.integers(1, 3))):
        offsets = tuple(data.draw(st.integers(0, n)) for n in shape)
        sizes = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, offsets,
                                                                      strict=True))
        selection.append((offsets, sizes))
    assert tensors.box_pieces(tensor, tuple(selection)) == _scan_pieces(tensor, selection)


def test_stacked_experts_tile_a_grid() -> None:
    """Megatron's stacked experts ([L, E, 2F, H], a chunk per layer and expert): a grid, and
    an expert's gate half is found in its one chunk."""
    layers, experts = 3, 16
    chunks = tuple(Chunk((lay, e, 0, 0), (1, 1, 8, 4), "f", lay * experts + e, 1)
                   for e in range(experts) for lay in range(layers))
    tensor = Tensor("t", ("t",), F32, (layers, experts, 8, 4), chunks)
    grid = tensors._make_grid(tensor)
    assert grid is not None
    ((c, pos, runs),) = tensors.box_pieces(tensor, (((2, 5, 0, 0), (1, 1, 4, 4)),))
    assert (c.offsets, pos, runs) == ((2, 5, 0, 0), 0, [(0, 0, 16)])


@settings(max_examples=300, deadline=None)
@given(split_tensor(), st.data())
def test_runs_placed_from_blocks_of_any_size(case, data) -> None:
    """A chunk's part of a selection placed from its bytes in blocks (mapped windows or reads
    into a buffer) of any size, a run cut where a block ends: the box's elements, as from the
    chunk whole."""
    shape, boxes = case
    chunks = [b for b in boxes if all(b[1])]
    if not chunks:
        return
    chunk = data.draw(st.sampled_from(chunks))
    full = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int32).reshape(shape)
    offsets = tuple(data.draw(st.integers(o, o + s - 1)) for o, s in box_pairs(chunk))
    sizes = tuple(data.draw(st.integers(1, o + s - x)) for (o, s), x in
                  zip(box_pairs(chunk), offsets, strict=True))
    box = (offsets, sizes)
    inner = intersect(chunk, box)
    assert inner is not None
    runs_ = sub_runs(inner, chunk, box)
    stored = full[tuple(slice(o, o + s) for o, s in box_pairs(chunk))].tobytes()
    item = 4
    first, last = runs_[0][0] * item, (runs_[-1][0] + runs_[-1][2]) * item
    block = data.draw(st.integers(1, max(1, last - first)))
    pieces = [memoryview(stored)[a : min(a + block, last)] for a in range(first, last, block)]
    want = full[tuple(slice(o, o + s) for o, s in box_pairs(box))].tobytes()
    out = bytearray(len(want))
    assert tensors._place(memoryview(out), pieces, runs_, 0, item, first) == last - first
    assert bytes(out) == want


def _column_tensors(cases: list[tuple[tuple[int, ...], list[tuple[tuple[int, ...],
                                                                  tuple[int, ...]]]]]
                    ) -> list[Tensor]:
    """Tensors of ``(shape, [(offsets, sizes), ...])`` on one ChunkTable (as a DCP .metadata's
    columns give them), a row of file 0 per chunk."""
    from array import array

    from ckpttool.formats.base import RECORD, ChunkColumns, ChunkTable

    boxes, rows = array("q"), 0
    spans = []
    for shape, chunks in cases:
        spans.append((rows, len(chunks), len(boxes), len(shape)))
        for offsets, sizes in chunks:
            boxes.extend(offsets)
            boxes.extend(sizes)
        rows += len(chunks)
    table = ChunkTable(["f"], array("i", [0]) * rows, array("q", range(rows)),
                       array("q", [1]) * rows, boxes, RECORD)
    return [Tensor(f"t{i}", (f"t{i}",), F32, shape,
                   ChunkColumns(table, first=a, num_chunks=n, box=b, ndim=nd))
            for i, ((shape, _), (a, n, b, nd)) in enumerate(zip(cases, spans, strict=True))]


@settings(max_examples=60, deadline=None)
@given(cases=st.lists(st.tuples(
    st.integers(0, 9), st.integers(1, 3),
    st.lists(st.tuples(st.integers(-1, 10), st.integers(-1, 10), st.integers(0, 3),
                       st.integers(0, 4)), max_size=6)), min_size=1, max_size=12),
    shuffle=st.randoms())
def test_tilings_checked_at_once_agree_with_one_by_one(cases, shuffle: random.Random) -> None:
    """structure's whole-table pass over column chunks says "tiles" exactly where the check
    of one tensor at a time finds a row tiling (and never where the full check finds a
    problem): gaps, overlaps, empty or negative rows, out-of-order rows, columns that are not
    whole, all among thousands of rows of good tensors."""
    from ckpttool.core.checkpoint import structure

    made = []
    for length, cols, pieces in cases:
        shuffle.shuffle(pieces)
        made.append(((length, cols), [((o, c0), (s, cs)) for o, s, c0, cs in pieces]))
    good = [((8, 2), [((k, 0), (1, 2)) for k in range(8)])] * 600  # 4,800 rows: the numpy pass
    tensors = _column_tensors(good + made + good[:1])
    tiled = structure._tiled_on_columns(tensors)
    block = structure.base.VECTOR_BLOCK
    try:  # in pieces of a few rows each (the temporaries' bound at 10M rows): the same
        structure.base.VECTOR_BLOCK = 7
        assert structure._tiled_on_columns(tensors) == tiled
    finally:
        structure.base.VECTOR_BLOCK = block
    assert set(range(len(good))) <= tiled and len(tensors) - 1 in tiled
    for i, t in enumerate(tensors):
        assert isinstance(t.chunks, structure.ChunkColumns)
        rows = t.chunks.rows(t.shape)
        one = rows is not None and rows_tile(t.shape[0], *rows)
        if i in tiled:
            assert one and structure._coverage(t.shape, t.chunks) is None, t
        elif one:  # the one-by-one check's slower cases only: no rows, empty ones, out of order
            offsets, sizes = rows
            assert not sizes or min(sizes) == 0 or list(offsets) != sorted(offsets), t


@pytest.mark.parametrize("rows", [10, 5000])
def test_rows_inside_their_files_on_columns(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ChunkTable.inside`` (Python below a few thousand rows, numpy passes of a block of
    rows each above): a row that ends one byte past its file's end, or a missing file, says
    no."""
    from array import array

    from ckpttool.formats import base
    from ckpttool.formats.base import RECORD, ChunkTable

    monkeypatch.setattr(base, "VECTOR_BLOCK", 999)

    file = array("i", [k % 3 for k in range(rows)])
    offset = array("q", [7 * (k // 3) for k in range(rows)])
    length = array("q", [7] * rows)
    table = ChunkTable(["a", "b", "c"], file, offset, length, array("q"), RECORD)
    ends = {n: max(o + ln for f, o, ln in zip(file, offset, length, strict=True) if f == i)
            for i, n in enumerate(table.names)}
    assert table.inside(ends)
    assert table.inside({**ends, "a": ends["a"] + 1})
    assert not table.inside({**ends, "b": ends["b"] - 1})
    assert not table.inside({**ends, "c": None})
    length[rows // 2] = (1 << 63) - 1  # a damaged size: no wrapped sum says "inside"
    assert not table.inside({n: (1 << 63) - 1 for n in table.names})


def test_tilings_at_once_leave_negative_and_huge_shapes_to_the_one_by_one_check() -> None:
    """A negative dimension (a wrapped int64 end could equal it) is never said to tile by the
    numpy pass (the one-by-one check reports it), nor is a dimension near int64's end looked
    at there (it tiles, one by one)."""
    from ckpttool.core.checkpoint import structure

    good = [((8, 2), [((k, 0), (1, 2)) for k in range(8)])] * 600
    odd = [((-(2**63) + 2, 2), [((0, 0), (2**63 - 1, 2)), ((2**63 - 1, 0), (3, 2))]),
           ((2**62 + 1, 2), [((0, 0), (2**62 + 1, 2))])]
    tensors = _column_tensors(good + odd)
    tiled = structure._tiled_on_columns(tensors)
    assert tiled == set(range(len(good)))
    negative, huge = tensors[len(good):]
    assert structure._coverage(negative.shape, negative.chunks) is not None
    assert structure._coverage(huge.shape, huge.chunks) is None
