"""Sharded ``torch.save`` checkpoints: ``pytorch_model.bin.index.json`` beside its ``.bin`` shards.

What ``transformers`` ``save_pretrained(safe_serialization=False)`` writes for a large model:
an index whose ``weight_map`` names, for every tensor, the shard that holds it
(``pytorch_model-00001-of-00002.bin``...), each shard one weights-only ``torch.save`` state
dict. Each shard is read by :mod:`torchfile` (nothing is unpickled beyond plain values, nothing
runs); the index is read and checked against the shards as a safetensors index is, and the
shards' tensors are the checkpoint's. Its reader is the ``torch.save`` one: CRCs included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpttool.errors import InputError
from ckpttool.formats import safetensors, torchfile
from ckpttool.formats.base import CheckpointInfo, DataFile, ObjectEntry, Problem, Tensor, error
from ckpttool.formats.torchfile import ArchiveReader, Archives, View
from ckpttool.storage.store import LOCAL, Store, Stores

NAME = "torch-save-sharded"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = '`pytorch_model.bin.index.json` + `.bin` shards'
WRITTEN_BY = 'transformers / huggingface_hub with `safe_serialization=False`'
INDEX_NAME = "pytorch_model.bin.index.json"


def detect(path: Path, stores: Stores = LOCAL) -> bool:
    return stores.file_size(path / INDEX_NAME) is not None


def pending(path: Path) -> str | None:
    """save_pretrained writes the index after the shards: a shard it names that is missing or
    short is damage (read_info reports it), not a save in progress."""
    return None


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> ArchiveReader:
    return ArchiveReader(info, store)


def read_info(path: str | Path, *, stores: Stores = LOCAL) -> CheckpointInfo:
    """Describe the shards an index names, from their pickles and zip headers.

    A missing or unreadable shard, or an index that disagrees with the shards, is a problem in
    ``info.problems`` (for ``verify`` to report, ``merge`` to refuse), not an exception.

    Raises:
        InputError: the index is not one (no ``weight_map`` of names to plain file names).
    """
    root = Path(path)
    index = safetensors.read_index(root / INDEX_NAME, stores)
    shard_names = list(dict.fromkeys(index.weight_map.values()))
    problems: list[Problem] = []
    tensors: dict[str, Tensor] = {}
    holders: dict[str, list[str]] = {}
    objects: list[ObjectEntry] = []
    values: dict[str, Any] = {}
    views: dict[str, View] = {}
    entries = {}
    readable: set[str] = set()
    for name in shard_names:
        shard = root / name
        if stores.file_size(shard) is None:
            problems.append(error("missing-file", f"{shard}: shard named in {INDEX_NAME} is "
                                  "missing; copy the whole directory again", file=name))
            continue
        try:
            info = torchfile.read_info(shard, stores=stores)
        except InputError as e:
            problems.append(error("header-corrupt", str(e), file=name))
            continue
        readable.add(name)
        archives: Archives = info.detail
        entries.update(archives.entries)
        for t in info.tensors:
            holders.setdefault(t.name, []).append(name)
            if t.name not in tensors:  # a name in two shards is a duplicate; describe it once
                tensors[t.name] = t
                views[t.name] = archives.views[t.name]
        for o in info.objects:
            if o.name not in values:
                objects.append(o)
                values[o.name] = info.values[o.name]
    problems += safetensors.duplicate_problems(root, holders)
    problems += safetensors.index_problems(
        root, index, holders, readable, complete=readable == set(shard_names),
        # As huggingface_hub counts it: each stored piece once (tied tensors share storage).
        total=sum(t.nbytes for t in {(t.chunks[0].file, t.chunks[0].offset): t
                                     for t in tensors.values()}.values()))
    return CheckpointInfo(
        format=NAME, root=root, tensors=tuple(tensors.values()), objects=tuple(objects),
        files=tuple(DataFile(n, stores.file_size(root / n)) for n in shard_names),
        metadata_name=INDEX_NAME, problems=tuple(problems), values=values,
        detail=Archives(views, entries), single_file=False)
