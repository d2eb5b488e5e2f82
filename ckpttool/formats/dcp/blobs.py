"""Chunks of a DCP checkpoint saved with ``SerializationFormat.SAFETENSORS``: one
safetensors blob per rank file, whose header (``DCP_SHARDING_INFO``) places each chunk that
``.metadata`` lists only at the blob's start."""


from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats import safetensors
from ckpttool.formats.base import (
    RAW,
    Chunk,
    ChunkColumns,
    Tensor,
)
from ckpttool.formats.dcp.metadata import SHARDING_KEY, ZSTD_RECORD
from ckpttool.storage.store import Stores

# --------------------------------------------------------------------------------------------
# SerializationFormat.SAFETENSORS: chunks placed by the blob's header


def locate_safetensors(root: Path, tensors: list[Tensor], stores: Stores
                        ) -> tuple[list[Tensor], str]:
    """Tensors whose chunks lie in a safetensors blob (``.metadata`` gives each the blob's
    start and the chunk's byte length, which no ``torch.save`` record can have) as RAW chunks
    at the places the blob's header gives; and the serialization the data files use
    (``torch_save``, ``safetensors``, or both joined by ``+``)."""
    blobs: dict[str, int] = {}  # file -> the blob's start
    record_files: set[str] = set()
    for t in tensors:
        if isinstance(t.chunks, ChunkColumns):  # records only (dcp_metadata checked)
            record_files.update(t.chunks.files)
            continue
        item = t.dtype.itemsize
        for c in t.chunks:
            if c.encoding == RAW:  # already placed (a tensor of an opened nested record)
                continue
            if c.length == math.prod(c.sizes) * item:
                if c.encoding == ZSTD_RECORD:
                    raise UnsupportedError(
                        f"{root / c.file}: tensor '{t.name}' is stored as safetensors "
                        "(SerializationFormat.SAFETENSORS) through the ZStandard extension; "
                        "torch writes no usable offsets for that combination (its own loader "
                        "cannot read it either); save with one of the two options")
                if blobs.setdefault(c.file, c.offset) != c.offset:
                    raise InputError(
                        f"{root / c.file}: .metadata places safetensors chunks at bytes "
                        f"{blobs[c.file]} and {c.offset}; corrupt metadata")
            else:
                record_files.add(c.file)
    mixed = sorted(set(blobs) & record_files)
    if mixed:
        raise InputError(f"{root / mixed[0]}: .metadata places both torch.save records and "
                         "safetensors chunks in this file; corrupt metadata")
    if not blobs:
        return tensors, "torch_save"
    serialization = "safetensors+torch_save" if record_files else "safetensors"
    # A missing file (or a name no file can have: too long) is for the structure checks.
    slots = {f: _blob_slots(root / f, at, stores) for f, at in blobs.items()
             if stores.file_size(root / f) is not None}
    out = []
    for t in tensors:
        if not any(f in slots for f in t.files):
            out.append(t)
            continue
        out.append(dataclasses.replace(t, chunks=tuple(
            _blob_chunk(root, t, c, *slots[c.file]) if c.file in slots else c
            for c in t.chunks)))
    return out, serialization


def _blob_slots(path: Path, offset: int, stores: Stores
                ) -> tuple[dict[str, safetensors.Slot], dict[str, Any]]:
    """The blob's slots by name, and each name's ``saved_offsets``."""
    meta, slots = safetensors.read_layout(path, offset=offset, stores=stores)
    raw = meta.get(SHARDING_KEY)
    try:
        sharding = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        sharding = None
    if not isinstance(sharding, dict):
        raise InputError(f"{path} at byte {offset}: safetensors blob without readable "
                         f"{SHARDING_KEY} offsets; corrupt")
    return {s.name: s for s in slots}, sharding


def _blob_chunk(root: Path, t: Tensor, c: Chunk, slots: dict[str, safetensors.Slot],
                sharding: dict[str, Any]) -> Chunk:
    where = f"{root / c.file} at byte {c.offset} (safetensors blob)"
    slot = slots.get(t.name)
    if slot is None:
        raise InputError(f"{where}: has no tensor '{t.name}', which .metadata places there; "
                         "corrupt")
    saved = sharding.get(t.name)
    saved = saved.get("saved_offsets") if isinstance(saved, dict) else None
    if (slot.dtype != t.dtype or slot.shape != c.sizes
            or not isinstance(saved, list) or tuple(saved) != c.offsets):
        raise InputError(
            f"{where}: tensor '{t.name}' is {slot.dtype.name} {list(slot.shape)} at offsets "
            f"{saved!r}, but .metadata promises {t.dtype.name} {list(c.sizes)} at "
            f"{list(c.offsets)}; the checkpoint is inconsistent")
    return Chunk(c.offsets, c.sizes, c.file, slot.begin, slot.nbytes, RAW)
