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
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats import dtypes
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

    @property
    def numel(self) -> int:
        return _prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as ``.metadata`` describes it."""

    fqn: str  # the flat key in .metadata
    path: tuple[str, ...]  # nested keys it came from (planner_data), e.g. ("model", "lm_head.weight")
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
    crc32: int  # CRC-32 of the payload, as the zip header records it

    @property
    def is_contiguous(self) -> bool:
        return self.stride == _contiguous_strides(self.shape) or _prod(self.shape) <= 1

    @property
    def nbytes(self) -> int:
        return _prod(self.shape) * self.dtype.itemsize


# --------------------------------------------------------------------------------------------
# .metadata: an allow-list unpickler onto inert stand-ins


class _Stub:
    """Inert stand-in for a DCP metadata class: keeps the state pickle hands it, runs nothing."""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, default: Any = None) -> Any:
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) state
        if isinstance(state, dict):
            return state.get(name, default)
        return default


def _stub_class(name: str) -> type[_Stub]:
    return type(name, (_Stub,), {})


_METADATA_CLASSES = {
    name: _stub_class(name)
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

# dtypes torch can name that ckpttool does not convert; kept distinct so the error says so.
_OTHER_TORCH_DTYPES = frozenset(
    "complex128 complex32 cdouble cfloat chalf qint8 quint8 qint32 quint4x2 quint2x4 bits8 bits16"
    " bits1x8 bits2x4 bits4x2 float4_e2m1fn_x2 uint1 uint2 uint3 uint4 uint5 uint6 uint7 int1"
    " int2 int3 int4 int5 int6 int7".split()
)
_LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "_mkldnn", "jagged"})
_MEMORY_FORMATS = frozenset(
    {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}
)


@dataclass(frozen=True)
class _UnknownDType:
    torch_name: str


def _torch_attr(name: str) -> Any | None:
    """The stand-in for ``torch.<name>`` as a pickle may name it, or None if not allowed."""
    if name in dtypes.BY_TORCH_NAME:
        return dtypes.BY_TORCH_NAME[name]
    if name in _OTHER_TORCH_DTYPES:
        return _UnknownDType(name)
    if name in _LAYOUTS or name in _MEMORY_FORMATS:
        return name
    if name == "Size":
        return _size
    return None


def _size(values: Any = ()) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


def _metadata_global(module: str, name: str) -> Any | None:
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
        if name in _METADATA_CLASSES:
            return _METADATA_CLASSES[name]
        if name == "_MEM_FORMAT_ENCODING":
            return int
    if module == "torch":
        return _torch_attr(name)
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


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(
        self, file: io.BytesIO, lookup: Callable[[str, str], Any | None], where: str
    ) -> None:
        super().__init__(file)
        self._lookup = lookup
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        found = self._lookup(module, name)
        if found is None:
            raise _Refused(module, name)
        return found


class _Refused(Exception):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


def _unpickle(data: bytes, lookup: Callable[[str, str], Any | None], where: str) -> Any:
    return _AllowListUnpickler(io.BytesIO(data), lookup, where).load()


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
    except _Refused as e:
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
    if type(md).__name__ != "Metadata" or not isinstance(md, _Stub):
        raise InputError(f"{md_path}: does not hold DCP Metadata (found {type(md).__name__})")
    return _convert(root, md_path, md)


def _convert(root: Path, md_path: Path, md: _Stub) -> DcpInfo:
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
        if type(info).__name__ != "_StorageInfo" or not isinstance(index, _Stub):
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
        key = (str(index.field("fqn")), None if offset is None else _size(offset))
        storage[key] = (rel, int(info.field("offset")), int(info.field("length")))

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
    entry: _Stub,
    storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
) -> TensorEntry:
    props = entry.field("properties")
    dtype: Any = None
    if isinstance(props, _Stub):
        state = props.state
        dtype = state[0] if isinstance(state, tuple) and state else props.field("dtype")
    if isinstance(dtype, _UnknownDType):
        raise UnsupportedError(
            f"{md_path}: tensor '{fqn}' has dtype torch.{dtype.torch_name}, which ckpttool "
            "cannot write to safetensors"
        )
    if not isinstance(dtype, DType):
        raise InputError(f"{md_path}: tensor '{fqn}' has no readable dtype; corrupt .metadata")
    shape = _size(entry.field("size") or ())
    chunks = []
    for c in entry.field("chunks") or ():
        offsets = _size(c.field("offsets"))
        sizes = _size(c.field("sizes"))
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
    """A storage path must stay inside the checkpoint directory."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or rel == "":
        raise InputError(
            f"{md_path}: storage path '{rel}' points outside the checkpoint directory; "
            "refusing to read it"
        )
    return rel


# --------------------------------------------------------------------------------------------
# torch.save records: zip headers and the data.pkl that names the storage


_EOCD = struct.Struct("<4sHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_HEAD_BYTES = 4096


@dataclass(frozen=True)
class _ZipEntry:
    name: str
    data_offset: int  # relative to the record start
    size: int
    crc32: int


class _RecordBytes:
    """Reads parts of one record with as few ``pread`` calls as the layout allows."""

    def __init__(self, fd: int, start: int, length: int, where: str) -> None:
        self.fd, self.start, self.length, self.where = fd, start, length, where
        self.head = os.pread(fd, min(length, _HEAD_BYTES), start)
        tail_len = min(length, _HEAD_BYTES)
        self.tail_start = length - tail_len
        self.tail = os.pread(fd, tail_len, start + self.tail_start)
        if len(self.head) < min(length, _HEAD_BYTES) or len(self.tail) < tail_len:
            raise InputError(f"{where}: file ends inside this record; it is truncated")

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or offset + size > self.length:
            raise InputError(f"{self.where}: record header points outside the record; corrupt")
        if offset + size <= len(self.head):
            return self.head[offset : offset + size]
        if offset >= self.tail_start:
            return self.tail[offset - self.tail_start : offset - self.tail_start + size]
        data = os.pread(self.fd, size, self.start + offset)
        if len(data) < size:
            raise InputError(f"{self.where}: file ends inside this record; it is truncated")
        return data


def _zip_entries(rb: _RecordBytes) -> dict[str, _ZipEntry]:
    where = rb.where
    tail = rb.tail
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 and rb.length > len(tail):  # a zip comment pushed the end record further back
        wider = min(rb.length, 65536 + _EOCD.size)
        rb.tail_start = rb.length - wider
        rb.tail = tail = os.pread(rb.fd, wider, rb.start + rb.tail_start)
        pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 or pos + _EOCD.size > len(tail):
        raise InputError(f"{where}: not a torch.save record (no zip end record); corrupt or truncated")
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        loc_pos = rb.tail_start + pos - _ZIP64_LOCATOR.size
        sig, _, z64_offset, _ = _ZIP64_LOCATOR.unpack(rb.read(loc_pos, _ZIP64_LOCATOR.size))
        if sig != b"PK\x06\x07":
            raise InputError(f"{where}: corrupt zip64 locator in torch.save record")
        fields = _ZIP64_EOCD.unpack(rb.read(z64_offset, _ZIP64_EOCD.size))
        if fields[0] != b"PK\x06\x06":
            raise InputError(f"{where}: corrupt zip64 end record in torch.save record")
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
    cd = rb.read(cd_offset, cd_size)
    entries: dict[str, _ZipEntry] = {}
    p = 0
    for _ in range(count):
        if p + _CENTRAL.size > len(cd):
            raise InputError(f"{where}: corrupt zip directory in torch.save record")
        (sig, _, _, _, method, _, _, crc, csize, usize, nlen, elen, clen, _, _, _, local) = (
            _CENTRAL.unpack_from(cd, p)
        )
        if sig != b"PK\x01\x02":
            raise InputError(f"{where}: corrupt zip directory in torch.save record")
        name = cd[p + _CENTRAL.size : p + _CENTRAL.size + nlen].decode("utf-8", "replace")
        extra = cd[p + _CENTRAL.size + nlen : p + _CENTRAL.size + nlen + elen]
        usize, csize, local = _zip64_extra(extra, usize, csize, local)
        p += _CENTRAL.size + nlen + elen + clen
        if method != 0:
            raise UnsupportedError(f"{where}: record entry '{name}' is compressed; not supported")
        lh = rb.read(local, _LOCAL.size)
        lsig, *_rest = _LOCAL.unpack(lh)
        if lsig != b"PK\x03\x04":
            raise InputError(f"{where}: corrupt zip entry '{name}' in torch.save record")
        lnlen, lelen = _rest[-2], _rest[-1]
        short = name.split("/", 1)[1] if "/" in name else name
        entries[short] = _ZipEntry(short, local + _LOCAL.size + lnlen + lelen, usize, crc)
    return entries


def _zip64_extra(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    p = 0
    while p + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, p)
        if tag == 1:
            q = p + 4
            if usize == 0xFFFFFFFF:
                (usize,) = struct.unpack_from("<Q", extra, q)
                q += 8
            if csize == 0xFFFFFFFF:
                (csize,) = struct.unpack_from("<Q", extra, q)
                q += 8
            if local == 0xFFFFFFFF:
                (local,) = struct.unpack_from("<Q", extra, q)
        p += 4 + size
    return usize, csize, local


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: DType | None  # None for an untyped storage (dtype then comes from the rebuild call)
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DType


_STORAGE_MARKER = "ckpttool:storage-class"


@dataclass(frozen=True)
class _StorageClass:
    dtype: DType | None


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *_: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef) or storage.dtype is None:
        raise pickle.UnpicklingError("tensor without a typed storage")
    return _TensorRef(storage, int(storage_offset), _size(size), _size(stride), storage.dtype)


def _rebuild_v3(
    storage: Any, storage_offset: Any, size: Any, stride: Any, _rg: Any, _hooks: Any,
    dtype: Any, *_: Any,
) -> _TensorRef:
    if not isinstance(storage, _StorageRef) or not isinstance(dtype, DType):
        raise pickle.UnpicklingError("tensor with an unknown dtype")
    return _TensorRef(storage, int(storage_offset), _size(size), _size(stride), dtype)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def _record_global(module: str, name: str) -> Any | None:
    if module == "torch._utils":
        return {
            "_rebuild_tensor_v2": _rebuild_v2,
            "_rebuild_tensor_v3": _rebuild_v3,
            "_rebuild_parameter": _rebuild_parameter,
        }.get(name)
    if module == "torch":
        if name in dtypes.BY_STORAGE_CLASS:
            return _StorageClass(dtypes.BY_STORAGE_CLASS[name])
        attr = _torch_attr(name)
        return None if attr is _size else attr
    if module == "torch.storage" and name == "UntypedStorage":
        return _StorageClass(None)
    if module == "collections" and name == "OrderedDict":
        return dict
    return None


class _RecordUnpickler(_AllowListUnpickler):
    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        kind = pid[1]
        if not isinstance(kind, _StorageClass):
            raise pickle.UnpicklingError("unknown storage class")
        return _StorageRef(str(pid[2]), kind.dtype, int(pid[4]))


def read_record(fd: int, *, offset: int, length: int, where: str) -> TensorRecord:
    """Decode the ``torch.save`` record of one tensor chunk at ``offset`` in the open file ``fd``.

    Reads only headers (two small reads for an ordinary record), never the tensor bytes.

    Raises:
        InputError: the record is truncated, corrupt, or its pickle is not a plain tensor.
        UnsupportedError: big-endian or compressed records.
    """
    rb = _RecordBytes(fd, offset, length, where)
    entries = _zip_entries(rb)
    pkl = entries.get("data.pkl")
    if pkl is None:
        raise InputError(f"{where}: torch.save record has no data.pkl; corrupt")
    order = entries.get("byteorder")
    if order is not None and rb.read(order.data_offset, order.size) != b"little":
        raise UnsupportedError(f"{where}: big-endian torch.save record; not supported")
    try:
        ref = _RecordUnpickler(
            io.BytesIO(rb.read(pkl.data_offset, pkl.size)), _record_global, where
        ).load()
    except _Refused as e:
        raise InputError(
            f"{where}: tensor record asks for '{e.qualname}', which a tensor never needs; "
            "refused (nothing was executed)"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            struct.error) as e:
        raise InputError(f"{where}: corrupt tensor record ({e})") from None
    if not isinstance(ref, _TensorRef):
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
    """A non-tensor entry that would need arbitrary unpickling; it is never executed."""

    def __init__(self, qualname: str) -> None:
        super().__init__(qualname)
        self.qualname = qualname


def read_object(fd: int, entry: ObjectEntry, *, where: str) -> Any:
    """Read a non-tensor entry with weights-only semantics: plain containers and scalars only.

    Raises:
        UnreadableObject: the pickle names a class or function (named in the exception).
        InputError: the record is truncated or corrupt.
    """
    rb = _RecordBytes(fd, entry.offset, entry.length, where)
    entries = _zip_entries(rb)
    pkl = entries.get("data.pkl")
    if pkl is None:
        raise InputError(f"{where}: torch.save record has no data.pkl; corrupt")
    try:
        value = _RecordUnpickler(
            io.BytesIO(rb.read(pkl.data_offset, pkl.size)), _record_global, where
        ).load()
    except _Refused as e:
        raise UnreadableObject(e.qualname) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            struct.error) as e:
        raise InputError(f"{where}: corrupt record ({e})") from None
    return _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, _TensorRef):
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
            self._fds[file] = fd
        return fd

    def where(self, file: str, offset: int, what: str) -> str:
        return f"{self.info.path / file} at byte {offset} ({what})"

    def record(self, tensor: TensorEntry, chunk: Chunk) -> TensorRecord:
        """The decoded record of ``chunk``, checked against what ``.metadata`` promises."""
        where = self.where(chunk.file, chunk.offset, f"tensor '{tensor.fqn}'")
        rec = read_record(self.fd(chunk.file), offset=chunk.offset, length=chunk.length,
                          where=where)
        if rec.dtype != tensor.dtype or rec.shape != chunk.sizes:
            raise InputError(
                f"{where}: record holds {rec.dtype.name} {list(rec.shape)} but .metadata "
                f"promises {tensor.dtype.name} {list(chunk.sizes)}; the checkpoint is inconsistent"
            )
        itemsize = rec.dtype.itemsize
        if rec.is_contiguous:
            need = (rec.storage_offset + _prod(rec.shape)) * itemsize
        else:
            need = (rec.storage_offset + 1 + sum(
                (n - 1) * s for n, s in zip(rec.shape, rec.stride, strict=True))) * itemsize
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
    item = rec.dtype.itemsize
    out = bytearray(rec.nbytes)
    view = memoryview(storage)
    pos = 0
    for index in _iter_index(rec.shape):
        src = (rec.storage_offset + sum(i * s for i, s in zip(index, rec.stride, strict=True)))
        out[pos : pos + item] = view[src * item : src * item + item]
        pos += item
    return bytes(out)


def _iter_index(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    if 0 in shape:
        return
    index = [0] * len(shape)
    while True:
        yield tuple(index)
        d = len(shape) - 1
        while d >= 0:
            index[d] += 1
            if index[d] < shape[d]:
                break
            index[d] = 0
            d -= 1
        if d < 0:
            return


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


def check_files(info: DcpInfo) -> None:
    """Every data file that ``.metadata`` references exists and is long enough.

    Raises:
        InputError: naming the first missing or truncated file, the entry and byte range.
    """
    ends: dict[str, tuple[int, str]] = {}
    for t in info.tensors:
        for c in t.chunks:
            if c.offset + c.length > ends.get(c.file, (-1, ""))[0]:
                ends[c.file] = (c.offset + c.length, f"tensor '{t.fqn}'")
    for o in info.objects:
        if o.offset + o.length > ends.get(o.file, (-1, ""))[0]:
            ends[o.file] = (o.offset + o.length, f"entry '{o.fqn}'")
    for file, (end, what) in sorted(ends.items()):
        path = info.path / file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise InputError(
                f"{path}: data file is missing; .metadata references it. Copy the whole "
                "checkpoint directory again"
            ) from None
        if size < end:
            raise InputError(
                f"{path}: truncated: .metadata places {what} up to byte {end} but the file has "
                f"{size} bytes; copy the checkpoint again"
            )


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


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
