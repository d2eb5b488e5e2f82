"""The neutral checkpoint model and the format protocol: what every format hands to ``core``.

Every on-disk format (DCP, HuggingFaceStorageWriter shards, per-rank files, safetensors,
``torch.save`` files...) is one module that turns its own metadata into a
:class:`CheckpointInfo` of :class:`Tensor`, :class:`Chunk` and :class:`ObjectEntry`, and opens
a :class:`Reader` over it. ``core`` works on these alone and never asks which format it holds,
as PyTorch DCP's planners work on one ``Metadata`` whatever storage wrote it.

A module is a format when it has (checked by :class:`Format` and the contract tests):

* ``NAME``: how reports and messages name it (``"dcp"``, ``"safetensors"``...);
* ``detect(path) -> bool``: the path looks like this format, judged from names and the first
  bytes only, so that a damaged checkpoint is still claimed and ``read_info`` can say exactly
  what is wrong with it;
* ``read_info(path, *, stores) -> CheckpointInfo``: metadata and headers only, never tensor
  data (data-file bytes it needs, such as nested records, through ``stores``);
* ``open_reader(info, *, store) -> Reader``: the bytes, through the
  :class:`~ckpttool.storage.store.Store` it is given.
* ``pending(path) -> str | None``: why a checkpoint the format claims is still being written
  (its writer's last step, e.g. DCP's ``.metadata``, has not happened yet), from names and
  sizes only; None when nothing the format records says so. What a sweep of a training run
  (``merge --all``) waits for instead of merging half a checkpoint.

Nothing here names a format.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, overload

from ckpttool.errors import InputError
from ckpttool.formats.codecs import torchsave
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.formats.codecs.placement import place
from ckpttool.storage.store import LOCAL, Capabilities, LocalStore, Store, Stores, read_blocks

# How a chunk's bytes are stored (Chunk.encoding).
RAW = "raw"  # the chunk's elements in C order, exactly ``length`` bytes at ``offset``
RECORD = "torch-record"  # a torch.save archive at ``offset`` whose storage holds the chunk
VIEW = "torch-view"  # a strided view of a torch.save storage; the format's reader decodes it


# --------------------------------------------------------------------------------------------
# Findings: what structure checks and verify report


SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Location:
    file: str | None = None  # relative to the checkpoint directory, or the file itself
    tensor: str | None = None  # canonical name where core knows it, else the stored name
    offset: int | None = None  # byte offset in ``file``

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "tensor": self.tensor, "offset": self.offset}


@dataclass(frozen=True)
class Problem:
    """One finding. ``error`` fails verification (exit 1) and stops a merge; ``warning`` and
    ``info`` do neither."""

    severity: str  # "error", "warning" or "info"
    code: str  # short and stable: "crc-mismatch", "chunk-overlap", "tie-broken"...
    message: str  # one line: what, where, what to do
    location: Location = Location()

    def to_json(self) -> dict[str, Any]:
        return {"severity": self.severity, "code": self.code, "message": self.message,
                "location": self.location.to_json()}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Problem:
        """What :meth:`to_json` gave (from a worker process of our own)."""
        return cls(doc["severity"], doc["code"], doc["message"], Location(**doc["location"]))


def error(code: str, message: str, **where: Any) -> Problem:
    return Problem("error", code, message, Location(**where))


def warning(code: str, message: str, **where: Any) -> Problem:
    return Problem("warning", code, message, Location(**where))


def info(code: str, message: str, **where: Any) -> Problem:
    return Problem("info", code, message, Location(**where))


# --------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint's base directory
    offset: int  # byte offset of the stored piece in ``file``
    length: int  # its byte length (a record's, with headers, for RECORD)
    encoding: str = RECORD
    # RAW: the CRC-32 the format records for the bytes at ``crc_span`` (offset, size), which
    # hold the chunk's (its storage in an archive); the chunk's own bytes when None.
    crc32: int | None = None
    crc_span: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def end(self) -> int:
        return self.offset + self.length


# Rows of a table from which its whole-table checks are numpy passes (fewer: Python), here
# and in core.checkpoint.structure's tiling check.
VECTOR_ROWS = 1 << 12
VECTOR_BLOCK = 1 << 20  # rows one such pass takes at a time (bounded temporaries)


class ChunkTable:
    """The chunks of many tensors as columns, for a checkpoint of millions of chunks (a DCP
    ``.metadata``): about 50 bytes a chunk where :class:`Chunk` objects take several hundred.
    Row ``g`` is a chunk: ``names[file[g]]``, ``offset[g]``, ``length[g]``; its offsets and
    sizes are in ``boxes`` where its :class:`ChunkColumns` says."""

    __slots__ = ("boxes", "encoding", "file", "length", "names", "offset")

    def __init__(self, names: Sequence[str], file: array[int], offset: array[int],
                 length: array[int], boxes: array[int], encoding: str) -> None:
        self.names = tuple(names)
        self.file = file
        self.offset = offset
        self.length = length
        self.boxes = boxes  # per chunk: its offsets, then its sizes (ndim each)
        self.encoding = encoding

    def inside(self, sizes: Mapping[str, int | None]) -> bool:
        """True if every row lies inside its file, given each file's size (None: missing)."""
        limits: list[int] = []
        for name in self.names:
            size = sizes.get(name)
            if size is None:
                return False
            limits.append(size)
        if len(self.file) < VECTOR_ROWS:
            return all(map(operator.le, map(operator.add, self.offset, self.length),
                           map(limits.__getitem__, self.file)))
        # Millions of rows (a DCP .metadata's): one numpy pass instead of ~0.15 s of Python.
        # ``offset <= limit - length`` cannot overflow (every value is >= 0), as a sum could.
        import numpy as np

        def column(a: array[int]) -> Any:
            return np.frombuffer(a, dtype=a.typecode)

        file, offset, length = column(self.file), column(self.offset), column(self.length)
        sizes_ = np.asarray(limits, dtype=np.int64)
        for a in range(0, len(file), VECTOR_BLOCK):  # bounded temporaries (10M rows: 80 MB)
            ends = sizes_[file[a : a + VECTOR_BLOCK]]
            ends -= length[a : a + VECTOR_BLOCK]
            if not (offset[a : a + VECTOR_BLOCK] <= ends).all():
                return False
        return True


class ChunkColumns(Sequence[Chunk]):
    """A tensor's chunks, rows ``first .. first + num_chunks`` of a :class:`ChunkTable` whose
    offsets and sizes start at ``boxes[box]``: a read-only sequence that builds each
    :class:`Chunk` when asked for it (nothing per chunk is kept), equal to the tuple of them."""

    __slots__ = ("_files", "box", "first", "ndim", "num_chunks", "table")

    def __init__(self, table: ChunkTable, *, first: int, num_chunks: int, box: int,
                 ndim: int, files: tuple[str, ...] | None = None) -> None:
        self.table = table
        self.first = first
        self.num_chunks = num_chunks
        self.box = box
        self.ndim = ndim
        self._files = files  # sorted names of the files its rows lie in; None: found when asked

    def __len__(self) -> int:
        return self.num_chunks

    def _chunk(self, i: int) -> Chunk:
        t, nd = self.table, self.ndim
        g, b = self.first + i, self.box + 2 * nd * i
        boxes = t.boxes
        return Chunk(tuple(boxes[b : b + nd]), tuple(boxes[b + nd : b + 2 * nd]),
                     t.names[t.file[g]], t.offset[g], t.length[g], t.encoding)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self._chunk(j) for j in range(*i.indices(self.num_chunks)))
        if i < 0:
            i += self.num_chunks
        if not 0 <= i < self.num_chunks:
            raise IndexError(i)
        return self._chunk(i)

    def __iter__(self) -> Iterator[Chunk]:
        for i in range(self.num_chunks):
            yield self._chunk(i)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (tuple, list, ChunkColumns)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ChunkColumns({list(self)!r})"

    def boxes(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """``(offsets, sizes)`` of every chunk (without building the chunks)."""
        nd = self.ndim
        if not nd:
            return (((), ()),) * self.num_chunks
        offsets = zip(*(self.column(k) for k in range(nd)), strict=True)
        sizes = zip(*(self.column(nd + k) for k in range(nd)), strict=True)
        return tuple(zip(offsets, sizes, strict=True))

    def column(self, k: int) -> array[int]:
        """Entry ``k`` of every chunk's box, its offsets then its sizes: ``column(d)`` is each
        chunk's offset along dimension ``d``, ``column(ndim + d)`` its size there (one strided
        copy, nothing per chunk built)."""
        if not 0 <= k < 2 * self.ndim:
            raise IndexError(k)
        step = 2 * self.ndim
        start = self.box + k
        return self.table.boxes[start : start + step * self.num_chunks : step]

    def rows(self, shape: tuple[int, ...]) -> tuple[array[int], array[int]] | None:
        """Dimension 0's offsets and sizes of every chunk, when every chunk spans every other
        dimension of ``shape`` whole (what ``Shard(0)`` gives): what a tiling check needs,
        without building the chunks. None otherwise (and for 0-dim tensors)."""
        nd, n = self.ndim, self.num_chunks
        if nd != len(shape) or not nd:
            return None
        step = 2 * nd
        b = self.table.boxes[self.box : self.box + step * n]
        for d in range(1, nd):
            if b[d::step].count(0) != n or b[nd + d :: step].count(shape[d]) != n:
                return None
        return b[0::step], b[nd::step]

    def placed(self) -> dict[str, tuple[int, int]]:
        """Per data file: how many of the chunks lie in it, and the end byte of the one that
        ends last (without building the chunks)."""
        t = self.table
        count: dict[int, int] = {}
        last: dict[int, int] = {}
        lo, hi = self.first, self.first + self.num_chunks
        for f, end in zip(t.file[lo:hi], map(operator.add, t.offset[lo:hi], t.length[lo:hi]),
                          strict=True):
            count[f] = count.get(f, 0) + 1
            if end > last.get(f, -1):
                last[f] = end
        return {t.names[f]: (n, last[f]) for f, n in count.items()}

    def numels(self) -> list[int]:
        """Elements of every chunk (without building the chunks)."""
        nd, n = self.ndim, self.num_chunks
        b = self.table.boxes
        at = self.box + nd
        if nd == 1:
            return list(b[at : at + 2 * n : 2])
        return [math.prod(b[at + 2 * nd * k : at + 2 * nd * k + nd]) for k in range(n)]

    @property
    def stored_bytes(self) -> int:
        """Bytes the chunks take where they are stored."""
        return sum(self.table.length[self.first : self.first + self.num_chunks])

    @property
    def files(self) -> tuple[str, ...]:
        """The data files the chunks lie in, sorted (without building the chunks)."""
        if self._files is not None:
            return self._files
        t = self.table
        self._files = tuple(sorted({t.names[f] for f in set(t.file[self.first : self.first
                                                                   + self.num_chunks])}))
        return self._files


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor as the checkpoint's metadata describes it."""

    name: str  # the key as stored (DCP flat key, safetensors name, dotted torch.save path)
    path: tuple[str, ...]  # the nested keys it was saved under, e.g. ("model", "lm_head.weight")
    dtype: DType
    shape: tuple[int, ...]
    chunks: Sequence[Chunk]  # a tuple, or ChunkColumns (nothing per chunk kept)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def stored_bytes(self) -> int:
        """Bytes its chunks take where they are stored (records with their headers)."""
        if isinstance(self.chunks, ChunkColumns):
            return self.chunks.stored_bytes
        return sum(c.length for c in self.chunks)

    @property
    def files(self) -> tuple[str, ...]:
        if isinstance(self.chunks, ChunkColumns):
            return self.chunks.files
        return tuple(sorted({c.file for c in self.chunks}))


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """A non-tensor entry (step counter, param groups, config value...). Stored as a record at
    ``file``/``offset`` (read on demand), or already read with the metadata (``file`` None)."""

    name: str
    path: tuple[str, ...]
    file: str | None = None
    offset: int = 0
    length: int = 0


@dataclass(frozen=True, slots=True)
class DataFile:
    name: str  # relative to the checkpoint's base directory
    size: int | None  # None: missing


@dataclass(frozen=True)
class CheckpointInfo:
    """Everything a checkpoint's metadata says, the same for every format."""

    format: str  # the format's NAME
    root: Path  # what was described: a directory, or a single file
    tensors: tuple[Tensor, ...]  # in stored order (the model's order)
    objects: tuple[ObjectEntry, ...]
    files: tuple[DataFile, ...]  # data files the metadata references
    # What references the data files, for messages: ".metadata", "model.safetensors.index.json".
    metadata_name: str
    # Chunks are pieces of a training split (DCP, per-rank files), not full weights: a tensor
    # stored as one whole chunk there is replicated (a buffer), and stays whole on reshard.
    sharded: bool = False
    num_ranks: int | None = None
    # Found while reading metadata and headers, format-specific (index disagreements, a shard
    # whose header is unreadable): structure problems that core reports beside its own.
    problems: tuple[Problem, ...] = ()
    stray: tuple[str, ...] = ()  # data files nothing references
    version: str | None = None
    values: dict[str, Any] = field(default_factory=dict)  # object values read with metadata
    # How the format stored this checkpoint, where it has several ways, for reports (inspect's
    # summary, merge and verify): DCP's {"serialization", "compression", "metadata"}.
    storage: dict[str, Any] = field(default_factory=dict)
    detail: Any = None  # the format's own notes for its reader; core never looks at them
    # Whether ``root`` is one file (True) or a directory (False), as the format found it
    # through its Stores; None: not said (``base`` then asks the local file system).
    single_file: bool | None = None

    def tensor(self, name: str) -> Tensor:
        """The tensor stored under ``name``."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def base(self) -> Path:
        """The directory that file names are relative to."""
        if self.single_file is None:
            return self.root if self.root.is_dir() else self.root.parent
        return self.root.parent if self.single_file else self.root


# --------------------------------------------------------------------------------------------
# Reading bytes: what Reader.read is asked for (one request type per kind of answer)


@dataclass(frozen=True, slots=True)
class Checksummed:
    """Bytes whose CRC-32 the format records: what ``verify`` recomputes."""

    file: str
    offset: int
    size: int
    crc32: int
    what: str  # "record entry 'data.pkl'", "storage data/3"...
    data: bytes | None = None  # the bytes themselves, when decoding already read them


@dataclass(frozen=True, slots=True)
class Payload:
    """Where a chunk's elements are, once its encoding is decoded."""

    file: str
    storage_offset: int  # absolute byte offset of the stored bytes (what ``crc32`` covers)
    storage_size: int
    crc32: int | None  # of the stored bytes, where recorded
    start: int | None  # absolute offset of the elements in C order; None: a strided view
    stride: tuple[int, ...] = ()  # strided views: element strides and offset in the storage
    view_offset: int = 0
    side: tuple[Checksummed, ...] = ()  # the record's other checksummed entries (headers)
    # Bytes of those entries whose CRC-32s the format checked already, while decoding (they
    # are then not in ``side``): a checkpoint of millions of records checks them in C.
    checked: int = 0
    # The stored bytes at ``storage_offset`` are compressed ("zstd"): the elements are reached
    # only through ``Reader.read_chunk``, which decompresses one record at a time (``start``
    # is None); ``side`` then holds the decompressed entries with their CRC-32s.
    compression: str | None = None
    # The stored bytes themselves (``storage_size`` of them, from ``storage_offset``), when
    # decoding read them already (small records are read whole): no second read is needed.
    data: bytes | memoryview | None = None


class UnreadableObject(Exception):
    """A non-tensor entry that is not read: it would need arbitrary unpickling (``qualname``
    names what it asks for; nothing is executed), or its structure is too large to walk."""

    def __init__(self, qualname: str | None, why: str | None = None, *,
                 names: list[str] | None = None) -> None:
        self.qualname = qualname
        self.names = names or ([qualname] if qualname else [])  # every global it names
        self.why = why or f"needs arbitrary unpickling ({qualname})"
        super().__init__(self.why)


@dataclass(frozen=True)
class TensorPlaceholder:
    """A tensor found inside a non-tensor entry; described, not loaded."""

    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"tensor({self.dtype}, {list(self.shape)})"


@dataclass(frozen=True, slots=True)
class Span:
    """``size`` stored bytes at ``offset`` of ``file``: ``bytes`` (InputError if it ends)."""

    file: str
    offset: int
    size: int
    what: str


@dataclass(frozen=True, slots=True)
class Blocks:
    """Stored bytes in blocks of at most ``len(buf)``, each valid until the next (fewer than
    ``size`` when the file ends first): :func:`~ckpttool.storage.store.read_blocks`."""

    file: str
    offset: int
    size: int
    buf: memoryview
    mapped: bool = True


@dataclass(frozen=True, slots=True)
class Into:
    """Stored bytes into each of ``bufs`` in turn (one scattered read): how many came."""

    file: str
    offset: int
    bufs: Sequence[memoryview]


@dataclass(frozen=True, slots=True)
class CopyOut:
    """``size`` stored bytes copied into the open file ``fd`` at ``at`` (in the kernel)."""

    file: str
    offset: int
    size: int
    fd: int
    at: int


@dataclass(frozen=True, slots=True)
class Decode:
    """Each ``(tensor, chunk)``'s :class:`Payload` (:meth:`Reader.payloads`), in order."""

    items: Sequence[tuple[Tensor, Chunk]]
    checksums: bool = False


@dataclass(frozen=True, slots=True)
class Elements:
    """One chunk's elements in C order, in its own dtype: ``bytes``."""

    tensor: Tensor
    chunk: Chunk


@dataclass(frozen=True, slots=True)
class Whole:
    """Each of ``tensors`` made whole in ``out`` at ``dsts[i]`` (its C-ordered bytes), the
    format choosing how: many small row chunks at once with nothing per chunk in Python
    where it can (DCP), else chunk by chunk. The answer, per tensor: the stored bytes whose
    CRC-32s the batched path checked with it (``checksums``; else, and chunk by chunk, 0), or
    None where it was not made whole. ``strict``: every tensor is made whole (a damaged one
    raises); else only what the batched path can make, every checksum matching, and None for
    the others (the caller then reads each its own way, which says what is wrong: verify).
    ``via``: what chunk by chunk reads go through (a checking wrapper); None: this reader."""

    tensors: Sequence[Tensor]
    out: bytearray
    dsts: Sequence[int]
    checksums: bool = False
    strict: bool = True
    via: Reader | None = None


Request = Span | Blocks | Into | CopyOut | Decode | Elements | Whole


def row_starts(tensor: Tensor) -> list[int] | None:
    """The byte at which each chunk begins in the C-ordered tensor, when every chunk is rows
    (``Shard(0)``: whole in every other dimension), read from columns; None otherwise (or
    when the columns are not there, or the tensor has no rows)."""
    chunks = tensor.chunks
    split = chunks.rows(tensor.shape) if isinstance(chunks, ChunkColumns) else None
    if split is None or not tensor.shape[0]:
        return None
    row = tensor.nbytes // tensor.shape[0]
    return [o * row for o in split[0]]


def stored_order(tensors: Sequence[Tensor], *, empty: bool = True
                 ) -> list[tuple[str, int, int, int]]:
    """``(file, offset, tensor index, chunk number)`` of every chunk of ``tensors`` (empty
    ones too, unless ``empty`` is False), in the order their bytes are stored; from columns
    where a tensor has them (nothing per chunk is built)."""
    order: list[tuple[str, int, int, int]] = []
    for i, t in enumerate(tensors):
        chunks = t.chunks
        if isinstance(chunks, ChunkColumns):
            table, lo, n = chunks.table, chunks.first, len(chunks)
            names = table.names
            places = zip(table.file[lo : lo + n], table.offset[lo : lo + n], strict=True)
            if empty:
                order += [(names[f], o, i, k) for k, (f, o) in enumerate(places)]
            else:
                numel = chunks.numels()
                order += [(names[f], o, i, k) for k, (f, o) in enumerate(places) if numel[k]]
        else:
            order += [(c.file, c.offset, i, k) for k, c in enumerate(chunks)
                      if empty or c.numel]
    order.sort()
    return order


class Reader:
    """A checkpoint's bytes. One data verb, :meth:`read`, takes a request (:data:`Request`);
    the format chooses the fastest way (a kernel copy, a scattered read into the caller's
    buffer, records read together, DCP's template fill). Call order: ``open_reader``;
    :meth:`open_files` before threads share it; :meth:`plan_reads` (object storage fetches
    those ranges ahead); :meth:`read` from any thread (:class:`Whole` for tensors made whole
    in memory; :class:`Decode` for where chunks are, then :class:`CopyOut`, :class:`Into`,
    :class:`Blocks` or :class:`Span` on its ranges; :class:`Elements` for a chunk in C
    order); :meth:`close`. Formats subclass it for their encodings (:meth:`_decode`,
    :meth:`read_chunk`) and batched paths (:meth:`_whole`)."""

    def __init__(self, info: CheckpointInfo, store: Store | None = None) -> None:
        self.info = info
        # Given by the caller (core opens it for the checkpoint's place); a local directory
        # otherwise (a library caller reading a local checkpoint).
        self.store: Store = store if store is not None else LocalStore(
            info.base, metadata_name=info.metadata_name)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.store.close()

    def open_files(self) -> None:
        """Open every present data file, before threads share the reader."""
        self.store.open_all(f.name for f in self.info.files if f.size is not None)

    def where(self, file: str, offset: int, what: str) -> str:
        return f"{self.store.path(file)} at byte {offset} ({what})"

    # -- metadata about the bytes (not data reads)

    @property
    def capabilities(self) -> Capabilities:
        """What the store under this reader does well (planned reads, local files)."""
        return self.store.capabilities

    def path(self, file: str) -> Path:
        """Where ``file`` is, for messages."""
        return self.store.path(file)

    def plan_reads(self, reads: list[tuple[str, int, int]]) -> None:
        """The ``(file, offset, size)`` ranges about to be read, in that order: object
        storage fetches them coalesced and ahead; a local store ignores it."""
        self.store.plan_reads(reads)

    # -- the one data verb (core reads through it alone)

    @overload
    def read(self, request: Span) -> bytes: ...
    @overload
    def read(self, request: Blocks) -> Iterator[memoryview]: ...
    @overload
    def read(self, request: Into) -> int: ...
    @overload
    def read(self, request: CopyOut) -> None: ...
    @overload
    def read(self, request: Decode) -> Iterator[Payload]: ...
    @overload
    def read(self, request: Elements) -> bytes: ...
    @overload
    def read(self, request: Whole) -> list[int | None]: ...

    def read(self, request: Request) -> Any:
        """What ``request`` asks for, the format choosing how; the only method through which
        ``core`` reads data. Raises InputError where the stored bytes are truncated, corrupt
        or not what was promised."""
        if isinstance(request, Whole):
            return self._whole(request, request.via or self)
        match request:
            case Span(file, offset, size, what):
                return self.read_exact(file, offset, size, what=what)
            case Blocks(file, offset, size, buf, mapped):
                return self.blocks(file, offset, size, buf, mapped=mapped)
            case Into(file, offset, bufs):
                return self.readv(file, offset, bufs)
            case CopyOut(file, offset, size, fd, at):
                return self.copy_to(file, offset, fd, at, size)
            case Decode(items, checksums):
                return self.payloads(items, checksums=checksums)
            case Elements(tensor, chunk):
                return self.read_chunk(tensor, chunk)
        raise TypeError(f"not a read request: {request!r}")

    def _whole(self, request: Whole, via: Reader) -> list[int | None]:
        """:class:`Whole` without a batched path: where ``strict``, chunk by chunk
        (:meth:`_chunk_by_chunk`); else None for each (the caller reads each its own way)."""
        if not request.strict:
            return [None] * len(request.tensors)
        self._chunk_by_chunk(request, range(len(request.tensors)), via)
        return [0] * len(request.tensors)

    def _chunk_by_chunk(self, request: Whole, rest: Iterable[int], via: Reader,
                        found: Callable[[list[tuple[Tensor, int]]],
                                        Iterator[memoryview | None]] | None = None) -> None:
        """Tensors ``rest`` of ``request`` made whole chunk by chunk, in stored order: from
        ``found`` where it has a chunk's elements in memory, else read through ``via``."""
        ts = [request.tensors[i] for i in rest]
        ats = [request.dsts[i] for i in rest]
        starts = [row_starts(t) for t in ts]
        order = stored_order(ts, empty=False)
        items = [(ts[i], k) for _, _, i, k in order]
        view = memoryview(request.out)
        got = found(items) if found is not None else (None for _ in items)
        for (t, k), data, (_, _, i, _) in zip(items, got, order, strict=True):
            at, first = ats[i], starts[i]
            if data is not None and first is not None:  # rows, from memory: the usual case
                view[at + first[k] : at + first[k] + len(data)] = data
                continue
            c = t.chunks[k]
            place(view, at, t.shape, c.offsets, c.sizes, t.dtype.itemsize,
                  data if data is not None else via.read(Elements(t, c)))

    # -- the steps read() is built on (each format's own; core calls read())

    def read_exact(self, file: str, offset: int, size: int, *, what: str) -> bytes:
        return self.store.read_exact(file, offset, size, what=what)

    def copy_to(self, file: str, offset: int, dst_fd: int, dst_offset: int, size: int) -> None:
        self.store.copy_to(file, offset, dst_fd, dst_offset, size)

    def readv(self, file: str, offset: int, bufs: Sequence[memoryview]) -> int:
        return self.store.readv(file, offset, bufs)

    def blocks(self, file: str, offset: int, size: int, buf: memoryview, *,
               mapped: bool = True) -> Iterator[memoryview]:
        return read_blocks(self.store, file, offset, size, buf, mapped=mapped)

    def payload(self, tensor: Tensor, chunk: Chunk, *, checksums: bool = False) -> Payload:
        """Where ``chunk``'s elements are, checked against what the metadata promises;
        decoded on every call and never kept (no per-chunk state). ``checksums``: fill
        ``Payload.side`` (what ``verify`` checks besides the elements); without it,
        ``Payload.crc32`` may be None where a format would have to decode it.

        Raises:
            InputError: the stored piece is truncated, corrupt or not what was promised.
        """
        return self._decode(tensor, chunk, checksums)

    def payloads(self, items: Sequence[tuple[Tensor, Chunk]], *, checksums: bool = False
                 ) -> Iterator[Payload]:
        """:meth:`payload` of each ``(tensor, chunk)``, in order (:class:`Decode`). Formats
        read what lies together together (DCP: back-to-back records in one read,
        ``Payload.data`` filled); raises as :meth:`payload`, at the failing item."""
        for tensor, chunk in items:
            yield self._decode(tensor, chunk, checksums)

    def _decode(self, tensor: Tensor, chunk: Chunk, checksums: bool = False) -> Payload:
        if chunk.encoding != RAW:
            raise InputError(f"{self.where(chunk.file, chunk.offset, repr(tensor.name))}: "
                             f"encoding {chunk.encoding!r} is not readable here")
        need = chunk.numel * tensor.dtype.itemsize
        if chunk.length != need:
            raise InputError(f"{self.where(chunk.file, chunk.offset, repr(tensor.name))}: "
                             f"holds {chunk.length} bytes for {list(chunk.sizes)} "
                             f"{tensor.dtype.name}; corrupt")
        span = chunk.crc_span or (chunk.offset, chunk.length)
        return Payload(chunk.file, span[0], span[1], chunk.crc32, chunk.offset)

    def read_chunk(self, tensor: Tensor, chunk: Chunk) -> bytes:
        """The chunk's elements, C-contiguous, in its own dtype (:class:`Elements`)."""
        p = self.payload(tensor, chunk)
        item = tensor.dtype.itemsize
        if p.start is not None:
            return self.store.read_exact(p.file, p.start, chunk.numel * item,
                                         what=f"tensor '{tensor.name}'")
        storage = self.store.read_exact(p.file, p.storage_offset, p.storage_size,
                                        what=f"tensor '{tensor.name}'")
        return torchsave.gather_strided(storage, itemsize=item, shape=chunk.sizes,
                                        stride=p.stride, storage_offset=p.view_offset)

    # -- what verify checks beyond the chunks

    def check_copies(self) -> list[Problem]:
        """Bytes stored more than once that must agree, compared: a replicated chunk that
        every rank wrote without coordination (DCP's ``use_collectives=False``). One error
        per copy that differs from the one the chunks use; reads every copy. ``merge`` and
        ``reshard`` stop on the first error, ``verify`` reports them all."""
        return []

    def other_checksums(self) -> tuple[list[Checksummed], list[Problem]]:
        """Checksummed bytes outside every chunk's payload (object records, an archive's
        pickle), and problems met while finding them."""
        return [], []

    def check_file_digests(self) -> list[Problem]:
        """Whole-file digests the format records beside the data (Megatron's
        ``integrity.json``: SHA-256 per file), recomputed: one error per file that differs or
        is missing. Reads every such file whole; ``verify`` calls it, ``merge`` does not."""
        return []

    # -- non-tensor entries

    def read_object(self, entry: ObjectEntry) -> Any:
        """The entry's value, read with weights-only semantics (plain containers, scalars).
        Raises UnreadableObject where it would need arbitrary unpickling (never done) or is
        too large, InputError where its record is truncated or corrupt."""
        if entry.file is None:
            return self.info.values[entry.name]
        raise InputError(f"{self.store.path(entry.file)}: entry '{entry.name}' is not readable "
                         "here")

    def object_record(self, entry: ObjectEntry) -> bytes | None:
        """The entry's stored record, verbatim (what a DCP writer can copy), if it has one."""
        return None


class Format(Protocol):
    """What a format module provides (modules satisfy it structurally)."""

    NAME: str
    SUMMARY: str  # what it looks like on disk (docs/formats.md)
    WRITTEN_BY: str  # which writers produce it (docs/formats.md)

    def detect(self, path: Path, stores: Stores = LOCAL) -> bool: ...

    def read_info(self, path: Path, *, stores: Stores = LOCAL) -> CheckpointInfo: ...

    def open_reader(self, info: CheckpointInfo, *, store: Store | None = None) -> Reader: ...

    def pending(self, path: Path) -> str | None: ...

