"""PyTorch Distributed Checkpoint (DCP) directories: ``.metadata`` plus ``__<rank>_<n>.distcp``.

Nothing here imports torch or runs code from the checkpoint:

* ``.metadata`` is a pickle. It is read by an allow-list unpickler that maps the handful of
  globals DCP writes (its metadata dataclasses, ``torch.Size``, dtypes, a layout helper, a path
  class) onto inert stand-ins. Any other global is refused by name before it is looked up.
* each chunk is a ``torch.save`` record: an uncompressed zip archive whose ``data.pkl`` names
  the storage, shape and strides, and whose ``data/<key>`` entry holds the raw bytes. The zip
  headers give the payload's offset and its CRC-32, so a chunk's bytes are located without
  reading them, and copied or checked without torch.

The layout is taken from what the real writer produces (torch/distributed/checkpoint/
metadata.py and filesystem.py): ``Metadata.state_dict_metadata`` maps each flat key to a
``TensorStorageMetadata`` (dtype, global size, chunks with offsets and sizes) or a
``BytesStorageMetadata``; ``Metadata.storage_data`` maps a ``MetadataIndex(fqn, offset)`` to a
``_StorageInfo(relative_path, offset, length)``; ``planner_data`` maps each flat key to the path
of nested keys it came from.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats import torchsave
from ckpttool.formats.dtypes import DType

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"


# --------------------------------------------------------------------------------------------
# What this module hands out


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the tensor and where its record is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint directory
    offset: int  # byte offset of the torch.save record in ``file``
    length: int  # byte length of the record
    # True when the bytes are stored plainly (C order, no torch.save record) at ``offset``:
    # the safetensors shards of HuggingFaceStorageWriter.
    raw: bool = False

    @property
    def numel(self) -> int:
        return _prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as ``.metadata`` describes it."""

    fqn: str  # the flat key in .metadata
    path: tuple[str, ...]  # nested keys (planner_data), e.g. ("model", "lm_head.weight")
    dtype: DType
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ObjectEntry:
    """A non-tensor entry (step counter, config value...): a pickled object in a record."""

    fqn: str
    path: tuple[str, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpInfo:
    """Everything ``.metadata`` says, as plain values."""

    path: Path
    tensors: tuple[TensorEntry, ...]  # in .metadata order (the model's order)
    objects: tuple[ObjectEntry, ...]
    files: tuple[str, ...]  # data files that storage entries reference, sorted
    version: str | None

    def tensor(self, fqn: str) -> TensorEntry:
        for t in self.tensors:
            if t.fqn == fqn:
                return t
        raise KeyError(fqn)


@dataclass(frozen=True)
class TensorRecord:
    """A chunk's ``torch.save`` record, decoded from its zip and pickle headers."""

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    data_offset: int  # absolute byte offset of the storage payload in the file
    data_size: int  # bytes of the storage payload
    crc32: int | None  # CRC-32 of the payload as the zip header records it (None: raw bytes)

    @property
    def is_contiguous(self) -> bool:
        return self.stride == torchsave.contiguous_strides(self.shape) or _prod(self.shape) <= 1

    @property
    def nbytes(self) -> int:
        return _prod(self.shape) * self.dtype.itemsize


# --------------------------------------------------------------------------------------------
# .metadata: an allow-list unpickler onto inert stand-ins


_METADATA_CLASSES = {
    name: torchsave.stub_class(name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_StorageInfo",
        "_StoragePrefix",
    )
}

def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


def _metadata_global(module: str, name: str) -> Any | None:
    if module in ("torch.distributed.checkpoint.metadata",
                  "torch.distributed.checkpoint.filesystem"):
        if name in _METADATA_CLASSES:
            return _METADATA_CLASSES[name]
        if name == "_MEM_FORMAT_ENCODING":
            return int
    if module == "torch":
        return torchsave.torch_attr(name)
    if module == "torch.serialization" and name == "_get_layout":
        return str
    if module == "pathlib" and name in (
        "PosixPath",
        "WindowsPath",
        "PurePosixPath",
        "PureWindowsPath",
        "Path",
    ):
        return _path
    if module == "collections" and name == "OrderedDict":
        return dict
    return None


def _unpickle(data: bytes, lookup: Callable[[str, str], Any | None], where: str) -> Any:
    return torchsave.AllowListUnpickler(io.BytesIO(data), lookup, where).load()


def read_metadata_object(path: Path) -> Any:
    """Unpickle ``path`` (a ``.metadata`` file) onto stand-ins; never runs checkpoint code.

    Raises:
        InputError: the file is missing, truncated, or names a global that DCP never writes.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return _unpickle(data, _metadata_global, str(path))
    except torchsave.Refused as e:
        raise InputError(
            f"{path}: refused to load: the pickle asks for '{e.qualname}', which a DCP "
            ".metadata never contains; the file may be malicious (nothing was executed)"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise InputError(
            f"{path}: truncated or corrupt .metadata ({type(e).__name__}: {e}); "
            "copy it again from the source"
        ) from None


def read_info(path: str | os.PathLike[str]) -> DcpInfo:
    """Read a DCP directory's ``.metadata`` into a :class:`DcpInfo`. Reads no tensor data.

    Raises:
        InputError: not a DCP directory, or its ``.metadata`` is unsafe, truncated or corrupt.
        UnsupportedError: a DCP layout ckpttool does not read yet.
    """
    root = Path(path)
    md_path = root / METADATA_FILE
    if not md_path.is_file():
        raise InputError(f"{root}: not a DCP checkpoint directory (no {METADATA_FILE} file)")
    md = read_metadata_object(md_path)
    if type(md).__name__ != "Metadata" or not isinstance(md, torchsave.Stub):
        raise InputError(f"{md_path}: does not hold DCP Metadata (found {type(md).__name__})")
    try:
        return _convert(root, md_path, md)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
        raise InputError(f"{md_path}: corrupt .metadata ({type(e).__name__}: {e}); copy it "
                         "again from the source") from None


def _convert(root: Path, md_path: Path, md: torchsave.Stub) -> DcpInfo:
    sd_meta = md.field("state_dict_metadata")
    storage_data = md.field("storage_data")
    planner_data = md.field("planner_data") or {}
    if not isinstance(sd_meta, dict):
        raise InputError(f"{md_path}: corrupt .metadata (state_dict_metadata is missing)")
    if not isinstance(storage_data, dict):
        raise UnsupportedError(
            f"{md_path}: storage layout '{type(storage_data).__name__}' is not a file-system "
            "DCP checkpoint; ckpttool reads checkpoints written by FileSystemWriter"
        )
    if not isinstance(planner_data, dict):
        planner_data = {}

    storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for index, info in storage_data.items():
        if type(info).__name__ != "_StorageInfo" or not isinstance(index, torchsave.Stub):
            raise UnsupportedError(
                f"{md_path}: storage entries of type '{type(info).__name__}' are not supported "
                "(this reads checkpoints written by torch.distributed.checkpoint.FileSystemWriter)"
            )
        descriptors = info.field("transform_descriptors")
        if descriptors:
            raise UnsupportedError(
                f"{md_path}: entry '{index.field('fqn')}' is stored with transforms "
                f"{list(descriptors)}; only untransformed records are supported"
            )
        rel = _safe_relative(md_path, str(info.field("relative_path")))
        offset = index.field("offset")
        key = (str(index.field("fqn")), None if offset is None else torchsave.size(offset))
        begin, length = int(info.field("offset")), int(info.field("length"))
        if begin < 0 or length < 0:
            raise InputError(f"{md_path}: entry '{key[0]}' has a negative byte range "
                             f"({begin}, {length}); corrupt .metadata")
        storage[key] = (rel, begin, length)

    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    for fqn, entry in sd_meta.items():
        fqn = str(fqn)
        path = _planner_path(planner_data.get(fqn), fqn)
        kind = type(entry).__name__
        if kind == "TensorStorageMetadata":
            tensors.append(_tensor_entry(md_path, fqn, path, entry, storage))
        elif kind == "BytesStorageMetadata":
            where = storage.get((fqn, None))
            if where is None:
                raise InputError(
                    f"{md_path}: entry '{fqn}' has no storage record; the checkpoint is incomplete"
                )
            objects.append(ObjectEntry(fqn, path, *where))
        else:
            raise UnsupportedError(f"{md_path}: entry '{fqn}' has unknown kind '{kind}'")

    files = sorted({rel for rel, _, _ in storage.values()})
    version = md.field("version")
    return DcpInfo(root, tuple(tensors), tuple(objects), tuple(files),
                   None if version is None else str(version))


def _tensor_entry(
    md_path: Path,
    fqn: str,
    path: tuple[str, ...],
    entry: torchsave.Stub,
    storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
) -> TensorEntry:
    props = entry.field("properties")
    dtype: Any = None
    if isinstance(props, torchsave.Stub):
        state = props.state
        dtype = state[0] if isinstance(state, tuple) and state else props.field("dtype")
    if isinstance(dtype, torchsave.UnknownDType):
        raise UnsupportedError(
            f"{md_path}: tensor '{fqn}' has dtype torch.{dtype.torch_name}, which ckpttool "
            "cannot write to safetensors"
        )
    if not isinstance(dtype, DType):
        raise InputError(f"{md_path}: tensor '{fqn}' has no readable dtype; corrupt .metadata")
    shape = torchsave.size(entry.field("size") or ())
    chunks = []
    for c in entry.field("chunks") or ():
        offsets = torchsave.size(c.field("offsets"))
        sizes = torchsave.size(c.field("sizes"))
        where = storage.get((fqn, offsets))
        if where is None:
            raise InputError(
                f"{md_path}: chunk of '{fqn}' at offsets {list(offsets)} has no storage record; "
                "the checkpoint is incomplete"
            )
        chunks.append(Chunk(offsets, sizes, *where))
    return TensorEntry(fqn, path, dtype, shape, tuple(chunks))


def _planner_path(raw: Any, fqn: str) -> tuple[str, ...]:
    if isinstance(raw, (tuple, list)) and raw and all(isinstance(p, (str, int)) for p in raw):
        return tuple(str(p) for p in raw)
    return (fqn,)


def _safe_relative(md_path: Path, rel: str) -> str:
    """A storage path must name a data file in the checkpoint directory itself (DCP's writer
    only writes plain names such as ``__0_0.distcp``)."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts:
        raise InputError(
            f"{md_path}: storage path '{rel}' points outside the checkpoint directory; "
            "refusing to read it"
        )
    if not rel or "\0" in rel or rel in (".", METADATA_FILE) or p.name != rel:
        raise InputError(f"{md_path}: storage path {rel!r} is not a data file name in the "
                         "checkpoint directory; refusing to read it")
    return rel


# --------------------------------------------------------------------------------------------
# torch.save records: zip headers and the data.pkl that names the storage


def read_record(fd: int, *, offset: int, length: int, where: str) -> TensorRecord:
    """Decode the ``torch.save`` record of one tensor chunk at ``offset`` in the open file ``fd``.

    Reads only headers (two small reads for an ordinary record), never the tensor bytes.

    Raises:
        InputError: the record is truncated, corrupt, or its pickle is not a plain tensor.
        UnsupportedError: big-endian or compressed records.
    """
    rb = torchsave.RecordBytes(fd, offset, length, where)
    entries = torchsave.zip_entries(rb)
    torchsave.check_byteorder(rb, entries)
    try:
        ref = torchsave.load_pickle(rb, entries)
    except torchsave.Refused as e:
        raise InputError(
            f"{where}: tensor record asks for '{e.qualname}', which a tensor never needs; "
            "refused (nothing was executed)"
        ) from None
    except torchsave.PICKLE_ERRORS as e:
        raise InputError(f"{where}: corrupt tensor record ({e})") from None
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
    )


# --------------------------------------------------------------------------------------------
# Non-tensor entries


@dataclass(frozen=True)
class TensorPlaceholder:
    """A tensor found inside a non-tensor entry; described, not loaded."""

    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"tensor({self.dtype}, {list(self.shape)})"


class UnreadableObject(Exception):
    """A non-tensor entry that is not read: it would need arbitrary unpickling (``qualname``
    names what it asks for; nothing is executed), or its structure is too large to walk."""

    def __init__(self, qualname: str | None, why: str | None = None) -> None:
        self.qualname = qualname
        self.why = why or f"needs arbitrary unpickling ({qualname})"
        super().__init__(self.why)


def read_object(fd: int, entry: ObjectEntry, *, where: str) -> Any:
    """Read a non-tensor entry with weights-only semantics: plain containers and scalars only.

    Raises:
        UnreadableObject: the pickle names a class or function (named in the exception).
        InputError: the record is truncated or corrupt.
    """
    rb = torchsave.RecordBytes(fd, entry.offset, entry.length, where)
    entries = torchsave.zip_entries(rb)
    try:
        value = torchsave.load_pickle(rb, entries, max_nodes=torchsave.OBJECT_MAX_NODES)
    except torchsave.Refused as e:
        raise UnreadableObject(e.qualname) from None
    except torchsave.TooComplex as e:
        raise UnreadableObject(None, str(e)) from None
    except torchsave.PICKLE_ERRORS as e:
        raise InputError(f"{where}: corrupt record ({e})") from None
    return _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, torchsave.TensorRef):
        return TensorPlaceholder(value.dtype.name, value.shape)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


# --------------------------------------------------------------------------------------------
# Reading data


class Reader:
    """Open data files of one checkpoint, each once; use as a context manager."""

    def __init__(self, info: DcpInfo) -> None:
        self.info = info
        self._fds: dict[str, int] = {}
        # Decoded record headers, by (tensor, chunk offsets): a tie check and the copy after it
        # (or several reads of one chunk) parse each record once.
        self._records: dict[tuple[str, tuple[int, ...]], TensorRecord] = {}

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            path = self.info.path / file
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise InputError(
                    f"{path}: data file is missing; .metadata references it. Copy the whole "
                    "checkpoint directory again"
                ) from None
            except OSError as e:
                raise InputError(f"{path}: cannot open data file: {e.strerror}") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise InputError(f"{path}: is not a regular file; .metadata names it as data")
            self._fds[file] = fd
        return fd

    def where(self, file: str, offset: int, what: str) -> str:
        return f"{self.info.path / file} at byte {offset} ({what})"

    def record(self, tensor: TensorEntry, chunk: Chunk) -> TensorRecord:
        """The decoded record of ``chunk``, checked against what ``.metadata`` promises."""
        key = (tensor.fqn, chunk.offsets)
        rec = self._records.get(key)
        if rec is None:
            rec = self._records[key] = self._decode_record(tensor, chunk)
        return rec

    def _decode_record(self, tensor: TensorEntry, chunk: Chunk) -> TensorRecord:
        where = self.where(chunk.file, chunk.offset, f"tensor '{tensor.fqn}'")
        if chunk.raw:
            if chunk.length != chunk.numel * tensor.dtype.itemsize:
                raise InputError(f"{where}: holds {chunk.length} bytes for "
                                 f"{list(chunk.sizes)} {tensor.dtype.name}; corrupt")
            return TensorRecord(tensor.dtype, chunk.sizes,
                                torchsave.contiguous_strides(chunk.sizes), 0, chunk.offset,
                                chunk.length, None)
        rec = read_record(self.fd(chunk.file), offset=chunk.offset, length=chunk.length,
                          where=where)
        if rec.dtype != tensor.dtype or rec.shape != chunk.sizes:
            raise InputError(
                f"{where}: record holds {rec.dtype.name} {list(rec.shape)} but .metadata "
                f"promises {tensor.dtype.name} {list(chunk.sizes)}; the checkpoint is inconsistent"
            )
        need = torchsave.view_extent(rec.shape, rec.stride, rec.storage_offset,
                                     contiguous=rec.is_contiguous) * rec.dtype.itemsize
        if _prod(rec.shape) and need > rec.data_size:
            raise InputError(f"{where}: record's storage is smaller than its tensor; corrupt")
        return rec

    def read_chunk(self, tensor: TensorEntry, chunk: Chunk) -> bytes:
        """The chunk's bytes, C-contiguous, in its own dtype."""
        rec = self.record(tensor, chunk)
        fd = self.fd(chunk.file)
        if rec.is_contiguous:
            start = rec.data_offset + rec.storage_offset * rec.dtype.itemsize
            data = os.pread(fd, rec.nbytes, start)
            if len(data) != rec.nbytes:
                raise InputError(
                    f"{self.where(chunk.file, start, repr(tensor.fqn))}: file ends inside the "
                    "tensor data; it is truncated"
                )
            return data
        return _gather_strided(os.pread(fd, rec.data_size, rec.data_offset), rec)

    def read_object(self, entry: ObjectEntry) -> Any:
        where = self.where(entry.file, entry.offset, f"entry '{entry.fqn}'")
        return read_object(self.fd(entry.file), entry, where=where)


def _gather_strided(storage: bytes, rec: TensorRecord) -> bytes:
    """Copy a strided view out of its storage bytes into C order (rare: DCP saves contiguous)."""
    return torchsave.gather_strided(storage, itemsize=rec.dtype.itemsize, shape=rec.shape,
                                    stride=rec.stride, storage_offset=rec.storage_offset)


def crc32_of(fd: int, offset: int, size: int, *, block: int = 1 << 24) -> int:
    """CRC-32 of ``size`` bytes at ``offset`` in ``fd``, read in blocks."""
    crc = 0
    done = 0
    while done < size:
        data = os.pread(fd, min(block, size - done), offset + done)
        if not data:
            break
        crc = zlib.crc32(data, crc)
        done += len(data)
    return crc


def extents(info: DcpInfo) -> dict[str, list[tuple[int, str, str]]]:
    """Per data file: (end byte, what, stored name) of every entry ``.metadata`` places in it."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    for t in info.tensors:
        for c in t.chunks:
            out.setdefault(c.file, []).append((c.offset + c.length, f"tensor '{t.fqn}'", t.fqn))
    for o in info.objects:
        out.setdefault(o.file, []).append((o.offset + o.length, f"entry '{o.fqn}'", o.fqn))
    return out


def check_files(info: DcpInfo) -> None:
    """Every data file that ``.metadata`` references exists and is long enough.

    Raises:
        InputError: naming the first missing or truncated file, the entry and byte range.
    """
    for file, ends in sorted(extents(info).items()):
        end, what, _ = max(ends)
        path = info.path / file
        try:
            st = path.stat()
        except FileNotFoundError:
            raise InputError(
                f"{path}: data file is missing; .metadata references it. Copy the whole "
                "checkpoint directory again"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: is not a regular file; .metadata names it as data")
        size = st.st_size
        if size < end:
            raise InputError(
                f"{path}: truncated: .metadata places {what} up to byte {end} but the file has "
                f"{size} bytes; copy the checkpoint again"
            )


def record_entries(fd: int, *, offset: int, length: int, where: str
                   ) -> tuple[torchsave.ZipEntry, ...]:
    """Every entry of the record at ``offset`` (data.pkl, the storage, byteorder...), with
    absolute offsets and the CRC-32 the zip headers record: what ``verify`` checks."""
    rb = torchsave.RecordBytes(fd, offset, length, where)
    return tuple(torchsave.ZipEntry(e.name, offset + e.data_offset, e.size, e.crc32)
                 for e in torchsave.zip_entries(rb).values())


_DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def rank_of(file: str) -> int | None:
    """The rank that wrote ``__<rank>_<n>.distcp``; None for other names."""
    m = _DATA_FILE_RE.match(Path(file).name)
    return int(m.group(1)) if m else None


def stray_files(info: DcpInfo) -> list[str]:
    """``.distcp`` files in the directory that ``.metadata`` never references (left over from
    another save, or a sign that ``.metadata`` is from a different save)."""
    referenced = set(info.files)
    return sorted(p.name for p in info.path.glob("*" + DATA_SUFFIX)
                  if p.name not in referenced and p.is_file())


# --------------------------------------------------------------------------------------------
# Recognising a DCP directory by content


def is_dcp_dir(path: Path) -> bool:
    """True if ``path`` holds a ``.metadata`` that starts like a pickle (not yet loaded)."""
    md = path / METADATA_FILE
    try:
        with open(md, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


def _prod(values: tuple[int, ...]) -> int:
    n = 1
    for v in values:
        n *= v
    return n
