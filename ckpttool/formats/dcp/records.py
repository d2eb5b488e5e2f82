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
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Any

from ckpttool.errors import CkptError, InputError
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
        InputError: the record is truncated, corrupt, or its pickle is not a plain tensor.
        UnsupportedError: big-endian or compressed records.
    """
    rb = archive.RecordBytes(fd, offset, length, where)
    entries = archive.zip_entries(rb)
    archive.check_byteorder(rb, entries)
    try:
        ref = torchsave.load_pickle(rb, entries)
    except torchsave.Refused as e:
        raise torchsave.refusal(where, e, torchsave.record_global,
                                "a tensor record never needs") from e
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
# A span read whole holds at most twice the bytes of its records, and this much more.
_GAP = 8 << 10
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

    Nothing is done per chunk in Python: the rows of all tensors are columns; the records
    of tensors stored together are read in one piece per file (where they are at least half
    of it); records of one length, dtype and size (a template) are
    joined, compared with the template with their varying bytes blanked (one comparison),
    their CRC-32s computed and compared as columns, and their elements copied by strided
    slices (or one slice each) into ``out``.

    Args:
        templates: the reader's templates, by (record length, dtype name, sizes).
        pread: ``(file, size, offset) -> bytes``, at most what the file holds: spans that
            claim more than ``_KEEP`` bytes in all (a damaged ``.metadata`` can claim
            gigabytes) are read this way.
        readinto: ``(file, offset, buffer) -> bytes read`` (fewer at the file's end).
        decode: decodes a chunk in full, which makes its template.
    """
    result: list[int | None] = [None] * len(tensors)
    rows = _row_columns(tensors, dsts)
    if rows is None:
        return result
    failed: set[int] = set()
    flat, at = _read_spans(rows, pread, readinto, failed)
    checked = _fill_templates(tensors, rows, flat, at, out, failed, checksums=checksums,
                              templates=templates, decode=decode)
    for i in rows.pending:
        if i not in failed:
            result[i] = checked[i]
    return result


@dataclass
class _Rows:
    """The row chunks :func:`fill_rows` fills, as columns: per row its span, offset, length,
    kind (dtype and trailing shape), size along dim 0, destination, tensor and table row;
    the spans to read (per group of tensors stored together: its files, its first span, per
    file the first offset, the last end and the bytes used); the tensors taken."""

    table: Any
    kinds: dict[tuple[Any, tuple[int, ...]], int]
    groups: list[list[Any]]
    pending: list[int]
    cols: tuple[array[int], ...] = field(default_factory=lambda: tuple(
        array("q") for _ in range(8)))


def _row_columns(tensors: Sequence[Tensor], dsts: Sequence[int]) -> _Rows | None:
    """The row chunks of ``tensors`` that :func:`fill_rows` can fill, as columns; None when
    there are none. The chunks of most tensors lie in the same files in the same order (one
    per rank): a group of such tensors reads one span per file, as long as its records are
    most of the span."""
    table = None
    rows = _Rows(None, {}, [], [])
    cspan, co, cl, ck, cs, cd, ct, cg = rows.cols
    open_groups: dict[bytes, list[Any]] = {}
    groups = rows.groups
    taken: list[tuple[tuple[int, int, int, int], int, int, array[int], array[int], array[int],
                      array[int], array[int]]] = []
    for i in _stored_first(tensors):
        t = tensors[i]
        cols = t.chunks
        if not isinstance(cols, ChunkColumns) or cols.table.encoding != RECORD or \
                not t.shape or not t.shape[0]:
            continue
        if table is None:
            table = cols.table
        elif cols.table is not table:
            continue
        found = cols.rows(t.shape)
        if found is None:
            continue
        offs0, sizes0 = found
        a, n = cols.first, cols.num_chunks
        files, offs, lens = table.file[a : a + n], table.offset[a : a + n], table.length[a : a + n]
        g = array("q", range(a, a + n))
        if not n or max(lens) > SMALL_RECORD:
            continue
        ends = list(map(operator.add, offs, lens))
        key = files.tobytes()
        group = open_groups.get(key)
        if group is not None:
            lo = list(map(min, group[2], offs))
            hi = list(map(max, group[3], ends))
            used = list(map(operator.add, group[4], lens))
            if all(map(operator.le, map(operator.sub, hi, lo),
                       map(operator.add, map(operator.add, used, used), repeat(_GAP)))):
                group[2:] = lo, hi, used
            else:
                group = None
        if group is None:
            first = groups[-1][1] + len(groups[-1][0]) if groups else 0
            group = [files, first, list(offs), ends, list(lens)]
            groups.append(group)
            open_groups[key] = group
        kind = rows.kinds.setdefault((t.dtype, t.shape[1:]), len(rows.kinds))
        taken.append(((kind, lens[0], sizes0[0], dsts[i]), i, group[1], offs, lens, offs0,
                      sizes0, g))
        rows.pending.append(i)
    if table is None or not rows.pending:
        return None
    # The rows by template, then by where they go: the tensors of one template that follow
    # one another in ``out`` are then one run of rows back to back (copied a column of
    # bytes at a time, :func:`_copy_elements`), not a run per tensor in stored order.
    taken.sort(key=operator.itemgetter(0))
    for (kind, _, _, dst), i, first, offs, lens, offs0, sizes0, g in taken:
        n = len(offs)
        row = tensors[i].nbytes // tensors[i].shape[0]
        cspan.extend(range(first, first + n))
        co.extend(offs)
        cl.extend(lens)
        cs.extend(sizes0)
        cd.extend(map(operator.add, map(operator.mul, offs0, repeat(row)), repeat(dst)))
        ct.extend(repeat(i, n))
        ck.extend(repeat(kind, n))
        cg.extend(g)
    rows.table = table
    return rows


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
                ) -> tuple[memoryview | bytes, array[int]]:
    """Every span read, one after another (into the thread's buffer, or by ``pread`` where
    they claim more than it keeps); the rows of a span whose file ends early dropped (their
    tensors into ``failed``); where each remaining record starts in what was read."""
    starts: list[int] = []  # per span, where it starts in what was read
    base: list[int] = []  # per span, its offset in its file
    short = []
    total = sum(hi - lo for g in rows.groups for lo, hi in zip(g[2], g[3], strict=True))
    buf = _span_buffer(total) if total <= _KEEP else None
    pieces: list[bytes] = []
    pos = 0
    for files, first, los, his, _ in rows.groups:
        for j, (f, lo, hi) in enumerate(zip(files, los, his, strict=True)):
            if buf is None:
                piece = pread(rows.table.names[f], hi - lo, lo)
                pieces.append(piece)
                got = len(piece)
            else:
                got = readinto(rows.table.names[f], lo, buf[pos : pos + hi - lo])
            if got < hi - lo:  # the file ends early
                short.append(first + j)
            starts.append(pos)
            base.append(lo)
            pos += got if buf is None else hi - lo
    flat: memoryview | bytes = buf[:pos] if buf is not None else b"".join(pieces)
    del pieces
    cspan, co, cl, ck, cs, cd, ct, cg = rows.cols
    if short:
        drop = set(short)
        keep = [j not in drop for j in cspan]
        failed.update(compress(ct, [not k for k in keep]))
        rows.cols = tuple(array(c.typecode, compress(c, keep)) for c in rows.cols)
        cspan, co = rows.cols[0], rows.cols[1]
    shift = list(map(operator.sub, starts, base))
    return flat, array("q", map(operator.add, co, map(shift.__getitem__, cspan)))


def _fill_templates(tensors: Sequence[Tensor], rows: _Rows, flat: memoryview | bytes,
                    at: array[int], out: bytearray, failed: set[int], *, checksums: bool,
                    templates: dict[Any, Template | None],
                    decode: Callable[[Tensor, Chunk], object]) -> list[int]:
    """The rows filled, run by run of one template (:func:`vecfill.fill_template_rows`, in
    steps of at most ``_STEP_BYTES`` of columns gathered); per tensor the bytes checked."""
    import numpy as np

    _, _, cl, ck, cs, cd, ct, cg = rows.cols
    checked = np.zeros(len(tensors), dtype=np.int64)
    kind_of = {v: k for k, v in rows.kinds.items()}
    n_rows = len(ct)
    keys = list(zip(cl, ck, cs, strict=True))
    cuts = [0, *compress(range(1, n_rows), map(operator.ne, keys[1:], keys[:-1])), n_rows
            ] if n_rows else []
    flat_np = np.frombuffer(flat, dtype=np.uint8)
    out_np = np.frombuffer(out, dtype=np.uint8)
    at_np = np.frombuffer(at, dtype=np.int64)
    dst_np = np.frombuffer(cd, dtype=np.int64)
    tensor_np = np.frombuffer(ct, dtype=np.int64)
    for a, b in zip(cuts, cuts[1:], strict=False):
        length, kind, s0 = keys[a]
        dtype, rest = kind_of[kind]
        sizes = (s0, *rest)
        tkey = (length, dtype.name, sizes)
        if tkey not in templates:  # the first of its kind: decoded in full, which makes it
            t = tensors[ct[a]]
            cols = t.chunks
            assert isinstance(cols, ChunkColumns)
            with contextlib.suppress(CkptError):
                decode(t, cols[cg[a] - cols.first])
        template = templates.get(tkey)
        if template is None or template.start is None:
            failed.update(ct[a:b])
            continue
        nbytes = math.prod(sizes) * dtype.itemsize
        step = max(1, _STEP_BYTES // (template.checked_bytes + nbytes + 64))
        for p in range(a, b, step):
            q = min(b, p + step)
            bad = vecfill.fill_template_rows(template, out_np, flat_np, at_np[p:q],
                                             dst_np[p:q], nbytes, checksums)
            if bad.any():
                failed.update(tensor_np[p:q][bad].tolist())
        if checksums:
            checked += np.bincount(tensor_np[a:b], minlength=len(tensors)
                                   ) * template.checked_bytes
    return [int(c) for c in checked.tolist()]


def _stored_first(tensors: Sequence[Tensor]) -> list[int]:
    """The tensors' positions in the order their first chunks are stored: the order a writer
    wrote them in, in which the records of consecutive tensors lie together in each file (a
    window's output order, by name, jumps back and forth)."""
    def first(i: int) -> tuple[int, int]:
        cols = tensors[i].chunks
        if not isinstance(cols, ChunkColumns) or not cols.num_chunks:
            return (-1, -1)
        return cols.table.file[cols.first], cols.table.offset[cols.first]

    return sorted(range(len(tensors)), key=first)
