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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ckpttool.errors import InputError
from ckpttool.formats.codecs import torchsave
from ckpttool.formats.codecs.dtypes import DType
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
# Reading bytes


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


class Reader:
    """A checkpoint's bytes: chunks decoded into payloads, chunks read in C order, objects.
    (Element ranges of a whole tensor are geometry over chunks: ``core.tensors``.)

    Shared by worker threads once :meth:`open_files` has run. Formats subclass it for their own
    encodings (``payload``) and objects; RAW chunks and everything built on payloads are here.
    """

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

    # -- bytes, for core (which reaches a store only through these)

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

    def read_exact(self, file: str, offset: int, size: int, *, what: str) -> bytes:
        return self.store.read_exact(file, offset, size, what=what)

    def copy_to(self, file: str, offset: int, dst_fd: int, dst_offset: int, size: int
                ) -> None:
        """Copy stored bytes into an open output file (in the kernel for local files)."""
        self.store.copy_to(file, offset, dst_fd, dst_offset, size)

    def readv(self, file: str, offset: int, bufs: Sequence[memoryview]) -> int:
        """Consecutive stored bytes into each of ``bufs`` in turn (:meth:`Store.readv`)."""
        return self.store.readv(file, offset, bufs)

    def blocks(self, file: str, offset: int, size: int, buf: memoryview, *,
               mapped: bool = True) -> Iterator[memoryview]:
        """Stored bytes in consecutive blocks (:func:`~ckpttool.storage.store.read_blocks`)."""
        return read_blocks(self.store, file, offset, size, buf, mapped=mapped)

    # -- chunks

    def payload(self, tensor: Tensor, chunk: Chunk, *, checksums: bool = False) -> Payload:
        """Where ``chunk``'s elements are, checked against what the metadata promises.

        Decoded on every call and never kept: a checkpoint of millions of chunks holds no
        per-chunk state (formats make a repeated decode cheap instead).

        Args:
            checksums: fill ``Payload.side`` (what ``verify`` checks besides the elements);
                without it, ``Payload.crc32`` may be None where a format would have to
                decode it (a copy needs no CRC).

        Raises:
            InputError: the stored piece is truncated, corrupt or not what was promised.
        """
        return self._decode(tensor, chunk, checksums)

    def payloads(self, items: Sequence[tuple[Tensor, Chunk]], *, checksums: bool = False
                 ) -> Iterator[Payload]:
        """:meth:`payload` of each ``(tensor, chunk)``, in order: the batched form, for a
        caller that knows many chunks it needs (merge, verify). Formats read what lies
        together together (DCP: back-to-back records in one read, ``Payload.data`` filled),
        so a caller that asks in file and offset order pays per span, not per chunk.

        Raises:
            InputError: as :meth:`payload`, when the failing item is reached.
        """
        for tensor, chunk in items:
            yield self._decode(tensor, chunk, checksums)

    def elements(self, items: Sequence[tuple[Tensor, int]]) -> Iterator[memoryview | None]:
        """For each ``(tensor, chunk number)``, in order, the chunk's elements in C order when
        the format has them in memory from reading many together, else None (the caller
        then reads the chunk itself: :meth:`read_chunk`). The copy of millions of small
        chunks (a merge's windows), with nothing built per chunk; callers ask in file and
        offset order. Formats without such a batched path give None for every chunk."""
        for _ in items:
            yield None

    def checked_elements(self, items: Sequence[tuple[Tensor, int]]
                         ) -> Iterator[tuple[memoryview, int] | None]:
        """:meth:`elements` for ``verify``: each chunk's elements and the stored bytes whose
        CRC-32s the format checked with them (the whole record's, every entry), where all
        of them matched; else None (no batched path, or a checksum that failed: the caller
        then decodes the chunk with :meth:`payload` and reports what is wrong)."""
        for _ in items:
            yield None

    def fill_rows(self, tensors: Sequence[Tensor], out: bytearray, dsts: Sequence[int], *,
                  checksums: bool = False) -> list[int | None]:
        """Each tensor made whole in ``out`` at ``dsts[i]`` (its C-ordered bytes), where the
        format can do that for many small chunks at once (a merge's windows, verify's groups
        of a checkpoint of millions of chunks) with nothing done per chunk in Python; callers
        offer tensors whose chunks are rows (``Shard(0)``). Per tensor: the stored bytes whose
        CRC-32s were checked with it (``checksums``; else 0), or None where it was not made
        whole: the caller then reads that tensor its own way (which reports any damage).
        Formats without such a path give None for every tensor."""
        return [None] * len(tensors)

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
        """The chunk's elements, C-contiguous, in its own dtype."""
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

        Raises:
            UnreadableObject: it would need arbitrary unpickling (never done) or is too large.
            InputError: its record is truncated or corrupt.
        """
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

