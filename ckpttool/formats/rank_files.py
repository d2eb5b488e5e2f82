"""Per-rank ``torch.save`` files of DTensor state dicts: ``model_world_size_<W>_rank_<R>.pt``.

verl (and trainers like it) save an FSDP2 model with one ``torch.save(model.state_dict())``
per rank. Each value is a DTensor (its local piece plus the device mesh and placements that say
where the piece sits in the full tensor) or, for buffers and in a world of one, a plain tensor.
The result is a :class:`~ckpttool.formats.base.CheckpointInfo` whose chunks are raw byte
ranges inside the rank files (with the zip's CRC-32 where a piece is its whole storage).

Nothing here imports torch or runs code from the files. A DTensor pickles as
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, global size,
global stride, storage offset, layout, device, requires_grad), state)`` where ``state`` holds
``_local_tensor`` (an ordinary tensor whose storage is a ``data/<key>`` entry of the same
archive) and ``_spec``: a ``DTensorSpec`` whose ``mesh`` (a ``DeviceMesh``) carries its ranks
as a small int tensor (``_rank_map``) viewed through a ``_MeshLayout``, and whose
``placements`` are ``Shard(dim)`` / ``Replicate()``. The allow-list maps exactly those globals
(as torch 2.13 writes them) onto inert stand-ins; anything else is refused by name before it is
looked up. The rank comes from the file name; each piece's offsets follow from the rank's
coordinate in the mesh and the placements, as DTensor computes them.

FSDP1 ``LOCAL_STATE_DICT`` files (flat parameters as ``ShardedTensor``) are recognised too, and
refused: flattened parameters cannot be split back into tensors without the model.
"""

from __future__ import annotations

import itertools
import os
import pickle
import pickletools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats import torchsave
from ckpttool.formats.base import RAW, CheckpointInfo, Chunk, DataFile, Reader, Tensor
from ckpttool.formats.dtypes import DType
from ckpttool.formats.store import file_size

NAME = "rank-files"

# verl's FSDPCheckpointManager names; optim_/extra_state_ files beside them are not the model.
MODEL_FILE_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
# accelerate's names for FSDP1 LOCAL_STATE_DICT saves (recognised only to explain the refusal).
ACCELERATE_LOCAL_RE = re.compile(r"^pytorch_model_fsdp(?:_\d+)?_rank(\d+)\.bin$")

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


def _accelerate_local_files(path: Path) -> list[tuple[int, str]]:
    try:
        names = [p.name for p in path.iterdir() if p.is_file()]
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := ACCELERATE_LOCAL_RE.match(n))]
    return sorted(found)


def _is_zip(file: Path) -> bool:
    try:
        with open(file, "rb") as f:
            return f.read(4) == torchsave.ZIP_MAGIC
    except OSError:
        return False


def detect(path: Path) -> bool:
    return path.is_dir() and is_rank_files_dir(path)


def open_reader(info: CheckpointInfo) -> Reader:
    """Pieces are raw byte ranges inside the rank files: the neutral reader reads them."""
    return Reader(info)


def is_rank_files_dir(path: Path) -> bool:
    """True if ``path`` holds per-rank ``torch.save`` files (``model_world_size_<W>_rank_<R>.pt``,
    or accelerate's FSDP1 ``pytorch_model_fsdp_rank<R>.bin``) that start like zip archives.

    Only the names and the zip magic are looked at here: a damaged or unsafe file is still
    recognised, so that :func:`read_info` can say precisely what is wrong with it.
    """
    model = _model_files(path)
    if model:
        return _is_zip(path / model[0].name)
    local = _accelerate_local_files(path)
    return bool(local) and _is_zip(path / local[0][1])


def rank_files(path: Path) -> list[RankFile]:
    """The model rank files of ``path``, ordered by rank, checked to be one complete world.

    Raises:
        InputError: none found, world sizes differ, or a rank's file is missing.
    """
    files = _model_files(path)
    if not files:
        raise InputError(f"{path}: no model_world_size_<W>_rank_<R>.pt files")
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


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, *_: Any) -> _WrapperArgs:
    if cls is not _DTensorClass:
        raise pickle.UnpicklingError("a tensor subclass other than DTensor")
    return _WrapperArgs(dtype, torchsave.size(size))


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> DTensorRef:
    if func is not _rebuild_wrapper_subclass or new_type is not _DTensorClass:
        raise pickle.UnpicklingError("a tensor subclass other than DTensor")
    wrapper = func(*args)
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


class _ShardedTensorFound(Exception):
    """The pickle names ``torch.distributed._shard`` (FSDP1's ShardedTensor); nothing was run."""

    def __init__(self, qualname: str) -> None:
        super().__init__(qualname)
        self.qualname = qualname


def dtensor_global(module: str, name: str) -> Any | None:
    """The allow-list of a DTensor state-dict pickle: :func:`torchsave.record_global` plus
    DTensor's spec, mesh and placements (torch 2.13 names), as inert stand-ins.

    Raises:
        _ShardedTensorFound: a ``torch.distributed._shard`` global (an FSDP1 ShardedTensor).
    """
    found = _DTENSOR_GLOBALS.get((module, name))
    if found is not None:
        return found
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
    distributed: bool  # a DTensor (else a plain tensor, the same on every rank)
    chunk: Chunk | None  # None when this rank's piece is empty


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


def _read_file(root: Path, rf: RankFile) -> list[_Piece]:
    path = root / rf.name
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if os.pread(fd, 4, 0) != torchsave.ZIP_MAGIC:
            raise InputError(f"{path}: not a torch.save file (no zip header); the rank file is "
                             "damaged, copy it again")
        rb = torchsave.RecordBytes(fd, 0, size, where)
        entries = torchsave.zip_entries(rb)
        torchsave.check_byteorder(rb, entries)
        try:
            root_value = torchsave.load_pickle(rb, entries, lookup=dtensor_global)
        except _ShardedTensorFound as e:
            pkl = entries["data.pkl"]
            if _has_flat_param(_pickle_strings(rb.read(pkl.data_offset, pkl.size))):
                raise UnsupportedError(FSDP1_LOCAL_MESSAGE.format(path=path)) from None
            raise UnsupportedError(
                f"{path}: holds ShardedTensor values ('{e.qualname}'), as FSDP1 "
                "SHARDED_STATE_DICT saved with torch.save writes them; ckpttool does not read "
                "these yet. Save with torch.distributed.checkpoint (a DCP checkpoint) instead"
            ) from None
        except torchsave.Refused as e:
            if e.qualname.startswith("torch.distributed."):
                raise UnsupportedError(
                    f"{path}: the pickle names '{e.qualname}', a torch.distributed class "
                    "ckpttool does not read (DTensor files are read as torch 2.13 writes them; "
                    "this one may come from another torch version). Nothing was executed"
                ) from None
            raise InputError(
                f"{path}: refused to load: the pickle asks for '{e.qualname}', which a state "
                "dict of tensors and DTensors never contains; the file may be malicious "
                "(nothing was executed)"
            ) from None
        except torchsave.TooComplex as e:
            raise InputError(f"{path}: {e}, more than any state dict holds; refusing to "
                             "walk it") from None
        except torchsave.PICKLE_ERRORS as e:
            raise InputError(f"{path}: corrupt pickle in torch.save file ({e}); copy it again") \
                from None
        if not isinstance(root_value, dict):
            raise InputError(f"{path}: holds a {type(root_value).__name__}, not a state dict")
        meshes: dict[int, _Mesh] = {}
        pieces = []
        for key_path, value in torchsave.flatten(root_value, is_tensor=_is_tensor,
                                                 expand_root=True):
            fqn = ".".join(key_path)
            if "flat_param" in fqn:
                raise UnsupportedError(FSDP1_LOCAL_MESSAGE.format(path=path))
            pieces.append(_piece(path, rf, rb, entries, meshes, fqn, value))
        return pieces
    finally:
        os.close(fd)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (torchsave.TensorRef, DTensorRef))




def _piece(path: Path, rf: RankFile, rb: torchsave.RecordBytes,
           entries: dict[str, torchsave.ZipEntry], meshes: dict[int, _Mesh], fqn: str,
           value: Any) -> _Piece:
    if isinstance(value, torchsave.TensorRef):
        dtype = _dtype(path, fqn, value.dtype)
        chunk = _chunk(path, entries, fqn, value, (0,) * len(value.shape))
        return _Piece(fqn, dtype, value.shape, False, chunk)
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
    return _Piece(fqn, dtype, value.shape, True, _chunk(path, entries, fqn, local, offsets))


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
            from None
    if rf.rank not in ranks:
        raise InputError(f"{path}: the device mesh of DTensor '{fqn}' (ranks {ranks}) does not "
                         f"include rank {rf.rank}, which the file name gives; misnamed file?")
    bad = [r for r in ranks if not 0 <= r < rf.world_size]
    if bad:
        raise InputError(f"{path}: the device mesh of DTensor '{fqn}' names rank {bad[0]}, "
                         f"outside the world of {rf.world_size} the file names give")
    shape = tuple(_prod(n for n, _ in modes) for modes in modes_by_axis)
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
            if q >= num_ranks or taken[q]:
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


def read_info(path: str | os.PathLike[str]) -> CheckpointInfo:
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
    if not _model_files(root):
        local = _accelerate_local_files(root)
        if local:
            _read_file(root, RankFile(local[0][0], len(local), local[0][1]))  # raises FSDP1
            raise InputError(f"{root / local[0][1]}: a per-rank file without the world size in "
                             "its name; expected model_world_size_<W>_rank_<R>.pt files")
    files = rank_files(root)
    order: list[str] = []
    first: dict[str, _Piece] = {}
    chunks: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk]] = {}
    for rf in files:
        pieces = _read_file(root, rf)
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
            if p.chunk is None:
                continue
            if not p.distributed and rf.rank != 0:
                continue  # a plain tensor is the same on every rank (an FSDP2 buffer)
            # A replicated piece appears on several ranks: keep the lowest rank's copy.
            chunks.setdefault(p.fqn, {}).setdefault((p.chunk.offsets, p.chunk.sizes), p.chunk)
    tensors = tuple(
        Tensor(fqn, (fqn,), first[fqn].dtype, first[fqn].shape,
               tuple(chunks.get(fqn, {}).values()))
        for fqn in order
    )
    return CheckpointInfo(
        format=NAME, root=root, tensors=tensors, objects=(),
        files=tuple(DataFile(f.name, file_size(root / f.name)) for f in files),
        metadata_name="the rank files' pickles", sharded=True, num_ranks=len(files))


def _describe(p: _Piece) -> str:
    kind = "a DTensor" if p.distributed else "a tensor"
    return f"{kind} {p.dtype.name} {list(p.shape)}"


def _prod(values: Iterable[int]) -> int:
    n = 1
    for v in values:
        n *= v
    return n


__all__ = ["FSDP1_LOCAL_MESSAGE", "NAME", "DTensorRef", "RankFile", "detect", "dtensor_global",
           "is_rank_files_dir", "open_reader", "rank_files", "read_info"]
