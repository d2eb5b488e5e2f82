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
as a small int tensor (``_rank_map``) viewed through a ``MeshLayout``, and whose
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

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import CkptError, InputError, UnsupportedError
from ckpttool.formats.base import (
    CheckpointInfo,
    Checksummed,
    Chunk,
    DataFile,
    Problem,
    Reader,
    Tensor,
)
from ckpttool.formats.codecs import archive, torchsave
from ckpttool.formats.rank_files.pieces import (
    FSDP1_LOCAL_MESSAGE,
    OPTIMIZER_KEYS,
    Piece,
    RankFile,
    load,
    read_file,
    top_keys,
)
from ckpttool.formats.rank_files.stand_ins import DTensorRef, ShardedTensorRef, dtensor_global
from ckpttool.storage.store import LOCAL, Store, Stores

NAME = "rank-files"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = ('per-rank `torch.save` files of DTensor (FSDP2) or ShardedTensor (FSDP1 '
    '`SHARDED_STATE_DICT`) state dicts, any names')
WRITTEN_BY = "verl; accelerate's `save_fsdp_model(..., use_dcp=False)`"

# verl's FSDPCheckpointManager names; optim_/extra_state_ files beside them are not the model.
MODEL_FILE_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")



# --------------------------------------------------------------------------------------------
# Finding the files




def _model_files(path: Path, stores: Stores) -> list[RankFile]:
    found = []
    names = [n for n, size in stores.listdir(path).items() if size is not None]
    for name in names:
        m = MODEL_FILE_RE.match(name)
        if m:
            found.append(RankFile(int(m.group(2)), int(m.group(1)), name))
    # By the rank number: rank 10 after rank 9, not between 1 and 2.
    return sorted(found, key=lambda f: (f.rank, f.world_size))


def detect(path: Path, stores: Stores = LOCAL) -> bool:
    return stores.is_dir(path) and (is_rank_files_dir(path, stores)
                                    or _titan_backend(path, stores) is not None)


# torchtitan's second checkpoint backend, torch_checkpointing: per step one
# checkpoint_<rank>.pt of that rank's local tensors and a metadata.pkl of the DTensor sharding
# specs (StridedShard included) that place them. Claimed here so that it is refused as what
# it is, never read as unrelated torch.save files (one rank's pieces merged as whole tensors).
_TITAN_METADATA = "metadata.pkl"
_TITAN_RANK_FILE = re.compile(r"^checkpoint_(\d+)\.pt$")


def _titan_backend(path: Path, stores: Stores) -> str | None:
    """The exit-4 message for a torchtitan torch_checkpointing directory, else None."""
    names = stores.listdir(path)
    if names.get(_TITAN_METADATA) is None:
        return None
    n = sum(1 for name in names if _TITAN_RANK_FILE.match(name))
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
        why = archive.pending_file(path / name)
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
        entries: dict[str, tuple[archive.ZipEntry, ...]] = self.info.detail or {}
        covered = {(c.file, c.crc_span[0]) for t in self.info.tensors for c in t.chunks
                   if c.crc32 is not None and c.crc_span is not None}
        return [Checksummed(file, e.data_offset, e.size, e.crc32, f"entry '{e.name}'")
                for file, found in entries.items() for e in found
                if (file, e.data_offset) not in covered], []


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> Reader:
    return RankReader(info, store)


def is_rank_files_dir(path: Path, stores: Stores = LOCAL) -> bool:
    """True if ``path`` holds per-rank ``torch.save`` files: verl's
    ``model_world_size_<W>_rank_<R>.pt`` (by name and zip magic), or files under any names
    whose pickles name DTensor or ShardedTensor (read as opcodes, never run).

    A set of rank files is claimed when one of its files shows distributed tensors, so that a
    damaged or unsafe sibling is still recognised and :func:`read_info` can say precisely what
    is wrong with it.
    """
    model = _model_files(path, stores)
    if model:
        return archive.is_zip(path / model[0].name, stores)
    return bool(_rank_sets(path, stores))


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


def _holds_distributed_tensors(file: Path, stores: Stores) -> bool:
    """The pickle of the ``torch.save`` archive ``file`` names DTensor or ShardedTensor
    classes. Reads the zip directory and the pickle's bytes; unpickles nothing."""
    try:
        with archive.opened(file, stores) as (pread, size):
            rb = archive.RecordBytes(pread, 0, size, str(file))
            pkl = archive.zip_entries(rb).get("data.pkl")
            if pkl is None:
                return False
            data = rb.read(pkl.data_offset, pkl.size)
    except (CkptError, OSError):
        return False  # damaged: a sibling may still show what the set holds
    if not any(m in data for m in _DISTRIBUTED_MODULES):  # the common answer, at C speed
        return False
    return any(g.startswith(tuple(m.decode() for m in _DISTRIBUTED_MODULES))
               for g in torchsave.named_globals(data))


def _rank_sets(path: Path, stores: Stores) -> list[RankSet]:
    """The sets of per-rank files of ``path`` that hold distributed tensors, by pattern."""
    files = sorted(n for n, size in stores.listdir(path).items()
                   if size is not None and not n.endswith(_NOT_RANK_FILES))
    by_pattern: dict[str, list[tuple[int | None, str]]] = {}
    for name in files:
        if archive.is_zip(path / name, stores):
            pattern, rank = name_rank(name)
            by_pattern.setdefault(pattern, []).append((rank, name))
    sets = []
    for pattern, members in by_pattern.items():
        members.sort(key=lambda m: (m[0] is None, m[0] or 0, m[1]))
        if any(_holds_distributed_tensors(path / name, stores) for _, name in members):
            sets.append(RankSet(pattern, tuple(members)))
    return sets


def rank_files(path: Path, stores: Stores = LOCAL) -> list[RankFile]:
    """The model rank files of ``path``, ordered by rank, checked to be one complete world:
    verl's ``model_world_size_<W>_rank_<R>.pt`` if there are any, else the one set of files
    under any names that holds distributed tensors (the model's, when an optimizer's set lies
    beside it, as accelerate's ``use_dcp=False`` saves leave them).

    Raises:
        InputError: none found, several sets, world sizes differ, or a rank's file is missing.
    """
    files = _model_files(path, stores)
    if not files:
        return _set_files(path, _chosen_set(path, stores))
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


def _is_optimizer(path: Path, rank_set: RankSet, stores: Stores) -> bool:
    for _, name in rank_set.files:
        keys = top_keys(path / name, stores)
        if keys is not None:
            return bool(keys) and set(keys) <= OPTIMIZER_KEYS
    return False


def _chosen_set(path: Path, stores: Stores) -> RankSet:
    sets = _rank_sets(path, stores)
    if not sets:
        raise InputError(f"{path}: no per-rank torch.save files of DTensors or ShardedTensors")
    if len(sets) == 1:
        return sets[0]
    models = [s for s in sets if not _is_optimizer(path, s, stores)]
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
# The whole checkpoint


def read_info(path: str | os.PathLike[str], *, stores: Stores = LOCAL) -> CheckpointInfo:
    """Describe a directory of per-rank DTensor state-dict files. Reads pickles and zip
    headers (and each mesh's tiny rank list), never tensor data; runs nothing from the files.

    Returns:
        A checkpoint with raw chunks: each sharded piece once,
        a replicated tensor (or a plain one in a world of several) from the lowest rank.

    Raises:
        InputError: a rank file is missing, misnamed, unsafe, corrupt, or the ranks disagree.
        UnsupportedError: FSDP1 flat parameters, Partial/StridedShard placements,
            non-contiguous pieces, non-tensor entries.
    """
    root = Path(path)
    titan = _titan_backend(root, stores)
    if titan is not None:
        raise UnsupportedError(titan)
    files = rank_files(root, stores)
    order: list[str] = []
    first: dict[str, Piece] = {}
    chunks: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk]] = {}
    archives: dict[str, tuple[archive.ZipEntry, ...]] = {}  # every entry, for verify's CRCs
    for rf in files:
        pieces, archives[rf.name] = read_file(root, rf, stores)
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
        files=tuple(DataFile(f.name, stores.file_size(root / f.name)) for f in files),
        metadata_name="the rank files' pickles", sharded=True, num_ranks=len(files),
        detail=archives, single_file=False)


def sets_beside(path: Path, own: frozenset[str], stores: Stores = LOCAL) -> list[RankSet]:
    """The other sets of per-rank files of distributed tensors in ``path``, none of whose
    files is in ``own`` (verl's ``optim_world_size_<W>_rank_<R>.pt`` beside its model files)."""
    return [s for s in _rank_sets(path, stores)
            if not any(name in own for _, name in s.files)]


def read_archives(path: Path, rank_set: RankSet, stores: Stores = LOCAL) -> CheckpointInfo:
    """A set of per-rank files that ckpttool checks but does not merge (an optimizer's
    DTensor state, which :func:`read_info` refuses): every file of the world is there, each
    archive's headers are sound and its pickle passes the allow-list (nothing is run), and
    every entry is listed for verify's CRC checks. No tensors are described.

    Raises:
        InputError: a rank's file is missing, damaged or unsafe.
        UnsupportedError: a form of ShardedTensor or torch.distributed class not read.
    """
    files = _set_files(path, rank_set)
    archives: dict[str, tuple[archive.ZipEntry, ...]] = {}
    for rf in files:
        with archive.opened(path / rf.name, stores) as (pread, size):
            archives[rf.name] = tuple(load(path / rf.name, pread, size)[1].values())
    return CheckpointInfo(
        format=NAME, root=path, tensors=(), objects=(),
        files=tuple(DataFile(f.name, stores.file_size(path / f.name)) for f in files),
        metadata_name="the rank files' pickles", sharded=True, num_ranks=len(files),
        detail=archives, single_file=False)


def _describe(p: Piece) -> str:
    kind = "a distributed tensor" if p.distributed else "a tensor"
    return f"{kind} {p.dtype.name} {list(p.shape)}"


__all__ = ["FSDP1_LOCAL_MESSAGE", "NAME", "SUMMARY", "WRITTEN_BY",
           "DTensorRef", "RankFile", "RankSet", "ShardedTensorRef",
           "detect", "dtensor_global", "name_rank",
           "is_rank_files_dir", "open_reader", "pending", "rank_files", "read_info"]
