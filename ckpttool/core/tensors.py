"""One way to read tensors from any supported checkpoint: by element range, in C order.

Operations that rewrite a checkpoint (``reshard``) see every input format through
:class:`Source`: a list of tensors and ``read(key, start, stop)`` returning the bytes of
elements ``[start, stop)`` of the full tensor, read straight from where they are stored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ckpttool.core import chunks as chunk_geometry
from ckpttool.core import source as locate
from ckpttool.errors import InputError
from ckpttool.formats import dcp, torchfile
from ckpttool.formats import safetensors as st
from ckpttool.formats.dtypes import DType


@dataclass(frozen=True)
class SourceTensor:
    key: str  # flat key as stored
    path: tuple[str, ...]  # nested key path (DCP planner_data), (key,) for flat formats
    dtype: DType
    shape: tuple[int, ...]
    whole: bool  # stored as a single full chunk (replicated or plain): keep it whole

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class SourceObject:
    key: str
    path: tuple[str, ...]
    record: bytes  # the torch.save record, copied verbatim


def read_range(reader: dcp.Reader, entry: dcp.TensorEntry, start: int, stop: int
               ) -> bytearray:
    """Elements ``[start, stop)`` of the C-ordered full tensor, read from the chunks that hold
    them (only the overlapping bytes of each chunk are read)."""
    item = entry.dtype.itemsize
    out = bytearray((stop - start) * item)
    for c in entry.chunks:
        if not c.numel:
            continue
        rec: dcp.TensorRecord | None = None
        whole_chunk: bytes | None = None
        for src, dst, n in chunk_geometry.runs(entry.shape, c.offsets, c.sizes):
            lo, hi = max(dst, start), min(dst + n, stop)
            if lo >= hi:
                continue
            if rec is None:
                rec = reader.record(entry, c)
            src_elem = src + lo - dst
            if rec.is_contiguous:
                at = rec.data_offset + (rec.storage_offset + src_elem) * item
                data = os.pread(reader.fd(c.file), (hi - lo) * item, at)
                if len(data) != (hi - lo) * item:
                    raise InputError(f"{reader.info.path / c.file}: ends inside tensor "
                                     f"'{entry.fqn}' at byte {at}; truncated")
            else:
                whole_chunk = whole_chunk or reader.read_chunk(entry, c)
                data = whole_chunk[src_elem * item : (src_elem + hi - lo) * item]
            out[(lo - start) * item : (hi - start) * item] = data
    return out


class Source:
    """Base: a format's tensors, readable by element range."""

    format = "?"
    tensors: tuple[SourceTensor, ...] = ()

    def read(self, key: str, start: int, stop: int) -> bytearray:
        raise NotImplementedError

    def objects(self) -> list[SourceObject]:
        return []

    def close(self) -> None:
        """Release open files."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DcpSource(Source):
    format = "dcp"

    def __init__(self, info: dcp.DcpInfo) -> None:
        self.info = info
        self.reader = dcp.Reader(info)
        self._entries = {t.fqn: t for t in info.tensors}
        self.tensors = tuple(
            SourceTensor(t.fqn, t.path, t.dtype, t.shape,
                         whole=len([c for c in t.chunks if c.numel]) == 1
                         and any(c.sizes == t.shape for c in t.chunks))
            for t in info.tensors
        )

    def read(self, key: str, start: int, stop: int) -> bytearray:
        return read_range(self.reader, self._entries[key], start, stop)

    def objects(self) -> list[SourceObject]:
        out = []
        for o in self.info.objects:
            record = os.pread(self.reader.fd(o.file), o.length, o.offset)
            if len(record) != o.length:
                raise InputError(f"{self.info.path / o.file}: ends inside entry '{o.fqn}'; "
                                 "truncated")
            out.append(SourceObject(o.fqn, o.path, record))
        return out

    def close(self) -> None:
        self.reader.close()


class SafetensorsSource(Source):
    format = "safetensors"

    def __init__(self, stored: tuple[st.StoredTensor, ...]) -> None:
        self.stored = {t.slot.name: t for t in stored}
        # Full weights: every tensor is split on dim 0 as fully_shard splits parameters.
        self.tensors = tuple(SourceTensor(t.slot.name, (t.slot.name,), t.slot.dtype,
                                          t.slot.shape, whole=False) for t in stored)
        self._fds: dict[Path, int] = {}

    def read(self, key: str, start: int, stop: int) -> bytearray:
        t = self.stored[key]
        item = t.slot.dtype.itemsize
        fd = self._fds.get(t.file)
        if fd is None:
            fd = self._fds[t.file] = os.open(t.file, os.O_RDONLY)
        out = bytearray((stop - start) * item)
        got = os.preadv(fd, [out], t.slot.begin + start * item)
        if got != len(out):
            raise InputError(f"{t.file}: ends inside tensor '{key}'; truncated")
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class TorchFileSource(Source):
    """A ``torch.save`` file as a :class:`~ckpttool.core.tensors.Source`."""

    format = "torch-save"

    def __init__(self, info: torchfile.TorchFileInfo) -> None:
        self.info = info
        self._entries = {t.name: t for t in info.tensors}
        # Full weights: every tensor is split on dim 0 as fully_shard splits parameters.
        self.tensors = tuple(SourceTensor(t.name, t.path, t.dtype, t.shape, whole=False)
                             for t in info.tensors)
        self._fd: int | None = None
        self._gathered: tuple[str, bytes] | None = None

    def fd(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self.info.path, os.O_RDONLY)
            except FileNotFoundError:
                raise InputError(f"{self.info.path}: no such file") from None
        return self._fd

    def read(self, key: str, start: int, stop: int) -> bytearray:
        t = self._entries[key]
        item = t.dtype.itemsize
        if t.is_contiguous:
            out = bytearray((stop - start) * item)
            at = t.data_offset + (t.storage_offset + start) * item
            if os.preadv(self.fd(), [out], at) != len(out):
                raise InputError(f"{self.info.path}: ends inside tensor '{key}' at byte {at}; "
                                 "truncated")
            return out
        gathered = self._gathered  # one local: threads may replace the cache meanwhile
        if gathered is None or gathered[0] != key:
            gathered = (key, torchfile.read_tensor(self.fd(), t, where=str(self.info.path)))
            self._gathered = gathered
        return bytearray(gathered[1][start * item : stop * item])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_source(path: Path) -> Source:
    """The checkpoint at ``path`` (a DCP directory, a safetensors file or directory, a
    ``torch.save`` state dict), by content.

    Raises:
        InputError: nothing readable there.
    """
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    info = locate.checkpoint_at(path) if path.is_dir() else None
    if info is not None:
        return DcpSource(info)
    if path.is_file():
        if st.is_safetensors_file(path):
            return SafetensorsSource(st.read_checkpoint(path))
        if torchfile.is_torch_file(path):
            return TorchFileSource(torchfile.read_info(path))
        raise InputError(f"{path}: neither a safetensors file nor a torch.save file")
    if (path / st.INDEX_NAME).is_file() or (path / st.SINGLE_NAME).is_file():
        return SafetensorsSource(st.read_checkpoint(path))
    # A training checkpoint directory holding one model DCP, as merge accepts.
    return DcpSource(locate.locate_model(path).info)
