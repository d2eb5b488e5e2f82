"""One rank's ``torch.save`` file read into pieces (raw byte ranges of the archive), and where a
DTensor's local piece lies in the global tensor (its mesh coordinate and placements)."""


from __future__ import annotations

import itertools
import math
import pickle
import pickletools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, InputError, UnsupportedError
from ckpttool.formats.base import (
    RAW,
    Chunk,
)
from ckpttool.formats.codecs import archive, torchsave
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.formats.rank_files.stand_ins import (
    DeviceMesh,
    DTensorRef,
    DTensorSpec,
    FlatLayout,
    LocalShard,
    MeshLayout,
    ProcessGroupState,
    Replicate,
    Shard,
    ShardedTensorFound,
    ShardedTensorMetadata,
    ShardedTensorRef,
    ShardMetadata,
    dtensor_global,
)
from ckpttool.storage.store import LOCAL, Stores

FSDP1_LOCAL_MESSAGE = (
    "{path}: FSDP1 LOCAL_STATE_DICT files (flattened parameters) cannot be merged without the "
    "model: load them into the FSDP1-wrapped model and save again with "
    "StateDictType.SHARDED_STATE_DICT (a DCP checkpoint ckpttool merges) or FULL_STATE_DICT"
)


# A device mesh's rank list is read from the file; a real one has one entry per rank.
_MAX_MESH_RANKS = 1 << 20

OPTIMIZER_KEYS = frozenset({"state", "param_groups"})


@dataclass(frozen=True)
class RankFile:
    rank: int
    world_size: int
    name: str  # relative to the checkpoint directory


# --------------------------------------------------------------------------------------------
# One rank's file


@dataclass(frozen=True)
class Piece:
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


def load(path: Path, fd: int | Callable[[int, int], bytes], size: int | None = None
         ) -> tuple[archive.RecordBytes, dict[str, archive.ZipEntry], dict[Any, Any]]:
    """The archive of an open rank file and its state dict, unpickled onto stand-ins.

    Raises:
        InputError: damaged, truncated, unsafe, or not a dict.
        UnsupportedError: FSDP1 flat parameters, torch.distributed classes not on the list.
    """
    rb, entries = archive.open_file_archive(fd, str(path),
                                              "the rank file is damaged, copy it again",
                                              size=size)
    try:
        root_value = torchsave.load_pickle(rb, entries, lookup=dtensor_global)
    except ShardedTensorFound as e:
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
        raise torchsave.refusal(path, e, dtensor_global,
                                "a state dict of tensors and DTensors never contains",
                                names=torchsave.archive_globals(rb, entries)) from e
    except torchsave.TooComplex as e:
        raise InputError(f"{path}: {e}, more than any state dict holds; refusing to "
                         "walk it") from e
    except torchsave.PICKLE_ERRORS as e:
        raise InputError(f"{path}: corrupt pickle in torch.save file ({e}); copy it again") \
            from e
    if not isinstance(root_value, dict):
        raise InputError(f"{path}: holds a {type(root_value).__name__}, not a state dict")
    return rb, entries, root_value


def read_file(root: Path, rf: RankFile, stores: Stores = LOCAL
              ) -> tuple[list[Piece], tuple[archive.ZipEntry, ...]]:
    path = root / rf.name
    with archive.opened(path, stores) as (pread, size):
        rb, entries, root_value = load(path, pread, size)
        if root_value and {str(k) for k in root_value} <= OPTIMIZER_KEYS:
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


def top_keys(path: Path, stores: Stores = LOCAL) -> list[str] | None:
    """The top-level keys of a rank file's state dict, or None if it cannot be read."""
    try:
        with archive.opened(path, stores) as (pread, size):
            return [str(k) for k in load(path, pread, size)[2]]
    except CkptError:
        return None


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (torchsave.TensorRef, DTensorRef, ShardedTensorRef))


def _piece(path: Path, rf: RankFile, rb: archive.RecordBytes,
           entries: dict[str, archive.ZipEntry], meshes: dict[int, _Mesh], fqn: str,
           value: Any) -> Piece:
    if isinstance(value, torchsave.TensorRef):
        dtype = _dtype(path, fqn, value.dtype)
        chunk = _chunk(path, entries, fqn, value, (0,) * len(value.shape))
        return Piece(fqn, dtype, value.shape, False, _some(chunk))
    if isinstance(value, ShardedTensorRef):
        return _sharded_piece(path, rf, entries, fqn, value)
    if not isinstance(value, DTensorRef):
        raise UnsupportedError(
            f"{path}: entry '{fqn}' is a {type(value).__name__}, not a tensor; ckpttool merges "
            "rank files whose state dict holds tensors only"
        )
    dtype = _dtype(path, fqn, value.dtype)
    local, spec = value.local, value.spec
    if not isinstance(local, torchsave.TensorRef) or not isinstance(spec, DTensorSpec):
        raise InputError(f"{path}: DTensor '{fqn}' lacks its local tensor or spec; corrupt")
    if local.dtype != dtype:
        raise InputError(f"{path}: DTensor '{fqn}' is {dtype.name} but its local piece is "
                         f"{local.dtype.name}; corrupt")
    mesh_stub = spec.field("mesh")
    if not isinstance(mesh_stub, DeviceMesh):
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
    return Piece(fqn, dtype, value.shape, True,
                  _some(_chunk(path, entries, fqn, local, offsets)))




def _some(chunk: Chunk | None) -> tuple[Chunk, ...]:
    return () if chunk is None else (chunk,)


def _sharded_piece(path: Path, rf: RankFile, entries: dict[str, archive.ZipEntry], fqn: str,
                   value: ShardedTensorRef) -> Piece:
    """An FSDP1 ShardedTensor: this rank's shards sit where their metadata says; the rank and
    world the writer saw must be the file's."""
    dtype = _dtype(path, fqn, value.dtype)
    shards, metadata, group = value.local_shards, value.metadata, value.process_group
    if not isinstance(metadata, ShardedTensorMetadata) or not isinstance(group,
                                                                          ProcessGroupState):
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
            if isinstance(shard, LocalShard) else (None, None)
        if not isinstance(local, torchsave.TensorRef) or not isinstance(shard_md,
                                                                          ShardMetadata):
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
    return Piece(fqn, dtype, value.shape, True, tuple(chunks))


def _shard_box(where: str, shape: tuple[int, ...],
               md: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A ShardMetadata's (offsets, sizes), checked to lie inside ``shape``."""
    offsets = md.field("shard_offsets") if isinstance(md, ShardMetadata) else None
    sizes = md.field("shard_sizes") if isinstance(md, ShardMetadata) else None
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


def _chunk(path: Path, entries: dict[str, archive.ZipEntry], fqn: str,
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


def _read_ints(rb: archive.RecordBytes, entries: dict[str, archive.ZipEntry],
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


def _mesh(path: Path, rf: RankFile, rb: archive.RecordBytes,
          entries: dict[str, archive.ZipEntry], fqn: str, mesh: torchsave.Stub) -> _Mesh:
    """Where this file's rank sits in ``mesh``: the layout picks the ranks of the mesh out of
    ``_rank_map`` (``rank_map.as_strided(complement + layout)``, as ``DeviceMesh.mesh`` does)."""
    layout, rank_map = mesh.field("_layout"), mesh.field("_rank_map")
    if not isinstance(layout, MeshLayout) or not isinstance(rank_map, torchsave.TensorRef):
        raise UnsupportedError(
            f"{path}: the device mesh of DTensor '{fqn}' has no _layout/_rank_map (written by "
            "another torch version than 2.13?); not supported yet"
        )
    try:
        axes = layout.field("axes")
        if not isinstance(axes, tuple) or not all(isinstance(a, FlatLayout) for a in axes):
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
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, Shard):
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

