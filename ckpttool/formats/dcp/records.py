"""``torch.save`` records of DCP chunks: decoded from their zip and pickle headers
(:func:`read_record`), non-tensor entries read with weights-only semantics
(:func:`read_object`), and records decoded once as templates for the many records of the same
layout (:class:`Template`), one at a time or many at once (:func:`fill_rows`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import CkptError, InputError, UnsupportedError
from ckpttool.formats.base import (
    RECORD,
    Checksummed,
    Chunk,
    ChunkColumns,
    ObjectEntry,
    Payload,
    Tensor,
    TensorPlaceholder,
    UnreadableObject,
)
from ckpttool.formats.codecs import archive, torchsave
from ckpttool.formats.codecs.crc import crc32
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.formats.dcp import vecfill


@dataclass(frozen=True)
class TensorRecord:
    """A chunk's ``torch.save`` record, decoded from its zip and pickle headers."""

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    data_offset: int  # absolute byte offset of the storage payload in the file
    data_size: int  # bytes of the storage payload
    crc32: int | None  # CRC-32 of the payload as the zip header records it
    entries: tuple[archive.ZipEntry, ...] = ()  # every entry, offsets relative to the record

    @functools.cached_property
    def is_contiguous(self) -> bool:  # cached: a template's record answers it per chunk
        return self.stride == torchsave.contiguous_strides(self.shape) or math.prod(self.shape) <= 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# --------------------------------------------------------------------------------------------
# torch.save records: zip headers and the data.pkl that names the storage


def read_record(fd: int | Callable[[int, int], bytes], *, offset: int, length: int, where: str
                ) -> TensorRecord:
    """Decode the ``torch.save`` record of one tensor chunk at ``offset`` in the open file ``fd``.

    Reads only headers (two small reads for an ordinary record), never the tensor bytes.

    Raises:
        InputError: the record is truncated, corrupt, or its pickle is not a plain tensor (a
            global no tensor record names is damage: .metadata was read by then).
        UnsupportedError: big-endian or compressed records.
    """
    rb = archive.RecordBytes(fd, offset, length, where)
    entries = archive.zip_entries(rb)
    archive.check_byteorder(rb, entries)
    try:
        ref = torchsave.load_pickle(rb, entries)
    except torchsave.Refused as e:
        verdict = torchsave.refusal(where, e, torchsave.record_global,
                                    "a tensor record never needs",
                                    names=torchsave.archive_globals(rb, entries))
        if isinstance(verdict, UnsupportedError):
            # .metadata was read, so the torch that wrote this checkpoint writes records
            # ckpttool reads: a class no tensor record names is damage, decided by the bytes
            # alone (never by what this process happens to have imported).
            verdict = InputError(
                f"{where}: the tensor record's pickle asks for '{e.qualname}', which no tensor "
                "record of a checkpoint whose .metadata ckpttool reads names: the record is "
                "damaged (nothing was executed). Copy the file again from the source")
        raise verdict from e
    except torchsave.PICKLE_ERRORS as e:
        raise InputError(f"{where}: corrupt tensor record ({e})") from e
    if not isinstance(ref, torchsave.TensorRef):
        raise InputError(f"{where}: record holds a {type(ref).__name__}, not a tensor")
    data = entries.get(f"data/{ref.storage.key}")
    if data is None:
        raise InputError(f"{where}: record lacks storage 'data/{ref.storage.key}'; corrupt")
    return TensorRecord(
        dtype=ref.dtype,
        shape=ref.shape,
        stride=ref.stride,
        storage_offset=ref.storage_offset,
        data_offset=offset + data.data_offset,
        data_size=data.size,
        crc32=data.crc32,
        entries=tuple(entries.values()),
    )


# --------------------------------------------------------------------------------------------
# Non-tensor entries


def read_object(fd: int | Callable[[int, int], bytes], entry: ObjectEntry, *, where: str
                ) -> Any:
    """Read a non-tensor entry with weights-only semantics: plain containers and scalars only.

    Raises:
        UnreadableObject: the pickle names a class or function (named in the exception).
        InputError: the record is truncated or corrupt.
    """
    rb = archive.RecordBytes(fd, entry.offset, entry.length, where)
    entries = archive.zip_entries(rb)
    try:
        value = torchsave.load_pickle(rb, entries, max_nodes=torchsave.OBJECT_MAX_NODES)
    except torchsave.Refused as e:
        pkl = entries["data.pkl"]
        names = torchsave.named_globals(rb.read(pkl.data_offset, pkl.size))
        raise UnreadableObject(e.qualname, names=names or [e.qualname]) from e
    except torchsave.TooComplex as e:
        raise UnreadableObject(None, str(e)) from e
    except torchsave.PICKLE_ERRORS as e:
        raise InputError(f"{where}: corrupt record ({e})") from e
    return plain(value)


def plain(value: Any) -> Any:
    if isinstance(value, torchsave.TensorRef):
        return TensorPlaceholder(value.dtype.name, value.shape)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def record_entries(fd: int | Callable[[int, int], bytes], *, offset: int, length: int,
                   where: str) -> tuple[archive.ZipEntry, ...]:
    """Every entry of the record at ``offset`` (data.pkl, the storage, byteorder...), with
    absolute offsets and the CRC-32 the zip headers record."""
    rb = archive.RecordBytes(fd, offset, length, where)
    return tuple(dataclasses.replace(e, data_offset=offset + e.data_offset)
                 for e in archive.zip_entries(rb).values())


# --------------------------------------------------------------------------------------------
# Reading data


# Records up to this size are read whole to match a template (one read instead of two).
SMALL_RECORD = 1 << 16
# Back-to-back small records are read together up to this many bytes (Reader.payloads).
SPAN = 4 << 20


# Entries whose bytes are the same in every record of one layout (compared with the template).
_SHARED = ("data.pkl", "byteorder")


class Template:
    """A decoded record, as a pattern for records of the same length, dtype and shape.

    torch's writer gives every chunk of one dtype and shape the same record but for the
    CRC-32 fields and the contents of the storage (and version) entries: headers, entry names,
    sizes and offsets, ``data.pkl`` and ``byteorder`` are the same bytes. A record whose bytes
    equal the template's everywhere else decodes, by the same code, to the same layout, so it
    is located without parsing its zip directory and unpickling its ``data.pkl`` again (the
    per-chunk cost that dominates checkpoints of many small chunks). The comparison and the
    CRC fields are one C-level call each.
    """

    def __init__(self, rec: TensorRecord, raw: bytes, length: int, data: archive.ZipEntry
                 ) -> None:
        self.rec = rec  # offsets relative to the record
        self.head = data.data_offset  # bytes read before the storage's data...
        self.data_end = data.data_offset + data.size  # ...and after it, to the record's end
        gap = data.size

        def in_raw(at: int) -> int:  # ``raw`` is [0, head) + [data_end, length)
            return at if at <= self.head else at - gap

        # Entries whose contents every record of the layout shares: where the template's
        # central directory CRC-32 for one is right, that field is compared too (not
        # blanked), so a record that matches has it right: fill_rows computes no CRC-32
        # for them (two of the seven entries torch writes).
        implied = {e.name for e in rec.entries if e.name in _SHARED and e is not data
                   and crc32(raw[in_raw(e.data_offset) : in_raw(e.data_offset) + e.size])
                   == e.crc32}
        masks = [(at, 4) for e in rec.entries
                 for at in (e.crc_fields[1:] if e.name in implied else e.crc_fields)]
        masks += [e.descriptor for e in rec.entries if e.descriptor[1]]
        masks += [(e.data_offset, e.size) for e in rec.entries if e.name not in _SHARED]
        spans = []  # in record coordinates; the storage's data is masked, so none spans it
        pos = 0
        for start, size in sorted(masks):
            if start > pos:
                spans.append((pos, start))
            pos = max(pos, start + size)
        if pos < length:
            spans.append((pos, length))
        segments = [slice(in_raw(a), in_raw(b)) for a, b in spans]
        self._compared = operator.itemgetter(*segments) if segments else (lambda raw: ())
        self._expected = self._compared(raw)
        self._size = len(raw)
        self.length = length
        # The same comparison on the whole record (read with others: no copy of its parts).
        self._compared_whole = (operator.itemgetter(*(slice(a, b) for a, b in spans))
                                if spans else (lambda whole: ()))
        # Every entry's CRC-32 as the central directory records it, in one unpack: the
        # storage's first, then the others (what verify checks besides the elements), whose
        # bytes are in ``raw`` already.
        self.side = tuple(e for e in rec.entries if e is not data)
        self.side_slices = tuple(slice(in_raw(e.data_offset), in_raw(e.data_offset) + e.size)
                                 for e in self.side)
        self.side_whole = tuple(slice(e.data_offset, e.data_offset + e.size)
                                for e in self.side)
        self._sides = operator.itemgetter(*self.side_whole) if len(self.side) > 1 else (
            lambda whole: tuple(whole[s] for s in self.side_whole))
        self.side_bytes = sum(e.size for e in self.side)
        # Where the elements start in the stored bytes (None: a strided view).
        self.start = rec.storage_offset * rec.dtype.itemsize if rec.is_contiguous else None
        fields = [e.crc_fields[0] for e in (data, *self.side)]
        order = sorted(range(len(fields)), key=fields.__getitem__)
        self._crcs = self._fields([in_raw(f) for f in fields], order)
        self._crcs_whole = self._fields(fields, order)
        self._order = order
        # Every entry's bytes in the whole record, in the order of their CRC fields: one
        # comparison checks them all.
        entries = [slice(self.head, self.data_end), *self.side_whole]
        ordered = [entries[i] for i in order]
        self._all_entries = operator.itemgetter(*ordered) if len(ordered) > 1 else (
            lambda whole: (whole[ordered[0]],))
        # Many records at once (:func:`fill_rows`): the record with every byte it does not
        # compare zeroed, the ranges zeroed, and each entry's range and CRC-32 field.
        masked, pos = [], 0
        for a, b in spans:
            if a > pos:
                masked.append((pos, a - pos))
            pos = b
        if pos < length:
            masked.append((pos, length - pos))
        self.masked = tuple(masked)
        self._raw = raw  # the record but the storage's data: its headers, a few KB
        self.checked_bytes = self.data_end - self.head + self.side_bytes
        self.checks = tuple((e.data_offset, e.size, e.crc_fields[0]) for e in (data, *self.side)
                            if e.name not in implied)

    @functools.cached_property
    def blank(self) -> bytes:
        """The whole record with every byte that varies zeroed (:func:`fill_rows` compares
        many small records with it at once). Built when first asked for: for a large record
        (a stacked Megatron weight's chunk, tens of MB) only :func:`fill_rows` would need
        it, and it never sees one, while building it cost a few hundred milliseconds of page
        faults per template (measured at load 7: 2.5 s of the worker threads' time in a 1 GB
        Megatron merge)."""
        raw, gap = self._raw, self.data_end - self.head
        blank = bytearray(raw[: self.head]) + bytes(gap) + raw[self.head :]
        for a, w in self.masked:
            blank[a : a + w] = bytes(w)
        return bytes(blank)

    @functools.cached_property
    def keep(self) -> bytes:
        """Per byte of the record, 0xFF where it is compared with :attr:`blank`, 0 where it
        varies from record to record (the mask :func:`fill_rows` ANDs)."""
        keep = bytearray(b"\xff") * self.length
        for a, w in self.masked:
            keep[a : a + w] = bytes(w)
        return bytes(keep)

    @staticmethod
    def _fields(fields: list[int], order: list[int]) -> struct.Struct:
        fmt, pos = "<", 0
        for i in order:
            fmt += f"{fields[i] - pos}xI"
            pos = fields[i] + 4
        return struct.Struct(fmt)

    def crcs(self, raw: bytes, *, whole: bool = False) -> list[int]:
        """The CRC-32 of the storage entry, then of each ``side`` entry (from the record
        without its storage's data, or from the ``whole`` record)."""
        values = (self._crcs_whole if whole else self._crcs).unpack_from(raw)
        out = [0] * len(values)
        for value, i in zip(values, self._order, strict=True):
            out[i] = value
        return out

    def decode_whole(self, chunk: Chunk, whole: bytes, checksums: bool) -> Payload | None:
        """The payload of ``chunk``, whose ``whole`` record was read already, if the record
        matches this template; None if it does not (then it is decoded in full). With
        ``checksums``, the other entries' CRC-32s are checked here, in C (``checked``), and
        handed on in ``side`` only when one fails."""
        if not self.matches_whole(whole):
            return None
        rec = self.rec
        at = chunk.offset + rec.data_offset
        stored = memoryview(whole)[self.head : self.data_end]
        start = at + self.start if self.start is not None else None
        if not checksums:
            return Payload(chunk.file, at, rec.data_size, None, start, rec.stride,
                           rec.storage_offset, data=stored)
        crcs = self.crcs(whole, whole=True)
        if list(map(crc32, self._sides(whole))) == crcs[1:]:
            return Payload(chunk.file, at, rec.data_size, crcs[0], start, rec.stride,
                           rec.storage_offset, checked=self.side_bytes, data=stored)
        return payload_of(chunk, rec, crcs[0], zip(self.side, crcs[1:], (
            whole[s] for s in self.side_whole), strict=True), stored)

    def checked(self, whole: bytes) -> int | None:
        """The bytes of the ``whole`` record (matching this template) whose CRC-32s were
        checked, all of its entries' (storage and side), if every one matches its header's;
        None if one does not."""
        if tuple(map(crc32, self._all_entries(whole))) != self._crcs_whole.unpack_from(whole):
            return None
        return self.data_end - self.head + self.side_bytes

    def matches(self, raw: bytes) -> bool:
        return len(raw) == self._size and self._compared(raw) == self._expected

    def matches_whole(self, whole: bytes) -> bool:
        return len(whole) == self.length and self._compared_whole(whole) == self._expected


def payload_of(chunk: Chunk, rec: TensorRecord, crc: int | None,
             side: Iterable[tuple[archive.ZipEntry, int, bytes | None]],
             data: memoryview | None = None) -> Payload:
    """Where a chunk's elements are, from its record (``rec``: offsets relative to it);
    ``data``: the stored bytes, when they were read with the record."""
    at = chunk.offset + rec.data_offset
    item = rec.dtype.itemsize
    return Payload(
        chunk.file, at, rec.data_size, crc,
        at + rec.storage_offset * item if rec.is_contiguous else None,
        stride=rec.stride, view_offset=rec.storage_offset,
        side=tuple(Checksummed(chunk.file, chunk.offset + e.data_offset, e.size, value,
                               f"record entry '{e.name}'", side_data)
                   for e, value, side_data in side),
        data=data)


# --------------------------------------------------------------------------------------------
# Many small records at once: the copy of millions of kilobyte-sized chunks

# Columns gathered per step (the entries whose CRC-32 is computed, the elements, the
# positions): bounds the memory a step takes.
_STEP_BYTES = 8 << 20
# Span buffers kept per thread up to this size (a merge window's spans: twice its stored
# bytes at most, engine.WINDOW_STORED); larger ones are made for the call.
_KEEP = 80 << 20
_scratch = threading.local()


def fill_rows(tensors: Sequence[Tensor], out: bytearray, dsts: Sequence[int], *,
              checksums: bool, templates: dict[Any, Template | None],
              pread: Callable[[str, int, int], bytes],
              readinto: Callable[[str, int, memoryview], int],
              decode: Callable[[Tensor, Chunk], object]) -> list[int | None]:
    """Each tensor of row chunks (``Shard(0)``, columns of one table) made whole in ``out`` at
    ``dsts[i]``, from records that match their templates: per tensor, the bytes whose CRC-32s
    were checked (with ``checksums``: every entry of every record; else 0), or None where it
    was not made whole (another layout, a record unlike its template, a checksum that fails, a
    file that ends early): the caller reads that one its own way, which says what is wrong.

    Nothing is done per chunk in Python: the rows of all tensors are numpy columns; the
    records are read in spans, one per stretch of a file where they lie close together
    (a span holds at most twice the bytes of its records); the records of one length, dtype
    and size (a template) are compared with the template and their CRC-32s computed and
    compared as byte matrices, and their elements copied into ``out``
    (:func:`vecfill.fill_template_rows`).

    Args:
        templates: the reader's templates, by (record length, dtype name, sizes).
        pread: ``(file, size, offset) -> bytes``, at most what the file holds: spans that
            claim more than ``_KEEP`` bytes in all (a damaged ``.metadata`` can claim
            gigabytes) are read this way.
        readinto: ``(file, offset, buffer) -> bytes read`` (fewer at the file's end).
        decode: decodes a chunk in full, which makes its template.
    """
    result: list[int | None] = [None] * len(tensors)
    # numpy is imported only where it has rows to fill (importing it takes 0.1-0.2 s of a
    # merge's start-up; a window of tensors to cast has none), and is a run-time dependency,
    # yet installs without it still merge.
    if not any(_record_rows(t) for t in tensors) or not _have_numpy():
        return result
    rows = _row_columns(tensors, dsts)
    if rows is None:
        return result
    failed: set[int] = set()
    flat, pos = _read_spans(rows, pread, readinto, failed)
    checked = _fill_templates(tensors, rows, flat, pos, out, failed, checksums=checksums,
                              templates=templates, decode=decode)
    for i in rows.pending:
        if i not in failed:
            result[i] = checked[i]
    return result


def _record_rows(t: Tensor) -> bool:
    """Whether ``t`` may be filled by :func:`fill_rows` (what :func:`_row_columns` takes
    first: columns of records, dimensions, rows)."""
    cols = t.chunks
    return isinstance(cols, ChunkColumns) and cols.table.encoding == RECORD and \
        bool(t.shape) and bool(t.shape[0]) and bool(cols.num_chunks) and \
        cols.ndim == len(t.shape)


@functools.cache
def _have_numpy() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class _Rows:
    """The row chunks :func:`fill_rows` fills, as numpy columns in the order they are
    filled (by template, then destination): per row its table row, file, offset, length,
    size along dim 0, kind (dtype and trailing shape), destination and tensor; the tensors
    taken."""

    table: Any
    kinds: list[tuple[Any, tuple[int, ...]]]
    pending: list[int]
    g: Any
    file: Any
    offset: Any
    length: Any
    size0: Any
    kind: Any
    dst: Any
    tensor: Any


def _row_columns(tensors: Sequence[Tensor], dsts: Sequence[int]) -> _Rows | None:
    """The row chunks of ``tensors`` that :func:`fill_rows` can fill, as columns; None when
    there are none. Every per-chunk column, and the check that each chunk spans every
    dimension but the first whole (Shard(0)), is numpy's work on the table's columns."""
    import numpy as np

    table = None
    kinds: dict[tuple[Any, tuple[int, ...]], int] = {}
    taken: list[tuple[int, int, int, int, int, int, int]] = []
    shapes: list[tuple[int, ...]] = []
    for i, t in enumerate(tensors):
        cols = t.chunks
        if not _record_rows(t):
            continue
        assert isinstance(cols, ChunkColumns)
        if table is None:
            table = cols.table
        elif cols.table is not table:
            continue
        kind = kinds.setdefault((t.dtype, t.shape[1:]), len(kinds))
        taken.append((i, cols.first, cols.num_chunks, cols.box, 2 * cols.ndim,
                      t.nbytes // t.shape[0], kind))
        shapes.append(t.shape)
    if table is None or not taken:
        return None
    i_, t_first, num, t_box, t_step, t_row, t_kind = (
        np.array(c, dtype=np.int64) for c in zip(*taken, strict=True))
    dst = np.array([dsts[i] for i in i_.tolist()], dtype=np.int64)
    begin = np.cumsum(num) - num  # each tensor's first row in the columns
    local = np.arange(int(num.sum()), dtype=np.int64) - np.repeat(begin, num)
    g = np.repeat(t_first, num) + local
    length = np.asarray(table.length)[g].astype(np.int64)
    boxes = np.asarray(table.boxes)
    at = np.repeat(t_box, num) + np.repeat(t_step, num) * local  # each chunk's box
    # Tensors with a record too large to read with others are left to the caller, and so
    # are those with a chunk that does not span another dimension whole (not Shard(0)).
    ok = np.maximum.reduceat(length, begin) <= SMALL_RECORD
    tensor_of = np.repeat(np.arange(len(i_)), num)
    nd_of = np.repeat(t_step // 2, num)
    for d in range(1, max(map(len, shapes))):
        has = nd_of > d
        want = np.repeat(np.array([s[d] if len(s) > d else 0 for s in shapes],
                                  dtype=np.int64), num)[has]
        box = at[has]
        off = box + d
        size = box + nd_of[has] + d
        wrong = (boxes[off] != 0) | (boxes[size] != want)
        if wrong.any():
            ok &= np.bincount(tensor_of[has][wrong], minlength=len(i_)) == 0
    if not ok.all():
        keep = np.repeat(ok, num)
        i_, num, t_row, t_kind, dst = (c[ok] for c in (i_, num, t_row, t_kind, dst))
        g, length, at, nd_of = g[keep], length[keep], at[keep], nd_of[keep]
        if not len(i_):
            return None
    offs0 = boxes[at].astype(np.int64)
    size0 = boxes[at + nd_of].astype(np.int64)
    rdst = np.repeat(dst, num) + offs0 * np.repeat(t_row, num)
    rkind = np.repeat(t_kind, num)
    # By template (kind, record length, rows per chunk), then by where they go: the rows of
    # one template that follow one another in ``out`` are then copied as one run.
    order = np.lexsort((rdst, size0, length, rkind))
    g = g[order]
    return _Rows(
        table=table, kinds=list(kinds), pending=i_.tolist(), g=g,
        file=np.asarray(table.file)[g].astype(np.int64),
        offset=np.asarray(table.offset)[g].astype(np.int64),
        length=length[order], size0=size0[order], kind=rkind[order], dst=rdst[order],
        tensor=np.repeat(i_, num)[order])


def _span_buffer(size: int) -> memoryview:
    """``size`` (at most ``_KEEP``) bytes to read spans into: the thread's buffer, kept from
    one call to the next (``os.pread`` into fresh ``bytes`` for every span faults in new pages
    each time: 13% of the samples of ``fill_rows`` over the 1M-chunk benchmark)."""
    buf: bytearray | None = getattr(_scratch, "spans", None)
    if buf is None or len(buf) < size:
        # A little more than asked (windows differ by a few records), never doubled: the
        # buffer stays as long as the thread, and adds to the peak only what it keeps.
        buf = _scratch.spans = bytearray(min(size + (size >> 4), _KEEP))
    return memoryview(buf)


def _read_spans(rows: _Rows, pread: Callable[[str, int, int], bytes],
                readinto: Callable[[str, int, memoryview], int], failed: set[int]
                ) -> tuple[memoryview | bytes, Any]:
    """The records read in spans, one after another (into the thread's buffer, or by
    ``pread`` where they claim more than it keeps): per file, in offset order, a record
    joins the span before it where the hole between them is at most its own length (a span
    holds at most twice its records' bytes); the rows of a span whose file ends early
    dropped (their tensors into ``failed``); where each remaining record starts in what
    was read."""
    import numpy as np

    n = len(rows.g)
    by_place = np.lexsort((rows.offset, rows.file))
    f, off = rows.file[by_place], rows.offset[by_place]
    end = off + rows.length[by_place]
    # The furthest end so far within each file (files ascend: an earlier file's ends are
    # below any of this one's once shifted by the file's number times the largest end).
    scale = int(end.max()) + 1 if n else 1
    if n and scale * (int(f.max()) + 1) < 1 << 62:
        reach = np.maximum.accumulate(end + f * scale) - f * scale
    else:  # offsets no file has (a damaged .metadata): the same, one row at a time
        reach = end.copy()
        for k in range(1, n):
            if f[k] == f[k - 1] and reach[k - 1] > reach[k]:
                reach[k] = reach[k - 1]
    new = np.ones(n, dtype=np.bool_)
    if n > 1:
        new[1:] = (f[1:] != f[:-1]) | (off[1:] - reach[:-1] > rows.length[by_place][1:])
    first = np.flatnonzero(new)
    span_of = np.cumsum(new) - 1  # per row in place order
    lo = off[first]
    hi = np.maximum.reduceat(reach, first) if n else reach
    total = int((hi - lo).sum())
    buf = _span_buffer(total) if total <= _KEEP else None
    pieces: list[bytes] = []
    starts: list[int] = []
    short: list[int] = []
    at = 0
    for j, (name, a, b) in enumerate(zip(f[first].tolist(), lo.tolist(), hi.tolist(),
                                         strict=True)):
        file = rows.table.names[name]
        if buf is None:
            piece = pread(file, b - a, a)
            pieces.append(piece)
            got = len(piece)
        else:
            got = readinto(file, a, buf[at : at + b - a])
        if got < b - a:  # the file ends early
            short.append(j)
        starts.append(at)
        at += got if buf is None else b - a
    flat: memoryview | bytes = buf[:at] if buf is not None else b"".join(pieces)
    del pieces
    place = np.empty(n, dtype=np.int64)
    place[by_place] = np.asarray(starts, dtype=np.int64)[span_of] + (off - lo[span_of])
    if short:
        dropped = np.zeros(n, dtype=np.bool_)
        dropped[by_place] = np.isin(span_of, short)
        failed.update(np.unique(rows.tensor[dropped]).tolist())
        kept = ~dropped
        for name in ("g", "file", "offset", "length", "size0", "kind", "dst", "tensor"):
            setattr(rows, name, getattr(rows, name)[kept])
        place = place[kept]
    return flat, place


def _fill_templates(tensors: Sequence[Tensor], rows: _Rows, flat: memoryview | bytes,
                    pos: Any, out: bytearray, failed: set[int], *, checksums: bool,
                    templates: dict[Any, Template | None],
                    decode: Callable[[Tensor, Chunk], object]) -> list[int]:
    """The rows filled, run by run of one template (:func:`vecfill.fill_template_rows`, in
    steps of at most ``_STEP_BYTES`` of columns gathered); per tensor the bytes checked."""
    import numpy as np

    checked = np.zeros(len(tensors), dtype=np.int64)
    n_rows = len(rows.g)
    if not n_rows:
        return [int(c) for c in checked.tolist()]
    keys = (rows.length, rows.kind, rows.size0)
    change = np.zeros(n_rows - 1, dtype=np.bool_)
    for k in keys:
        change |= k[1:] != k[:-1]
    cuts = [0, *(np.flatnonzero(change) + 1).tolist(), n_rows]
    flat_np = np.frombuffer(flat, dtype=np.uint8)
    out_np = np.frombuffer(out, dtype=np.uint8)
    for a, b in zip(cuts, cuts[1:], strict=False):
        length, kind, s0 = (int(k[a]) for k in keys)
        dtype, rest = rows.kinds[kind]
        sizes = (s0, *rest)
        tkey = (length, dtype.name, sizes)
        if tkey not in templates:  # the first of its kind: decoded in full, which makes it
            t = tensors[int(rows.tensor[a])]
            cols = t.chunks
            assert isinstance(cols, ChunkColumns)
            with contextlib.suppress(CkptError):
                decode(t, cols[int(rows.g[a]) - cols.first])
        template = templates.get(tkey)
        if template is None or template.start is None:
            failed.update(rows.tensor[a:b].tolist())
            continue
        nbytes = math.prod(sizes) * dtype.itemsize
        step = max(1, _STEP_BYTES // (template.checked_bytes + nbytes + 64))
        for p in range(a, b, step):
            q = min(b, p + step)
            bad = vecfill.fill_template_rows(template, out_np, flat_np, pos[p:q],
                                             rows.dst[p:q], nbytes, checksums)
            if bad.any():
                failed.update(rows.tensor[p:q][bad].tolist())
        if checksums:
            checked += np.bincount(rows.tensor[a:b], minlength=len(tensors)
                                   ) * template.checked_bytes
    return [int(c) for c in checked.tolist()]
