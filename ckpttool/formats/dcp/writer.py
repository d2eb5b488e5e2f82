"""Writing DCP directories the way ``torch.distributed.checkpoint.FileSystemWriter`` does.

Each chunk becomes a ``torch.save`` record appended to its rank's ``__<rank>_0.distcp``; the
``.metadata`` pickle holds torch's own metadata classes so that ``dcp.load`` (and every tool
built on it) reads the result. Writing therefore needs torch, imported when a writer is made.

This is the only module that touches a private torch API:
``torch.distributed.checkpoint.filesystem._StorageInfo``, the per-record storage entry that
``FileSystemReader`` expects in ``Metadata.storage_data``. There is no public way to build it;
``tests/formats/test_upstream_names.py`` fails loudly if an upgrade moves it.
"""

from __future__ import annotations

import io
import pickle
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpttool.formats.codecs.dtypes import DType
from ckpttool.formats.dcp.reader import METADATA_FILE

OpenFile = Callable[[str], int]  # name -> writable descriptor
WriteAt = Callable[[int, bytes, int], None]  # (fd, data, offset)


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


@dataclass
class DcpWriter:
    """Collects records per rank file, then the ``.metadata`` that describes them."""

    open_file: OpenFile
    write_at: WriteAt
    checkpoint_id: str
    _fds: dict[str, int] = field(default_factory=dict)
    _ends: dict[str, int] = field(default_factory=dict)
    _tensors: dict[str, tuple[DType, tuple[int, ...], list[tuple[tuple[int, ...],
                                                                  tuple[int, ...]]]]] = field(
        default_factory=dict)
    _objects: list[str] = field(default_factory=list)
    _paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _storage: list[tuple[str, tuple[int, ...] | None, str, int, int]] = field(
        default_factory=list)

    def _append(self, rank: int, record: bytes) -> tuple[str, int, int]:
        name = rank_file(rank)
        if name not in self._fds:
            self._fds[name] = self.open_file(name)
            self._ends[name] = 0
        offset = self._ends[name]
        self.write_at(self._fds[name], record, offset)
        self._ends[name] = offset + len(record)
        return name, offset, len(record)

    def declare_tensor(self, key: str, path: tuple[str, ...], dtype: DType,
                       shape: tuple[int, ...]) -> None:
        """Announce a tensor before its chunks, so ``.metadata`` keeps the model's order."""
        self._tensors[key] = (dtype, shape, [])
        self._paths[key] = path

    def add_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                  data: bytes | bytearray, rank: int) -> None:
        """Write one chunk's C-ordered bytes as a ``torch.save`` record in ``rank``'s file."""
        import torch

        dtype, _, chunks = self._tensors[key]
        torch_dtype = getattr(torch, dtype.torch_name)
        if data:
            t = torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(sizes)
        else:
            t = torch.empty(sizes, dtype=torch_dtype)
        buf = io.BytesIO()
        torch.save(t, buf)
        self._storage.append((key, offsets, *self._append(rank, buf.getvalue())))
        chunks.append((offsets, sizes))

    def add_object(self, key: str, path: tuple[str, ...], record: bytes, rank: int = 0) -> None:
        """Copy a non-tensor entry's ``torch.save`` record verbatim (never unpickled here)."""
        self._objects.append(key)
        self._paths[key] = path
        self._storage.append((key, None, *self._append(rank, record)))

    def metadata(self) -> bytes:
        """The ``.metadata`` pickle for everything added."""
        import torch
        from torch.distributed.checkpoint import metadata as md
        from torch.distributed.checkpoint.filesystem import _StorageInfo  # private: see above

        state: dict[str, Any] = {}
        for key, (dtype, shape, chunks) in self._tensors.items():
            state[key] = md.TensorStorageMetadata(
                properties=md.TensorProperties(dtype=getattr(torch, dtype.torch_name)),
                size=torch.Size(shape),
                chunks=[md.ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                        for o, s in chunks],
            )
        for key in self._objects:
            state[key] = md.BytesStorageMetadata()
        storage = {}
        chunk_index: dict[str, int] = {}
        for key, offsets, file, offset, length in self._storage:
            if offsets is None:
                index = md.MetadataIndex(key)
            else:
                i = chunk_index.get(key, 0)
                chunk_index[key] = i + 1
                index = md.MetadataIndex(key, offsets, i)
            storage[index] = _StorageInfo(file, offset, length)
        meta = md.Metadata(
            state_dict_metadata=state,
            planner_data=dict(self._paths),
            storage_data=storage,
            storage_meta=md.StorageMeta(checkpoint_id=self.checkpoint_id,
                                        save_id=str(uuid.uuid4())),
            version="1.0.0",
        )
        return pickle.dumps(meta)

    @property
    def files(self) -> list[str]:
        return sorted(self._fds)


__all__ = ["METADATA_FILE", "DcpWriter", "rank_file"]
