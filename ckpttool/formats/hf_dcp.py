"""DCP checkpoints written by PyTorch's ``HuggingFaceStorageWriter``.

Each rank writes safetensors files (``shard-00001-model-00001-of-00001.safetensors``...) holding
its local pieces; the header's ``__metadata__["DCP_SHARDING_INFO"]`` (a JSON string) gives each
piece's ``saved_offsets`` in the full tensor. There is no ``.metadata``: the global shape of a
tensor is where its pieces end, and a rank that held nothing writes no file, so a missing
last piece cannot be told from a smaller tensor (PyTorch's own reader has the same limit). The
chunks are raw byte ranges in the shards; safetensors carries no checksum.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckpttool.errors import InputError
from ckpttool.formats import safetensors
from ckpttool.formats.base import RAW, CheckpointInfo, Chunk, DataFile, Reader, Tensor
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.storage.store import LOCAL, Store, Stores

NAME = "dcp-safetensors"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = 'per-rank safetensors shards with `DCP_SHARDING_INFO` offsets'
WRITTEN_BY = "PyTorch's `HuggingFaceStorageWriter`"
SHARDING_KEY = "DCP_SHARDING_INFO"


def _shard_files(path: Path, stores: Stores) -> dict[str, int | None]:
    """The ``*.safetensors`` entries in ``path``, by name: a regular file's size, else None."""
    return {n: size for n, size in sorted(stores.listdir(path).items())
            if n.endswith(".safetensors")}


def _sharding_info(file: Path, stores: Stores) -> dict[str, object] | None:
    try:
        meta, _ = safetensors.read_layout(file, stores=stores)
    except InputError:
        return None
    raw = meta.get(SHARDING_KEY)
    if not isinstance(raw, str):
        return None
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


def detect(path: Path, stores: Stores = LOCAL) -> bool:
    return is_hf_dcp_dir(path, stores)


def pending(path: Path) -> str | None:
    """HuggingFaceStorageWriter's distributed save writes no marker at the end: only the
    sizes its shard headers promise tell a shard still being written."""
    for f in _shard_files(path, LOCAL):
        why = safetensors.pending_file(path / f)
        if why is not None:
            return why
    return None


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> Reader:
    """Pieces are raw byte ranges in the shards: the neutral reader reads them."""
    return Reader(info, store)


def is_hf_dcp_dir(path: Path, stores: Stores = LOCAL) -> bool:
    """True if ``path`` holds safetensors shards that carry DCP sharding offsets."""
    first = next((n for n, size in _shard_files(path, stores).items() if size is not None),
                 None)
    return first is not None and _sharding_info(path / first, stores) is not None


def read_info(path: str | os.PathLike[str], *, stores: Stores = LOCAL) -> CheckpointInfo:
    """Describe a ``HuggingFaceStorageWriter`` checkpoint. Reads headers only.

    Raises:
        InputError: a shard lacks sharding offsets, or pieces of a tensor disagree.
    """
    root = Path(path)
    pieces: dict[str, list[tuple[DType, Chunk]]] = {}
    for name, size in _shard_files(root, stores).items():
        file = root / name
        if size is None:
            raise InputError(f"{file}: not a regular file, where a shard of this checkpoint "
                             "belongs; copy the checkpoint again")
        info = _sharding_info(file, stores)
        if info is None:
            raise InputError(f"{file}: safetensors shard without {SHARDING_KEY} metadata among "
                             "DCP shards; the directory mixes checkpoints")
        for slot in safetensors.read_layout(file, exact=True, stores=stores)[1]:
            entry = info.get(slot.name)
            offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
            if not isinstance(offsets, list) or len(offsets) != len(slot.shape) or not all(
                    isinstance(o, int) and o >= 0 for o in offsets):
                raise InputError(f"{file}: tensor '{slot.name}' has no valid saved_offsets in "
                                 f"{SHARDING_KEY}")
            chunk = Chunk(tuple(offsets), slot.shape, file.name, slot.begin, slot.nbytes,
                          encoding=RAW)
            pieces.setdefault(slot.name, []).append((slot.dtype, chunk))
    tensors = []
    for name, found in pieces.items():
        dtypes = {d for d, _ in found}
        if len(dtypes) > 1:
            raise InputError(f"{root}: pieces of '{name}' have different dtypes "
                             f"{sorted(d.name for d in dtypes)}; corrupt checkpoint")
        chunks: dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk] = {}
        for _, c in found:
            chunks.setdefault((c.offsets, c.sizes), c)  # a replicated piece may appear twice
        ndim = len(found[0][1].sizes)
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c in chunks.values())
                      for d in range(ndim))
        tensors.append(Tensor(name, (name,), found[0][0], shape, tuple(chunks.values())))
    files = sorted({c.file for t in tensors for c in t.chunks})
    return CheckpointInfo(
        format=NAME, root=root, tensors=tuple(tensors), objects=(),
        files=tuple(DataFile(f, stores.file_size(root / f)) for f in files),
        metadata_name=f"the shards' {SHARDING_KEY}", sharded=True, single_file=False)
