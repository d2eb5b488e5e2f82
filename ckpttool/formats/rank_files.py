"""Per-rank ``torch.save`` files of distributed state dicts, recognised by content.

FSDP trainers may save a model with one ``torch.save(model.state_dict())`` per rank: verl as
``model_world_size_<W>_rank_<R>.pt`` (FSDP2), accelerate's ``save_fsdp_model(...,
use_dcp=False)`` as ``pytorch_model_fsdp_0_rank<R>.bin`` straight into the training directory,
beside ``optimizer_0_rank<R>.bin`` (FSDP2 DTensors, or FSDP1 ``SHARDED_STATE_DICT``
ShardedTensors). A directory is claimed when a ``torch.save`` file in it names DTensor or
ShardedTensor classes (its pickle read as opcodes, never run); the files of one set are those
whose names differ only in the rank number (:func:`name_rank`), and of several sets the one that
is not an optimizer's state is the model. The result is a
:class:`~ckpttool.formats.base.CheckpointInfo` whose chunks are raw byte ranges inside the rank
files (with the zip's CRC-32 where a piece is its whole storage).

Nothing here imports torch or runs code from the files. A DTensor pickles as
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, global size,
global stride, storage offset, layout, device, requires_grad), state)`` where ``state`` holds
``_local_tensor`` (an ordinary tensor whose storage is a ``data/<key>`` entry of the same
archive) and ``_spec``: a ``DTensorSpec`` whose ``mesh`` (a ``DeviceMesh``) carries its ranks
as a small int tensor (``_rank_map``) viewed through a ``_MeshLayout``, and whose
``placements`` are ``Shard(dim)`` / ``Replicate()``. A ShardedTensor pickles the same way with
``ShardedTensor.__getstate__``'s tuple as state: its local shards (tensor plus
``ShardMetadata`` offsets and sizes), the global ``ShardedTensorMetadata`` and the writer's
``ProcessGroupState`` (its rank and world size). The allow-list maps exactly those globals (as
torch 2.13 writes them) onto inert stand-ins; anything else is refused by name before it is
looked up. The rank comes from the file name and is cross-checked with what the writer pickled
(the mesh's ``_rank``, the process group's ``global_rank``); DTensor pieces are placed by the
rank's coordinate in the mesh and the placements, as DTensor computes them, ShardedTensor pieces
by their shard metadata.

FSDP1 ``LOCAL_STATE_DICT`` files (flat parameters as ``ShardedTensor``) are recognised too, and
refused: flattened parameters cannot be split back into tensors without the model.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
import pickletools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, InputError, UnsupportedError
from ckpttool.formats.base import (
    RAW,
    CheckpointInfo,
    Checksummed,
    Chunk,
    DataFile,
    Problem,
    Reader,
    Tensor,
)
from ckpttool.formats.codecs import torchsave
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.storage.store import LOCAL, Store, Stores, file_size

NAME = "rank-files"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = ('per-rank `torch.save` files of DTensor (FSDP2) or ShardedTensor (FSDP1 '
    '`SHARDED_STATE_DICT`) state dicts, any names')
WRITTEN_BY = "verl; accelerate's `save_fsdp_model(..., use_dcp=False)`"

# verl's FSDPCheckpointManager names; optim_/extra_state_ files beside them are not the model.
MODEL_FILE_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")

FSDP1_LOCAL_MESSAGE = (
    "{path}: FSDP1 LOCAL_STATE_DICT files (flattened parameters) cannot be merged without the "
    "model: load them into the FSDP1-wrapped model and save again with "
    "StateDictType.SHARDED_STATE_DICT (a DCP checkpoint ckpttool merges) or FULL_STATE_DICT"
)

# A device mesh's rank list is read from the file; a real one has one entry per rank.
_MAX_MESH_RANKS = 1 << 20


# --------------------------------------------------------------------------------------------
# Finding the files


@dataclass(frozen=True)
class RankFile:
    rank: int
    world_size: int
    name: str  # relative to the checkpoint directory


def _model_files(path: Path) -> list[RankFile]:
    found = []
    try:
        names = [p.name for p in path.iterdir() if p.is_file()]
    except OSError:
        return []
    for name in names:
        m = MODEL_FILE_RE.match(name)
        if m:
            found.append(RankFile(int(m.group(2)), int(m.group(1)), name))
    # By the rank number: rank 10 after rank 9, not between 1 and 2.
    return sorted(found, key=lambda f: (f.rank, f.world_size))


def detect(path: Path) -> bool:
    return path.is_dir() and (is_rank_files_dir(path) or _titan_backend(path) is not None)


# torchtitan's second checkpoint backend, torch_checkpointing: per step one
# checkpoint_<rank>.pt of that rank's local tensors and a metadata.pkl of the DTensor sharding
# specs (_StridedShard included) that place them. Claimed here so that it is refused as what
# it is, never read as unrelated torch.save files (one rank's pieces merged as whole tensors).
_TITAN_METADATA = "metadata.pkl"
_TITAN_RANK_FILE = re.compile(r"^checkpoint_(\d+)\.pt$")


def _titan_backend(path: Path) -> str | None:
    """The exit-4 message for a torchtitan torch_checkpointing directory, else None."""
    if not (path / _TITAN_METADATA).is_file():
        return None
    try:
        n = sum(1 for name in os.listdir(path) if _TITAN_RANK_FILE.match(name))
    except OSError:
        return None
    if not n:
        return None
    return (f"{path}: a torchtitan checkpoint of the torch_checkpointing backend ({n} "
            f"checkpoint_<rank>.pt files of local tensors placed by {_TITAN_METADATA}); not "
            "supported yet. Save with torchtitan's default DCP checkpointer (a .metadata and "
            ".distcp files), which ckpttool merges")


def pending(path: Path) -> str | None:
    """Each rank saves its own file, with no marker at the end: missing ranks (of the world
    size the names give) or a file whose zip end record is not there yet."""
    found = {m[2]: m for n in _dir_names(path) if (m := MODEL_FILE_RE.match(n))}
    sizes = {int(m[1]) for m in found.values()}
    if len(sizes) == 1:
        (world,) = sizes
        missing = [r for r in range(world) if str(r) not in found]
        if missing:
            return (f"{len(missing)} of {world} rank files not written yet (rank "
                    f"{missing[0]} first)")
    for name in sorted(m[0] for m in found.values()):
        why = torchsave.pending_file(path / name)
        if why is not None:
            return why
    return None


def _dir_names(path: Path) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except OSError:
        return []


class RankReader(Reader):
    """Pieces are raw byte ranges inside the rank files: the neutral reader reads them."""

    def other_checksums(self) -> tuple[list[Checksummed], list[Problem]]:
        """Every archive entry no chunk's CRC check covers: each pickle, and the storages of
        the copies no chunk uses (a plain tensor or a replicated piece on every rank but
        the lowest)."""
        entries: dict[str, tuple[torchsave.ZipEntry, ...]] = self.info.detail or {}
        covered = {(c.file, c.crc_span[0]) for t in self.info.tensors for c in t.chunks
                   if c.crc32 is not None and c.crc_span is not None}
        return [Checksummed(file, e.data_offset, e.size, e.crc32, f"entry '{e.name}'")
                for file, found in entries.items() for e in found
                if (file, e.data_offset) not in covered], []


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> Reader:
    return RankReader(info, store)


def is_rank_files_dir(path: Path) -> bool:
    """True if ``path`` holds per-rank ``torch.save`` files: verl's
    ``model_world_size_<W>_rank_<R>.pt`` (by name and zip magic), or files under any names
    whose pickles name DTensor or ShardedTensor (read as opcodes, never run).

    A set of rank files is claimed when one of its files shows distributed tensors, so that a
    damaged or unsafe sibling is still recognised and :func:`read_info` can say precisely what
    is wrong with it.
    """
    model = _model_files(path)
    if model:
        return torchsave.is_zip(path / model[0].name)
    return bool(_rank_sets(path))


# Any names: a set of rank files is the files whose names differ only in the rank number.

# The rank number: the digits after "rank" (accelerate's ``_rank0``, ``rank_0``, ``rank-0``),
# else the last digits of the name.
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_DIGITS = re.compile(r"\d+")
# Never a per-rank torch.save file: DCP's data files (records, not one archive) and pickles,
# which are listed but never opened.
_NOT_RANK_FILES = (".distcp", ".pkl", ".pickle")
# What a pickle of distributed tensors names (module prefixes of their classes).
_DISTRIBUTED_MODULES = (b"torch.distributed.tensor", b"torch.distributed._shard")


@dataclass(frozen=True)
class RankSet:
    """Per-rank files under one name pattern: ``pattern`` has ``<R>`` where the rank goes."""

    pattern: str
    files: tuple[tuple[int | None, str], ...]  # (rank in the name, file name), by rank

    def name(self, rank: int) -> str:
        return self.pattern.replace("<R>", str(rank))


def name_rank(name: str) -> tuple[str, int | None]:
    """``(pattern, rank)`` of a file name: ``pytorch_model_fsdp_0_rank1.bin`` ->
    ``("pytorch_model_fsdp_0_rank<R>.bin", 1)``; a name without digits has no rank."""
    found = list(_RANK_IN_NAME.finditer(name))
    if found:
        start, end = found[-1].span(1)
    else:
        digits = list(_DIGITS.finditer(name))
        if not digits:
            return name, None
        start, end = digits[-1].span()
    return f"{name[:start]}<R>{name[end:]}", int(name[start:end])


def _holds_distributed_tensors(file: Path) -> bool:
    """The pickle of the ``torch.save`` archive ``file`` names DTensor or ShardedTensor
    classes. Reads the zip directory and the pickle's bytes; unpickles nothing."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return False
    try:
        rb = torchsave.RecordBytes(fd, 0, os.fstat(fd).st_size, str(file))
        pkl = torchsave.zip_entries(rb).get("data.pkl")
        if pkl is None:
            return False
        data = rb.read(pkl.data_offset, pkl.size)
    except (CkptError, OSError):
        return False  # damaged: a sibling may still show what the set holds
    finally:
        os.close(fd)
    if not any(m in data for m in _DISTRIBUTED_MODULES):  # the common answer, at C speed
        return False
    return any(g.startswith(tuple(m.decode() for m in _DISTRIBUTED_MODULES))
               for g in torchsave.named_globals(data))


def _rank_sets(path: Path) -> list[RankSet]:
    """The sets of per-rank files of ``path`` that hold distributed tensors, by pattern."""
    try:
        files = sorted(p.name for p in path.iterdir()
                       if p.is_file() and not p.name.endswith(_NOT_RANK_FILES))
    except OSError:
        return []
    by_pattern: dict[str, list[tuple[int | None, str]]] = {}
    for name in files:
        if torchsave.is_zip(path / name):
            pattern, rank = name_rank(name)
            by_pattern.setdefault(pattern, []).append((rank, name))
    sets = []
    for pattern, members in by_pattern.items():
        members.sort(key=lambda m: (m[0] is None, m[0] or 0, m[1]))
        if any(_holds_distributed_tensors(path / name) for _, name in members):
            sets.append(RankSet(pattern, tuple(members)))
    return sets


def rank_files(path: Path) -> list[RankFile]:
    """The model rank files of ``path``, ordered by rank, checked to be one complete world:
    verl's ``model_world_size_<W>_rank_<R>.pt`` if there are any, else the one set of files
    under any names that holds distributed tensors (the model's, when an optimizer's set lies
    beside it, as accelerate's ``use_dcp=False`` saves leave them).

    Raises:
        InputError: none found, several sets, world sizes differ, or a rank's file is missing.
    """
    files = _model_files(path)
    if not files:
        return _set_files(path, _chosen_set(path))
    sizes = sorted({f.world_size for f in files})
    if len(sizes) > 1:
        examples = ", ".join(next(f.name for f in files if f.world_size == w) for w in sizes)
        raise InputError(
            f"{path}: rank files of different world sizes {sizes} ({examples}); the directory "
            "mixes saves of different runs; keep the files of one world size only"
        )
    world = sizes[0]
    by_rank = {f.rank: f for f in files}
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        others = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(
            f"{path / f'model_world_size_{world}_rank_{missing[0]}.pt'}: missing{others}; a "
            f"world of {world} needs one file per rank. Copy every rank's file"
        )
    extra = [f for f in files if f.rank >= world]
    if extra:
        raise InputError(f"{path / extra[0].name}: rank {extra[0].rank} in a world of {world}; "
                         "the file is misnamed or from another save")
    return files


# Top-level keys of a torch optimizer's state dict (accelerate saves it beside the model).
_OPTIMIZER_KEYS = frozenset({"state", "param_groups"})


def _is_optimizer(path: Path, rank_set: RankSet) -> bool:
    for _, name in rank_set.files:
        keys = _top_keys(path / name)
        if keys is not None:
            return bool(keys) and set(keys) <= _OPTIMIZER_KEYS
    return False


def _chosen_set(path: Path) -> RankSet:
    sets = _rank_sets(path)
    if not sets:
        raise InputError(f"{path}: no per-rank torch.save files of DTensors or ShardedTensors")
    if len(sets) == 1:
        return sets[0]
    models = [s for s in sets if not _is_optimizer(path, s)]
    if len(models) == 1:
        return models[0]
    found = models or sets
    raise InputError(
        f"{path}: holds {len(found)} sets of per-rank model files "
        f"({', '.join(s.pattern for s in found)}); ckpttool reads one set per directory: move "
        "the files of the one to read into a directory of their own"
    )


def _set_files(path: Path, rank_set: RankSet) -> list[RankFile]:
    """The files of a set as ranks 0 .. W-1, W the highest rank in the names plus one."""
    if rank_set.files[0][0] is None:  # a name without digits: a set of its own
        return [RankFile(0, 1, rank_set.files[0][1])]
    by_rank: dict[int, str] = {}
    for rank, name in rank_set.files:
        assert rank is not None  # names of one pattern all have the rank digits
        if rank in by_rank:
            raise InputError(f"{path / name}: a second file for rank {rank} (beside "
                             f"{by_rank[rank]}); keep one file per rank")
        by_rank[rank] = name
    world = max(by_rank) + 1
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        others = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{path / rank_set.name(missing[0])}: missing{others}; a world of "
                         f"at least {world} needs one file per rank. Copy every rank's file")
    return [RankFile(r, world, by_rank[r]) for r in range(world)]


# --------------------------------------------------------------------------------------------
# The allow-list: what a pickled DTensor names, as inert stand-ins


class _Fields(tuple):  # type: ignore[type-arg]
    """Stand-in for a NamedTuple pickle builds with NEWOBJ (``TensorMeta``, ``ShardOrderEntry``)."""

    def __new__(cls, *fields: Any) -> _Fields:
        return tuple.__new__(cls, fields)




_DTensorSpec = torchsave.stub_class("DTensorSpec")
_DeviceMesh = torchsave.stub_class("DeviceMesh")
_MeshLayout = torchsave.stub_class("_MeshLayout")
_FlatLayout = torchsave.stub_class("_FlatLayout")
_Shard = torchsave.stub_class("Shard")
_Replicate = torchsave.stub_class("Replicate")
# Recognised only to say they are not supported: a Partial tensor is a sum of the ranks'
# pieces, a _StridedShard interleaves them.
_Partial = torchsave.stub_class("Partial")
_StridedShard = torchsave.stub_class("_StridedShard")
_TensorMeta = type("TensorMeta", (_Fields,), {})
_ShardOrderEntry = type("ShardOrderEntry", (_Fields,), {})


class _DTensorClass:
    """Stand-in for the ``DTensor`` class object itself (an argument, never instantiated)."""


@dataclass(frozen=True)
class _WrapperArgs:
    dtype: Any
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DTensorRef:
    """A DTensor as the pickle describes it: global dtype and shape, local piece, spec."""

    dtype: Any
    shape: tuple[int, ...]
    local: Any  # torchsave.TensorRef when well formed
    spec: Any  # _DTensorSpec stand-in when well formed


class _ShardedTensorClass:
    """Stand-in for the ``ShardedTensor`` class object (an argument, never instantiated)."""


@dataclass(frozen=True)
class ShardedTensorRef:
    """An FSDP1 ShardedTensor as the pickle describes it (``ShardedTensor.__getstate__``):
    global dtype and shape, this rank's shards, the global metadata and the process group the
    writer saw."""

    dtype: Any
    shape: tuple[int, ...]
    local_shards: Any  # a list of _LocalShard stand-ins when well formed
    metadata: Any  # _ShardedTensorMetadata stand-in when well formed
    process_group: Any  # _ProcessGroupState stand-in when well formed


_LocalShard = torchsave.stub_class("Shard")  # sharded_tensor.shard.Shard: tensor + metadata
_ShardMetadata = torchsave.stub_class("ShardMetadata")
_ShardedTensorMetadata = torchsave.stub_class("ShardedTensorMetadata")
_TensorProperties = torchsave.stub_class("TensorProperties")
_RemoteDevice = torchsave.stub_class("_remote_device")
_ChunkShardingSpec = torchsave.stub_class("ChunkShardingSpec")
_ProcessGroupState = torchsave.stub_class("ProcessGroupState")


# The enum TensorProperties pickles its memory format as (torch 2.13's members).
_MEM_FORMAT_ENCODING = torchsave.EnumClass("MEM_FORMAT_ENCODING", {
    "TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2})


def _getattr(obj: Any, name: Any) -> Any:
    """``getattr`` as a ShardedTensor pickle calls it: ``getattr(ShardedTensor,
    "ProcessGroupState")`` (a nested class) or an allow-listed Enum member by name (Python
    3.11), nothing else; the object is a stand-in, so nothing real is ever reached."""
    if obj is _ShardedTensorClass:
        if name == "ProcessGroupState":
            return _ProcessGroupState
        raise torchsave.Refused("builtins", f"getattr(ShardedTensor, {str(name)[:60]!r})")
    return torchsave.enum_getattr(obj, name)


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, *_: Any) -> _WrapperArgs:
    if cls is not _DTensorClass and cls is not _ShardedTensorClass:
        raise pickle.UnpicklingError("a tensor subclass other than DTensor and ShardedTensor")
    return _WrapperArgs(dtype, torchsave.size(size))


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any,
                          state: Any) -> DTensorRef | ShardedTensorRef:
    if func is not _rebuild_wrapper_subclass or new_type not in (_DTensorClass,
                                                                  _ShardedTensorClass):
        raise pickle.UnpicklingError("a tensor subclass other than DTensor and ShardedTensor")
    wrapper = func(*args)
    if new_type is _ShardedTensorClass:
        # (local shards, metadata, process group state, sharding spec, init_rrefs)
        if not isinstance(state, tuple) or len(state) != 5:
            raise pickle.UnpicklingError("ShardedTensor without its state")
        return ShardedTensorRef(wrapper.dtype, wrapper.shape, state[0], state[1], state[2])
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}
    if not isinstance(state, dict):
        raise pickle.UnpicklingError("DTensor without state")
    return DTensorRef(wrapper.dtype, wrapper.shape, state.get("_local_tensor"),
                      state.get("_spec"))


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


_DTENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch.distributed.tensor", "DTensor"): _DTensorClass,
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"): _DTensorSpec,
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"): _TensorMeta,
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"): _ShardOrderEntry,
    ("torch.distributed.device_mesh", "DeviceMesh"): _DeviceMesh,
    ("torch.distributed._mesh_layout", "_MeshLayout"): _MeshLayout,
    ("torch.distributed._mesh_layout", "_FlatLayout"): _FlatLayout,
    ("torch.distributed.tensor.placement_types", "Shard"): _Shard,
    ("torch.distributed.tensor.placement_types", "Replicate"): _Replicate,
    ("torch.distributed.tensor.placement_types", "Partial"): _Partial,
    ("torch.distributed.tensor.placement_types", "_StridedShard"): _StridedShard,
    ("torch", "device"): _device,
    ("torch", "Size"): torchsave.size,
    ("torch.serialization", "_get_layout"): str,
}

# What FSDP1's SHARDED_STATE_DICT pickles (torch 2.13 names); the enum and the nested class
# come through a call (MEM_FORMAT_ENCODING(0), getattr(ShardedTensor, "ProcessGroupState")).
_ST = "torch.distributed._shard.sharded_tensor"
_SHARDED_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    (f"{_ST}.api", "ShardedTensor"): _ShardedTensorClass,
    (f"{_ST}.shard", "Shard"): _LocalShard,
    ("torch.distributed._shard.metadata", "ShardMetadata"): _ShardMetadata,
    (f"{_ST}.metadata", "ShardedTensorMetadata"): _ShardedTensorMetadata,
    (f"{_ST}.metadata", "TensorProperties"): _TensorProperties,
    (f"{_ST}.metadata", "MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"):
        _ChunkShardingSpec,
    ("torch.distributed.remote_device", "_remote_device"): _RemoteDevice,
}


class _ShardedTensorFound(Exception):
    """The pickle names a ``torch.distributed._shard`` global that is not allowed (another
    form of ShardedTensor than FSDP1's SHARDED_STATE_DICT writes); nothing was run."""

    def __init__(self, qualname: str) -> None:
        super().__init__(qualname)
        self.qualname = qualname


def dtensor_global(module: str, name: str) -> Any | None:
    """The allow-list of a per-rank state-dict pickle: :func:`torchsave.record_global` plus
    DTensor's spec, mesh and placements and FSDP1 ShardedTensor's shards and metadata (torch
    2.13 names), as inert stand-ins.

    Raises:
        _ShardedTensorFound: another ``torch.distributed._shard`` global.
    """
    found = _DTENSOR_GLOBALS.get((module, name)) or _SHARDED_TENSOR_GLOBALS.get((module, name))
    if found is not None:
        return found
    if module in ("__builtin__", "builtins") and name == "getattr":
        return _getattr
    if module == "torch.distributed._shard" or module.startswith("torch.distributed._shard."):
        raise _ShardedTensorFound(f"{module}.{name}")
    return torchsave.record_global(module, name)


# --------------------------------------------------------------------------------------------
# One rank's file


@dataclass(frozen=True)
class _Piece:
    """One state-dict entry of one rank's file."""

    fqn: str
    dtype: DType
    shape: tuple[int, ...]  # of the whole tensor
    distributed: bool  # a DTensor or ShardedTensor (else a plain tensor, the same everywhere)
    chunks: tuple[Chunk, ...]  # this rank's non-empty pieces (FSDP: one at most)


def _pickle_strings(data: bytes) -> Iterator[str]:
    """The string constants of a pickle, parsed without running it."""
    try:
        for _op, arg, _pos in pickletools.genops(data):
            if isinstance(arg, str):
                yield arg
    except Exception:  # noqa: BLE001 - a corrupt pickle simply yields no more strings
        return


def _has_flat_param(names: Iterable[str]) -> bool:
    return any("flat_param" in n for n in names)


def _load(path: Path, fd: int) -> tuple[torchsave.RecordBytes, dict[str, torchsave.ZipEntry],
                                        dict[Any, Any]]:
    """The archive of an open rank file and its state dict, unpickled onto stand-ins.

    Raises:
        InputError: damaged, truncated, unsafe, or not a dict.
        UnsupportedError: FSDP1 flat parameters, torch.distributed classes not on the list.
    """
    rb, entries = torchsave.open_file_archive(fd, str(path),
                                              "the rank file is damaged, copy it again")
    try:
        root_value = torchsave.load_pickle(rb, entries, lookup=dtensor_global)
    except _ShardedTensorFound as e:
        pkl = entries["data.pkl"]
        if _has_flat_param(_pickle_strings(rb.read(pkl.data_offset, pkl.size))):
            raise UnsupportedError(FSDP1_LOCAL_MESSAGE.format(path=path)) from e
        raise UnsupportedError(
            f"{path}: holds ShardedTensor values naming '{e.qualname}', which FSDP1's "
            "SHARDED_STATE_DICT (torch 2.13) does not write; ckpttool does not read this form. "
            "Save with torch.distributed.checkpoint (a DCP checkpoint) instead"
        ) from e
    except torchsave.Refused as e:
        if e.qualname.startswith("torch.distributed."):
            raise UnsupportedError(
                f"{path}: the pickle names '{e.qualname}', a torch.distributed class "
                "ckpttool does not read (DTensor files are read as torch 2.13 writes them; "
                "this one may come from another torch version). Nothing was executed"
            ) from e
        raise InputError(
            f"{path}: refused to load: the pickle asks for '{e.qualname}', which a state "
            "dict of tensors and DTensors never contains; the file may be malicious "
            "(nothing was executed)"
        ) from e
    except torchsave.TooComplex as e:
        raise InputError(f"{path}: {e}, more than any state dict holds; refusing to "
                         "walk it") from e
    except torchsave.PICKLE_ERRORS as e:
        raise InputError(f"{path}: corrupt pickle in torch.save file ({e}); copy it again") \
            from e
    if not isinstance(root_value, dict):
        raise InputError(f"{path}: holds a {type(root_value).__name__}, not a state dict")
    return rb, entries, root_value


def _read_file(root: Path, rf: RankFile
               ) -> tuple[list[_Piece], tuple[torchsave.ZipEntry, ...]]:
    path = root / rf.name
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from e
    try:
        rb, entries, root_value = _load(path, fd)
        if root_value and {str(k) for k in root_value} <= _OPTIMIZER_KEYS:
            raise UnsupportedError(
                f"{path}: per-rank optimizer state (its keys are {sorted(root_value)}); "
                "ckpttool merges per-rank model files only. Save the optimizer with "
                "torch.distributed.checkpoint (accelerate: use_dcp=True) to merge it"
            )
        meshes: dict[int, _Mesh] = {}
        pieces = []
        for key_path, value in torchsave.flatten(root_value, is_tensor=_is_tensor,
                                                 expand_root=True):
            fqn = ".".join(key_path)
            if "flat_param" in fqn:
                raise UnsupportedError(FSDP1_LOCAL_MESSAGE.format(path=path))
            pieces.append(_piece(path, rf, rb, entries, meshes, fqn, value))
        return pieces, tuple(entries.values())
    finally:
        os.close(fd)


def _top_keys(path: Path) -> list[str] | None:
    """The top-level keys of a rank file's state dict, or None if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return [str(k) for k in _load(path, fd)[2]]
    except CkptError:
        return None
    finally:
        os.close(fd)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (torchsave.TensorRef, DTensorRef, ShardedTensorRef))


def _piece(path: Path, rf: RankFile, rb: torchsave.RecordBytes,
           entries: dict[str, torchsave.ZipEntry], meshes: dict[int, _Mesh], fqn: str,
           value: Any) -> _Piece:
    if isinstance(value, torchsave.TensorRef):
        dtype = _dtype(path, fqn, value.dtype)
        chunk = _chunk(path, entries, fqn, value, (0,) * len(value.shape))
        return _Piece(fqn, dtype, value.shape, False, _some(chunk))
    if isinstance(value, ShardedTensorRef):
        return _sharded_piece(path, rf, entries, fqn, value)
    if not isinstance(value, DTensorRef):
        raise UnsupportedError(
            f"{path}: entry '{fqn}' is a {type(value).__name__}, not a tensor; ckpttool merges "
            "rank files whose state dict holds tensors only"
        )
    dtype = _dtype(path, fqn, value.dtype)
    local, spec = value.local, value.spec
    if not isinstance(local, torchsave.TensorRef) or not isinstance(spec, _DTensorSpec):
        raise InputError(f"{path}: DTensor '{fqn}' lacks its local tensor or spec; corrupt")
    if local.dtype != dtype:
        raise InputError(f"{path}: DTensor '{fqn}' is {dtype.name} but its local piece is "
                         f"{local.dtype.name}; corrupt")
    mesh_stub = spec.field("mesh")
    if not isinstance(mesh_stub, _DeviceMesh):
        raise InputError(f"{path}: DTensor '{fqn}' has no device mesh; corrupt")
    mesh = meshes.get(id(mesh_stub))
    if mesh is None:
        mesh = meshes[id(mesh_stub)] = _mesh(path, rf, rb, entries, fqn, mesh_stub)
    placements = spec.field("placements")
    if not isinstance(placements, tuple) or len(placements) != len(mesh.shape):
        raise InputError(f"{path}: DTensor '{fqn}' has {placements!r} placements for a "
                         f"{len(mesh.shape)}-dimensional mesh; corrupt")
    _check_shard_order(path, fqn, spec.field("shard_order"))
    offsets, sizes = _local_box(path, fqn, value.shape, mesh, placements)
    if local.shape != sizes:
        raise InputError(
            f"{path}: DTensor '{fqn}' holds a local piece of shape {list(local.shape)} where its "
            f"placements put {list(sizes)} on rank {rf.rank}; the file is corrupt or misnamed"
        )
    return _Piece(fqn, dtype, value.shape, True,
                  _some(_chunk(path, entries, fqn, local, offsets)))




def _some(chunk: Chunk | None) -> tuple[Chunk, ...]:
    return () if chunk is None else (chunk,)


def _sharded_piece(path: Path, rf: RankFile, entries: dict[str, torchsave.ZipEntry], fqn: str,
                   value: ShardedTensorRef) -> _Piece:
    """An FSDP1 ShardedTensor: this rank's shards sit where their metadata says; the rank and
    world the writer saw must be the file's."""
    dtype = _dtype(path, fqn, value.dtype)
    shards, metadata, group = value.local_shards, value.metadata, value.process_group
    if not isinstance(metadata, _ShardedTensorMetadata) or not isinstance(group,
                                                                          _ProcessGroupState):
        raise InputError(f"{path}: ShardedTensor '{fqn}' lacks its metadata; corrupt")
    global_rank, world = group.field("global_rank"), group.field("global_world_size")
    if isinstance(global_rank, int) and global_rank != rf.rank:
        raise InputError(f"{path}: written by rank {global_rank} but named for rank {rf.rank}; "
                         "the rank files were renamed. Restore the original names")
    if isinstance(world, int) and world != rf.world_size:
        raise InputError(f"{path}: written by one of {world} ranks, but the files here make a "
                         f"world of {rf.world_size}; a rank file is missing or from another "
                         "save. Copy every rank's file")
    where = f"{path}: ShardedTensor '{fqn}'"
    size = metadata.field("size")
    if not isinstance(size, tuple) or size != value.shape:
        raise InputError(f"{where} has size {size!r} in its metadata but {list(value.shape)} "
                         "in the tensor; corrupt")
    listed = metadata.field("shards_metadata")
    boxes = {_shard_box(where, value.shape, m) for m in listed} \
        if isinstance(listed, list) else set()
    if not isinstance(shards, list):
        raise InputError(f"{where} has no list of local shards; corrupt")
    chunks: list[Chunk] = []
    for shard in shards:
        local, shard_md = (shard.field("tensor"), shard.field("metadata")) \
            if isinstance(shard, _LocalShard) else (None, None)
        if not isinstance(local, torchsave.TensorRef) or not isinstance(shard_md,
                                                                          _ShardMetadata):
            raise InputError(f"{where} has a local shard without tensor or metadata; corrupt")
        offsets, sizes = _shard_box(where, value.shape, shard_md)
        if local.shape != sizes or local.dtype != dtype:
            raise InputError(
                f"{where} holds a {local.dtype.name} piece of shape {list(local.shape)} where "
                f"its metadata says {dtype.name} {list(sizes)}; corrupt")
        if (offsets, sizes) not in boxes:
            raise InputError(f"{where}: the local shard at {list(offsets)} is not among the "
                             "shards its metadata lists; corrupt")
        chunks.extend(_some(_chunk(path, entries, fqn, local, offsets)))
    return _Piece(fqn, dtype, value.shape, True, tuple(chunks))


def _shard_box(where: str, shape: tuple[int, ...],
               md: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A ShardMetadata's (offsets, sizes), checked to lie inside ``shape``."""
    offsets = md.field("shard_offsets") if isinstance(md, _ShardMetadata) else None
    sizes = md.field("shard_sizes") if isinstance(md, _ShardMetadata) else None
    if not (isinstance(offsets, list) and isinstance(sizes, list)
            and len(offsets) == len(sizes) == len(shape)
            and all(isinstance(v, int) and v >= 0 for v in (*offsets, *sizes))
            and all(o + n <= d for o, n, d in zip(offsets, sizes, shape, strict=True))):
        raise InputError(f"{where} has a shard at {offsets!r} of size {sizes!r}, not inside its "
                         f"shape {list(shape)}; corrupt")
    return tuple(offsets), tuple(sizes)


def _dtype(path: Path, fqn: str, dtype: Any) -> DType:
    if isinstance(dtype, torchsave.UnknownDType):
        raise UnsupportedError(f"{path}: tensor '{fqn}' has dtype torch.{dtype.torch_name}, "
                               "which ckpttool cannot write to safetensors")
    if not isinstance(dtype, DType):
        raise InputError(f"{path}: tensor '{fqn}' has no readable dtype; corrupt")
    return dtype


def _is_c_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if len(shape) != len(stride):
        return False
    if 0 in shape:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _chunk(path: Path, entries: dict[str, torchsave.ZipEntry], fqn: str,
           t: torchsave.TensorRef, offsets: tuple[int, ...]) -> Chunk | None:
    numel = 1
    for n in t.shape:
        numel *= n
    if numel == 0:
        return None
    if not _is_c_contiguous(t.shape, t.stride):
        raise UnsupportedError(
            f"{path}: tensor '{fqn}' is saved as a non-contiguous view (shape {list(t.shape)}, "
            f"strides {list(t.stride)}); ckpttool reads contiguous pieces only (FSDP2 writes "
            "them so). Save .contiguous() tensors"
        )
    data = entries.get(f"data/{t.storage.key}")
    if data is None:
        raise InputError(f"{path}: tensor '{fqn}' names storage 'data/{t.storage.key}', which "
                         "the archive lacks; corrupt")
    why = t.storage.claims(data.size)
    if why is not None:
        raise InputError(f"{path}: tensor '{fqn}': {why}")
    itemsize = t.dtype.itemsize
    nbytes = numel * itemsize
    start = t.storage_offset * itemsize
    if t.storage_offset < 0 or start + nbytes > data.size:
        raise InputError(f"{path}: tensor '{fqn}' reaches past the end of its storage; corrupt")
    # The zip's CRC covers the whole storage the piece lies in (each local tensor has its own).
    return Chunk(offsets, t.shape, path.name, data.data_offset + start, nbytes, encoding=RAW,
                 crc32=data.crc32, crc_span=(data.data_offset, data.size))


# --------------------------------------------------------------------------------------------
# Device meshes and placements


@dataclass(frozen=True)
class _Mesh:
    shape: tuple[int, ...]  # size of each mesh dimension
    coordinate: tuple[int, ...]  # this file's rank in the mesh


def _ints(value: Any) -> tuple[int, ...]:
    """A layout's shape or stride: an int or a (possibly nested) tuple of ints, flattened."""
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(i for v in value for i in _ints(v))
    raise pickle.UnpicklingError(f"layout entry {value!r}")


def _read_ints(rb: torchsave.RecordBytes, entries: dict[str, torchsave.ZipEntry],
               t: torchsave.TensorRef) -> list[int]:
    numel = 1
    for n in t.shape:
        numel *= n
    if t.dtype.kind != "int" or numel > _MAX_MESH_RANKS or not _is_c_contiguous(t.shape, t.stride):
        raise pickle.UnpicklingError("rank map is not a small contiguous int tensor")
    data = entries.get(f"data/{t.storage.key}")
    size = t.dtype.itemsize
    if data is None or (t.storage_offset + numel) * size > data.size:
        raise pickle.UnpicklingError("rank map storage missing")
    raw = rb.read(data.data_offset + t.storage_offset * size, numel * size)
    return [int.from_bytes(raw[i * size:(i + 1) * size], "little", signed=True)
            for i in range(numel)]


def _mesh(path: Path, rf: RankFile, rb: torchsave.RecordBytes,
          entries: dict[str, torchsave.ZipEntry], fqn: str, mesh: torchsave.Stub) -> _Mesh:
    """Where this file's rank sits in ``mesh``: the layout picks the ranks of the mesh out of
    ``_rank_map`` (``rank_map.as_strided(complement + layout)``, as ``DeviceMesh.mesh`` does)."""
    layout, rank_map = mesh.field("_layout"), mesh.field("_rank_map")
    if not isinstance(layout, _MeshLayout) or not isinstance(rank_map, torchsave.TensorRef):
        raise UnsupportedError(
            f"{path}: the device mesh of DTensor '{fqn}' has no _layout/_rank_map (written by "
            "another torch version than 2.13?); not supported yet"
        )
    try:
        axes = layout.field("axes")
        if not isinstance(axes, tuple) or not all(isinstance(a, _FlatLayout) for a in axes):
            raise pickle.UnpicklingError("mesh layout axes")
        modes_by_axis = []
        for a in axes:
            shape, stride = _ints(a.field("shape", ())), _ints(a.field("stride", ()))
            if len(shape) != len(stride) or any(n < 1 for n in shape):
                raise pickle.UnpicklingError("mesh layout axis")
            modes_by_axis.append(tuple(zip(shape, stride, strict=True)))
        ranks = _read_ints(rb, entries, rank_map)
    except (pickle.UnpicklingError, TypeError, ValueError) as e:
        raise InputError(f"{path}: unreadable device mesh of DTensor '{fqn}' ({e}); corrupt") \
            from e
    if rf.rank not in ranks:
        raise InputError(f"{path}: the device mesh of DTensor '{fqn}' (ranks {ranks}) does not "
                         f"include rank {rf.rank}, which the file name gives; misnamed file?")
    bad = [r for r in ranks if not 0 <= r < rf.world_size]
    if bad:
        raise InputError(f"{path}: the device mesh of DTensor '{fqn}' names rank {bad[0]}, "
                         f"outside the world of {rf.world_size} whose rank files are here; a "
                         "rank file is missing or from another save. Copy every rank's file")
    shape = tuple(math.prod(n for n, _ in modes) for modes in modes_by_axis)
    coordinate = _coordinate(modes_by_axis, len(ranks), ranks.index(rf.rank))
    if coordinate is None:
        raise UnsupportedError(f"{path}: the device mesh layout of DTensor '{fqn}' "
                               f"({modes_by_axis}) is not one ckpttool can place ranks in")
    # What the writer computed for itself, when pickled: it must agree with the file name.
    writer_rank = mesh.field("_rank")
    if isinstance(writer_rank, int) and writer_rank != rf.rank:
        raise InputError(f"{path}: written by rank {writer_rank} but named for rank {rf.rank}; "
                         "the rank files were renamed. Restore the original names")
    writer_coordinate = mesh.field("_coordinate_on_dim")
    if isinstance(writer_coordinate, (tuple, list)) and tuple(writer_coordinate) != coordinate:
        raise InputError(f"{path}: the writer placed itself at mesh coordinate "
                         f"{list(writer_coordinate)}, the mesh layout gives {list(coordinate)}; "
                         "corrupt device mesh")
    return _Mesh(shape, coordinate)


def _coordinate(modes_by_axis: list[tuple[tuple[int, int], ...]], num_ranks: int,
                position: int) -> tuple[int, ...] | None:
    """The mesh coordinate of the rank at ``position`` in the rank map, or None if the layout
    does not tile the rank map. Modes within an axis count row-major, as ``as_strided`` does."""
    modes = [m for axis in modes_by_axis for m in axis]
    mesh_size = 1
    for n, _ in modes:
        if n < 1:
            return None
        mesh_size *= n
        if mesh_size > num_ranks:  # a mesh cannot be larger than the ranks that hold it
            return None
    reach: dict[int, tuple[int, ...]] = {}  # offset from the group's first rank -> coordinate
    for index in itertools.product(*(range(n) for n, _ in modes)):
        offset = sum(i * s for i, (_, s) in zip(index, modes, strict=True))
        coord, k = [], 0
        for axis in modes_by_axis:
            c = 0
            for i, (n, _) in zip(index[k:k + len(axis)], axis, strict=True):
                c = c * n + i
            coord.append(c)
            k += len(axis)
        if offset in reach:
            return None
        reach[offset] = tuple(coord)
    # The rank map holds one or more copies of the mesh (a sub-mesh of a bigger one), each
    # starting at the lowest position not yet taken.
    taken = [False] * num_ranks
    for base in range(num_ranks):
        if taken[base]:
            continue
        for offset in reach:
            q = base + offset
            if not 0 <= q < num_ranks or taken[q]:  # (a negative stride reaches before it)
                return None
            taken[q] = True
        if position - base in reach:
            return reach[position - base]
    return None


def _check_shard_order(path: Path, fqn: str, order: Any) -> None:
    """Pieces are placed left to right over the placements; a spec that orders the mesh
    dimensions of a tensor dimension otherwise is not read."""
    for entry in order or ():
        mesh_dims = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else None
        if not isinstance(mesh_dims, tuple) or list(mesh_dims) != sorted(mesh_dims):
            raise UnsupportedError(f"{path}: DTensor '{fqn}' has shard order {entry!r}, not "
                                   "left to right over the mesh; not supported")


def _local_box(path: Path, fqn: str, shape: tuple[int, ...], mesh: _Mesh,
               placements: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes of this rank's piece: Shard(d) splits dim d like ``torch.chunk``
    (ceil(n / m) per rank, the last ones short or empty), applied in placement order."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, _Replicate):
            continue
        if not isinstance(p, _Shard):
            raise UnsupportedError(
                f"{path}: DTensor '{fqn}' is placed as {type(p).__name__} on mesh dimension "
                f"{mesh_dim}; ckpttool merges Shard and Replicate placements only (redistribute "
                "to Shard/Replicate, or save with torch.distributed.checkpoint)"
            )
        dim = p.field("dim")
        if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
            raise InputError(f"{path}: DTensor '{fqn}' is sharded on dim {dim!r} of a "
                             f"{len(shape)}-dimensional tensor; corrupt")
        dim %= len(shape)
        m, c = mesh.shape[mesh_dim], mesh.coordinate[mesh_dim]
        per = -(-sizes[dim] // m)
        start = min(c * per, sizes[dim])
        offsets[dim] += start
        sizes[dim] = max(0, min(per, sizes[dim] - start))
    return tuple(offsets), tuple(sizes)


# --------------------------------------------------------------------------------------------
# The whole checkpoint


def read_info(path: str | os.PathLike[str], *, stores: Stores = LOCAL) -> CheckpointInfo:
    """Describe a directory of per-rank DTensor state-dict files. Reads pickles and zip
    headers (and each mesh's tiny rank list), never tensor data; runs nothing from the files.

    Returns:
        A checkpoint with raw chunks: each sharded piece once,
        a replicated tensor (or a plain one in a world of several) from the lowest rank.

    Raises:
        InputError: a rank file is missing, misnamed, unsafe, corrupt, or the ranks disagree.
        UnsupportedError: FSDP1 flat parameters, Partial/_StridedShard placements,
            non-contiguous pieces, non-tensor entries.
    """
    root = Path(path)
    titan = _titan_backend(root)
    if titan is not None:
        raise UnsupportedError(titan)
    files = rank_files(root)
    order: list[str] = []
    first: dict[str, _Piece] = {}
    chunks: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk]] = {}
    archives: dict[str, tuple[torchsave.ZipEntry, ...]] = {}  # every entry, for verify's CRCs
    for rf in files:
        pieces, archives[rf.name] = _read_file(root, rf)
        keys = [p.fqn for p in pieces]
        if rf.rank == 0:
            order = keys
        elif set(keys) != set(order):
            have, want = set(keys), set(order)
            missing = [k for k in order if k not in have]
            extra = [k for k in keys if k not in want]
            what = (f"lacks '{missing[0]}' that rank 0 has" if missing
                    else f"has '{extra[0]}' that rank 0 lacks")
            raise InputError(f"{root / rf.name}: {what}; the rank files come from different "
                             "saves or models")
        for p in pieces:
            ref = first.setdefault(p.fqn, p)
            if (p.dtype, p.shape, p.distributed) != (ref.dtype, ref.shape, ref.distributed):
                raise InputError(
                    f"{root / rf.name}: '{p.fqn}' is "
                    f"{_describe(p)} but {_describe(ref)} on rank 0; the rank files come from "
                    "different saves or models"
                )
            if not p.distributed and rf.rank != 0:
                continue  # a plain tensor is the same on every rank (an FSDP buffer)
            for c in p.chunks:
                # A replicated piece appears on several ranks: keep the lowest rank's copy.
                chunks.setdefault(p.fqn, {}).setdefault((c.offsets, c.sizes), c)
    tensors = tuple(
        Tensor(fqn, (fqn,), first[fqn].dtype, first[fqn].shape,
               tuple(chunks.get(fqn, {}).values()))
        for fqn in order
    )
    return CheckpointInfo(
        format=NAME, root=root, tensors=tensors, objects=(),
        files=tuple(DataFile(f.name, file_size(root / f.name)) for f in files),
        metadata_name="the rank files' pickles", sharded=True, num_ranks=len(files),
        detail=archives)


def sets_beside(path: Path, own: frozenset[str]) -> list[RankSet]:
    """The other sets of per-rank files of distributed tensors in ``path``, none of whose
    files is in ``own`` (verl's ``optim_world_size_<W>_rank_<R>.pt`` beside its model files)."""
    return [s for s in _rank_sets(path) if not any(name in own for _, name in s.files)]


def read_archives(path: Path, rank_set: RankSet) -> CheckpointInfo:
    """A set of per-rank files that ckpttool checks but does not merge (an optimizer's
    DTensor state, which :func:`read_info` refuses): every file of the world is there, each
    archive's headers are sound and its pickle passes the allow-list (nothing is run), and
    every entry is listed for verify's CRC checks. No tensors are described.

    Raises:
        InputError: a rank's file is missing, damaged or unsafe.
        UnsupportedError: a form of ShardedTensor or torch.distributed class not read.
    """
    files = _set_files(path, rank_set)
    archives: dict[str, tuple[torchsave.ZipEntry, ...]] = {}
    for rf in files:
        try:
            fd = os.open(path / rf.name, os.O_RDONLY)
        except OSError as e:
            raise InputError(f"{path / rf.name}: cannot read: {e.strerror}") from None
        try:
            archives[rf.name] = tuple(_load(path / rf.name, fd)[1].values())
        finally:
            os.close(fd)
    return CheckpointInfo(
        format=NAME, root=path, tensors=(), objects=(),
        files=tuple(DataFile(f.name, file_size(path / f.name)) for f in files),
        metadata_name="the rank files' pickles", sharded=True, num_ranks=len(files),
        detail=archives)


def _describe(p: _Piece) -> str:
    kind = "a distributed tensor" if p.distributed else "a tensor"
    return f"{kind} {p.dtype.name} {list(p.shape)}"


__all__ = ["FSDP1_LOCAL_MESSAGE", "NAME", "SUMMARY", "WRITTEN_BY",
           "DTensorRef", "RankFile", "RankSet", "ShardedTensorRef",
           "detect", "dtensor_global", "name_rank",
           "is_rank_files_dir", "open_reader", "pending", "rank_files", "read_info"]
