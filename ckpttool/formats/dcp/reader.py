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
``_StorageInfo(relative_path, offset, length, transform_descriptors)``; ``planner_data`` maps
each flat key to the path of nested keys it came from.

``FileSystemWriter``'s options, as torch 2.13 writes them:

* ``serialization_format=SerializationFormat.SAFETENSORS``: a rank's non-tensor records come
  first (``torch.save`` records as usual), then one safetensors blob of all its tensor chunks,
  keyed by flat key, whose ``__metadata__`` ``DCP_SHARDING_INFO`` gives each chunk's
  ``saved_offsets``. ``.metadata`` records every chunk of the file at the blob's start with
  the chunk's byte length (nothing locates it inside the blob), so the blob's header is read
  here to place each chunk; no checksum covers the bytes. (torch's own ``FileSystemReader``
  cannot load these: it hands the blob to ``torch.load``.)
* ``dcp.save(..., use_collectives=False)``: every rank writes its own ``__<rank>.metadata``,
  describing only its own chunks and no global ``.metadata``; a replicated tensor is written
  by every rank. The checkpoint is the union of the rank files; a chunk stored by several
  ranks is read from the lowest rank, once the others are known to hold the same bytes
  (:meth:`DcpReader.check_copies`).
* ``_extensions=[ZStandard()]``: every record (tensor chunk or not) is one zstd frame of the
  usual ``torch.save`` record, with the descriptor ``stream.zstd/1`` in its storage entry.
  Records are decompressed one at a time (:mod:`ckpttool.formats.codecs.zstd`); the archive's
  CRC-32s
  are the only checksums.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import json
import math
import os
import pickle
import re
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool._gc import gc_paused
from ckpttool.errors import CkptError, InputError, UnsupportedError
from ckpttool.formats import safetensors as st
from ckpttool.formats.base import (
    RAW,
    RECORD,
    CheckpointInfo,
    Checksummed,
    Chunk,
    ChunkColumns,
    DataFile,
    ObjectEntry,
    Payload,
    Problem,
    Reader,
    Tensor,
    error,
)
from ckpttool.formats.codecs import archive, policy, torchsave, zstd
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.formats.dcp import columns as dcp_metadata
from ckpttool.formats.dcp.records import (
    SMALL_RECORD,
    SPAN,
    Template,
    TensorRecord,
    fill_rows,
    payload_of,
    read_object,
    read_record,
    record_entries,
)
from ckpttool.formats.dcp.records import plain as _plain
from ckpttool.storage import sidefiles
from ckpttool.storage.store import LOCAL, Store, Stores, file_size, pread_of

NAME = "dcp"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = '`.metadata` (or one `__<rank>.metadata` per rank) + `__<rank>_<n>.distcp` files'
WRITTEN_BY = ('`torch.distributed.checkpoint.save` (FSDP2, accelerate, torchtitan, Lightning '
    'Fabric...), with any `FileSystemWriter` option')
METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
# A chunk's record compressed by DCP's ZStandard extension (one zstd frame of a RECORD).
ZSTD_RECORD = "torch-record-zstd"
RANK_METADATA = "the __<rank>.metadata files"  # CheckpointInfo.metadata_name, rank-local
SHARDING_KEY = "DCP_SHARDING_INFO"  # in a SAFETENSORS blob's __metadata__
# A decompressed record holds its chunk's bytes plus a few hundred bytes of zip and pickle
# headers (DCP's writer gives each chunk a storage of its own size); beyond this it is corrupt.
_RECORD_OVERHEAD = 1 << 16
_OBJECT_LIMIT = 256 << 20  # a compressed non-tensor record decompresses to at most this


@dataclass(frozen=True)
class Copy:
    """A chunk (or non-tensor record) that several ranks stored: ``kept`` is the one the
    checkpoint's tensors use, ``other`` another rank's copy that must hold the same bytes."""

    name: str  # the stored name
    kept: Chunk | ObjectEntry
    other: Chunk | ObjectEntry
    kept_from: str  # the metadata files that list them
    other_from: str


@dataclass(frozen=True)
class Detail:
    """What :func:`read_info` tells :class:`DcpReader` (``CheckpointInfo.detail``)."""

    compressed_objects: frozenset[tuple[str, int]] = frozenset()  # (file, offset)
    copies: tuple[Copy, ...] = ()
    nested: Nested | None = None  # records of an unflattened save, opened


# --------------------------------------------------------------------------------------------
# .metadata: an allow-list unpickler onto inert stand-ins


# TensorProperties pickles a tuple state (its own __getstate__): it needs a Stub's
# __setstate__. Every other class pickles a dict and is built by the C unpickler alone.
_METADATA_CLASSES: dict[str, type[torchsave.Stub] | type[torchsave.PlainStub]] = {
    "TensorProperties": torchsave.stub_class("TensorProperties"),
    **{name: torchsave.plain_stub_class(name) for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "StorageMeta",
        "MetadataIndex",
        "_StorageInfo",
        "_StoragePrefix",
    )},
}
_STORAGE_INFO = _METADATA_CLASSES["_StorageInfo"]
_METADATA_INDEX = _METADATA_CLASSES["MetadataIndex"]
_CHUNK_METADATA = _METADATA_CLASSES["ChunkStorageMetadata"]

# How TensorProperties pickles its memory format (torch 2.13's members, unchanged since 2.0).
_MEM_FORMAT_ENCODING = torchsave.EnumClass("_MEM_FORMAT_ENCODING", {
    "TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2})


def _metadata_global(module: str, name: str) -> Any | None:
    if module in ("torch.distributed.checkpoint.metadata",
                  "torch.distributed.checkpoint.filesystem"):
        if name in _METADATA_CLASSES:
            return _METADATA_CLASSES[name]
        if name == "_MEM_FORMAT_ENCODING":
            return _MEM_FORMAT_ENCODING
    if module in ("builtins", "__builtin__") and name == "getattr":
        return torchsave.enum_getattr  # an Enum member pickled by name (Python 3.11)
    if module == "torch":
        # torch.Size((r, c)) is then the tuple itself (REDUCE in C); checked by ints().
        return tuple if name == "Size" else torchsave.torch_attr(name)
    if module == "torch.serialization" and name == "_get_layout":
        return str
    if module == "collections" and name == "OrderedDict":
        return dict
    # The rest by what it is (the one pickle policy): paths under every Python (3.13's
    # pathlib._local.PosixPath as StorageMeta.checkpoint_id), enums, namespaces...
    return policy.data_global(module, name)


def _unpickle(data: bytes, lookup: Callable[[str, str], Any | None], where: str) -> Any:
    try:
        return torchsave.AllowListUnpickler(io.BytesIO(data), lookup, where).load_deep(len(data))
    except MemoryError as err:  # a damaged length field asks for an absurd buffer
        raise pickle.UnpicklingError("a length in the pickle is beyond its data") from err
    except (torchsave.Refused, CkptError, pickle.UnpicklingError):
        raise
    except Exception as e:  # noqa: BLE001 - anything else a damaged pickle raises
        raise torchsave.corrupt(e) from e


Lookup = Callable[[str, str], Any | None]  # an allow-list: (module, name) -> stand-in or None

# Globals that genuine checkpoints of other writers put in a .metadata beside DCP's own: torch's
# save plans (Megatron-Core's torch_dist keeps its central plan there) and Megatron's own
# classes. Refused here all the same, but named for what they are: a valid checkpoint that
# this reader does not read (exit 4), not a file that may be malicious.
_KNOWN_WRITERS = (
    ("torch.distributed.checkpoint.planner.", "torch's DCP save plans (Megatron-Core "
     "torch_dist writes them)"),
    ("megatron.", "Megatron-Core's checkpoint classes"),
)


def read_metadata_object(path: Path, lookup: Lookup | None = None) -> Any:
    """Unpickle ``path`` (a ``.metadata`` file) onto stand-ins; never runs checkpoint code.

    Args:
        lookup: the allow-list (default: what DCP itself writes); a format built on DCP
            (Megatron's torch_dist) passes its own, which falls back on this one.

    Raises:
        InputError: the file is missing, truncated, or names a global that DCP never writes.
        UnsupportedError: it names a global that a known writer puts there (a valid
            checkpoint of a layout this reader does not read).
    """
    try:
        data = sidefiles.read_checked(path, dcp_metadata.METADATA_KIND)
    except FileNotFoundError as err:
        raise InputError(f"{path}: no such file") from err
    except MemoryError as e:
        raise InputError(f"{path}: {file_size(path) or 0:,} bytes, more than this process "
                         "may hold in memory; a .metadata that large is corrupt, or needs a "
                         "machine with more memory") from e
    try:
        return _unpickle(data, lookup or _metadata_global, str(path))
    except torchsave.Refused as e:
        raise _refusal(path, e, data, lookup or _metadata_global) from e
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise InputError(
            f"{path}: truncated or corrupt .metadata ({type(e).__name__}: {e}); "
            "copy it again from the source"
        ) from e


def _refusal(path: Path, refused: torchsave.Refused, data: bytes, lookup: Lookup) -> CkptError:
    """Exit 4 naming the writer when every global outside DCP's allow-list is one a known
    writer puts in its .metadata (the first refused one may be a decoy: all are checked);
    else "may be malicious"."""
    others = [g for g in torchsave.named_globals(data)
              if _metadata_global(*g.rsplit(".", 1)) is None] or [refused.qualname]
    kinds = [next((what for prefix, what in _KNOWN_WRITERS if g.startswith(prefix)), None)
             for g in others]
    known = [k for k in kinds if k is not None]
    if len(known) == len(kinds):
        return UnsupportedError(
            f"{path}: a valid DCP .metadata that also holds {', '.join(dict.fromkeys(known))} "
            f"('{others[0]}'); not supported as a plain DCP directory yet. A Megatron-Core "
            "torch_dist checkpoint is read from its iter_NNNNNNN directory with its "
            "metadata.json, or from the run directory (latest_checkpointed_iteration.txt)")
    return torchsave.refusal(path, refused, lookup, "a DCP .metadata never contains",
                             names=torchsave.named_global_pairs(data))


def detect(path: Path) -> bool:
    """A directory with a ``.metadata`` file, ``__<rank>.metadata`` files or ``.distcp`` data
    files (data files alone are a damaged DCP checkpoint, which :func:`read_info` explains)."""
    if not path.is_dir():
        return False
    return ((path / METADATA_FILE).exists() or any(path.glob("*" + DATA_SUFFIX))
            or bool(_rank_metadata_files(path)))


def piece_of(path: Path) -> str | None:
    """Why the file ``path`` is a piece of a DCP checkpoint, not a checkpoint (a data file,
    ``.metadata``, ``__<rank>.metadata``), naming the directory to pass; None otherwise.
    Names only: a data file begins with a valid ``torch.save`` archive (its first record),
    which must never be taken for the whole checkpoint."""
    if path.name.endswith(DATA_SUFFIX):
        what = "a DCP data file (records of one rank, a piece of the checkpoint)"
    elif path.name == METADATA_FILE or _RANK_METADATA_RE.match(path.name):
        what = "the metadata of a DCP checkpoint"
    else:
        return None
    return f"{path}: {what}; pass the DCP directory that holds it: {path.parent}"


def pending(path: Path) -> str | None:
    """``dcp.save`` writes ``.metadata`` (or, without collectives, each rank its
    ``__<rank>.metadata``) after every data file: without one, the save is still going on, or
    its writer was killed before the end."""
    if (path / METADATA_FILE).is_file() or _rank_metadata_files(path):
        return None
    return f"no {METADATA_FILE} yet (dcp.save writes it after every data file)"


_RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")


def _rank_metadata_files(root: Path) -> list[tuple[int, Path]]:
    """``__<rank>.metadata`` files (``dcp.save(use_collectives=False)``), by rank."""
    found = []
    for p in root.glob("__*.metadata"):
        m = _RANK_METADATA_RE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def read_info(path: str | os.PathLike[str], *, lookup: Lookup | None = None,
              stores: Stores = LOCAL, open_nested: bool = True) -> CheckpointInfo:
    """Read a DCP directory's ``.metadata`` (or, without one, every ``__<rank>.metadata``),
    plus the header of each safetensors blob (``SerializationFormat.SAFETENSORS``). Reads no
    tensor data.

    ``lookup``: the ``.metadata`` allow-list, for a format built on DCP whose writer pickles
    more than DCP's own classes there (default: DCP's).

    Raises:
        InputError: not a DCP directory, or its metadata is missing, unsafe, truncated or
            corrupt.
        UnsupportedError: a DCP layout ckpttool does not read yet.
    """
    root = Path(path)
    md_path = root / METADATA_FILE
    ranks = _rank_metadata_files(root) if not md_path.exists() else []
    if not md_path.exists() and not ranks and any(root.glob("*" + DATA_SUFFIX)):
        raise InputError(f"{root}: has .distcp data files but no {METADATA_FILE}; the copy is "
                         f"incomplete (copy {METADATA_FILE} too)")
    if not ranks and not md_path.is_file():
        raise InputError(f"{root}: not a DCP checkpoint directory (no {METADATA_FILE} file)")
    with gc_paused():
        if not ranks:
            read = _read_one(root, md_path, lookup, stores, open_nested)
            per_file = [(0, read)]
            tensors, objects = read.tensors, read.objects
            copies: list[Copy] = []
            metadata_name, problems = METADATA_FILE, []
            zstd_records = read.compressed_all
        else:
            reads = [(r, _read_one(root, p, lookup, stores, open_nested)) for r, p in ranks]
            per_file = reads
            read = reads[0][1]
            tensors, objects, copies = _union(reads)
            metadata_name, problems = RANK_METADATA, _missing_rank_metadata(root, reads)
            zstd_records = frozenset().union(*(r.compressed_all for _, r in reads))
        tensors, serialization = _locate_safetensors(root, tensors, stores)
    for t in tensors:
        # No file holds 2**63 bytes: a larger claim is damage, refused before any size is
        # computed or printed from it (sizes past a float's range cannot be formatted).
        if math.prod(t.shape) * t.dtype.itemsize > torchsave.MAX_INT:
            raise InputError(f"{root / metadata_name}: tensor '{t.name}' claims shape "
                             f"{list(t.shape)[:8]}, more than 2**63 bytes; corrupt")
    names = sorted({f for t in tensors for f in t.files}
                   | {o.file for o in objects if o.file is not None})
    ranks_of = {rank_of(f) for f in names}
    # Copies of objects are read too (check_copies): every compressed record is listed.
    compressed = zstd_records & frozenset((o.file, o.offset) for o in objects if o.file)
    if copies:
        compressed |= zstd_records & frozenset(
            (c.other.file, c.other.offset) for c in copies
            if isinstance(c.other, ObjectEntry) and c.other.file)
    any_zstd = bool(zstd_records)
    return CheckpointInfo(
        format=NAME, root=root, tensors=tuple(tensors), objects=tuple(objects),
        files=tuple(DataFile(f, file_size(root / f)) for f in names),
        metadata_name=metadata_name, sharded=True,
        num_ranks=None if None in ranks_of else len(ranks_of),
        problems=tuple(problems) + tuple(p for _, r in per_file for p in r.nested.problems),
        values={k: v for _, r in per_file for k, v in r.nested.values.items()},
        stray=tuple(_stray_files(root, set(names))),
        version=read.version,
        storage={"serialization": serialization,
                 "compression": zstd.NAME if any_zstd else None,
                 "metadata": "rank-local" if ranks else "global"},
        detail=Detail(compressed, tuple(copies), _nested(per_file)))


def _nested(reads: list[tuple[int, _Read]]) -> Nested | None:
    records = [rec for _, r in reads for rec in r.nested.records]
    return Nested(records) if records else None


@dataclass
class _Read:
    """One metadata file, converted."""

    path: Path
    tensors: list[Tensor]
    objects: list[ObjectEntry]
    version: str | None
    compressed_all: frozenset[tuple[str, int]]  # (file, offset) of every compressed record
    nested: Nested  # records of an unflattened save, opened


def _read_one(root: Path, md_path: Path, lookup: Lookup | None = None,
              stores: Stores = LOCAL, open_nested: bool = True) -> _Read:
    # Columns first (millions of chunks without an object each); anything it does not
    # recognise with certainty is read by the allow-list unpickler, which decides.
    fast = dcp_metadata.read(md_path, lookup or _metadata_global, metadata_file=METADATA_FILE)
    if fast is not None:
        return _Read(md_path, fast.tensors, fast.objects, fast.version, frozenset(), Nested())
    return _read_unpickled(root, md_path, lookup, stores, open_nested)


def _read_unpickled(root: Path, md_path: Path, lookup: Lookup | None = None,
                    stores: Stores = LOCAL, open_nested: bool = True) -> _Read:
    md = read_metadata_object(md_path, lookup)
    if type(md).__name__ != "Metadata" or not isinstance(md, torchsave.PlainStub):
        raise InputError(f"{md_path}: does not hold DCP Metadata (found {type(md).__name__})")
    try:
        return _convert(root, md_path, md, stores, open_nested)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
        raise InputError(f"{md_path}: corrupt metadata ({type(e).__name__}: {e}); copy it "
                         "again from the source") from e


def _convert(root: Path, md_path: Path, md: torchsave.PlainStub, stores: Stores,
             open_nested: bool = True) -> _Read:
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

    storage, compressed = _storage(md_path, storage_data)
    # Every chunk has a storage record of its own: a .metadata that lists more chunks than
    # records (one chunk object repeated millions of times costs a few bytes each) is refused
    # before any per-chunk work, which stays bounded by what the files hold.
    claimed = sum(len(chunks) for e in sd_meta.values()
                  if isinstance(e, torchsave.PlainStub)
                  and isinstance(chunks := e.field("chunks"), (list, tuple)))
    if claimed > len(storage):
        raise InputError(f"{md_path}: lists {claimed:,} tensor chunks but {len(storage):,} "
                         "storage records; corrupt .metadata, copy it again from the source")

    tensors: list[Tensor] = []
    objects: list[ObjectEntry] = []
    for fqn, entry in sd_meta.items():
        fqn = str(fqn)
        path = _planner_path(planner_data.get(fqn), fqn)
        kind = type(entry).__name__
        if kind == "TensorStorageMetadata":
            tensors.append(_tensor_entry(md_path, fqn, path, entry, storage, compressed))
        elif kind == "BytesStorageMetadata":
            stored = storage.get((fqn, None))
            if stored is None:
                raise InputError(
                    f"{md_path}: entry '{fqn}' has no storage record; the checkpoint is incomplete"
                )
            objects.append(ObjectEntry(fqn, path, *stored))
        else:
            raise UnsupportedError(f"{md_path}: entry '{fqn}' has unknown kind '{kind}'")

    nested = Nested()
    if open_nested and not md.field("planner_data"):
        # Saved without flattening (DefaultSavePlanner(flatten_state_dict=False)): every
        # top-level value is one record, and a nested dict of tensors is pickled whole in it.
        objects = _open_nested(root, md_path, objects, tensors, nested, stores)
    version = md.field("version")
    return _Read(md_path, tensors, objects, None if version is None else str(version),
                 compressed, nested)


@dataclass
class Nested:
    """Records of a checkpoint saved without flattening whose pickles were opened
    (``CheckpointInfo.detail``): their tensors became tensors of the checkpoint."""

    records: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)  # their other leaves
    problems: list[Problem] = dataclasses.field(default_factory=list)


def _open_nested(root: Path, md_path: Path, objects: list[ObjectEntry], tensors: list[Tensor],
                 nested: Nested, stores: Stores) -> list[ObjectEntry]:
    """Open the records of ``objects`` that hold tensors: each tensor becomes a tensor of the
    checkpoint, placed in its record's storage entry (a raw byte range with that entry's
    CRC-32), each other leaf an object read already. A record holding DTensors (one rank's
    shards, pickled whole) cannot be placed: a problem says why. Returns the objects left."""
    kept: list[ObjectEntry] = []
    for o in objects:
        path = root / (o.file or "")
        if o.file is None or not path.is_file():
            kept.append(o)  # a missing file is a structure problem
            continue
        where = f"{path} at byte {o.offset} (entry '{o.name}')"
        # Through the store's pread: a remote checkpoint's data file is read by ranged GETs.
        # Only a file really inside the checkpoint, as the data files a store reads.
        with pread_of(path, stores, inside=os.path.realpath(root)) as pread:
            try:
                rb = archive.RecordBytes(pread, o.offset, o.length, where)
                entries = archive.zip_entries(rb)
                value = torchsave.load_pickle(rb, entries, max_nodes=torchsave.MAX_NODES)
            except torchsave.Refused:
                rb = archive.RecordBytes(pread, o.offset, o.length, where)
                pkl = archive.zip_entries(rb)["data.pkl"]
                named = torchsave.named_globals(rb.read(pkl.data_offset, pkl.size))
                dist = next((n for n in named if n.startswith("torch.distributed.")), None)
                if dist is not None:
                    nested.problems.append(error(
                        "tensors-unplaced",
                        f"{md_path}: entry '{o.name}' holds distributed tensors ('{dist}') "
                        "pickled whole by one rank: the checkpoint was saved without "
                        "flattening (DefaultSavePlanner(flatten_state_dict=False)), so only one "
                        "rank's shards were written and the others' are not in it; save it "
                        "again with the default planner (flatten_state_dict=True)",
                        file=o.file, offset=o.offset))
                kept.append(o)
                continue
            except (InputError, UnsupportedError, torchsave.TooComplex) + torchsave.PICKLE_ERRORS:
                kept.append(o)  # damaged: verify reports its CRCs, merge its structure
                continue
        if not torchsave.has_tensor(value):
            kept.append(o)
            continue
        nested.records.append((o.file, o.offset, o.length))
        for key_path, leaf in torchsave.flatten(value, path=o.path):
            name = ".".join(key_path)
            if not isinstance(leaf, torchsave.TensorRef):
                kept.append(ObjectEntry(name, key_path))
                nested.values[name] = _plain(leaf)
                continue
            tensors.append(_nested_tensor(md_path, o, name, key_path, leaf, entries))
    return kept


def _nested_tensor(md_path: Path, o: ObjectEntry, name: str, key_path: tuple[str, ...],
                   ref: torchsave.TensorRef, entries: dict[str, archive.ZipEntry]) -> Tensor:
    assert o.file is not None
    data = entries.get(f"data/{ref.storage.key}")
    n = math.prod(ref.shape) * ref.dtype.itemsize
    start = ref.storage_offset * ref.dtype.itemsize
    contiguous = ref.stride == torchsave.contiguous_strides(ref.shape) or math.prod(ref.shape) <= 1
    if data is None or start + n > data.size:
        raise InputError(f"{md_path}: tensor '{name}' in entry '{o.name}' reaches past its "
                         "storage; corrupt")
    if not contiguous:
        raise UnsupportedError(f"{md_path}: tensor '{name}' in entry '{o.name}' is a strided "
                               "view; ckpttool reads contiguous tensors of unflattened records")
    at = o.offset + data.data_offset
    chunk = Chunk((0,) * len(ref.shape), ref.shape, o.file, at + start, n, RAW,
                  crc32=data.crc32, crc_span=(at, data.size))
    return Tensor(name, key_path, ref.dtype, ref.shape, (chunk,))


def _storage(md_path: Path, storage_data: dict[Any, Any]
             ) -> tuple[dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
                        frozenset[tuple[str, int]]]:
    """``storage_data`` as (fqn, chunk offsets) -> (file, byte offset, byte length), and the
    (file, offset) of every record stored zstd-compressed.

    Checked in bulk (types, integers, file names once per file): a million entries cost a few
    C-level passes, not a million Python-level checks each.
    """
    where = str(md_path)
    keys, infos = list(storage_data), list(storage_data.values())
    if (set(map(type, infos)) - {_STORAGE_INFO}) or (set(map(type, keys)) - {_METADATA_INDEX}):
        bad = next(v for k, v in zip(keys, infos, strict=True)
                   if type(v) is not _STORAGE_INFO or type(k) is not _METADATA_INDEX)
        raise UnsupportedError(
            f"{md_path}: storage entries of type '{type(bad).__name__}' are not supported "
            "(this reads checkpoints written by torch.distributed.checkpoint.FileSystemWriter)")
    ks = [k.__dict__ for k in keys]
    vs = [v.__dict__ for v in infos]
    fqns = [k.get("fqn") for k in ks]
    if set(map(type, fqns)) - {str}:
        raise InputError(f"{md_path}: a storage entry has no name; corrupt .metadata")
    rels = [str(v.get("relative_path")) for v in vs]
    safe = {rel: _safe_relative(md_path, rel) for rel in set(rels)}
    offsets = [k.get("offset") for k in ks]
    torchsave.all_ints([o for o in offsets if o is not None], where)
    begins = [v.get("offset") for v in vs]
    lengths = [v.get("length") for v in vs]
    ranges = begins + lengths
    if ranges and (set(map(type, ranges)) - {int} or min(ranges) < 0):
        i = next(i for i, (b, n) in enumerate(zip(begins, lengths, strict=True))
                 if type(b) is not int or type(n) is not int or b < 0 or n < 0)
        raise InputError(f"{md_path}: entry '{fqns[i]}' has the byte range "
                         f"({begins[i]!r}, {lengths[i]!r}), not two non-negative integers; "
                         "corrupt .metadata")
    compressed = _transforms(md_path, fqns, vs, rels, begins)
    return ({(fqn, off): (safe[rel], b, n)
             for fqn, off, rel, b, n in zip(fqns, offsets, rels, begins, lengths, strict=True)},
            compressed)


def _transforms(md_path: Path, fqns: list[str], vs: list[dict[str, Any]], rels: list[str],
                begins: list[int]) -> frozenset[tuple[str, int]]:
    """The (file, offset) of the records stored through DCP's stream extensions (zstd only:
    anything else is refused by name)."""
    descriptors = [v.get("transform_descriptors") for v in vs]
    kinds = {tuple(d) if isinstance(d, (list, tuple)) else d for d in descriptors if d}
    if not kinds:
        return frozenset()
    for kind in kinds:
        if not (isinstance(kind, tuple) and len(kind) == 1 and isinstance(kind[0], str)
                and zstd.supported(kind[0])):
            i = next(i for i, d in enumerate(descriptors)
                     if d and (tuple(d) if isinstance(d, (list, tuple)) else d) == kind)
            shown = list(kind) if isinstance(kind, tuple) else kind
            raise UnsupportedError(
                f"{md_path}: entry '{fqns[i]}' is stored with transforms {shown!r}; ckpttool "
                f"reads DCP's ZStandard extension ({zstd.DESCRIPTOR}/1) only")
    return frozenset((rel, b) for d, rel, b in zip(descriptors, rels, begins, strict=True) if d)


def _tensor_entry(
    md_path: Path,
    fqn: str,
    path: tuple[str, ...],
    entry: torchsave.PlainStub,
    storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
    compressed: frozenset[tuple[str, int]],
) -> Tensor:
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
    here = str(md_path)
    shape = torchsave.ints(entry.field("size") or (), here)
    found = entry.field("chunks") or ()
    if not isinstance(found, (list, tuple)) or set(map(type, found)) - {_CHUNK_METADATA}:
        raise InputError(f"{md_path}: tensor '{fqn}' has chunks that are not chunk "
                         "metadata; corrupt .metadata")
    ds = [c.__dict__ for c in found]
    offsets = [d.get("offsets") for d in ds]
    sizes = [d.get("sizes") for d in ds]
    torchsave.all_ints(offsets + sizes, here)
    chunks = []
    for o, size in zip(offsets, sizes, strict=True):
        stored = storage.get((fqn, o))
        if stored is None:
            raise InputError(
                f"{md_path}: chunk of '{fqn}' at offsets {list(o)} has no storage record; "
                "the checkpoint is incomplete"
            )
        encoding = ZSTD_RECORD if compressed and stored[:2] in compressed else RECORD
        chunks.append(Chunk(o, size, *stored, encoding))
    return Tensor(fqn, path, dtype, shape, tuple(chunks))


# --------------------------------------------------------------------------------------------
# SerializationFormat.SAFETENSORS: chunks placed by the blob's header


def _locate_safetensors(root: Path, tensors: list[Tensor], stores: Stores
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
             if file_size(root / f) is not None}
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
                ) -> tuple[dict[str, st.Slot], dict[str, Any]]:
    """The blob's slots by name, and each name's ``saved_offsets``."""
    meta, slots = st.read_layout(path, offset=offset, stores=stores)
    raw = meta.get(SHARDING_KEY)
    try:
        sharding = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        sharding = None
    if not isinstance(sharding, dict):
        raise InputError(f"{path} at byte {offset}: safetensors blob without readable "
                         f"{SHARDING_KEY} offsets; corrupt")
    return {s.name: s for s in slots}, sharding


def _blob_chunk(root: Path, t: Tensor, c: Chunk, slots: dict[str, st.Slot],
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


# --------------------------------------------------------------------------------------------
# use_collectives=False: the union of every rank's metadata


def _union(reads: list[tuple[int, _Read]]
           ) -> tuple[list[Tensor], list[ObjectEntry], list[Copy]]:
    """Every rank's tensors and objects once: a chunk (same offsets and sizes) or object that
    several ranks stored is kept from the lowest rank, the others listed as copies."""
    Box = tuple[tuple[int, ...], tuple[int, ...]]
    tensors: dict[str, tuple[Tensor, dict[Box, tuple[Chunk, str]], str]] = {}
    objects: dict[str, tuple[ObjectEntry, str]] = {}
    copies: list[Copy] = []
    for _, read in reads:
        here = read.path.name
        for t in read.tensors:
            have = tensors.get(t.name)
            if have is None:
                tensors[t.name] = (t, {(c.offsets, c.sizes): (c, here) for c in t.chunks},
                                   here)
                continue
            first, chunks, there = have
            if (t.dtype, t.shape) != (first.dtype, first.shape):
                raise InputError(
                    f"{read.path}: tensor '{t.name}' is {t.dtype.name} {list(t.shape)} here "
                    f"but {first.dtype.name} {list(first.shape)} in {there}; the rank metadata "
                    "files are from different saves")
            for c in t.chunks:
                kept, listed = chunks.setdefault((c.offsets, c.sizes), (c, here))
                if kept is not c:
                    copies.append(Copy(t.name, kept, c, listed, here))
        for o in read.objects:
            kept_o, listed_o = objects.setdefault(o.name, (o, here))
            if kept_o is not o:
                copies.append(Copy(o.name, kept_o, o, listed_o, here))
    return ([dataclasses.replace(t, chunks=tuple(c for c, _ in chunks.values()))
             for t, chunks, _ in tensors.values()],
            [o for o, _ in objects.values()], copies)


def _missing_rank_metadata(root: Path, reads: list[tuple[int, _Read]]) -> list[Problem]:
    """Data files of a rank whose ``__<rank>.metadata`` is missing: its chunks are unknown."""
    have = {r for r, _ in reads}
    orphans: dict[int, list[str]] = {}
    for p in sorted(root.glob("*" + DATA_SUFFIX)):
        r = rank_of(p.name)
        if r is not None and r not in have:
            orphans.setdefault(r, []).append(p.name)
    return [error("missing-file", f"{root / f'__{r}.metadata'}: missing; rank {r}'s data "
                  f"({', '.join(files)}) is described by no metadata. Copy the checkpoint "
                  "again, with every __<rank>.metadata", file=f"__{r}.metadata")
            for r, files in sorted(orphans.items())]


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


class DcpReader(Reader):
    """Chunks are ``torch.save`` records (zstd-compressed ones included) or ranges of a
    safetensors blob; objects are pickled records."""

    def __init__(self, info: CheckpointInfo, store: Store | None = None, *,
                 templates: bool = True) -> None:
        super().__init__(info, store)
        self._templates: dict[tuple[int, str, tuple[int, ...]], Template | None] = {}
        self._use_templates = templates  # False: decode every record in full (tests compare)
        self.detail = info.detail if isinstance(info.detail, Detail) else Detail()
        # The last record each thread decompressed: payload() then read_chunk() of one chunk
        # decompress it once. One record per thread is all that is ever held.
        self._inflated = threading.local()

    def close(self) -> None:
        self._inflated = threading.local()
        super().close()

    def _pread(self, file: str) -> Callable[[int, int], bytes]:
        return functools.partial(self.store.pread, file)

    def _outside_data(self, chunk: Chunk, head: int, data_end: int
                      ) -> tuple[bytes, bytes | None]:
        """The record's bytes before and after its storage's data, in one read when small;
        and then the whole record (None when it is read in two parts)."""
        if chunk.length <= SMALL_RECORD:
            whole = self.store.pread(chunk.file, chunk.length, chunk.offset)
            if len(whole) != chunk.length:
                return b"", None
            return whole[:head] + whole[data_end:], whole
        return (self.store.pread(chunk.file, head, chunk.offset)
                + self.store.pread(chunk.file, chunk.length - data_end, chunk.offset + data_end),
                None)

    # -- zstd-compressed records

    def _inflate(self, file: str, offset: int, length: int, *, limit: int, what: str
                 ) -> bytes | bytearray:
        """The decompressed record at ``offset`` (the thread's last one, when asked again)."""
        key = (file, offset, length)
        last = getattr(self._inflated, "record", None)
        if last is not None and last[0] == key:
            return last[1]  # type: ignore[no-any-return]
        data = zstd.inflate(self._pread(file), offset, length, limit=limit,
                            where=self.where(file, offset, f"{what}, zstd-compressed record"))
        self._inflated.record = (key, data)
        return data

    def _zstd_record(self, tensor: Tensor, chunk: Chunk
                     ) -> tuple[TensorRecord, bytes | bytearray, str]:
        """A compressed chunk's record, decoded from its decompressed bytes, and those bytes;
        checked against what the metadata promises as an uncompressed record is."""
        what = f"tensor '{tensor.name}'"
        need = chunk.numel * tensor.dtype.itemsize
        where = self.where(chunk.file, chunk.offset, f"{what}, zstd-compressed record")
        # The metadata's claim, judged before any memory is taken for it.
        zstd.check_claim(need, chunk.length, where=where)
        raw = self._inflate(chunk.file, chunk.offset, chunk.length,
                            limit=need + _RECORD_OVERHEAD, what=what)
        rec = read_record(functools.partial(_slice, raw), offset=0, length=len(raw),
                          where=where)
        if rec.dtype != tensor.dtype or rec.shape != chunk.sizes:
            raise InputError(
                f"{where}: record holds {rec.dtype.name} {list(rec.shape)} but the metadata "
                f"promises {tensor.dtype.name} {list(chunk.sizes)}; the checkpoint is "
                "inconsistent")
        extent = torchsave.view_extent(rec.shape, rec.stride, rec.storage_offset,
                                       contiguous=rec.is_contiguous) * rec.dtype.itemsize
        if math.prod(rec.shape) and extent > rec.data_size:
            raise InputError(f"{where}: record's storage is smaller than its tensor; corrupt")
        return rec, raw, where

    def read_chunk(self, tensor: Tensor, chunk: Chunk) -> bytes:
        if chunk.encoding != ZSTD_RECORD:
            return super().read_chunk(tensor, chunk)
        rec, raw, where = self._zstd_record(tensor, chunk)
        storage = memoryview(raw)[rec.data_offset : rec.data_offset + rec.data_size]
        # Nothing else checks a compressed record (its zstd frame has no checksum), and it is
        # decompressed anyway: the archive's CRC-32 of the storage costs little more.
        crc = zlib.crc32(storage)
        if rec.crc32 is not None and crc != rec.crc32:
            raise InputError(f"{where}: CRC-32 of the decompressed storage is {crc:08x} but "
                             f"the record says {rec.crc32:08x}; the record is damaged. Copy "
                             "the checkpoint again from a good source")
        item = tensor.dtype.itemsize
        if rec.is_contiguous:
            start = rec.storage_offset * item
            return bytes(storage[start : start + chunk.numel * item])
        return torchsave.gather_strided(bytes(storage), itemsize=item, shape=chunk.sizes,
                                        stride=rec.stride, storage_offset=rec.storage_offset)

    def _zstd_payload(self, tensor: Tensor, chunk: Chunk, checksums: bool) -> Payload:
        rec, raw, _ = self._zstd_record(tensor, chunk)
        side = tuple(Checksummed(chunk.file, chunk.offset, e.size, e.crc32,
                                 f"record entry '{e.name}', decompressed",
                                 bytes(raw[e.data_offset : e.data_offset + e.size]))
                     for e in rec.entries) if checksums else ()
        return Payload(chunk.file, chunk.offset, chunk.length, None, None, stride=rec.stride,
                       view_offset=rec.storage_offset, side=side, compression=zstd.NAME)

    def _object_bytes(self, entry: ObjectEntry) -> tuple[Callable[[int, int], bytes],
                                                          ObjectEntry]:
        """``pread`` over the entry's record and the entry relative to it (decompressed for
        a compressed record)."""
        assert entry.file is not None
        if (entry.file, entry.offset) not in self.detail.compressed_objects:
            return self._pread(entry.file), entry
        raw = self._inflate(entry.file, entry.offset, entry.length, limit=_OBJECT_LIMIT,
                            what=f"entry '{entry.name}'")
        return (functools.partial(_slice, raw),
                dataclasses.replace(entry, offset=0, length=len(raw)))

    # -- chunks

    def _decode(self, tensor: Tensor, chunk: Chunk, checksums: bool = False,
                whole: bytes | None = None) -> Payload:
        """``whole``: the record's bytes, when the caller read them already (:meth:`payloads`)."""
        if chunk.encoding == ZSTD_RECORD:
            return self._zstd_payload(tensor, chunk, checksums)
        if chunk.encoding != RECORD:
            return super()._decode(tensor, chunk, checksums)
        key = (chunk.length, tensor.dtype.name, chunk.sizes)
        template = self._templates.get(key) if self._use_templates else None
        if template is not None:
            if whole is not None:  # read with its neighbours: compared in place
                p = template.decode_whole(chunk, whole, checksums)
                if p is not None:
                    return p
            else:
                raw, whole = self._outside_data(chunk, template.head, template.data_end)
                if template.matches(raw):
                    crcs = template.crcs(raw)
                    return payload_of(chunk, template.rec, crcs[0],
                                    zip(template.side, crcs[1:],
                                        (raw[s] for s in template.side_slices), strict=True)
                                    if checksums else (),
                                    None if whole is None
                                    else memoryview(whole)[template.head:template.data_end])
        where = self.where(chunk.file, chunk.offset, f"tensor '{tensor.name}'")
        rec = read_record(self._pread(chunk.file), offset=chunk.offset, length=chunk.length,
                          where=where)
        if rec.dtype != tensor.dtype or rec.shape != chunk.sizes:
            raise InputError(
                f"{where}: record holds {rec.dtype.name} {list(rec.shape)} but .metadata "
                f"promises {tensor.dtype.name} {list(chunk.sizes)}; the checkpoint is inconsistent"
            )
        need = torchsave.view_extent(rec.shape, rec.stride, rec.storage_offset,
                                     contiguous=rec.is_contiguous) * rec.dtype.itemsize
        if math.prod(rec.shape) and need > rec.data_size:
            raise InputError(f"{where}: record's storage is smaller than its tensor; corrupt")
        relative = dataclasses.replace(rec, data_offset=rec.data_offset - chunk.offset)
        data = next(e for e in rec.entries if e.data_offset == relative.data_offset)
        if self._use_templates and key not in self._templates:
            self._templates[key] = (Template(relative, self._outside_data(
                chunk, data.data_offset, data.data_offset + data.size)[0], chunk.length, data)
                if data.crc_fields else None)
        return payload_of(chunk, relative, rec.crc32,
                        ((e, e.crc32, None) for e in rec.entries if e is not data)
                        if checksums else ())

    def payloads(self, items: Sequence[tuple[Tensor, Chunk]], *, checksums: bool = False
                 ) -> Iterator[Payload]:
        """Records that lie back to back in one file (as a writer leaves them, and as a
        caller that sorts by file and offset asks for them) are read together, in one read
        of up to ``SPAN`` bytes, and decoded from memory with their stored bytes."""
        i, n = 0, len(items)
        while i < n:
            first = items[i][1]
            if first.encoding != RECORD or first.length > SMALL_RECORD:
                yield self._decode(items[i][0], first, checksums)
                i += 1
                continue
            j, end = i + 1, first.end
            while j < n:
                c = items[j][1]
                if (c.offset != end or c.file != first.file or c.encoding != RECORD
                        or c.length > SMALL_RECORD or c.end - first.offset > SPAN):
                    break
                end = c.end
                j += 1
            span = self.store.pread(first.file, end - first.offset, first.offset)
            templates = self._templates if self._use_templates else {}
            for t, c in items[i:j]:
                at = c.offset - first.offset
                if at + c.length > len(span):
                    # A short read (a truncated file): decoded alone, which says where it ends.
                    yield self._decode(t, c, checksums)
                    continue
                whole = span[at : at + c.length]
                template = templates.get((c.length, t.dtype.name, c.sizes))
                p = template.decode_whole(c, whole, checksums) if template is not None else None
                yield p if p is not None else self._decode(t, c, checksums, whole)
            i = j

    def elements(self, items: Sequence[tuple[Tensor, int]]) -> Iterator[memoryview | None]:
        """Chunks of column tables (a ``.metadata`` of many chunks) whose records lie back to
        back are read together, as in :meth:`payloads`, and each record that matches its
        template hands over its elements, located by the template: no Chunk or Payload is
        built. None for any other chunk (a record with no template yet, or not matching it,
        a strided view, a compressed or large record): the caller reads it the usual way,
        which decodes it in full (and makes the template)."""
        for got in self._from_templates(items, checksums=False):
            yield None if got is None else got[0]

    def checked_elements(self, items: Sequence[tuple[Tensor, int]]
                         ) -> Iterator[tuple[memoryview, int] | None]:
        return self._from_templates(items, checksums=True)

    def _from_templates(self, items: Sequence[tuple[Tensor, int]], *, checksums: bool
                        ) -> Iterator[tuple[memoryview, int] | None]:
        """(elements, bytes checked) per item, as :meth:`elements` and
        :meth:`checked_elements` say."""
        templates = self._templates if self._use_templates else {}
        i, n = 0, len(items)
        while i < n:
            t, k = items[i]
            cols = t.chunks
            g = cols.first + k if isinstance(cols, ChunkColumns) else 0
            if not isinstance(cols, ChunkColumns) or cols.table.encoding != RECORD or \
                    cols.table.length[g] > SMALL_RECORD:
                yield None
                i += 1
                continue
            table = cols.table
            file_col, offset_col, length_col = table.file, table.offset, table.length
            file, start = file_col[g], offset_col[g]
            end = start + length_col[g]
            j = i + 1
            while j < n:  # the run of back-to-back records in this table and file
                t2, k2 = items[j]
                c2 = t2.chunks
                if not isinstance(c2, ChunkColumns) or c2.table is not table:
                    break
                g2 = c2.first + k2
                if file_col[g2] != file or offset_col[g2] != end or \
                        length_col[g2] > SMALL_RECORD or end + length_col[g2] - start > SPAN:
                    break
                end += length_col[g2]
                j += 1
            span = self.store.pread(table.names[file], end - start, start)
            for t2, k2 in items[i:j]:
                c2 = t2.chunks
                assert isinstance(c2, ChunkColumns)
                g2, nd = c2.first + k2, c2.ndim
                at, length = offset_col[g2] - start, length_col[g2]
                b = c2.box + 2 * nd * k2 + nd
                sizes = tuple(table.boxes[b : b + nd])
                template = templates.get((length, t2.dtype.name, sizes))
                if template is None or template.start is None or at + length > len(span):
                    yield None
                    continue
                whole = span[at : at + length]
                if not template.matches_whole(whole):
                    yield None
                    continue
                first = template.head + template.start
                elements = memoryview(whole)[first : first + math.prod(sizes)
                                             * t2.dtype.itemsize]
                if not checksums:
                    yield elements, 0
                    continue
                checked = template.checked(whole)
                yield None if checked is None else (elements, checked)
            i = j

    def fill_rows(self, tensors: Sequence[Tensor], out: bytearray, dsts: Sequence[int], *,
                  checksums: bool = False) -> list[int | None]:
        # Object storage reads the ranges a merge planned, ahead (formats/remote.py): the
        # chunk by chunk path asks for exactly those.
        if not self._use_templates or self.capabilities.many_ranges:
            return [None] * len(tensors)
        return fill_rows(tensors, out, dsts, checksums=checksums, templates=self._templates,
                         pread=self.store.pread, readinto=self.store.readinto,
                         decode=self._decode)

    def other_checksums(self) -> tuple[list[Checksummed], list[Problem]]:
        """The entries of every non-tensor record (their pickles) whose file holds them, and
        every copy of a replicated chunk or record that another rank stored too."""
        sums: list[Checksummed] = []
        problems: list[Problem] = []
        nested = self.detail.nested
        if nested is not None and nested.records:
            covered = {(c.file, c.crc_span[0]) for t in self.info.tensors for c in t.chunks
                       if c.crc_span is not None}
            for file, offset, length in nested.records:
                where = self.where(file, offset, "a record of nested values")
                try:
                    entries = record_entries(self._pread(file), offset=offset, length=length,
                                             where=where)
                except InputError as e:
                    problems.append(error("record-corrupt", str(e), file=file, offset=offset))
                    continue
                sums += [Checksummed(file, e.data_offset, e.size, e.crc32,
                                     f"record entry '{e.name}'") for e in entries
                         if (file, e.data_offset) not in covered]
        objects = list(self.info.objects) + [c.other for c in self.detail.copies
                                             if isinstance(c.other, ObjectEntry)]
        for o in objects:
            if o.file is None or not self._present(o.file, o.offset + o.length):
                continue  # missing or truncated: a structure problem already
            where = self.where(o.file, o.offset, f"entry '{o.name}'")
            try:
                pread, rel = self._object_bytes(o)
                entries = record_entries(pread, offset=rel.offset, length=rel.length,
                                         where=where)
            except InputError as e:
                problems.append(error("record-corrupt", str(e), file=o.file, offset=o.offset))
                continue
            if rel is o:
                sums += [Checksummed(o.file, e.data_offset, e.size, e.crc32,
                                     f"record entry '{e.name}'") for e in entries]
            else:
                sums += [Checksummed(o.file, o.offset, e.size, e.crc32,
                                     f"record entry '{e.name}', decompressed",
                                     pread(e.size, e.data_offset)) for e in entries]
        tensors = {t.name: t for t in self.info.tensors} if self.detail.copies else {}
        for copy in self.detail.copies:
            c = copy.other
            if not isinstance(c, Chunk) or not self._present(c.file, c.end):
                continue
            t = tensors[copy.name]
            try:
                p = self.payload(t, c, checksums=True)
            except InputError as e:
                problems.append(error("record-corrupt", str(e), file=c.file, tensor=t.name,
                                      offset=c.offset))
                continue
            sums += p.side
            if p.crc32 is not None:
                sums.append(Checksummed(c.file, p.storage_offset, p.storage_size, p.crc32,
                                        f"tensor '{t.name}', the copy listed in "
                                        f"{copy.other_from}"))
        return sums, problems

    def _present(self, file: str, end: int) -> bool:
        size = self._sizes.get(file)
        return size is not None and end <= size

    @functools.cached_property
    def _sizes(self) -> dict[str, int | None]:
        return {f.name: f.size for f in self.info.files}

    def check_copies(self) -> list[Problem]:
        """Each chunk (and non-tensor record) several ranks stored against the copy the
        checkpoint uses, byte for byte, in blocks."""
        problems: list[Problem] = []
        tensors = {t.name: t for t in self.info.tensors} if self.detail.copies else {}
        for copy in self.detail.copies:
            kept, other = copy.kept, copy.other
            ends = [(x.file, x.end if isinstance(x, Chunk) else x.offset + x.length)
                    for x in (kept, other)]
            if not all(f is not None and self._present(f, e) for f, e in ends):
                continue  # missing or truncated: a structure problem already
            try:
                if isinstance(kept, Chunk) and isinstance(other, Chunk):
                    at = _first_difference(self._chunk_blocks(tensors[copy.name], kept),
                                           self._chunk_blocks(tensors[copy.name], other))
                    what = f"tensor '{copy.name}', chunk at offsets {list(kept.offsets)}"
                else:
                    assert isinstance(kept, ObjectEntry) and isinstance(other, ObjectEntry)
                    at = self._object_difference(kept, other)
                    what = f"entry '{copy.name}'"
            except InputError as e:  # a damaged copy: verify's CRCs name it too
                problems.append(error("record-corrupt", str(e), file=other.file,
                                      tensor=copy.name, offset=other.offset))
                continue
            if at is None:
                continue
            problems.append(error(
                "copy-differs",
                f"{self.info.root}: {what} is stored by several ranks, and the copies differ "
                f"(from byte {at}): {other.file} at byte {other.offset} (listed in "
                f"{copy.other_from}) and {kept.file} at byte {kept.offset} (listed in "
                f"{copy.kept_from}). The ranks saved different values without coordination "
                "(dcp.save(use_collectives=False)) or a copy is damaged; ckpttool verify "
                "names damaged records",
                file=other.file, tensor=copy.name, offset=other.offset))
        return problems

    def _chunk_blocks(self, tensor: Tensor, chunk: Chunk) -> Iterator[bytes]:
        """The chunk's elements in C order, in blocks of ``_COMPARE_BLOCK`` bytes."""
        n = chunk.numel * tensor.dtype.itemsize
        p = self.payload(tensor, chunk)
        if p.start is not None:
            for at in range(0, n, _COMPARE_BLOCK):
                yield self.store.read_exact(p.file, p.start + at, min(_COMPARE_BLOCK, n - at),
                                            what=f"tensor '{tensor.name}'")
            return
        data = self.read_chunk(tensor, chunk)  # a compressed record or a strided view
        for at in range(0, n, _COMPARE_BLOCK):
            yield data[at : at + _COMPARE_BLOCK]

    def _object_difference(self, kept: ObjectEntry, other: ObjectEntry) -> int | None:
        """Where two copies of a non-tensor record first differ (None: they do not). A record
        is compared decompressed, whole (records of non-tensor entries are small)."""
        def record(o: ObjectEntry) -> bytes:
            pread, rel = self._object_bytes(o)
            return pread(rel.length, rel.offset)

        return _first_difference(iter([record(kept)]), iter([record(other)]))

    def read_object(self, entry: ObjectEntry) -> Any:
        if entry.file is None:
            return super().read_object(entry)
        where = self.where(entry.file, entry.offset, f"entry '{entry.name}'")
        pread, rel = self._object_bytes(entry)
        return read_object(pread, rel, where=where)

    def object_record(self, entry: ObjectEntry) -> bytes | None:
        if entry.file is None:
            return None
        if (entry.file, entry.offset) in self.detail.compressed_objects:
            pread, rel = self._object_bytes(entry)
            return pread(rel.length, rel.offset)  # a DCP writer stores it uncompressed
        return self.store.read_exact(entry.file, entry.offset, entry.length,
                                     what=f"entry '{entry.name}'")


# Bytes of two copies compared at a time.
_COMPARE_BLOCK = 16 << 20


def _slice(data: bytes | bytearray, size: int, offset: int) -> bytes:
    """``pread(size, offset)`` over bytes in memory."""
    return bytes(memoryview(data)[offset : offset + size])


def _first_difference(a: Iterator[bytes], b: Iterator[bytes]) -> int | None:
    """The first byte at which two equally cut block streams differ; None if they do not."""
    done = 0
    for x, y in itertools.zip_longest(a, b):
        if x is None or y is None:
            return done
        if x != y:
            return done + next((i for i, (u, v) in enumerate(zip(x, y, strict=False))
                                if u != v), min(len(x), len(y)))
        done += len(x)
    return None


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> DcpReader:
    return DcpReader(info, store)


_DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def rank_of(file: str) -> int | None:
    """The rank that wrote ``__<rank>_<n>.distcp``; None for other names."""
    m = _DATA_FILE_RE.match(Path(file).name)
    return int(m.group(1)) if m else None


def _stray_files(root: Path, referenced: set[str]) -> list[str]:
    """``.distcp`` files in the directory that ``.metadata`` never references (left over from
    another save, or a sign that ``.metadata`` is from a different save)."""
    return sorted(p.name for p in root.glob("*" + DATA_SUFFIX)
                  if p.name not in referenced and p.is_file())


