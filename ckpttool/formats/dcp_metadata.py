"""A DCP ``.metadata`` read into columns: what :mod:`ckpttool.formats.dcp` gets from the
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

import math
import re
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool.formats import torchsave
from ckpttool.formats.base import RECORD, ChunkColumns, ChunkTable, ObjectEntry, Tensor
from ckpttool.formats.dtypes import DType

_WINDOW = 4 << 20  # bytes of the file held at a time
_AHEAD = 1 << 18  # before a run of entries is matched, at least this much is in the window
_MAX_NDIM = 64
_CACHE = 1 << 16  # decoded int tuples kept by their bytes

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


_ANY_TUPLE = rb"(\)|" + _INT + rb"{1,3}[\x85\x86\x87]\x94|\(" + _INT + rb"{4,64}t\x94)"
# The first chunk entry of a run, with the GETs to learn and the tuples to size.
_CHUNK_HEAD = re.compile(
    b"(" + _GET + b")" + _NEWOBJ + b"(" + _GET + b")(" + _GET + b")" + _ANY_TUPLE + _REDUCED
    + b"(" + _GET + b")(" + _GET + b")" + _ANY_TUPLE + _REDUCED + rb"ub", re.DOTALL)
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
        if None in (self.chunk_cls, self.index_cls, self.info_cls, self.size_fn):
            raise Fallback("lookup")
        # Columns: chunk rows, and storage entries (joined with them after the walk).
        self.boxes = array("q")
        self.num_rows = 0
        self.s_fqn: list[str] = []
        self.s_index = array("q")
        self.s_offs = array("q")
        self.s_ndim = array("B")
        self.s_file = array("i")
        self.s_begin = array("q")
        self.s_length = array("q")
        self.names: dict[str, int] = {}
        self.markers: list[_Marker] = []
        self.storage_dicts: dict[int, dict[Any, Any]] = {}  # dicts storage runs went into
        self.chunk_patterns: dict[tuple[bytes, int, int], re.Pattern[bytes]] = {}
        self.storage_patterns: dict[tuple[bytes, int], re.Pattern[bytes]] = {}
        self.decoded: dict[bytes, tuple[int, ...]] = {}  # tuples by their bytes

    # -- bytes

    def need(self, n: int) -> None:
        """At least ``n`` bytes from ``pos`` in the window, or Fallback (past the end)."""
        if self.pos + n <= len(self.buf):
            return
        if self.done + self.pos + n > self.size:
            raise Fallback("truncated")
        keep = self.buf[self.pos:]
        self.done += self.pos
        more = self.f.read(max(n - len(keep), _WINDOW))
        self.buf = keep + more
        self.pos = 0
        if len(self.buf) < n:
            raise Fallback("short read")

    def ahead(self) -> None:
        """Top the window up for a run (as far as the file goes)."""
        left = self.size - self.done - self.pos
        self.need(min(_AHEAD, left))

    def take(self, n: int) -> bytes:
        self.need(n)
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def tuple_of(self, blob: bytes) -> tuple[int, ...]:
        got = self.decoded.get(blob)
        if got is None:
            got = _tuple_ints(blob)
            if got and min(got) < 0:
                raise Fallback("negative")
            if len(self.decoded) >= _CACHE:
                self.decoded.clear()
            self.decoded[blob] = got
        return got

    # -- runs of entries

    def memo_is(self, lit: bytes, want: Any) -> bool:
        got = self.memo.get(_get_index(lit), _MISSING)
        return got is want if not isinstance(want, str) else got == want and type(got) is str

    def chunk_run(self) -> _ChunkRun | None:
        """ChunkStorageMetadata entries from ``pos`` (at a GET of the class), into columns."""
        self.ahead()
        buf, p = self.buf, self.pos
        head = _CHUNK_HEAD.match(buf, p)
        if head is None:
            return None
        nd = len(self.tuple_of(head[4]))
        if len(self.tuple_of(head[7])) != nd or nd > _MAX_NDIM:
            return None
        key = (head[1] + head[2] + head[3] + head[5] + head[6], nd, 0)
        pat = self.chunk_patterns.get(key)
        if pat is None:
            if not (self.memo_is(head[1], self.chunk_cls) and self.memo_is(head[2], "offsets")
                    and self.memo_is(head[3], self.size_fn) and self.memo_is(head[5], "sizes")
                    and self.memo_is(head[6], self.size_fn)):
                return None
            t = b"(" + _tuple_of(nd) + b")"
            pat = re.compile(re.escape(head[1]) + _NEWOBJ + re.escape(head[2] + head[3]) + t
                             + _REDUCED + re.escape(head[5] + head[6]) + t + _REDUCED + rb"ub",
                             re.DOTALL)
            self.chunk_patterns[key] = pat
        first, box, end = self.num_rows, len(self.boxes), len(buf)
        boxes, tuple_of, match = self.boxes, self.tuple_of, pat.match
        n = 0
        while p < end:
            m = match(buf, p)
            if m is None:
                break
            o, s = tuple_of(m[1]), tuple_of(m[2])
            if len(o) != nd or len(s) != nd:
                break
            boxes.extend(o)
            boxes.extend(s)
            n += 1
            p = m.end()
        if not n:
            return None
        self.num_rows += n
        self.num_memo += n * (2 + 2 * _size_memos(nd))
        self.pos = p
        return _ChunkRun(first, box, n, nd)

    def storage_run(self) -> _StorageRun | None:
        """MetadataIndex -> _StorageInfo pairs from ``pos`` (at a GET of the index class)."""
        self.ahead()
        buf, p = self.buf, self.pos
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
            e = [re.escape(x) for x in lits]
            pat = re.compile(
                e[0] + _NEWOBJ + e[1] + b"(" + _GET + b")" + e[2] + b"(" + _INT + b")"
                + e[3] + e[4] + b"(" + _tuple_of(nd) + b")" + _REDUCED + rb"ub"
                + e[5] + _NEWOBJ + e[6] + b"(" + _GET + b")" + e[7] + b"(" + _INT + b")"
                + e[8] + b"(" + _INT + b")" + rb"ub", re.DOTALL)
            self.storage_patterns[key] = pat
        end, match, memo, names = len(buf), pat.match, self.memo, self.names
        tuple_of = self.tuple_of
        s_fqn, s_index, s_offs = self.s_fqn, self.s_index, self.s_offs
        s_file, s_begin, s_length = self.s_file, self.s_begin, self.s_length
        strings: dict[bytes, str | None] = {}  # GET bytes -> the memoized str (fixed here)
        files: dict[bytes, int] = {}  # GET bytes of a relative path -> its file number
        n = 0
        while p < end:
            m = match(buf, p)
            if m is None:
                break
            g_fqn, i_index, t_offs, g_rel, i_begin, i_length = m.groups()
            fqn = strings.get(g_fqn, _MISSING)
            if fqn is _MISSING:
                got = memo.get(_get_index(g_fqn))
                fqn = strings[g_fqn] = got if type(got) is str else None
            file = files.get(g_rel)
            if file is None:
                rel = memo.get(_get_index(g_rel))
                if type(rel) is not str:
                    break
                file = names.get(rel)
                if file is None:
                    file = names[rel] = len(names)
                files[g_rel] = file
            if fqn is None:
                break  # the interpreter builds it; the conversion decides
            index, begin, length = _int(i_index), _int(i_begin), _int(i_length)
            offs = tuple_of(t_offs)
            if index < 0 or begin < 0 or length < 0:
                raise Fallback("negative")
            if len(offs) != nd:
                break
            s_fqn.append(fqn)  # type: ignore[arg-type]
            s_index.append(index)
            s_offs.extend(offs)
            s_file.append(file)
            s_begin.append(begin)
            s_length.append(length)
            n += 1
            p = m.end()
        self.s_ndim.extend(array("B", [nd]) * n)
        if not n:
            return None
        self.num_memo += n * (4 + _size_memos(nd))
        self.pos = p
        return _StorageRun()

    # -- the walk

    def run(self) -> Any:  # noqa: C901, PLR0912, PLR0915 - one dispatch loop, on purpose
        stack: list[Any] = []
        marks: list[int] = []
        memo = self.memo
        seen_memoize = seen_put = False
        chunk_cls, index_cls = self.chunk_cls, self.index_cls
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
                i = self.take(1)[0] if op == 0x68 else int.from_bytes(self.take(4), "little")
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
                stack.append(obj)
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = self.take(1)[0]
                stack.append(self.text(n))
            elif op == 0x58:  # BINUNICODE
                n = struct.unpack("<I", self.take(4))[0]
                stack.append(self.text(n))
            elif op == 0x8D:  # BINUNICODE8
                n = struct.unpack("<Q", self.take(8))[0]
                stack.append(self.text(n))
            elif op == 0x4B:  # BININT1
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
            if isinstance(k, _Marker) or isinstance(v, _Marker):
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
# Conversion: what dcp._convert makes of the same objects, or Fallback


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


def _convert(vm: _Machine, md: Any, metadata_file: str) -> Columnar:  # noqa: C901, PLR0912
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
    tensor_cls = vm.lookup(_MD, "TensorStorageMetadata")
    bytes_cls = vm.lookup(_MD, "BytesStorageMetadata")
    chunk_cls = vm.chunk_cls
    rows: list[_TensorRows] = []
    by_fqn: dict[str, _TensorRows] = {}
    objects: list[tuple[str, tuple[str, ...]]] = []
    boxes = vm.boxes
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
            first, box = vm.num_rows, len(boxes)
            for c in found:
                if isinstance(c, _ChunkRun):
                    if c.ndim != nd:
                        raise Fallback("ndim")
                    boxes.extend(boxes[c.box : c.box + 2 * nd * c.num])
                    vm.num_rows += c.num
                elif type(c) is chunk_cls:
                    o = _nonneg_ints(c.__dict__.get("offsets"))
                    s = _nonneg_ints(c.__dict__.get("sizes"))
                    if len(o) != nd or len(s) != nd:
                        raise Fallback("ndim")
                    boxes.extend(o)
                    boxes.extend(s)
                    vm.num_rows += 1
                else:
                    raise Fallback("chunk")
            t = _TensorRows(fqn, path, dtype, shape, first, box, vm.num_rows - first, nd)
        if fqn in by_fqn:
            raise Fallback("duplicate fqn")
        by_fqn[fqn] = t
        rows.append(t)
    if any(m.consumed != 1 for m in vm.markers):
        raise Fallback("marker")

    # storage: every tensor row gets exactly one entry, the one whose index hint names it and
    # whose offsets are the row's (so the allow-list path's (fqn, offsets) lookup agrees).
    num = vm.num_rows
    file = array("i", [-1]) * num
    begin = array("q", [0]) * num
    length = array("q", [-1]) * num
    names = vm.names
    object_storage: dict[str, tuple[str, int, int]] = {}

    def place(fqn: str, index: Any, offs: tuple[int, ...] | array[int], f: int, b: int,
              n: int) -> None:
        t = by_fqn.get(fqn)
        if t is None:
            return  # an entry no tensor uses (the allow-list path ignores it too)
        if type(index) is not int or not 0 <= index < t.num:
            raise Fallback("index")
        g = t.first + index
        at = t.box + 2 * t.ndim * index
        if length[g] != -1 or len(offs) != t.ndim or boxes[at : at + t.ndim] != (
                offs if isinstance(offs, array) else array("q", offs)):
            raise Fallback("storage mismatch")
        file[g], begin[g], length[g] = f, b, n

    s_offs = vm.s_offs
    at = 0
    for fqn, nd, index, f, b, n in zip(vm.s_fqn, vm.s_ndim, vm.s_index, vm.s_file, vm.s_begin,
                                       vm.s_length, strict=True):
        tr = by_fqn.get(fqn)
        if tr is not None:
            if index >= tr.num or tr.ndim != nd:
                raise Fallback("index")
            g = tr.first + index
            box = tr.box + 2 * nd * index
            if length[g] != -1 or boxes[box : box + nd] != s_offs[at : at + nd]:
                raise Fallback("storage mismatch")
            file[g], begin[g], length[g] = f, b, n
        at += nd
    del vm.s_fqn[:]
    for k, v in storage_data.items():
        if type(k) is not vm.index_cls or type(v) is not vm.info_cls:
            raise Fallback("storage kind")
        kd, vd = k.__dict__, v.__dict__
        fqn, offs = kd.get("fqn"), kd.get("offset")
        rel = vd.get("relative_path")
        b, n = vd.get("offset"), vd.get("length")
        if type(fqn) is not str or type(rel) is not str or type(b) is not int or \
                type(n) is not int or b < 0 or n < 0 or vd.get("transform_descriptors"):
            raise Fallback("storage entry")
        f = names.get(rel)
        if f is None:
            f = names[rel] = len(names)
        if offs is None:
            object_storage[fqn] = (rel, b, n)
            continue
        place(fqn, kd.get("index"), _nonneg_ints(offs), f, b, n)
    for rel in names:
        _plain_name(rel, metadata_file)

    table = ChunkTable(list(names), file, begin, length, boxes, RECORD)
    tensors = []
    for t in rows:
        nd, item = t.ndim, t.dtype.itemsize
        if -1 in length[t.first : t.first + t.num]:
            raise Fallback("no storage")  # the allow-list path says which
        seen: set[tuple[int, ...]] = set()
        at = t.box
        for g in range(t.first, t.first + t.num):
            seen.add(tuple(boxes[at : at + nd]))
            if length[g] == math.prod(boxes[at + nd : at + 2 * nd]) * item:
                raise Fallback("raw chunk")  # SerializationFormat.SAFETENSORS: dcp places it
            at += 2 * nd
        if len(seen) != t.num:
            raise Fallback("duplicate offsets")
        tensors.append(Tensor(t.fqn, t.path, t.dtype, t.shape,
                              ChunkColumns(table, first=t.first, num_chunks=t.num, box=t.box,
                                           ndim=nd)))
    out_objects = []
    for fqn, path in objects:
        stored = object_storage.get(fqn)
        if stored is None:
            raise Fallback("object storage")
        out_objects.append(ObjectEntry(fqn, path, *stored))
    version = md.field("version")
    return Columnar(tensors, out_objects, None if version is None else str(version))


def read(path: Path, lookup: Callable[[str, str], Any | None], *,
         metadata_file: str = ".metadata") -> Columnar | None:
    """``path`` (a ``.metadata``) as tensors with columnar chunks, objects and version, or None
    where the allow-list unpickler must decide (anything not recognised with certainty).

    Args:
        lookup: the allow-list (``dcp._metadata_global``): every global comes from it.
    """
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            with torchsave.gc_paused():
                vm = _Machine(f, size, lookup)
                md = vm.run()
                return _convert(vm, md, metadata_file)
    except (Fallback, OSError, MemoryError, RecursionError, OverflowError):
        # OverflowError: a number beyond int64 in a damaged file (array('q') refuses it); the
        # allow-list path reads the file again and says what is wrong.
        return None

