"""A DCP checkpoint's ``.metadata`` (or its ``__<rank>.metadata`` files): the allow-list
unpickler onto inert stand-ins, the conversion into the neutral model (tensors, chunks,
non-tensor records, nested saves), the union of rank-local files, and the file names
DCP writes. :mod:`ckpttool.formats.dcp.columns` is the fast path that must agree with it."""


from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, InputError, UnsupportedError
from ckpttool.formats.base import (
    RAW,
    RECORD,
    Chunk,
    ObjectEntry,
    Problem,
    Tensor,
    error,
)
from ckpttool.formats.codecs import archive, policy, torchsave, zstd
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.formats.dcp import columns
from ckpttool.formats.dcp.records import plain as _plain
from ckpttool.storage import sidefiles
from ckpttool.storage.store import LOCAL, Stores, pread_of

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
# Stacked ZStandard extensions read (each layer bounds the next: see DcpReader._inflate).
MAX_ZSTD_LAYERS = 4
# A chunk's record compressed by DCP's ZStandard extension (one zstd frame of a RECORD).
ZSTD_RECORD = "torch-record-zstd"
RANK_METADATA = "the __<rank>.metadata files"  # CheckpointInfo.metadata_name, rank-local
SHARDING_KEY = "DCP_SHARDING_INFO"  # in a SAFETENSORS blob's __metadata__


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
    zstd_layers: int = 1  # ZStandard extensions stacked on each compressed record


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


def allowed_global(module: str, name: str) -> Any | None:
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


def _unpickle(data: bytes, lookup: Callable[[str, str], Any | None]) -> Any:
    try:
        return torchsave.AllowListUnpickler(io.BytesIO(data), lookup).load_deep(len(data))
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


def read_metadata_object(path: Path, lookup: Lookup | None = None,
                         stores: Stores = LOCAL) -> Any:
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
        with stores.side_file(path, columns.METADATA_KIND) as f:
            data = sidefiles.read_file(f, path, columns.METADATA_KIND)
    except FileNotFoundError as err:
        raise InputError(f"{path}: no such file") from err
    except MemoryError as e:
        raise InputError(f"{path}: {stores.file_size(path) or 0:,} bytes, more than this process "
                         "may hold in memory; a .metadata that large is corrupt, or needs a "
                         "machine with more memory") from e
    try:
        return _unpickle(data, lookup or allowed_global)
    except torchsave.Refused as e:
        raise _refusal(path, e, data, lookup or allowed_global) from e
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
              if allowed_global(*g.rsplit(".", 1)) is None] or [refused.qualname]
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


RANK_METADATA_RE = re.compile(r"^__(\d+)\.metadata$")


def rank_metadata_files(root: Path, names: Iterable[str]) -> list[tuple[int, Path]]:
    """``__<rank>.metadata`` files (``dcp.save(use_collectives=False)``), by rank, of the
    names in ``root`` (its listing)."""
    found = []
    for name in names:
        m = RANK_METADATA_RE.match(name)
        if m:
            found.append((int(m.group(1)), root / name))
    return sorted(found)


def nested_records(reads: list[tuple[int, _Read]]) -> Nested | None:
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
    zstd_layers: int = 1  # ZStandard extensions stacked on each compressed record


def read_one(root: Path, md_path: Path, lookup: Lookup | None = None,
              stores: Stores = LOCAL, open_nested: bool = True) -> _Read:
    # Columns first (millions of chunks without an object each); anything it does not
    # recognise with certainty is read by the allow-list unpickler, which decides.
    fast = columns.read(md_path, lookup or allowed_global, metadata_file=METADATA_FILE,
                        stores=stores)
    if fast is not None:
        return _Read(md_path, fast.tensors, fast.objects, fast.version, frozenset(), Nested())
    return _read_unpickled(root, md_path, lookup, stores, open_nested)


def _read_unpickled(root: Path, md_path: Path, lookup: Lookup | None = None,
                    stores: Stores = LOCAL, open_nested: bool = True) -> _Read:
    md = read_metadata_object(md_path, lookup, stores)
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

    storage, compressed, layers = _storage(md_path, storage_data)
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
                 compressed, nested, layers)


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
        if o.file is None or stores.file_size(path) is None:
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
                        frozenset[tuple[str, int]], int]:
    """``storage_data`` as (fqn, chunk offsets) -> (file, byte offset, byte length), the
    (file, offset) of every record stored zstd-compressed, and how many times each is.

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
    compressed, layers = _transforms(md_path, fqns, vs, rels, begins)
    return ({(fqn, off): (safe[rel], b, n)
             for fqn, off, rel, b, n in zip(fqns, offsets, rels, begins, lengths, strict=True)},
            compressed, layers)


def _transforms(md_path: Path, fqns: list[str], vs: list[dict[str, Any]], rels: list[str],
                begins: list[int]) -> tuple[frozenset[tuple[str, int]], int]:
    """The (file, offset) of the records stored through DCP's stream extensions, and how many
    ZStandard extensions each went through (``_extensions=[ZStandard(), ZStandard()]``
    compresses every record twice, which torch reads): zstd only, the same number for every
    record, at most :data:`MAX_ZSTD_LAYERS`; anything else is refused by name."""
    descriptors = [v.get("transform_descriptors") for v in vs]
    kinds = {tuple(d) if isinstance(d, (list, tuple)) else d for d in descriptors if d}
    if not kinds:
        return frozenset(), 1
    for kind in kinds:
        if not (isinstance(kind, tuple) and 1 <= len(kind) <= MAX_ZSTD_LAYERS
                and all(isinstance(k, str) and zstd.supported(k) for k in kind)):
            i = next(i for i, d in enumerate(descriptors)
                     if d and (tuple(d) if isinstance(d, (list, tuple)) else d) == kind)
            shown = list(kind) if isinstance(kind, tuple) else kind
            raise UnsupportedError(
                f"{md_path}: entry '{fqns[i]}' is stored with transforms {shown!r}; ckpttool "
                f"reads DCP's ZStandard extension ({zstd.DESCRIPTOR}/1), applied up to "
                f"{MAX_ZSTD_LAYERS} times")
    layers = {len(kind) for kind in kinds}
    if len(layers) > 1:
        raise UnsupportedError(
            f"{md_path}: records are compressed {' or '.join(map(str, sorted(layers)))} times "
            "with the ZStandard extension within one checkpoint, which one save never writes; "
            "ckpttool reads checkpoints whose records went through the same extensions")
    return (frozenset((rel, b) for d, rel, b in zip(descriptors, rels, begins, strict=True)
                      if d), layers.pop())


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
# use_collectives=False: the union of every rank's metadata


def union_of(reads: list[tuple[int, _Read]]
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


def missing_rank_metadata(root: Path, reads: list[tuple[int, _Read]], names: Iterable[str]
                          ) -> list[Problem]:
    """Data files of a rank whose ``__<rank>.metadata`` is missing: its chunks are unknown
    (``names``: the directory's listing)."""
    have = {r for r, _ in reads}
    orphans: dict[int, list[str]] = {}
    for name in sorted(n for n in names if n.endswith(DATA_SUFFIX)):
        r = rank_of(name)
        if r is not None and r not in have:
            orphans.setdefault(r, []).append(name)
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


_DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def rank_of(file: str) -> int | None:
    """The rank that wrote ``__<rank>_<n>.distcp``; None for other names."""
    m = _DATA_FILE_RE.match(Path(file).name)
    return int(m.group(1)) if m else None


def stray_files(names: dict[str, int | None], referenced: set[str]) -> list[str]:
    """``.distcp`` files of a directory (``names``: its listing) that ``.metadata`` never
    references (left over from another save, or a sign that ``.metadata`` is from a different
    save)."""
    return sorted(n for n, size in names.items()
                  if n.endswith(DATA_SUFFIX) and n not in referenced and size is not None)
