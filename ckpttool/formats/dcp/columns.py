"""A DCP ``.metadata`` read into columns: what :mod:`ckpttool.formats.dcp.reader` gets from the
allow-list unpickler, without the million-object graph.

torch pickles ``.metadata`` with protocol 4, which memoizes every object it writes; an
unpickler keeps all of them alive until the load ends: about 16 objects and 1.7 KB per chunk
(a ``ChunkStorageMetadata``, a ``MetadataIndex``, a ``_StorageInfo``, their dicts, the
``torch.Size`` tuples). Here the pickle's opcodes are walked by a small interpreter that builds
the few objects per tensor as the allow-list unpickler builds them (same stand-ins, from the
same ``lookup``), and recognises the repeating per-chunk entries by their bytes: a run of
``ChunkStorageMetadata`` entries, or of ``MetadataIndex`` -> ``_StorageInfo`` pairs, goes into
``array('q')`` columns and stands on the stack as one marker. Nothing is built for them.

Anything this does not recognise with certainty (an opcode, a global or a shape outside what
DCP writes, a value the allow-list path would refuse or report) raises :class:`Fallback`:
the caller then reads the file with the allow-list unpickler, which gives the answer or the
error it always gave. So this never answers differently, only sooner (``tests/formats/
test_dcp_metadata.py`` checks both on every fixture and on mutated files).

Safety is the allow-list unpickler's: globals come only from ``lookup`` (the same function),
nothing else is called, every length is bounded by the file, the walk is a loop (no
recursion), and memory per chunk is bounded by the columns.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool._gc import gc_paused
from ckpttool.formats.base import RECORD, ChunkColumns, ChunkTable, ObjectEntry, Tensor
from ckpttool.formats.codecs import torchsave
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.formats.dcp import opcodes
from ckpttool.formats.dcp.machine import _Machine
from ckpttool.formats.dcp.opcodes import _MD, Fallback, _ChunkRun, _numpy
from ckpttool.storage import sidefiles
from ckpttool.storage.store import LOCAL, Stores

# A plain data file name, as DCP's writer makes them (``__0_0.distcp``); others fall back.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}\Z")


@dataclass
class Columnar:
    tensors: list[Tensor]
    objects: list[ObjectEntry]
    version: str | None


# --------------------------------------------------------------------------------------------
# Conversion: what metadata._convert makes of the same objects, or Fallback


def _planner_path(raw: Any, fqn: str) -> tuple[str, ...]:
    if isinstance(raw, (tuple, list)) and raw and all(isinstance(p, (str, int)) for p in raw):
        return tuple(str(p) for p in raw)
    return (fqn,)


def _nonneg_ints(value: Any) -> tuple[int, ...]:
    if type(value) is tuple and all(type(x) is int and x >= 0 for x in value):
        return value
    raise Fallback("ints")


def _plain_name(rel: Any, metadata_file: str) -> str:
    if type(rel) is not str or not _PLAIN_NAME.match(rel) or rel == metadata_file:
        raise Fallback("name")
    return rel


@dataclass
class _TensorRows:
    fqn: str
    path: tuple[str, ...]
    dtype: DType
    shape: tuple[int, ...]
    first: int
    box: int
    num: int
    ndim: int


def _blocks(sizes: Sequence[int]) -> Iterator[tuple[int, int]]:
    """``sizes`` cut into consecutive pieces ``[a, b)`` of at least :data:`opcodes.BLOCK` in all
    (the last: what is left)."""
    a = total = 0
    for b, n in enumerate(sizes, 1):
        total += n
        if total >= opcodes.BLOCK:
            yield a, b
            a, total = b, 0
    if a < len(sizes):
        yield a, len(sizes)


def _check_rows(vm: _Machine, rows: list[_TensorRows], cols: _Placement) -> None:
    """Every tensor's rows against the storage entries placed in them, and what the
    allow-list path would read differently, by numpy passes over :data:`opcodes.BLOCK` rows at a
    time (a row is a chunk).

    Raises:
        Fallback: a row without an entry, or with another tensor's; offsets that differ from
            the entry's; the same offsets twice in one tensor; a chunk stored raw.
    """
    rows = [t for t in rows if t.num]
    for a, b in _blocks([t.num for t in rows]):
        _check_block(vm, rows[a:b], cols)


def _check_block(vm: _Machine, rows: list[_TensorRows], cols: _Placement) -> None:
    """:func:`_check_rows` for some tensors (each of one row or more)."""
    np = _numpy()
    num = np.array([t.num for t in rows], dtype=np.int64)
    nds = np.array([t.ndim for t in rows], dtype=np.int64)
    before = np.cumsum(num) - num  # rows of the tensors before, in this order
    total = int(num.sum())
    j = np.arange(total, dtype=np.int64)
    # Per row of a tensor (tensor by tensor): its row in the table, its tensor's name number
    # and ndim, where its box starts.
    nd = np.repeat(nds, num)
    row = np.repeat(np.array([t.first for t in rows], dtype=np.int64) - before, num) + j
    box = np.repeat(np.array([t.box for t in rows], dtype=np.int64) - 2 * nds * before,
                    num) + 2 * nd * j
    owner = np.repeat(np.array([vm.fqns[t.fqn] for t in rows], dtype=np.int32), num)
    boxes = np.frombuffer(vm.boxes, dtype=np.int64)
    length = np.frombuffer(cols.length, dtype=np.int64)[row]
    if length.min() < 0:
        raise Fallback("no storage")  # the allow-list path says which
    if not np.array_equal(np.frombuffer(cols.row_fqn, dtype=np.int32)[row], owner):
        raise Fallback("index")  # an entry of another tensor in its rows
    # Each row's offsets against its entry's, and a key of them per row (offsets by the
    # tensor's strides, wrapping: equal offsets give equal keys, so keys that rise through
    # a tensor mean no offsets twice in it); each row's bytes if stored raw.
    strides = []
    for t in rows:
        s, st = 1, []
        for d in reversed(t.shape):
            st.append(s)
            s = s * d % (1 << 64)
        strides.append([(x + (1 << 63)) % (1 << 64) - (1 << 63) for x in reversed(st)])
    key = np.zeros(total, dtype=np.int64)
    nbytes = np.repeat(np.array([t.dtype.itemsize for t in rows], dtype=np.int64), num)
    for k in range(int(nds.max())):
        has = np.flatnonzero(nd > k)
        offs = boxes[box[has] + k]
        if not np.array_equal(offs, np.frombuffer(cols.row_offs[k], dtype=np.int64)[row[has]]):
            raise Fallback("storage mismatch")
        stride = np.array([x[k] if len(x) > k else 0 for x in strides], dtype=np.int64)
        key[has] += offs * np.repeat(stride, num)[has]
        nbytes[has] *= boxes[box[has] + nd[has] + k]
    # A chunk whose length is its elements' (SerializationFormat.SAFETENSORS): dcp places it.
    # (A product that wraps int64 cannot equal a length: the partial products never pass it.)
    if np.any(length == nbytes):
        raise Fallback("raw chunk")
    rises = np.diff(key) > 0
    rises[before[1:] - 1] = True  # from one tensor to the next
    # The tensors of those rows, each once (rising: np.unique would import numpy.ma, 15 ms).
    for i in dict.fromkeys(
            (np.searchsorted(before, np.flatnonzero(~rises) + 1, side="right") - 1).tolist()):
        t = rows[i]  # keys that do not rise: the offsets themselves, as tuples
        step = 2 * t.ndim
        end = t.box + step * t.num
        offs_ = [vm.boxes[t.box + k : end : step] for k in range(t.ndim)]
        if t.ndim == 0 or len(set(zip(*offs_, strict=True))) != t.num:
            raise Fallback("duplicate offsets")  # the allow-list path gives both one entry


def _files_of(vm: _Machine, rows: list[_TensorRows], cols: _Placement
              ) -> list[tuple[str, ...] | None]:
    """Each tensor's data files, sorted, from its rows' files as one bit each (up to 64 files;
    None for each where there are more: found when asked). Tensors of one set of files share
    one tuple."""
    names = list(vm.names)
    if len(names) > 64:
        return [None] * len(rows)
    np = _numpy()
    sets: dict[int, tuple[str, ...]] = {0: ()}
    masks: list[int] = []
    with_rows = [t for t in rows if t.num]
    for a, b in _blocks([t.num for t in with_rows]):
        block = with_rows[a:b]
        num = np.array([t.num for t in block], dtype=np.int64)
        row = np.repeat(np.array([t.first for t in block], dtype=np.int64) - (np.cumsum(num)
                                                                             - num), num)
        row += np.arange(len(row), dtype=np.int64)
        bits = np.left_shift(np.uint64(1), np.frombuffer(cols.file, dtype=np.int32)[row]
                             .astype(np.uint64))
        masks += np.bitwise_or.reduceat(bits, np.cumsum(num) - num).tolist()
    by_mask = iter(masks)
    out: list[tuple[str, ...] | None] = []
    for t in rows:
        mask = next(by_mask) if t.num else 0
        got = sets.get(mask)
        if got is None:
            got = sets[mask] = tuple(sorted(n for i, n in enumerate(names) if mask >> i & 1))
        out.append(got)
    return out


def _convert(vm: _Machine, md: Any, metadata_file: str) -> Columnar:
    """The interpreted ``Metadata`` as columns: tensors' rows, then every storage entry placed
    in its row, then the checks that each row got exactly one.

    Raises:
        Fallback: anything this path does not recognise with certainty.
    """
    if type(md) is not vm.lookup(_MD, "Metadata"):
        raise Fallback("not Metadata")
    sd_meta = md.field("state_dict_metadata")
    storage_data = md.field("storage_data")
    planner_data = md.field("planner_data")
    if type(sd_meta) is not dict or type(storage_data) is not dict or \
            type(planner_data) is not dict or not planner_data:
        raise Fallback("layout")
    if any(id(d) != id(storage_data) for d in vm.storage_dicts.values()):
        raise Fallback("storage runs elsewhere")
    rows, by_fqn, objects = _tensor_rows(vm, sd_meta, planner_data)

    # storage: every tensor row gets exactly one entry, the one whose index hint names it and
    # whose offsets are the row's (so the allow-list path's (fqn, offsets) lookup agrees).
    cols = _Placement(vm, rows, by_fqn)
    placed = cols.place_runs(vm)
    object_storage: dict[str, tuple[str, int, int]] = {}
    placed += cols.place_dict(vm, storage_data, object_storage)
    # As many entries placed as the tensors have rows, and none of those rows left without
    # one (_check_rows): each row got exactly one. (Rows a tensor's chunks were copied from,
    # above, are no tensor's.)
    if placed != sum(t.num for t in rows):
        raise Fallback("storage count")  # the allow-list path says what is wrong
    for rel in vm.names:
        _plain_name(rel, metadata_file)

    _check_rows(vm, rows, cols)
    files = _files_of(vm, rows, cols)
    table = ChunkTable(list(vm.names), cols.file, cols.begin, cols.length, vm.boxes, RECORD)
    tensors = []
    for t, f in zip(rows, files, strict=True):
        tensors.append(Tensor(t.fqn, t.path, t.dtype, t.shape,
                              ChunkColumns(table, first=t.first, num_chunks=t.num, box=t.box,
                                           ndim=t.ndim, files=f)))
    out_objects = []
    for fqn, path in objects:
        stored = object_storage.get(fqn)
        if stored is None:
            raise Fallback("object storage")
        out_objects.append(ObjectEntry(fqn, path, *stored))
    version = md.field("version")
    return Columnar(tensors, out_objects, None if version is None else str(version))


def _tensor_rows(vm: _Machine, sd_meta: dict[Any, Any], planner_data: dict[Any, Any]
                 ) -> tuple[list[_TensorRows], dict[str, _TensorRows],
                            list[tuple[str, tuple[str, ...]]]]:
    """Each tensor's rows of the chunk table (its own run, or rows copied from its chunks),
    by name; and the bytes entries (objects) with their paths."""
    tensor_cls = vm.lookup(_MD, "TensorStorageMetadata")
    bytes_cls = vm.lookup(_MD, "BytesStorageMetadata")
    rows: list[_TensorRows] = []
    by_fqn: dict[str, _TensorRows] = {}
    objects: list[tuple[str, tuple[str, ...]]] = []
    for fqn, entry in sd_meta.items():
        if type(fqn) is not str:
            raise Fallback("fqn")
        path = _planner_path(planner_data.get(fqn), fqn)
        if type(entry) is bytes_cls:
            objects.append((fqn, path))
            continue
        if type(entry) is not tensor_cls:
            raise Fallback("kind")
        props = entry.field("properties")
        if not isinstance(props, torchsave.Stub):
            raise Fallback("properties")
        state = props.state
        dtype = state[0] if isinstance(state, tuple) and state else props.field("dtype")
        if not isinstance(dtype, DType):
            raise Fallback("dtype")
        shape = _nonneg_ints(entry.field("size") or ())
        found = entry.field("chunks") or ()
        if not isinstance(found, (list, tuple)):
            raise Fallback("chunks")
        nd = len(shape)
        runs = [c for c in found if isinstance(c, _ChunkRun)]
        for r in runs:
            r.consumed += 1
        if len(runs) == 1 and len(found) == 1 and runs[0].ndim == nd:
            r = runs[0]
            t = _TensorRows(fqn, path, dtype, shape, r.first, r.box, r.num, nd)
        else:  # stubs, or several runs: copied to rows of their own
            first, box = _copied_rows(vm, found, nd)
            t = _TensorRows(fqn, path, dtype, shape, first, box, vm.num_rows - first, nd)
        if fqn in by_fqn:
            raise Fallback("duplicate fqn")
        by_fqn[fqn] = t
        rows.append(t)
    if any(m.consumed != 1 for m in vm.markers):
        raise Fallback("marker")
    return rows, by_fqn, objects


def _copied_rows(vm: _Machine, found: Sequence[Any], nd: int) -> tuple[int, int]:
    """A tensor's chunks (stubs, or several runs) copied to rows of their own at the end of
    the table: its first row and first box."""
    boxes = vm.boxes
    first, box = vm.num_rows, len(boxes)
    for c in found:
        if isinstance(c, _ChunkRun):
            if c.ndim != nd:
                raise Fallback("ndim")
            boxes.extend(boxes[c.box : c.box + 2 * nd * c.num])
            vm.num_rows += c.num
        elif type(c) is vm.chunk_cls:
            o = _nonneg_ints(c.__dict__.get("offsets"))
            s = _nonneg_ints(c.__dict__.get("sizes"))
            if len(o) != nd or len(s) != nd:
                raise Fallback("ndim")
            boxes.extend(o)
            boxes.extend(s)
            vm.num_rows += 1
        else:
            raise Fallback("chunk")
    return first, box


class _Placement:
    """The storage columns of the chunk table (file, begin, length per row) being filled, with
    what each row's entry said (its name as a number in ``vm.fqns``, its offsets: one column
    per dimension), compared with the rows' own tensor by tensor once all are placed."""

    def __init__(self, vm: _Machine, rows: list[_TensorRows],
                 by_fqn: dict[str, _TensorRows]) -> None:
        num = vm.num_rows
        self.by_fqn = by_fqn
        self.file = array("i", [-1]) * num
        self.begin = array("q", [0]) * num
        self.length = array("q", [-1]) * num
        self.row_fqn = array("i", [-1]) * num
        self.row_offs = [array("q", [-1]) * num
                         for _ in range(max((t.ndim for t in rows), default=0))]
        fqns = vm.fqns
        by_number: list[_TensorRows | None] = [None] * len(fqns)
        for t in rows:
            n = fqns.setdefault(t.fqn, len(fqns))
            if n == len(by_number):
                by_number.append(t)
            else:
                by_number[n] = t
        self.fqns = fqns
        # By name number: the first row of its tensor and the tensor's ndim (-1: none).
        self.first_by_number = [-1 if t is None else t.first for t in by_number]
        self.ndim_by_number = [-1 if t is None else t.ndim for t in by_number]

    def place(self, fqn: str, index: Any, offs: Sequence[int], f: int, b: int, n: int) -> int:
        """One entry into its row; 1 if placed, 0 for an entry no tensor uses (the allow-list
        path ignores it too)."""
        t = self.by_fqn.get(fqn)
        if t is None:
            return 0
        if type(index) is not int or not 0 <= index < t.num or len(offs) != t.ndim:
            raise Fallback("index")
        g = t.first + index
        if self.length[g] != -1:
            raise Fallback("storage mismatch")
        self.file[g], self.begin[g], self.length[g] = f, b, n
        self.row_fqn[g] = self.fqns[fqn]
        for k, o in enumerate(offs):
            self.row_offs[k][g] = o
        return 1

    def place_runs(self, vm: _Machine) -> int:
        """The interpreter's runs of entries, placed by numpy scatters, runs of
        :data:`opcodes.BLOCK` entries at a time; how many."""
        placed = 0
        vm.storage_block()
        blocks, vm.s_blocks = vm.s_blocks, []
        blocks.reverse()
        while blocks:
            a, b, columns = blocks.pop()  # freed once placed
            placed += self.place_block(vm, vm.s_runs[a:b], columns)
            del columns
        return placed

    def place_block(self, vm: _Machine, runs: Sequence[tuple[int, int, int, int, int]],
                    columns: tuple[Any, ...]) -> int:
        """Consecutive runs of entries placed; how many.

        An entry goes to its tensor's first row plus its index hint. One whose name is no
        tensor's, or a tensor's of another ndim, is placed one by one (:meth:`place`). Two
        entries in one row leave another row without one, which the caller finds.
        """
        np = _numpy()
        at, cnt, nds, o_at, memo_size = (np.array(c, dtype=np.int64)
                                         for c in zip(*runs, strict=True))
        e0, o0, total = runs[0][0], runs[0][3], int(cnt.sum())
        fqn_at, index, offs, file_at, begin, length = columns
        # A run's GETs name entries the memo had when it was read (before: not numbered).
        below = np.repeat(memo_size, cnt)
        if len(fqn_at) != total or np.any(fqn_at >= below) or np.any(file_at >= below):
            raise Fallback("get")  # not in the memo (yet)
        fq = vm.fqn_numbers.numbered(fqn_at)
        file = vm.file_numbers.numbered(file_at)
        # Names numbered since (no tensor's): none there.
        self.first_by_number += [-1] * (len(self.fqns) - len(self.first_by_number))
        self.ndim_by_number += [-1] * (len(self.fqns) - len(self.ndim_by_number))
        if not len(fq) == len(index) == len(file) == len(begin) == len(length) == total:
            raise Fallback("storage columns")  # cannot happen: a run's columns are its entries'
        nd = np.repeat(nds, cnt)
        # Each entry's offsets start at its run's, ndim apart (in this block's offsets).
        o_first = (np.repeat(o_at - o0 - nds * (at - e0), cnt)
                   + nd * np.arange(total, dtype=np.int64))
        first = np.array(self.first_by_number, dtype=np.int64)[fq]
        fits = (first >= 0) & (np.array(self.ndim_by_number, dtype=np.int64)[fq] == nd)
        fast = np.flatnonzero(fits)
        row = first[fast] + index[fast]  # >= 0: both are
        if row.size and row.max() >= len(self.file):
            raise Fallback("index")  # past the table (past its tensor: checked later)
        np.frombuffer(self.row_fqn, dtype=np.int32)[row] = fq[fast]
        np.frombuffer(self.file, dtype=np.int32)[row] = file[fast]
        for col, got in ((self.begin, begin), (self.length, length)):
            np.frombuffer(col, dtype=np.int64)[row] = got[fast]
        for k, col in enumerate(self.row_offs):
            has = np.flatnonzero(nd[fast] > k)
            np.frombuffer(col, dtype=np.int64)[row[has]] = offs[o_first[fast[has]] + k]
        placed = len(fast)
        names = list(self.fqns)  # by number
        for i in np.flatnonzero(~fits).tolist():
            o = int(o_first[i])
            placed += self.place(names[fq[i]], int(index[i]), offs[o : o + int(nd[i])].tolist(),
                                 int(file[i]), int(begin[i]), int(length[i]))
        return placed

    def place_dict(self, vm: _Machine, storage_data: dict[Any, Any],
                   object_storage: dict[str, tuple[str, int, int]]) -> int:
        """The entries the interpreter left as objects, one by one (objects' storage into
        ``object_storage``); how many tensor entries were placed."""
        placed = 0
        names = vm.names
        for k, v in storage_data.items():
            if type(k) is not vm.index_cls or type(v) is not vm.info_cls:
                raise Fallback("storage kind")
            kd, vd = k.__dict__, v.__dict__
            fqn, offs_ = kd.get("fqn"), kd.get("offset")
            rel = vd.get("relative_path")
            b, n = vd.get("offset"), vd.get("length")
            if type(fqn) is not str or type(rel) is not str or type(b) is not int or \
                    type(n) is not int or b < 0 or n < 0 or vd.get("transform_descriptors"):
                raise Fallback("storage entry")
            f = names.get(rel)
            if f is None:
                f = names[rel] = len(names)
            if offs_ is None:
                object_storage[fqn] = (rel, b, n)
                continue
            placed += self.place(fqn, kd.get("index"), _nonneg_ints(offs_), f, b, n)
        return placed


# DCP's .metadata, read as a side file: about 180 bytes per chunk, so 4 GiB is over 20
# million chunks.
METADATA_KIND = sidefiles.Kind("DCP .metadata file", 4 << 30)


def read(path: Path, lookup: Callable[[str, str], Any | None], *,
         metadata_file: str = ".metadata", stores: Stores = LOCAL) -> Columnar | None:
    """``path`` (a ``.metadata``) as tensors with columnar chunks, objects and version, or None
    where the allow-list unpickler must decide (anything not recognised with certainty).

    Args:
        lookup: the allow-list (``metadata.allowed_global``): every global comes from it.
        stores: what reads it (a remote one's by ranged GETs).
    """
    try:
        with stores.side_file(path, METADATA_KIND) as f:
            size = f.seek(0, 2)
            f.seek(0)
            with gc_paused():
                vm = _Machine(f, size, lookup)
                md = vm.run()
                return _convert(vm, md, metadata_file)
    except (Fallback, OSError, MemoryError, RecursionError, OverflowError):
        # OverflowError: a number beyond int64 in a damaged file (array('q') refuses it); the
        # allow-list path reads the file again and says what is wrong.
        return None
