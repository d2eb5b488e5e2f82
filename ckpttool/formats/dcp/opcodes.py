"""What torch's pickler writes for DCP's ``.metadata``, as bytes: the opcode patterns of
its per-chunk entries, the ints and tuples in them, the memo caches, and the layouts that
match a run of entries at once. Used by the machine that walks the pickle
(:mod:`ckpttool.formats.dcp.machine`); :class:`Fallback` is how any part of the fast path
says "read it with the allow-list unpickler" (:mod:`ckpttool.formats.dcp.columns`)."""


from __future__ import annotations

import operator
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_MAX_RUN = 1 << 14  # entries matched at once (torch's pickler batches 1000 per SETITEMS/APPENDS)

_MD = "torch.distributed.checkpoint.metadata"


class Fallback(Exception):  # noqa: N818 - not an error: the allow-list path decides
    """Not recognised with certainty: read the file with the allow-list unpickler."""


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


BLOCK = 1 << 16  # rows or entries one numpy pass takes (bounds its temporaries)


def _numpy() -> Any:
    """numpy, imported here only: the columns' whole-table passes (never on ``--help``).
    Without it (an install that skipped the dependency) the allow-list unpickler reads the
    file: slower at millions of chunks, the same answer."""
    try:
        import numpy
    except ImportError:
        raise Fallback from None
    return numpy
