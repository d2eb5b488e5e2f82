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

import operator
import os
import re
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool._gc import gc_paused
from ckpttool.formats.base import RECORD, ChunkColumns, ChunkTable, ObjectEntry, Tensor
from ckpttool.formats.codecs import torchsave
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.storage import sidefiles

_WINDOW = 4 << 20  # bytes of the file held at a time
_AHEAD = 1 << 18  # before a run of entries is matched, at least this much is in the window
_MAX_NDIM = 64
_CACHE = 1 << 16  # decoded ints and int tuples kept by their bytes
_MAX_RUN = 1 << 14  # entries matched at once (torch's pickler batches 1000 per SETITEMS/APPENDS)

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# A plain data file name, as DCP's writer makes them (``__0_0.distcp``); others fall back.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}\Z")


class Fallback(Exception):  # noqa: N818 - not an error: the allow-list path decides
    """Not recognised with certainty: read the file with the allow-list unpickler."""


@dataclass
class Columnar:
    tensors: list[Tensor]
    objects: list[ObjectEntry]
    version: str | None


# --------------------------------------------------------------------------------------------
# Pickle pieces, as bytes patterns (DOTALL: any byte)

_GET = rb"(?:h.|j....)"
_INT = (rb"(?:K.|M..|J....|\x8a(?:\x01.|\x02..|\x03...|\x04....|\x05.{5}|\x06.{6}|\x07.{7}"
        rb"|\x08.{8}))")
_NEWOBJ = rb"\)\x81\x94\}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK
_REDUCED = rb"\x85\x94R\x94"  # TUPLE1 MEMOIZE REDUCE MEMOIZE: torch.Size((...))


def _tuple_of(ndim: int) -> bytes:
    """A tuple of ``ndim`` ints, memoized (the empty tuple is not)."""
    if ndim == 0:
        return rb"\)"
    if ndim <= 3:
        return _INT * ndim + re.escape(bytes([0x84 + ndim])) + rb"\x94"
    return rb"\(" + _INT * ndim + rb"t\x94"


def _size_memos(ndim: int) -> int:
    """MEMOIZEs in one ``torch.Size`` of ``ndim`` ints: the tuple, its args, the result."""
    return 3 if ndim else 2


# TUPLE1/2/3 each take as many ints as they say (a TUPLE1 after two ints is another pickle:
# it leaves the first int on the stack).
_ANY_TUPLE = (rb"(\)|" + _INT + rb"\x85\x94|" + _INT + rb"{2}\x86\x94|" + _INT + rb"{3}\x87\x94|\("
              + _INT + rb"{4,64}t\x94)")
# Distinct layouts (their GETs' bytes) matched by compiled patterns before the file is left to
# the allow-list unpickler: a real file has a few; each costs a regex compile (~15 ms).
_MAX_LAYOUTS = 64
# The first chunk entry of a run, with the GETs to learn and the tuples to size.
_CHUNK_HEAD = re.compile(
    b"(" + _GET + b")" + _NEWOBJ + b"(" + _GET + b")(" + _GET + b")" + _ANY_TUPLE + _REDUCED
    + b"(" + _GET + b")(" + _GET + b")" + _ANY_TUPLE + _REDUCED + rb"ub", re.DOTALL)
# A TensorStorageMetadata entry's opening, from the GET of its class to its chunk list's MARK,
# as torch pickles every tensor's after the first (classes, strings and the dtype by GET): its
# properties (dtype, layout, requires_grad, memory format, pin_memory), its torch.Size, the
# empty chunk list. Only the size's ints differ from one tensor to the next.
_TENSOR_HEAD = re.compile(
    b"(" + _GET + b")" + _NEWOBJ + b"(" + _GET + b")(" + _GET + rb")\)\x81\x94\("
    + b"(" + _GET + b")(" + _GET + rb")([\x88\x89])(" + _GET + rb")([\x88\x89])t\x94b"
    + b"(" + _GET + b")(" + _GET + b")" + _ANY_TUPLE + _REDUCED
    + b"(" + _GET + rb")\]\x94\(", re.DOTALL)
_STORAGE_HEAD = re.compile(
    b"(" + _GET + b")" + _NEWOBJ + b"(" + _GET + b")" + _GET + b"(" + _GET + b")" + _INT
    + b"(" + _GET + b")(" + _GET + b")" + _ANY_TUPLE + _REDUCED + rb"ub"
    + b"(" + _GET + b")" + _NEWOBJ + b"(" + _GET + b")" + _GET + b"(" + _GET + b")" + _INT
    + b"(" + _GET + b")" + _INT + rb"ub", re.DOTALL)


def _get_index(lit: bytes) -> int:
    return lit[1] if lit[0] == 0x68 else int.from_bytes(lit[1:5], "little")


def _ints(blob: bytes) -> tuple[int, ...]:
    """The ints of a pickled run of BININT1/BININT2/BININT/LONG1 (no terminator)."""
    out = []
    i, n = 0, len(blob)
    while i < n:
        op = blob[i]
        if op == 0x4B:  # K
            out.append(blob[i + 1])
            i += 2
        elif op == 0x4D:  # M
            out.append(blob[i + 1] | blob[i + 2] << 8)
            i += 3
        elif op == 0x4A:  # J
            out.append(int.from_bytes(blob[i + 1 : i + 5], "little", signed=True))
            i += 5
        else:  # \x8a LONG1
            k = blob[i + 1]
            out.append(int.from_bytes(blob[i + 2 : i + 2 + k], "little", signed=True))
            i += 2 + k
    return tuple(out)


def _int(blob: bytes) -> int:
    """One BININT1/BININT2/BININT/LONG1."""
    op = blob[0]
    if op == 0x8A:
        return int.from_bytes(blob[2:], "little", signed=True)
    return int.from_bytes(blob[1:], "little", signed=op == 0x4A)


def _tuple_ints(blob: bytes) -> tuple[int, ...]:
    """The ints of a pickled tuple as :func:`_tuple_of` matches it."""
    if blob == b")":
        return ()
    if blob[0] == 0x28:  # MARK ... TUPLE MEMOIZE
        return _ints(blob[1:-2])
    return _ints(blob[:-2])


# --------------------------------------------------------------------------------------------
# Columns of a run, decoded by C-level passes: a run's matches are split into columns of bytes,
# and each column is decoded at once (a join and strided byte copies for ints of one width, a
# dict lookup per entry for values seen before). Python code runs per entry only for bytes not
# seen yet (``__missing__``), or not at all.

_group1 = operator.itemgetter(1)
_groups = re.Match.groups
_BIG_ENDIAN = sys.byteorder == "big"


def _matches(pattern: re.Pattern[bytes], buf: bytes, pos: int) -> list[re.Match[bytes]]:
    """Back-to-back matches of ``pattern`` from ``pos`` until one fails (at most ``_MAX_RUN``).

    ``Pattern.scanner`` (CPython's sre since Python 2; no stub) anchors each match where the
    last one ended, so the loop runs in C; elsewhere, the same loop in Python.
    """
    scanner = getattr(pattern, "scanner", None)
    if scanner is not None:
        return list(islice(iter(scanner(buf, pos).match, None), _MAX_RUN))
    out: list[re.Match[bytes]] = []
    while len(out) < _MAX_RUN:
        m = pattern.match(buf, pos)
        if m is None:
            break
        out.append(m)
        pos = m.end()
    return out


class _Ints(dict[bytes, int]):
    """One pickled int (BININT1/BININT2/BININT/LONG1) by its bytes, decoded when first seen."""

    def __missing__(self, blob: bytes) -> int:
        got = self[blob] = _int(blob)
        return got


class _Tuples(dict[bytes, tuple[int, ...]]):
    """A pickled tuple of ints (as :func:`_tuple_of` matches it) by its bytes; negative ints are
    not decoded (:class:`Fallback`)."""

    def __missing__(self, blob: bytes) -> tuple[int, ...]:
        got = _tuple_ints(blob)
        if got and min(got) < 0:
            raise Fallback("negative")
        self[blob] = got
        return got


class _Boxes(dict[bytes, tuple[int, ...]]):
    """A chunk's offsets and sizes, pickled as two ``torch.Size`` of ``ndim`` ints with the
    bytes ``pair`` matches between them, by those bytes: the offsets, then the sizes."""

    def __init__(self, pair: re.Pattern[bytes]) -> None:
        super().__init__()
        self.pair = pair

    def __missing__(self, blob: bytes) -> tuple[int, ...]:
        m = self.pair.match(blob)
        if m is None:  # the run's pattern matched these bytes: cannot happen
            raise Fallback("box")
        got = _tuple_ints(m[1]) + _tuple_ints(m[2])
        if got and min(got) < 0:
            raise Fallback("negative")
        self[blob] = got
        return got


class _MemoStrs(dict[int, int]):
    """A memo index -> the number of the memoized str it holds, numbered in ``numbers`` in
    the order first seen; -1 (not kept) where the memo holds no str there. Looked up once all
    is read: memo entries never change once a run was matched (a PUT then falls back), and a
    run's GETs point below the memo's end when it was matched (checked when its block is placed)."""

    def __init__(self, memo: dict[int, Any], numbers: dict[str, int]) -> None:
        super().__init__()
        self.memo = memo
        self.numbers = numbers
        # Memo indices numbered so far, sorted, and their numbers (numpy arrays).
        self.known: tuple[Any, Any] | None = None

    def __missing__(self, key: int) -> int:
        got = self.memo.get(key)
        if type(got) is not str:
            return -1
        n = self.numbers.get(got)
        if n is None:
            n = self.numbers[got] = len(self.numbers)
        self[key] = n
        return n

    def numbered(self, keys: Any) -> Any:
        """The numbers of ``keys`` (a numpy array of memo indices), new ones numbered in the
        order of ``keys``: Python code runs per distinct index only.

        Raises:
            Fallback: an index whose memo entry is no str.
        """
        np = _numpy()
        distinct, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        numbers = np.empty(len(distinct), dtype=np.int32)
        # Indices numbered in an earlier block (nearly all: every block holds most names),
        # by one sorted lookup; the others one by one, in the order first seen.
        if self.known is None:
            self.known = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32)
        known, known_numbers = self.known
        if len(known):
            at = np.minimum(np.searchsorted(known, distinct), len(known) - 1)
            hit = known[at] == distinct
            numbers[hit] = known_numbers[at[hit]]
            new = np.flatnonzero(~hit)
        else:
            new = np.arange(len(distinct))
        for i in new[np.argsort(first[new], kind="stable")].tolist():
            numbers[i] = self[int(distinct[i])]
        if len(numbers) and numbers.min() < 0:
            raise Fallback("storage entry")  # the allow-list path says what it is
        if len(new):
            keys_ = np.concatenate((known, distinct[new]))
            order = np.argsort(keys_, kind="stable")
            self.known = keys_[order], np.concatenate((known_numbers, numbers[new]))[order]
        return numbers[inverse.reshape(-1)]


def _int_column(col: Sequence[bytes], ints: _Ints) -> array[int]:
    """The ints of ``col`` (each one pickled int), as ``array('q')``.

    All of one width (the common case: a run's byte offsets, lengths, indices), the values'
    bytes are copied out of the joined column by strided slices, in C; otherwise each is
    looked up in ``ints``. Negative values raise :class:`Fallback`.
    """
    n = len(col)
    first = col[0]
    w = len(first)
    op = first[0]
    joined = b"".join(col)
    skip, k = (2, first[1]) if op == 0x8A else (1, w - 1)
    if (len(joined) == n * w and k <= 8 and joined[::w] == joined[:1] * n
            and (op != 0x8A or joined[1::w] == joined[1:2] * n)):
        # K and M are unsigned; J and LONG1 are two's complement: a top bit set is negative.
        if op in (0x4A, 0x8A) and k and max(joined[skip + k - 1 :: w]) >= 0x80:
            raise Fallback("negative")
        raw = bytearray(8 * n)
        for i in range(k):
            raw[i::8] = joined[skip + i :: w]
        out = array("q", raw)
        if _BIG_ENDIAN:
            out.byteswap()
        return out
    out = array("q", map(ints.__getitem__, col))
    if min(out) < 0:
        raise Fallback("negative")
    return out


# Runs of one layout. Within a run the entries usually differ in their values only: every int
# has the same opcode (width) as in the first entry, so every entry has its size and its
# opcodes at the same places. Then the run is checked by comparing its bytes with the first
# entry's, value bytes blanked in both (memcmp), and each value is gathered from every entry at
# once by strided byte slices: no object per entry at all.

_MIN_LAID_OUT = 16  # fewer entries of one layout: matched one by one (widths that vary)
_STORAGE_FIRST = 1024  # storage entries looked at in a run's first block (torch's batch: 1,000)
_Field = tuple[int, int, bool]  # an int in an entry: offset of its bytes, their number, signed


@dataclass(frozen=True)
class _Layout:
    """One entry's bytes with its value bytes zeroed, and where the values are."""

    size: int
    blank: bytes
    fields: tuple[_Field, ...]
    # The bytes every entry of its kind starts with, whatever its widths: those before the
    # first value's opcode.
    prefix: bytes

    @staticmethod
    def of(buf: bytes, m: re.Match[bytes], groups: Sequence[tuple[int, str]]) -> _Layout:
        """The layout of the entry ``m`` matched, from its ``groups``: (number, kind), kind
        ``get`` (a memo GET: its index is the value), ``int`` or ``tuple`` (of ints)."""
        start = m.start()
        fields: list[_Field] = []
        for g, kind in groups:
            a, b = m.span(g)
            if kind == "get":
                fields.append((a + 1 - start, 1 if buf[a] == 0x68 else 4, False))
                continue
            if kind == "tuple":
                if buf[a] == 0x29:  # the empty tuple
                    continue
                a, b = (a + 1 if buf[a] == 0x28 else a), b - 2
            while a < b:
                op = buf[a]
                if op == 0x8A:
                    k = buf[a + 1]
                    if k > 8:
                        raise Fallback("long")  # beyond int64
                    fields.append((a + 2 - start, k, True))
                    a += 2 + k
                else:
                    k = 1 if op == 0x4B else 2 if op == 0x4D else 4
                    fields.append((a + 1 - start, k, op == 0x4A))
                    a += 1 + k
        blank = bytearray(buf[start : m.end()])
        for at, width, _ in fields:
            blank[at : at + width] = bytes(width)
        prefix = bytes(blank[: max(fields[0][0] - 2, 0)] if fields else blank)
        return _Layout(len(blank), bytes(blank), tuple(fields), prefix)

    def count(self, buf: bytes, start: int, limit: int) -> int:
        """How many entries from ``start`` have this layout (at most ``limit``, within
        ``buf``): their bytes, value bytes blanked, are the blank entry's."""
        size = self.size
        n = min(limit, (len(buf) - start) // size)
        if n <= 0:
            return 0
        # Where the run ends, nearly always: the first entry not starting as this one does.
        starts = buf[start : start + n * size : size]
        n -= len(starts.lstrip(self.blank[:1]))
        if n <= 0:
            return 0
        block = bytearray(memoryview(buf)[start : start + n * size])
        zeros = bytes(n)
        for at, width, _ in self.fields:
            for i in range(width):
                block[at + i :: size] = zeros
        want = self.blank * n
        if block == want:
            return n
        # The first byte that differs: the highest bit of the difference, read big-endian.
        x = int.from_bytes(block, "big") ^ int.from_bytes(want, "big")
        return (len(block) - 1 - (x.bit_length() - 1) // 8) // size

    def whole(self, buf: bytes, start: int, n: int) -> bool:
        """``n`` entries of this layout from ``start`` are a whole run: enough of them, or not
        followed by an entry of another layout (ints of other widths), which one by one
        matching takes (a run whose widths keep changing is not cut into tiny ones)."""
        return n >= _MIN_LAID_OUT or (n > 0 and not buf.startswith(self.prefix,
                                                                     start + n * self.size))

    def run(self, buf: bytes, start: int, first: int = 64) -> int:
        """How many entries from ``start`` have this layout, up to ``_MAX_RUN``; looked at in
        growing blocks from ``first`` entries (a tensor's chunk list is often short; torch
        pickles storage entries 1,000 to a SETITEMS)."""
        n, limit = 0, first
        while n < _MAX_RUN:
            limit = min(limit, _MAX_RUN - n)
            got = self.count(buf, start + n * self.size, limit)
            n += got
            # The next entry of another kind (a tensor's chunk list ends): no block more.
            if got < limit or not buf.startswith(self.prefix, start + n * self.size):
                break
            limit *= 4
        return n

    def gather(self, buf: bytes, start: int, n: int, fields: Sequence[_Field]) -> array[int]:
        """The values of ``fields`` in ``n`` entries from ``start``, entry by entry (each
        entry's fields in order), as ``array('q')``; negative ones raise :class:`Fallback`."""
        k, size = len(fields), self.size
        raw = bytearray(8 * k * n)
        end = start + n * size
        for j, (at, width, signed) in enumerate(fields):
            at += start
            for i in range(width):
                raw[8 * j + i :: 8 * k] = buf[at + i : end : size]
            if signed and width and max(buf[at + width - 1 : end : size]) >= 0x80:
                raise Fallback("negative")
        out = array("q", raw)
        if _BIG_ENDIAN:
            out.byteswap()
        return out


class _Marker:
    """Stands on the stack for a run of entries the columns took."""

    __slots__ = ("consumed",)

    def __init__(self) -> None:
        self.consumed = 0


class _ChunkRun(_Marker):
    __slots__ = ("box", "first", "ndim", "num")

    def __init__(self, first: int, box: int, num: int, ndim: int) -> None:
        super().__init__()
        self.first, self.box, self.num, self.ndim = first, box, num, ndim


class _StorageRun(_Marker):
    __slots__ = ()


# --------------------------------------------------------------------------------------------
# The interpreter


class _Machine:
    """One pass over the pickle. Raises :class:`Fallback` on anything unexpected."""

    def __init__(self, f: BinaryIO, size: int, lookup: Callable[[str, str], Any | None]) -> None:
        self.f = f
        self.size = size
        self.lookup = lookup
        self.buf = b""
        self.pos = 0
        self.done = 0  # file bytes before buf
        self.memo: dict[int, Any] = {}
        self.num_memo = 0
        self.allowed: dict[int, Any] = {}  # id -> object, what lookup returned (callable)
        # What DCP's classes are, from the same lookup the allow-list unpickler uses.
        self.chunk_cls = lookup(_MD, "ChunkStorageMetadata")
        self.index_cls = lookup(_MD, "MetadataIndex")
        self.info_cls = lookup(_FS, "_StorageInfo")
        self.size_fn = lookup("torch", "Size")
        self.tensor_cls = lookup(_MD, "TensorStorageMetadata")
        self.props_cls = lookup(_MD, "TensorProperties")
        if None in (self.chunk_cls, self.index_cls, self.info_cls, self.size_fn):
            raise Fallback("lookup")
        # A tensor head's GETs (by their bytes) -> what they were checked to hold.
        self.heads: dict[bytes, tuple[Any, ...]] = {}
        # Columns: chunk rows, and storage entries (joined with them after the walk). A
        # storage entry's name and file are numbers: in ``fqn_numbers``, ``names``.
        self.boxes = array("q")
        self.num_rows = 0
        # Each run's columns as it was read, joined into one block of columns per
        # _BLOCK entries or more (one growing column each cost a copy of it at every few
        # runs; small pieces kept to the end would stay in the heap): name (a memo index,
        # numbered by fqn_numbers once all is read), index hint, offsets (ndim per entry),
        # file (a memo index, as the name), byte offset, length.
        # (first entry, entries, ndim, first offset, the memo's size then: its GETs are below)
        self.s_runs: list[tuple[int, int, int, int, int]] = []
        self.s_pieces: list[tuple[array[int], ...]] = []  # of the runs since the last block
        self.s_blocks: list[tuple[int, int, tuple[Any, ...]]] = []  # (runs from, to, columns)
        self.s_entries = 0  # in all runs
        self.s_offsets = 0
        self.s_pending = 0  # entries in s_pieces
        self.names: dict[str, int] = {}
        self.fqns: dict[str, int] = {}
        self.fqn_numbers = _MemoStrs(self.memo, self.fqns)
        self.file_numbers = _MemoStrs(self.memo, self.names)
        self.markers: list[_Marker] = []
        self.storage_dicts: dict[int, dict[Any, Any]] = {}  # dicts storage runs went into
        self.chunk_patterns: dict[tuple[bytes, int], tuple[re.Pattern[bytes], _Boxes]] = {}
        self.storage_patterns: dict[tuple[bytes, int], re.Pattern[bytes]] = {}
        self.tuples = _Tuples()  # decoded by their bytes
        # The layouts of the last runs laid out (and their ndim): usually the next one's.
        self.chunk_layout: tuple[_Layout, int] | None = None
        self.storage_layout: tuple[_Layout, int] | None = None
        self.ints = _Ints()

    # -- bytes

    def need(self, n: int) -> None:
        """At least ``n`` bytes from ``pos`` in the window, or Fallback (past the end)."""
        if self.pos + n <= len(self.buf):
            return
        if self.done + self.pos + n > self.size:
            raise Fallback("truncated")
        # The window read again from ``pos`` (the few bytes kept come from the page cache):
        # one copy of each byte into a new window, where keeping them cost a second copy and
        # a second new buffer's page faults (0.14 s of CPU over a 127 MB file).
        self.done += self.pos
        self.f.seek(self.done)
        self.buf = self.f.read(max(n, _WINDOW))
        self.pos = 0
        if len(self.buf) < n:
            raise Fallback("short read")

    def ahead(self) -> None:
        """Top the window up for a run (as far as the file goes)."""
        if self.pos + _AHEAD <= len(self.buf):  # nearly always
            return
        left = self.size - self.done - self.pos
        self.need(min(_AHEAD, left))

    def take(self, n: int) -> bytes:
        self.need(n)
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def tuple_of(self, blob: bytes) -> tuple[int, ...]:
        return self.tuples[blob]

    # -- runs of entries

    def memo_is(self, lit: bytes, want: Any) -> bool:
        got = self.memo.get(_get_index(lit), _MISSING)
        return got is want if not isinstance(want, str) else got == want and type(got) is str

    def chunk_run(self) -> _ChunkRun | None:
        """ChunkStorageMetadata entries from ``pos`` (at a GET of the class), into columns."""
        self.ahead()
        buf, p = self.buf, self.pos
        # Most chunk lists are laid out as the last one was: no pattern needed.
        if self.chunk_layout is not None:
            laid, nd = self.chunk_layout
            n = laid.run(buf, p)
            if laid.whole(buf, p, n):
                return self.chunk_rows(laid.gather(buf, p, n, laid.fields), n, nd,
                                       p + n * laid.size)
        head = _CHUNK_HEAD.match(buf, p)
        if head is None:
            return None
        nd = len(self.tuple_of(head[4]))
        if len(self.tuple_of(head[7])) != nd or nd > _MAX_NDIM:
            return None
        key = (head[1] + head[2] + head[3] + head[5] + head[6], nd)
        run = self.chunk_patterns.get(key)
        if run is None:
            if len(self.chunk_patterns) >= _MAX_LAYOUTS:
                raise Fallback("layouts")
            if not (self.memo_is(head[1], self.chunk_cls) and self.memo_is(head[2], "offsets")
                    and self.memo_is(head[3], self.size_fn) and self.memo_is(head[5], "sizes")
                    and self.memo_is(head[6], self.size_fn)):
                return None
            # One group from the offsets to the sizes (decoded together, by their bytes), and
            # one for each (the layout).
            t = b"(" + _tuple_of(nd) + b")"
            between = _REDUCED + re.escape(head[5] + head[6])
            pat = re.compile(re.escape(head[1]) + _NEWOBJ + re.escape(head[2] + head[3])
                             + b"(" + t + between + t + b")" + _REDUCED + rb"ub", re.DOTALL)
            pair = re.compile(t + between + t + rb"\Z", re.DOTALL)
            run = self.chunk_patterns[key] = (pat, _Boxes(pair))
        pat, decoded = run
        m = pat.match(buf, p)
        if m is None:
            return None
        laid = _Layout.of(buf, m, ((2, "tuple"), (3, "tuple")))
        n = laid.run(buf, p)
        if laid.whole(buf, p, n):  # offsets then sizes: the rows' boxes as they are kept
            self.chunk_layout = laid, nd
            return self.chunk_rows(laid.gather(buf, p, n, laid.fields), n, nd,
                                   p + n * laid.size)
        ms = _matches(pat, buf, p)  # ints of several widths: one by one
        got = array("q", chain.from_iterable(map(decoded.__getitem__, map(_group1, ms))))
        if len(decoded) > _CACHE:
            decoded.clear()
        return self.chunk_rows(got, len(ms), nd, ms[-1].end())

    def tensor_head(self, stack: list[Any], marks: list[int]) -> bool:
        """A tensor entry's opening from ``pos`` (at a GET of TensorStorageMetadata), done at
        once as the opcodes would do it (the same objects, stack, marks and memo); False
        where its bytes are not :data:`_TENSOR_HEAD` with GETs of what DCP puts there."""
        self.ahead()
        m = _TENSOR_HEAD.match(self.buf, self.pos)
        if m is None:
            return False
        lits = m.group(1, 2, 3, 4, 5, 7, 9, 10, 12)
        key = b"".join(lits)
        got = self.heads.get(key)
        if got is None:
            memo = self.memo
            if not (isinstance(self.tensor_cls, type)
                    and issubclass(self.tensor_cls, torchsave.PlainStub)
                    and isinstance(self.props_cls, type)
                    and issubclass(self.props_cls, torchsave.Stub)
                    and id(self.size_fn) in self.allowed
                    and self.memo_is(lits[0], self.tensor_cls)
                    and self.memo_is(lits[1], "properties")
                    and self.memo_is(lits[2], self.props_cls)
                    and all(_get_index(lit) in memo for lit in lits[3:6])
                    and self.memo_is(lits[6], "size") and self.memo_is(lits[7], self.size_fn)
                    and self.memo_is(lits[8], "chunks")):
                return False  # the opcodes go one by one (and say what is wrong)
            got = self.heads[key] = tuple(memo[_get_index(lit)] for lit in lits)
        tensor_cls, properties, props_cls, dtype, layout, memory_format, size_key, size_fn, \
            chunks_key = got
        shape = self.tuple_of(m[11])
        if len(self.tuples) > _CACHE:  # as many shapes as tensors: kept bounded
            self.tuples.clear()
        if len(shape) > _MAX_NDIM:
            return False
        memo, n = self.memo, self.num_memo
        entry = tensor_cls.__new__(tensor_cls)
        state: dict[Any, Any] = {}
        props = props_cls.__new__(props_cls)
        args = (dtype, layout, m[6] == b"\x88", memory_format, m[8] == b"\x88")
        self.build(props, args)
        memo[n], memo[n + 1], memo[n + 2], memo[n + 3] = entry, state, props, args
        n += 4
        if shape:
            memo[n] = shape
            n += 1
        reduced = (shape,)
        try:
            size = size_fn(*reduced)
        except Exception as e:  # noqa: BLE001 - the allow-list path reports it
            raise Fallback("reduce") from e
        chunks: list[Any] = []
        memo[n], memo[n + 1], memo[n + 2] = reduced, size, chunks
        self.num_memo = n + 3
        stack += (entry, state)
        marks.append(len(stack))
        stack += (properties, props, size_key, size, chunks_key, chunks)
        marks.append(len(stack))
        self.pos = m.end()
        return True

    def chunk_rows(self, boxes: array[int], n: int, nd: int, end: int) -> _ChunkRun:
        run = _ChunkRun(self.num_rows, len(self.boxes), n, nd)
        self.boxes.extend(boxes)
        self.num_rows += n
        self.num_memo += n * (2 + 2 * _size_memos(nd))
        self.pos = end
        return run

    def storage_run(self) -> _StorageRun | None:
        """MetadataIndex -> _StorageInfo pairs from ``pos`` (at a GET of the index class)."""
        self.ahead()
        buf, p = self.buf, self.pos
        if self.storage_layout is not None:
            laid, nd = self.storage_layout
            n = laid.run(buf, p, _STORAGE_FIRST)
            if laid.whole(buf, p, n):
                return self.storage_rows(buf, p, laid, n, nd)
        head = _STORAGE_HEAD.match(buf, p)
        if head is None:
            return None
        nd = len(self.tuple_of(head[6]))
        if nd > _MAX_NDIM:
            return None
        lits = head[1], head[2], head[3], head[4], head[5], head[7], head[8], head[9], head[10]
        key = (b"".join(lits), nd)
        pat = self.storage_patterns.get(key)
        if pat is None:
            want = (self.index_cls, "fqn", "index", "offset", self.size_fn, self.info_cls,
                    "relative_path", "offset", "length")
            if not all(self.memo_is(lit, w) for lit, w in zip(lits, want, strict=True)):
                return None
            if len(self.storage_patterns) >= _MAX_LAYOUTS:
                raise Fallback("layouts")
            e = [re.escape(x) for x in lits]
            pat = re.compile(
                e[0] + _NEWOBJ + e[1] + b"(" + _GET + b")" + e[2] + b"(" + _INT + b")"
                + e[3] + e[4] + b"(" + _tuple_of(nd) + b")" + _REDUCED + rb"ub"
                + e[5] + _NEWOBJ + e[6] + b"(" + _GET + b")" + e[7] + b"(" + _INT + b")"
                + e[8] + b"(" + _INT + b")" + rb"ub", re.DOTALL)
            self.storage_patterns[key] = pat
        m = pat.match(buf, p)
        if m is None:
            return None
        laid = _Layout.of(buf, m, ((1, "get"), (2, "int"), (3, "tuple"), (4, "get"), (5, "int"),
                                   (6, "int")))
        n = laid.run(buf, p)
        if laid.whole(buf, p, n):
            self.storage_layout = laid, nd
            return self.storage_rows(buf, p, laid, n, nd)
        # Ints of several widths: one by one, each column decoded at once.
        ms = _matches(pat, buf, p)
        k_fqn, i_index, t_offs, k_rel, i_begin, i_length = zip(*map(_groups, ms), strict=True)
        ints = self.ints
        index = _int_column(i_index, ints)
        begin = _int_column(i_begin, ints)
        length = _int_column(i_length, ints)
        offs = array("q", chain.from_iterable(map(self.tuples.__getitem__, t_offs)))
        if len(ints) > _CACHE:
            ints.clear()
        if len(self.tuples) > _CACHE:
            self.tuples.clear()
        n = self.storage_columns(array("q", map(_get_index, k_fqn)), index, offs,
                                 array("q", map(_get_index, k_rel)), begin, length, nd)
        if not n:
            return None
        self.pos = ms[n - 1].end()
        return _StorageRun()

    def storage_rows(self, buf: bytes, p: int, laid: _Layout, n: int, nd: int
                     ) -> _StorageRun | None:
        f = laid.fields

        def column(fields: Sequence[_Field]) -> array[int]:
            return laid.gather(buf, p, n, fields)

        n = self.storage_columns(column(f[:1]), column(f[1:2]), column(f[2 : 2 + nd]),
                                 column(f[2 + nd : 3 + nd]), column(f[3 + nd : 4 + nd]),
                                 column(f[4 + nd :]), nd)
        if not n:
            return None
        self.pos = p + n * laid.size
        return _StorageRun()

    def storage_columns(self, fqn: array[int], index: array[int], offs: array[int],
                        file: array[int], begin: array[int], length: array[int],
                        nd: int) -> int:
        """A run's entries into the storage columns (names and files as memo indices, looked
        up once all is read); how many."""
        n = len(fqn)
        if not n:
            return 0
        self.s_runs.append((self.s_entries, n, nd, self.s_offsets, self.num_memo))
        self.s_pieces.append((fqn, index, offs, file, begin, length))
        self.s_entries += n
        self.s_offsets += len(offs)
        self.s_pending += n
        if self.s_pending >= _BLOCK:
            self.storage_block()
        self.num_memo += n * (4 + _size_memos(nd))
        return n

    def storage_block(self) -> None:
        """The runs read since the last block, their columns joined (int64 numpy arrays)."""
        pieces = self.s_pieces
        if not pieces:
            return
        np = _numpy()

        def column(c: int) -> Any:
            got = [np.frombuffer(p[c], dtype=np.int64) for p in pieces if p[c]]
            return np.concatenate(got) if got else np.empty(0, dtype=np.int64)

        b = len(self.s_runs)
        self.s_blocks.append((b - len(pieces), b, tuple(column(c) for c in range(6))))
        self.s_pieces = []
        self.s_pending = 0

    # -- the walk

    def run(self) -> Any:  # noqa: C901, PLR0912, PLR0915 - one dispatch loop, on purpose
        stack: list[Any] = []
        marks: list[int] = []
        memo = self.memo
        seen_memoize = seen_put = False
        chunk_cls, index_cls, tensor_cls = self.chunk_cls, self.index_cls, self.tensor_cls
        while True:
            if self.pos >= len(self.buf):
                self.need(1)
            buf = self.buf
            start = self.pos
            op = buf[start]
            self.pos = start + 1
            if op == 0x94:  # MEMOIZE
                if len(stack) <= (marks[-1] if marks else 0):
                    raise Fallback("memoize")
                memo[self.num_memo] = stack[-1]
                self.num_memo += 1
                seen_memoize = True
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                if start + 5 <= len(buf):  # in the window (nearly always): no take()
                    if op == 0x68:
                        i = buf[start + 1]
                        self.pos = start + 2
                    else:
                        i = int.from_bytes(buf[start + 1 : start + 5], "little")
                        self.pos = start + 5
                else:  # the GET straddles the window's end: read it where it lies after
                    self.pos = start
                    self.need(2 if op == 0x68 else 5)
                    start, buf = self.pos, self.buf
                    i = buf[start + 1] if op == 0x68 else \
                        int.from_bytes(buf[start + 1 : start + 5], "little")
                    self.pos = start + (2 if op == 0x68 else 5)
                if i not in memo:
                    raise Fallback("get")
                obj = memo[i]
                if obj is chunk_cls or obj is index_cls:
                    self.pos = start
                    run = self.chunk_run() if obj is chunk_cls else self.storage_run()
                    if run is not None:
                        self.markers.append(run)
                        stack.append(run)
                        seen_memoize = True
                        if seen_put:
                            raise Fallback("memo")
                        continue
                    self.pos += 2 if op == 0x68 else 5  # where the GET is (the window moves)
                elif obj is tensor_cls:
                    self.pos = start
                    if self.tensor_head(stack, marks):
                        seen_memoize = True
                        if seen_put:
                            raise Fallback("memo")
                        continue
                    self.pos += 2 if op == 0x68 else 5
                stack.append(obj)
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x8C:  # SHORT_BINUNICODE
                end = start + 2 + buf[start + 1] if start + 1 < len(buf) else len(buf) + 1
                if end <= len(buf):  # in the window (nearly always): no take()
                    self.pos = end
                    try:
                        stack.append(buf[start + 2 : end].decode("utf-8", "surrogatepass"))
                    except UnicodeDecodeError as e:
                        raise Fallback("string") from e
                else:
                    n = self.take(1)[0]
                    stack.append(self.text(n))
            elif op == 0x58:  # BINUNICODE
                n = struct.unpack("<I", self.take(4))[0]
                stack.append(self.text(n))
            elif op == 0x8D:  # BINUNICODE8
                n = struct.unpack("<Q", self.take(8))[0]
                stack.append(self.text(n))
            elif op == 0x4B:  # BININT1
                if start + 1 < len(buf):
                    stack.append(buf[start + 1])
                    self.pos = start + 2
                else:
                    stack.append(self.take(1)[0])
            elif op == 0x4D:  # BININT2
                stack.append(int.from_bytes(self.take(2), "little"))
            elif op == 0x4A:  # BININT
                stack.append(int.from_bytes(self.take(4), "little", signed=True))
            elif op == 0x8A:  # LONG1
                n = self.take(1)[0]
                stack.append(int.from_bytes(self.take(n), "little", signed=True))
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
                k = op - 0x84
                self.above_fence(stack, marks, k)
                tup = tuple(stack[-k:])
                del stack[-k:]
                stack.append(tup)
            elif op == 0x74:  # TUPLE
                stack.append(tuple(self.pop_mark(stack, marks)))
            elif op == 0x75:  # SETITEMS
                items = self.pop_mark(stack, marks)
                self.setitems(stack, items, marks)
            elif op == 0x73:  # SETITEM
                self.above_fence(stack, marks, 3)
                v, k = stack.pop(), stack.pop()
                self.setitems(stack, [k, v], marks)
            elif op == 0x65:  # APPENDS
                items = self.pop_mark(stack, marks)
                self.appends(stack, items, marks)
            elif op == 0x61:  # APPEND
                self.above_fence(stack, marks, 2)
                self.appends(stack, [stack.pop()], marks)
            elif op == 0x93:  # STACK_GLOBAL
                self.above_fence(stack, marks, 2)
                name, module = stack.pop(), stack.pop()
                if type(name) is not str or type(module) is not str:
                    raise Fallback("global")
                stack.append(self.global_(module, name))
            elif op == 0x63:  # GLOBAL
                module, name = self.line(), self.line()
                stack.append(self.global_(module, name))
            elif op == 0x81:  # NEWOBJ
                self.above_fence(stack, marks, 2)
                args, cls = stack.pop(), stack.pop()
                if args != () or type(args) is not tuple or not isinstance(cls, type) or \
                        not issubclass(cls, (torchsave.Stub, torchsave.PlainStub)):
                    raise Fallback("newobj")
                stack.append(cls.__new__(cls))
            elif op == 0x52:  # REDUCE
                self.above_fence(stack, marks, 2)
                args, func = stack.pop(), stack.pop()
                if type(args) is not tuple or id(func) not in self.allowed or \
                        any(isinstance(a, _Marker) for a in args):
                    raise Fallback("reduce")
                try:
                    stack.append(func(*args))
                except Exception as e:  # noqa: BLE001 - the allow-list path reports it
                    raise Fallback("reduce") from e
            elif op == 0x62:  # BUILD
                self.above_fence(stack, marks, 2)
                state = stack.pop()
                self.build(stack[-1], state)
            elif op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
                i = self.take(1)[0] if op == 0x71 else int.from_bytes(self.take(4), "little")
                if len(stack) <= (marks[-1] if marks else 0):
                    raise Fallback("put")
                memo[i] = stack[-1]
                seen_put = True
            elif op == 0x95:  # FRAME: a hint; the C unpickler checks its length only
                n = int.from_bytes(self.take(8), "little")
                if self.done + self.pos + n > self.size:
                    raise Fallback("frame")
            elif op == 0x80:  # PROTO
                if not 2 <= self.take(1)[0] <= 5:
                    raise Fallback("protocol")
            elif op == 0x2E:  # STOP
                if not stack or marks:
                    raise Fallback("stop")
                return stack[-1]
            elif op == 0x47:  # BINFLOAT
                stack.append(struct.unpack(">d", self.take(8))[0])
            else:
                raise Fallback(f"opcode {op:#x}")
            if seen_put and seen_memoize:
                raise Fallback("memo")

    def text(self, n: int) -> str:
        if self.done + self.pos + n > self.size:
            raise Fallback("string")
        try:
            return self.take(n).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise Fallback("string") from e

    def line(self) -> str:
        self.need(min(512, self.size - self.done - self.pos))
        end = self.buf.find(b"\n", self.pos, self.pos + 512)
        if end < 0:
            raise Fallback("global")
        raw = self.buf[self.pos : end]
        self.pos = end + 1
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Fallback("global") from e

    def global_(self, module: str, name: str) -> Any:
        found = self.lookup(module, name)
        if found is None:
            raise Fallback("refused")  # the allow-list path names it
        if callable(found):
            self.allowed[id(found)] = found
        return found

    @staticmethod
    def above_fence(stack: list[Any], marks: list[int], k: int) -> None:
        """``k`` items above the last MARK, as the C unpickler requires (else: underflow)."""
        if len(stack) - (marks[-1] if marks else 0) < k:
            raise Fallback("underflow")

    @staticmethod
    def pop_mark(stack: list[Any], marks: list[int]) -> list[Any]:
        if not marks:
            raise Fallback("mark")
        at = marks.pop()
        if at > len(stack):
            raise Fallback("mark")
        items = stack[at:]
        del stack[at:]
        return items

    def setitems(self, stack: list[Any], items: list[Any], marks: list[int]) -> None:
        if len(stack) <= (marks[-1] if marks else 0) or type(stack[-1]) is not dict:
            raise Fallback("setitems")
        d = stack[-1]
        i, n = 0, len(items)
        while i < n:
            k = items[i]
            if isinstance(k, _StorageRun):  # at a key's place: a run of whole pairs
                k.consumed += 1
                self.storage_dicts[id(d)] = d
                i += 1
                continue
            if i + 1 >= n:
                raise Fallback("setitems")
            v = items[i + 1]
            if isinstance(k, _Marker) or isinstance(v, _Marker) or type(k) is tuple:
                # DCP's keys are names and MetadataIndex objects; hashing a tuple recurses
                # in C without a limit (a deep one overflows the stack): the allow-list
                # path loads such a pickle on a deep enough stack.
                raise Fallback("setitems")
            try:
                d[k] = v
            except TypeError as e:
                raise Fallback("setitems") from e
            i += 2

    @staticmethod
    def appends(stack: list[Any], items: list[Any], marks: list[int]) -> None:
        if len(stack) <= (marks[-1] if marks else 0) or type(stack[-1]) is not list:
            raise Fallback("appends")
        stack[-1].extend(items)

    @staticmethod
    def build(inst: Any, state: Any) -> None:
        if isinstance(state, _Marker):
            raise Fallback("build")
        if isinstance(inst, torchsave.Stub):
            inst.__setstate__(state)
        elif isinstance(inst, torchsave.PlainStub) and type(state) is dict and all(
                type(k) is str for k in state):
            inst.__dict__.update(state)
        else:
            raise Fallback("build")


_MISSING = object()


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


_BLOCK = 1 << 16  # rows or entries one numpy pass takes (bounds its temporaries)


def _blocks(sizes: Sequence[int]) -> Iterator[tuple[int, int]]:
    """``sizes`` cut into consecutive pieces ``[a, b)`` of at least :data:`_BLOCK` in all
    (the last: what is left)."""
    a = total = 0
    for b, n in enumerate(sizes, 1):
        total += n
        if total >= _BLOCK:
            yield a, b
            a, total = b, 0
    if a < len(sizes):
        yield a, len(sizes)


def _numpy() -> Any:
    """numpy, imported here only: the columns' whole-table passes (never on ``--help``).
    Without it (an install that skipped the dependency) the allow-list unpickler reads the
    file: slower at millions of chunks, the same answer."""
    try:
        import numpy
    except ImportError:
        raise Fallback from None
    return numpy


def _check_rows(vm: _Machine, rows: list[_TensorRows], cols: _Placement) -> None:
    """Every tensor's rows against the storage entries placed in them, and what the
    allow-list path would read differently, by numpy passes over :data:`_BLOCK` rows at a
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
        :data:`_BLOCK` entries at a time; how many."""
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
         metadata_file: str = ".metadata") -> Columnar | None:
    """``path`` (a ``.metadata``) as tensors with columnar chunks, objects and version, or None
    where the allow-list unpickler must decide (anything not recognised with certainty).

    Args:
        lookup: the allow-list (``metadata.allowed_global``): every global comes from it.
    """
    try:
        with os.fdopen(sidefiles.open_checked(path, METADATA_KIND), "rb") as f:
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

