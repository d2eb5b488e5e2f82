"""``torch.save`` files: a ``pytorch_model.bin`` / ``*.pt`` state dict, read weights-only.

The file is one ``torch.save`` archive (:mod:`torchsave`): its ``data.pkl`` is unpickled by
the same allow-list as DCP records (tensors, parameters, dicts, lists, scalars, strings), onto
stand-ins, so that reading it never runs code and never imports torch. Tensors are located by
the zip headers (storage offset, size and CRC-32) without reading their bytes. A pickle that
names any other global (a custom class, ``os.system``) is refused as a whole, as
``torch.load(weights_only=True)`` refuses it.

Nested containers are flattened the way DCP flattens a state dict: ``{"model": {"w": t}}``
gives the tensor ``model.w`` with key path ``("model", "w")``; list items are numbered. A
subtree without tensors stays one non-tensor entry.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import (
    RAW,
    VIEW,
    CheckpointInfo,
    Checksummed,
    Chunk,
    DataFile,
    ObjectEntry,
    Payload,
    Problem,
    Reader,
    Tensor,
)
from ckpttool.formats.codecs import archive, torchsave
from ckpttool.formats.codecs.archive import ZipEntry
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.storage.store import LOCAL, Store, Stores

NAME = "torch-save"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = 'one `.bin` / `.pt` / `.pth` state dict'
WRITTEN_BY = '`torch.save`'
SUFFIXES = (".bin", ".pt", ".pth")


@dataclass(frozen=True)
class View:
    """A tensor of the file: a view of one storage (``data/<storage>`` in the archive)."""

    name: str  # dotted key path
    path: tuple[str, ...]  # the nested keys it came from
    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: str
    storage_offset: int  # in elements
    data_offset: int  # absolute byte offset of the storage payload in the file
    data_size: int  # bytes of the storage payload

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self.stride == torchsave.contiguous_strides(self.shape) or self.numel <= 1

    @property
    def extent(self) -> int:
        """Bytes of the storage this view reaches (from the storage start)."""
        return torchsave.view_extent(self.shape, self.stride, self.storage_offset,
                                     contiguous=self.is_contiguous) * self.dtype.itemsize


@dataclass(frozen=True)
class Archives:
    """What the reader needs beyond the neutral model (``CheckpointInfo.detail``), for one
    archive or several (the shards of a ``pytorch_model.bin.index.json``)."""

    views: dict[str, View]  # by tensor name
    entries: dict[str, tuple[ZipEntry, ...]]  # per file: every entry, offsets absolute


# torch.save's legacy (pre-1.6) format opens with a pickled magic number: LONG1 of 10 bytes.
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _is_legacy(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) opens torch.save's legacy format (any pickle
    protocol: the magic number follows the protocol and, from protocol 4, a frame header)."""
    return head[:1] == b"\x80" and _LEGACY_MAGIC in head[:24]


def is_torch_file(path: Path, stores: Stores = LOCAL) -> bool:
    """True if ``path`` is a file that starts like a zip archive, or like torch.save's legacy
    format (which :func:`read_info` names as not supported) (not yet read further)."""
    try:
        with stores.reading(path) as pread:
            head = pread(24, 0)
    except (OSError, InputError):
        return False
    return head[:4] == archive.ZIP_MAGIC or _is_legacy(head)


def detect(path: Path, stores: Stores = LOCAL) -> bool:
    return stores.file_size(path) is not None and is_torch_file(path, stores)


def pending(path: Path) -> str | None:
    """A torch.save archive whose zip end record is not written yet."""
    return archive.pending_file(path)


def read_info(path: str | os.PathLike[str], *, stores: Stores = LOCAL) -> CheckpointInfo:
    """Read a ``torch.save`` file's tensors and non-tensor values. Reads no tensor data.

    Raises:
        InputError: missing, not a torch.save file, truncated or corrupt, or its pickle names
            a global that a weights-only load refuses (nothing was executed).
        UnsupportedError: the legacy (pre-1.6) format, a TorchScript archive, big-endian data.
    """
    p = Path(path)
    if stores.is_dir(p):
        raise InputError(f"{p}: is a directory, not a torch.save file")
    size = stores.file_size(p)
    if size is None:
        if p.name in stores.listdir(p.parent):  # a FIFO, a device...: never read
            raise InputError(f"{p}: not a regular file, so not a torch.save file")
        raise InputError(f"{p}: no such file")
    with contextlib.ExitStack() as opened:
        try:
            pread = opened.enter_context(stores.reading(p))
        except FileNotFoundError as err:
            raise InputError(f"{p}: no such file") from err
        except OSError as e:
            raise InputError(f"{p}: cannot read: {e.strerror}") from e
        head = pread(24, 0)
        if head[:4] != archive.ZIP_MAGIC:
            if _is_legacy(head):
                raise UnsupportedError(
                    f"{p}: legacy torch.save format (written by torch < 1.6 or with "
                    "_use_new_zipfile_serialization=False); load and save it again with a "
                    "current torch to read it here"
                )
            if head[:1] == b"\x80":
                raise UnsupportedError(f"{p}: a Python pickle, not a torch.save file; "
                                       "ckpttool never unpickles arbitrary pickles")
            raise InputError(f"{p}: not a torch.save file (no zip header)")
        rb = archive.RecordBytes(pread, 0, size, str(p))
        entries = archive.zip_entries(rb)
        if "data.pkl" not in entries and "constants.pkl" in entries:
            raise UnsupportedError(f"{p}: a TorchScript archive, not a state dict; "
                                   "not supported")
        archive.check_byteorder(rb, entries)
        if p.name == "common.pt" and stores.file_size(p.parent / ".metadata") is not None:
            # Megatron-Core's common state (args as an argparse.Namespace...): genuine.
            raise UnsupportedError(
                f"{p}: Megatron-Core's common state (args and the iteration), not a model "
                f"file on its own; pass its checkpoint: ckpttool inspect {p.parent}")
        try:
            root = torchsave.load_pickle(rb, entries)
        except torchsave.Refused as e:
            if _names_distributed_tensors(rb, entries):
                raise InputError(
                    f"{p}: one rank's file of a sharded checkpoint (DTensor or ShardedTensor "
                    f"values); pass the directory that holds every rank's file ({p.parent})"
                ) from e
            raise torchsave.refusal(
                p, e, torchsave.record_global, "a weights-only load never allows",
                then=". Only a state dict of tensors and plain values can be read",
                names=torchsave.archive_globals(rb, entries)) from e
        except torchsave.TooComplex as e:
            raise InputError(f"{p}: {e}, more than any state dict holds; refusing to "
                             "walk it") from e
        except torchsave.PICKLE_ERRORS as e:
            raise InputError(f"{p}: corrupt pickle in torch.save file ({e}); copy it again") \
                from e
    views: dict[str, View] = {}
    objects: list[ObjectEntry] = []
    values: dict[str, Any] = {}
    for key_path, value in torchsave.flatten(root, expand_root=True):
        name = ".".join(key_path) if key_path else "tensor"
        if name in views or name in values:
            raise InputError(f"{p}: two entries are both named '{name}' once nested keys are "
                             "joined with dots; the state dict is ambiguous")
        if isinstance(value, torchsave.TensorRef):
            data = entries.get(f"data/{value.storage.key}")
            if data is None:
                raise InputError(f"{p}: tensor '{name}' names storage "
                                 f"'data/{value.storage.key}', which the archive lacks; corrupt")
            why = value.storage.claims(data.size)
            if why is not None:
                raise InputError(f"{p}: tensor '{name}': {why}")
            t = View(name, key_path, value.dtype, value.shape, value.stride,
                     value.storage.key, value.storage_offset, data.data_offset, data.size)
            if t.numel and t.extent > t.data_size:
                raise InputError(f"{p}: tensor '{name}' reaches past the end of its storage; "
                                 "corrupt")
            views[name] = t
        else:
            objects.append(ObjectEntry(name, key_path))
            values[name] = _plain(value)
    crcs = {e.data_offset: e.crc32 for e in entries.values()}
    return CheckpointInfo(
        format=NAME, root=p, tensors=tuple(_tensor(p.name, v, crcs) for v in views.values()),
        objects=tuple(objects), files=(DataFile(p.name, size),),
        metadata_name="the torch.save archive", values=values,
        detail=Archives(views, {p.name: tuple(entries.values())}), single_file=True)


def _names_distributed_tensors(rb: archive.RecordBytes, entries: dict[str, ZipEntry]) -> bool:
    """The pickle names DTensor or ShardedTensor classes (read as opcodes, nothing run)."""
    pkl = entries["data.pkl"]
    return any(g.startswith(("torch.distributed.tensor.", "torch.distributed._shard."))
               for g in torchsave.named_globals(rb.read(pkl.data_offset, pkl.size)))


def _tensor(file: str, v: View, crcs: dict[int, int]) -> Tensor:
    """A contiguous view is one raw byte range (with the storage's CRC when it is all of the
    storage); any other is a strided view its reader gathers."""
    zeros = (0,) * len(v.shape)
    if v.is_contiguous:
        start = v.data_offset + v.storage_offset * v.dtype.itemsize
        whole = v.storage_offset == 0 and v.nbytes == v.data_size
        chunk = Chunk(zeros, v.shape, file, start, v.nbytes, encoding=RAW,
                      crc32=crcs[v.data_offset] if whole else None)
    else:
        chunk = Chunk(zeros, v.shape, file, v.data_offset, v.data_size, encoding=VIEW)
    return Tensor(v.name, v.path, v.dtype, v.shape, (chunk,))


class ArchiveReader(Reader):
    """Strided views are gathered from their storage; CRCs not covered by a tensor's own
    bytes (the pickle, shared or partly viewed storages) are listed for ``verify``."""

    def _decode(self, tensor: Tensor, chunk: Chunk, checksums: bool = False) -> Payload:
        if chunk.encoding != VIEW:
            return super()._decode(tensor, chunk, checksums)
        archives: Archives = self.info.detail
        v = archives.views[tensor.name]
        crc = next(e.crc32 for e in archives.entries[chunk.file] if e.data_offset == v.data_offset)
        return Payload(chunk.file, v.data_offset, v.data_size, crc, None, stride=v.stride,
                       view_offset=v.storage_offset)

    def other_checksums(self) -> tuple[list[Checksummed], list[Problem]]:
        archives: Archives = self.info.detail
        covered = {(c.file, c.offset) for t in self.info.tensors for c in t.chunks
                   if c.crc32 is not None or c.encoding == VIEW}
        return [Checksummed(file, e.data_offset, e.size, e.crc32, f"entry '{e.name}'")
                for file, entries in archives.entries.items() for e in entries
                if (file, e.data_offset) not in covered], []


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> ArchiveReader:
    return ArchiveReader(info, store)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value
