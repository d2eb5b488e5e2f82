"""The small interpreter that walks a DCP ``.metadata`` pickle's opcodes
(:mod:`ckpttool.formats.dcp.columns` tells why): it builds the few objects per tensor as the
allow-list unpickler builds them and turns runs of per-chunk entries into columns."""


from __future__ import annotations

import re
import struct
from array import array
from collections.abc import Callable, Sequence
from itertools import chain, islice
from typing import Any, BinaryIO

from ckpttool.formats.codecs import torchsave
from ckpttool.formats.dcp import opcodes
from ckpttool.formats.dcp.opcodes import (
    _CHUNK_HEAD,
    _GET,
    _INT,
    _MAX_RUN,
    _MD,
    _NEWOBJ,
    _REDUCED,
    _STORAGE_FIRST,
    _STORAGE_HEAD,
    _TENSOR_HEAD,
    Fallback,
    _Boxes,
    _ChunkRun,
    _Field,
    _get_index,
    _group1,
    _groups,
    _int_column,
    _Ints,
    _Layout,
    _Marker,
    _MemoStrs,
    _numpy,
    _size_memos,
    _StorageRun,
    _tuple_of,
    _Tuples,
)

_WINDOW = 4 << 20  # bytes of the file held at a time
_AHEAD = 1 << 18  # before a run of entries is matched, at least this much is in the window
_MAX_NDIM = 64
_CACHE = 1 << 16  # decoded ints and int tuples kept by their bytes
_FS = "torch.distributed.checkpoint.filesystem"
# Distinct layouts (their GETs' bytes) matched by compiled patterns before the file is left to
# the allow-list unpickler: a real file has a few; each costs a regex compile (~15 ms).
_MAX_LAYOUTS = 64


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
        # opcodes.BLOCK entries or more (one growing column each cost a copy of it at every few
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
        if self.s_pending >= opcodes.BLOCK:
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
