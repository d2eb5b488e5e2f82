"""DeepSpeed ZeRO-2 / ZeRO-3 checkpoints: ``global_step<N>/``, as ``save_checkpoint`` writes it.

A save leaves ``latest`` (the tag, e.g. ``global_step500``) beside the tag directory, which holds
per rank a ``*_optim_states.pt`` (the optimizer's flat fp32 master partitions) and a
``*_model_states.pt`` (``mp_rank_00_model_states.pt`` once for ZeRO-1/2,
``zero_pp_rank_<R>_mp_rank_00_model_states.pt`` per rank for ZeRO-3) that names what is in the
partitions: ``param_shapes`` (per optimizer group, in flattening order), ``frozen_param_shapes``
with ``frozen_param_fragments``, ``buffer_names`` (values in ``module``) and ``shared_params``
(a tied weight, stored once). Either directory is claimed.

The full weights are the fp32 masters, as DeepSpeed's own ``zero_to_fp32.py`` rebuilds them
(this module follows its layout rules, 0.19):

* ZeRO-1/2 (``single_partition_of_fp32_groups``): per group, the ranks' partitions
  concatenated (their lengths may differ by a few elements) are the group's flat vector; its
  parameters follow each other, each then padded by ``param_alignment_paddings`` where the file
  has them, the vector's end padded to a multiple of 2 x world size. A parameter is one range
  of that vector, so it lies in one or two (or more) ranks' partitions.
* ZeRO-3 (``fp32_flat_groups``): every parameter is split on its own: rank r holds its flat
  elements ``[r * p, (r + 1) * p)``, ``p = ceil(numel / world)`` (the last piece padded), at the
  same offset of every rank's groups, parameters back to back. Frozen parameters are split the
  same way into the model-state files (``frozen_param_fragments``).

A range of a parameter's flat elements is not a box of its shape (it starts and ends inside
rows), so each becomes the few boxes it is made of (at most 2 x ndim - 1), each one contiguous
run of bytes in its rank's file: raw chunks that merge copies or casts in streaming blocks.
Buffers and ZeRO-2's frozen parameters are whole tensors in the model-state file. A tied weight
is a second tensor over the same chunks, so that the tie policy sees it as any format's.

The pickles are read by the allow-list unpickler of :mod:`torchsave`, with inert stand-ins for
the few DeepSpeed globals these files name (the ZeRO stage enum, the loss scaler, fragment
addresses) and the ``torch.Tensor`` rebuild ZeRO-3 uses for its partitions; anything else is
refused by name and nothing is executed. Tensor data is never read here.

Not read (refused with a message, exit 4): tensor- or pipeline-parallel saves (``mp_rank_01``,
AutoTP, ``layer_*``), mixture-of-experts (``expp_rank_*``, AutoEP), universal checkpoints
(``*_universal/``: ``zero/<param>/fp32.pt``) and groups partitioned over different worlds.
"""

from __future__ import annotations

import bisect
import math
import os
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import (
    RAW,
    CheckpointInfo,
    Checksummed,
    Chunk,
    DataFile,
    ObjectEntry,
    Problem,
    Reader,
    Tensor,
)
from ckpttool.formats.codecs import archive, policy, torchsave
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.storage import sidefiles
from ckpttool.storage.store import LOCAL, Store, Stores

NAME = "deepspeed"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = ('`latest` + `global_step<N>/` with `*_optim_states.pt` and `*_model_states.pt` '
    '(ZeRO-1/2/3)')
WRITTEN_BY = "DeepSpeed's `engine.save_checkpoint` (HF Trainer with DeepSpeed)"
LATEST = "latest"
# A tag name; a larger "latest" is not DeepSpeed's.
_LATEST = sidefiles.Kind("DeepSpeed 'latest' file (a tag name)", 1024)

_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_MOE_RE = re.compile(r"^(?:bf16_)?expp_rank_\d+_mp_rank_\d+_(?:optim|model)_states\.pt$")
_PIPELINE_RE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$|^layer_\d+-model_states\.pt$")

# What each ZeRO stage calls its fp32 master partitions.
_FP32_KEYS = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups",
              3: "fp32_flat_groups"}
# Non-tensor values of the model-state file shown as entries (plain values only).
_OBJECT_KEYS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "ds_version")


# --------------------------------------------------------------------------------------------
# Finding the directory


def _names(directory: Path, stores: Stores) -> list[str]:
    """The regular files in ``directory``."""
    return [n for n, size in stores.listdir(directory).items() if size is not None]


def _subdirs(directory: Path, stores: Stores) -> list[Path]:
    return [directory / n for n, size in stores.listdir(directory).items()
            if size is None and stores.is_dir(directory / n)]


def is_tag_dir(path: Path, stores: Stores = LOCAL) -> bool:
    """True if ``path`` holds ZeRO optimizer-state and model-state files (names and zip magic
    only: a damaged one is still claimed, so that ``read_info`` says what is wrong)."""
    names = _names(path, stores)
    optim = sorted(n for n in names if _OPTIM_RE.match(n))
    model = [n for n in names if _MODEL_RE.match(n) or _ZERO3_MODEL_RE.match(n)]
    return bool(optim) and bool(model) and archive.is_zip(path / optim[0], stores)


def _read_latest(path: Path, stores: Stores = LOCAL) -> str | None:
    """The tag ``path/latest`` names, if it is a small regular file (None otherwise)."""
    try:
        data = stores.read_small(path / LATEST, _LATEST)
    except (OSError, InputError):  # recognising never waits on a FIFO nor reads a device
        return None
    return data.decode("utf-8", "replace").strip()


def _latest_tag(path: Path, stores: Stores) -> str | None:
    tag = _read_latest(path, stores)
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\x00" in tag:
        return None
    return tag if is_tag_dir(path / tag, stores) else None


# A universal checkpoint (DeepSpeed's ds_to_universal.py): zero/<param>/fp32.pt and the
# optimizer's moments per parameter, beside mp_rank_00_model_states.pt.
UNIVERSAL_DIR = "zero"


def _unsupported_layout(path: Path, stores: Stores) -> str | None:
    """What a DeepSpeed directory ckpttool recognises but does not read is (for exit 4), or
    None: a universal checkpoint (or its zero/ directory), or model-state files of several
    tensor-parallel ranks without ZeRO optimizer files (AutoTP at ZeRO stage 0)."""
    names = _names(path, stores)
    if stores.is_dir(path / UNIVERSAL_DIR) and "mp_rank_00_model_states.pt" in names:
        return (f"{path}: a DeepSpeed universal checkpoint (ds_to_universal.py: "
                f"{UNIVERSAL_DIR}/<param>/fp32.pt); not supported yet. Merge the ZeRO "
                "checkpoint it was converted from (the global_step<N> directory beside it)")
    if path.name == UNIVERSAL_DIR and "optimizer_state.pt" in names and any(
            stores.file_size(p / "fp32.pt") is not None for p in _subdirs(path, stores)):
        return (f"{path}: the parameter directory of a DeepSpeed universal checkpoint; not "
                "supported yet. Merge the ZeRO checkpoint it was converted from")
    ranks = sorted(int(m.group(1)) for n in names if (m := _MODEL_RE.match(n)))
    if len(ranks) > 1 and not any(_OPTIM_RE.match(n) for n in names):
        return (f"{path / f'mp_rank_{ranks[-1]:02d}_model_states.pt'}: a tensor-parallel "
                f"DeepSpeed checkpoint ({len(ranks)} model-parallel ranks, AutoTP or "
                "Megatron); not supported yet. Save with tensor parallelism 1, or convert it "
                "with DeepSpeed's ds_to_universal.py and load it on one rank")
    return None


def detect(path: Path, stores: Stores = LOCAL) -> bool:
    """A tag directory, or a directory with ``latest`` beside one (even when ``latest`` names
    another: ``read_info`` then says so, rather than a stale tag being merged unnoticed), or a
    DeepSpeed layout that ``read_info`` refuses by name."""
    if not stores.is_dir(path):
        return False
    if is_tag_dir(path, stores) or _unsupported_layout(path, stores) is not None:
        return True
    if _read_latest(path, stores) is None:
        return False
    if _latest_tag(path, stores) is not None:
        return True
    return any(is_tag_dir(p, stores) for p in _subdirs(path, stores))


def pending(path: Path) -> str | None:
    """DeepSpeed writes ``latest`` (beside the tag directories) once a save is complete: a tag
    directory newer than the tag ``latest`` names (by its step number) is still being
    written. Without ``latest`` nothing says so."""
    if not is_tag_dir(path):
        return None
    tag = _read_latest(path.parent)
    if tag is None or tag == path.name:
        return None
    mine, theirs = _step_of(path.name), _step_of(tag)
    if mine is not None and theirs is not None and mine > theirs:
        return f"{LATEST} names {tag}, an earlier tag (DeepSpeed writes {LATEST} last)"
    return None


def _step_of(tag: str) -> int | None:
    found = re.findall(r"\d+", tag)
    return int(found[-1]) if found else None


# --------------------------------------------------------------------------------------------
# The allow-list: what DeepSpeed's pickles name, as inert stand-ins


class _LossScaler(torchsave.Stub):
    pass


class _FragmentAddress(torchsave.Stub):
    pass


class _TensorClass(metaclass=policy.Sealed):
    """``torch.Tensor`` as ``_rebuild_from_type_v2`` names it (a plain tensor with attributes:
    ZeRO-3 tags its partitions with ``ds_id``)."""


def _zero_stage(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= 3:
        raise pickle.UnpicklingError(f"ZeRO stage {value!r}")
    return value


_REBUILD = torchsave._rebuild_v2  # what record_global maps torch._utils._rebuild_tensor_v2 to


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if new_type is not _TensorClass or func is not _REBUILD or not isinstance(args, tuple):
        raise pickle.UnpicklingError("a tensor subclass")
    return _REBUILD(*args)  # the attributes in ``state`` (ds_id) are not needed


_GLOBALS: dict[tuple[str, str], Any] = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _LossScaler,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _LossScaler,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _FragmentAddress,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorClass,
    ("torch", "Size"): torchsave.size,
}


def deepspeed_global(module: str, name: str) -> Any | None:
    """The allow-list of DeepSpeed's checkpoint pickles: :func:`torchsave.record_global` plus
    the globals above (DeepSpeed 0.19 names)."""
    found = _GLOBALS.get((module, name))
    return found if found is not None else torchsave.record_global(module, name)


# --------------------------------------------------------------------------------------------
# One file


@dataclass(frozen=True)
class _File:
    name: str  # relative to the checkpoint root
    path: Path
    value: dict[str, Any]
    entries: dict[str, archive.ZipEntry]
    size: int


def _load(root: Path, name: str, stores: Stores) -> _File:
    path = root / name
    where = str(path)
    with archive.opened(path, stores) as (pread, size):
        rb, entries = archive.open_file_archive(pread, where, "copy the checkpoint again",
                                                size=size)
        try:
            value = torchsave.load_pickle(rb, entries, lookup=deepspeed_global)
        except torchsave.Refused as e:
            if e.qualname.startswith("deepspeed."):
                raise UnsupportedError(
                    f"{path}: the pickle names '{e.qualname}', a DeepSpeed class ckpttool does "
                    "not read (written by another DeepSpeed version?); nothing was executed. "
                    "Convert with the zero_to_fp32.py script saved beside the checkpoint"
                ) from e
            raise torchsave.refusal(path, e, deepspeed_global,
                                    "a DeepSpeed checkpoint never contains",
                                    names=torchsave.archive_globals(rb, entries)) from e
        except torchsave.TooComplex as e:
            raise InputError(f"{path}: {e}, more than any checkpoint holds; refusing to "
                             "walk it") from e
        except torchsave.PICKLE_ERRORS as e:
            raise InputError(f"{path}: corrupt pickle in torch.save file ({e}); copy it "
                             "again") from e
    if not isinstance(value, dict):
        raise InputError(f"{path}: holds a {type(value).__name__}, not a DeepSpeed state dict")
    return _File(name, path, value, entries, rb.length)


@dataclass(frozen=True)
class _Flat:
    """A 1-D contiguous tensor of a file: where its elements are."""

    file: str
    start: int  # absolute byte offset of element 0
    numel: int
    dtype: DType
    crc32: int | None  # the storage's, when the tensor is all of it
    span: tuple[int, int]  # (offset, size) of its storage


def _flat(f: _File, ref: Any, what: str) -> _Flat:
    if not isinstance(ref, torchsave.TensorRef):
        raise InputError(f"{f.path}: {what} is not a tensor; corrupt")
    dtype = ref.dtype
    if not isinstance(dtype, DType):
        raise UnsupportedError(f"{f.path}: {what} has a dtype ckpttool cannot write")
    numel = math.prod(ref.shape)
    contiguous = ref.stride == torchsave.contiguous_strides(ref.shape) or numel <= 1
    if not contiguous:
        raise UnsupportedError(f"{f.path}: {what} is saved as a non-contiguous view; not "
                               "supported")
    data = f.entries.get(f"data/{ref.storage.key}")
    if data is None:
        raise InputError(f"{f.path}: {what} names storage 'data/{ref.storage.key}', which the "
                         "archive lacks; corrupt")
    why = ref.storage.claims(data.size)
    if why is not None:
        raise InputError(f"{f.path}: {what}: {why}")
    start = ref.storage_offset * dtype.itemsize
    nbytes = numel * dtype.itemsize
    if start + nbytes > data.size:
        raise InputError(f"{f.path}: {what} reaches past the end of its storage; corrupt")
    whole = start == 0 and nbytes == data.size
    return _Flat(f.name, data.data_offset + start, numel, dtype,
                 data.crc32 if whole else None, (data.data_offset, data.size))


def _field(f: _File, value: dict[str, Any], key: str, kind: type | tuple[type, ...],
           what: str | None = None) -> Any:
    found = value.get(key)
    if not isinstance(found, kind):
        raise InputError(f"{f.path}: {what or key!r} is missing or not a "
                         f"{getattr(kind, '__name__', 'container')}; not a DeepSpeed ZeRO "
                         "checkpoint, or a corrupt one")
    return found


def _shape(f: _File, name: str, value: Any) -> tuple[int, ...]:
    return torchsave.ints(value, f"{f.path}: the shape of '{name}'")


# --------------------------------------------------------------------------------------------
# Geometry: a range of a tensor's flat elements as boxes


def flat_boxes(shape: tuple[int, ...], start: int, stop: int
               ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes ``(offsets, sizes)`` that elements ``[start, stop)`` of a C-ordered tensor of
    ``shape`` are made of, in order; each is one contiguous run (at most 2 x ndim - 1)."""
    if start >= stop:
        return
    if not shape:
        yield (), ()
        return
    inner = math.prod(shape[1:])
    rest = shape[1:]
    first, first_off = divmod(start, inner)
    last, last_off = divmod(stop, inner)
    if first == last:
        for o, s in flat_boxes(rest, first_off, last_off):
            yield (first, *o), (1, *s)
        return
    row = first
    if first_off:
        for o, s in flat_boxes(rest, first_off, inner):
            yield (row, *o), (1, *s)
        row += 1
    if last > row:
        yield (row, *(0,) * len(rest)), (last - row, *rest)
    if last_off:
        for o, s in flat_boxes(rest, 0, last_off):
            yield (last, *o), (1, *s)


def _chunks(shape: tuple[int, ...], start: int, count: int, src: _Flat, src_elem: int
            ) -> Iterator[Chunk]:
    """Elements ``[start, start + count)`` of a tensor, stored from element ``src_elem`` of
    ``src`` on, as raw chunks (no CRC of their own: the storage's is checked once, apart)."""
    item = src.dtype.itemsize
    pos = start
    for offsets, sizes in flat_boxes(shape, start, start + count):
        n = math.prod(sizes)
        yield Chunk(offsets, sizes, src.file, src.start + (src_elem + pos - start) * item,
                    n * item, encoding=RAW)
        pos += n


# --------------------------------------------------------------------------------------------
# The whole checkpoint


@dataclass(frozen=True)
class Detail:
    """What the reader needs beyond the neutral model: every archive's entries."""

    entries: dict[str, tuple[archive.ZipEntry, ...]]  # per file, offsets absolute


@dataclass
class _Param:
    dtype: DType
    shape: tuple[int, ...]
    chunks: list[Chunk]


def _tag(root: Path, stores: Stores) -> tuple[Path, str]:
    """The tag directory and the prefix of file names relative to ``root``."""
    if is_tag_dir(root, stores):
        return root, ""
    tag = _read_latest(root, stores)
    if tag is None:
        raise InputError(f"{root}: no *_optim_states.pt files and no readable '{LATEST}' file; "
                         "pass the directory DeepSpeed saved (holding 'latest') or its "
                         "global_step<N> directory")
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\x00" in tag:
        raise InputError(f"{root / LATEST}: holds {tag[:80]!r}, not a tag directory name; "
                         "pass the global_step<N> directory itself")
    if not is_tag_dir(root / tag, stores):
        raise InputError(f"{root / LATEST}: names '{tag}', which is not a DeepSpeed checkpoint "
                         "directory here; pass an existing global_step<N> directory instead")
    return root / tag, f"{tag}/"


def read_info(path: str | os.PathLike[str], *, stores: Stores = LOCAL) -> CheckpointInfo:
    """Describe a DeepSpeed ZeRO checkpoint (the directory holding ``latest``, or the tag
    directory). Reads pickles and zip headers only, never tensor data; runs nothing.

    Raises:
        InputError: a rank's file is missing, damaged or unsafe, or the files disagree.
        UnsupportedError: tensor, pipeline or expert parallelism; a stage ckpttool does not
            read; a DeepSpeed class these pickles do not normally name.
    """
    root = Path(path)
    unsupported = None if is_tag_dir(root, stores) else _unsupported_layout(root, stores)
    if unsupported is not None:
        raise UnsupportedError(unsupported)
    tag_dir, prefix = _tag(root, stores)
    optim_files, flats, osd = _optimizer_files(root, tag_dir, prefix, stores)
    stage, world = osd["zero_stage"], len(optim_files)
    model_files, params = _parameters(root, prefix, optim_files, flats, osd, stores)
    m0 = model_files[0]
    module = _field(m0, m0.value, "module", dict)
    order = [k for k in module if isinstance(k, str) and k in params]
    order += [k for k in params if k not in set(order)]
    tensors = tuple(Tensor(k, (k,), params[k].dtype, params[k].shape, tuple(params[k].chunks))
                    for k in order)
    values = {k: m0.value[k] for k in _OBJECT_KEYS
              if isinstance(m0.value.get(k), (int, str)) and not isinstance(m0.value[k], bool)}
    values["zero_stage"] = stage
    files = optim_files + model_files
    return CheckpointInfo(
        format=NAME, root=root, tensors=tensors,
        objects=tuple(ObjectEntry(k, (k,)) for k in values),
        files=tuple(DataFile(f.name, f.size) for f in files),
        metadata_name="the DeepSpeed model-state and optimizer-state pickles", sharded=True,
        num_ranks=world, version=str(m0.value.get("ds_version") or "") or None, values=values,
        detail=Detail({f.name: tuple(f.entries.values()) for f in files}), single_file=False)


def _optimizer_files(root: Path, tag_dir: Path, prefix: str, stores: Stores
                     ) -> tuple[list[_File], list[list[_Flat]], dict[str, Any]]:
    """Every rank's optimizer-state file (checked to be one save's, of a layout ckpttool
    reads), each rank's fp32 partitions, and rank 0's optimizer state dict."""
    names = _names(tag_dir, stores)
    for n in names:
        if _MOE_RE.match(n):
            raise UnsupportedError(f"{tag_dir / n}: a mixture-of-experts (expert-parallel) "
                                   "DeepSpeed checkpoint; not supported. Convert it with "
                                   "zero_to_fp32.py")
        if _PIPELINE_RE.match(n):
            raise UnsupportedError(f"{tag_dir / n}: a pipeline-parallel DeepSpeed checkpoint; "
                                   "not supported. Convert it with DeepSpeed's "
                                   "ds_to_universal.py")
    optim: dict[int, str] = {}
    for n in names:
        m = _OPTIM_RE.match(n)
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise UnsupportedError(f"{tag_dir / n}: a tensor-parallel DeepSpeed checkpoint "
                                   f"(model-parallel rank {int(m.group(2))}); not supported")
        if int(m.group(1)) in optim:
            raise InputError(f"{tag_dir}: two optimizer-state files for rank {m.group(1)} "
                             f"({optim[int(m.group(1))]}, {n}); remove the stale one")
        optim[int(m.group(1))] = n
    first = _load(root, prefix + optim[min(optim)], stores)
    osd = _field(first, first.value, "optimizer_state_dict", dict)
    stage = osd.get("zero_stage")
    if stage not in _FP32_KEYS:
        raise UnsupportedError(f"{first.path}: ZeRO stage {stage!r}; ckpttool reads stages 1, "
                               "2 and 3")
    counts = osd.get("partition_count")
    count_list = counts if isinstance(counts, list) else [counts]
    if not count_list or not all(type(c) is int and c > 0 for c in count_list):
        raise InputError(f"{first.path}: partition_count {counts!r}; corrupt")
    if len(set(count_list)) > 1:
        raise UnsupportedError(f"{first.path}: parameter groups partitioned over different "
                               f"worlds ({count_list}, expert parallelism); not supported")
    world = count_list[0]
    missing = [r for r in range(world) if r not in optim]
    if missing or len(optim) != world:
        what = (f"rank {missing[0]}'s optimizer-state file is missing" if missing
                else f"{len(optim)} optimizer-state files for a world of {world}")
        raise InputError(f"{tag_dir}: {what}; a rank did not finish saving or files of another "
                         "save are mixed in. Copy the whole checkpoint again")
    optim_files = [first] + [_load(root, prefix + optim[r], stores) for r in range(1, world)]
    flats: list[list[_Flat]] = []
    for r, f in enumerate(optim_files):
        sd = _field(f, f.value, "optimizer_state_dict", dict)
        if sd.get("zero_stage") != stage:
            raise InputError(f"{f.path}: ZeRO stage {sd.get('zero_stage')!r}, rank 0's is "
                             f"{stage}; the files come from different saves")
        groups = _field(f, sd, _FP32_KEYS[stage], list)
        flats.append([_flat(f, g, f"{_FP32_KEYS[stage]}[{i}] of rank {r}")
                      for i, g in enumerate(groups)])
    dtypes = {g.dtype for fl in flats for g in fl}
    if len(dtypes) > 1:
        raise InputError(f"{tag_dir}: the fp32 partitions have different dtypes; corrupt")
    return optim_files, flats, osd


def _parameters(root: Path, prefix: str, optim_files: list[_File], flats: list[list[_Flat]],
                osd: dict[str, Any], stores: Stores) -> tuple[list[_File], dict[str, _Param]]:
    """The model-state files and every parameter (trainable, frozen, buffers, shared
    aliases) as chunks of the fp32 partitions or of the model states."""
    stage, world = osd["zero_stage"], len(optim_files)
    if stage <= 2:
        model_names = [prefix + "mp_rank_00_model_states.pt"]
    else:
        model_names = [prefix + f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
                       for r in range(world)]
    for n in model_names:
        if stores.file_size(root / n) is None:
            raise InputError(f"{root / n}: missing; the ZeRO-{stage} model-state file names "
                             "the parameters. Copy the whole checkpoint again")
    model_files = [_load(root, n, stores) for n in model_names]
    m0 = model_files[0]
    module = _field(m0, m0.value, "module", dict)
    param_shapes = _field(m0, m0.value, "param_shapes", list)
    buffer_names = _field(m0, m0.value, "buffer_names", list)
    shared = m0.value.get("shared_params") or {}
    frozen_shapes = m0.value.get("frozen_param_shapes") or {}
    if not isinstance(shared, dict) or not isinstance(frozen_shapes, dict):
        raise InputError(f"{m0.path}: shared_params / frozen_param_shapes are not dicts; "
                         "corrupt")

    params: dict[str, _Param] = {}
    trainable = _zero2(optim_files, flats, param_shapes, osd, world) if stage <= 2 else \
        _zero3(m0, flats, param_shapes, world)
    for name, p in trainable.items():
        params[name] = p
    for name, value in frozen_shapes.items():
        if name in params:
            raise InputError(f"{m0.path}: '{name}' is both trainable and frozen; corrupt")
        params[name] = _frozen(model_files, stage, world, name, _shape(m0, name, value))
    for name in buffer_names:
        if not isinstance(name, str) or name not in module:
            continue  # as zero_to_fp32: a buffer not saved is not restored
        b = _flat(m0, module[name], f"buffer '{name}'")
        ref: torchsave.TensorRef = module[name]
        chunk = Chunk((0,) * len(ref.shape), ref.shape, b.file, b.start,
                      b.numel * b.dtype.itemsize, encoding=RAW, crc32=b.crc32)
        params[name] = _Param(b.dtype, ref.shape, [chunk] if b.numel else [])
    for alias, target in shared.items():
        if isinstance(alias, str) and target in params and alias not in params:
            params[alias] = params[target]  # a tied weight: the same chunks under both names
    return model_files, params


def _group_shapes(f: _File, group: Any, g: int) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(group, dict):
        raise InputError(f"{f.path}: param_shapes[{g}] is not a dict; corrupt")
    out = []
    for name, shape in group.items():
        if not isinstance(name, str):
            raise InputError(f"{f.path}: param_shapes[{g}] has a key {name!r}; corrupt")
        out.append((name, _shape(f, name, shape)))
    return out


def _zero2(optim_files: list[_File], flats: list[list[_Flat]], param_shapes: list[Any],
           osd: dict[str, Any], world: int) -> dict[str, _Param]:
    """ZeRO-1/2: each group's ranks' partitions, concatenated, hold its parameters in order."""
    f0 = optim_files[0]
    if any(len(fl) != len(param_shapes) for fl in flats):
        raise InputError(f"{f0.path}: {len(flats[0])} fp32 partitions for {len(param_shapes)} "
                         "parameter groups; the files come from different saves")
    paddings = osd.get("param_alignment_paddings")
    out: dict[str, _Param] = {}
    for g, group in enumerate(param_shapes):
        shapes = _group_shapes(f0, group, g)
        parts = [fl[g] for fl in flats]
        starts = [0]  # of each rank's partition in the group's vector (lengths may differ)
        for p in parts:
            starts.append(starts[-1] + p.numel)
        pads: list[Any] | None = None
        if paddings is not None:
            if not isinstance(paddings, list) or g >= len(paddings) or not isinstance(
                    paddings[g], list) or len(paddings[g]) != len(shapes):
                raise InputError(f"{f0.path}: param_alignment_paddings does not match the "
                                 f"{len(shapes)} parameters of group {g}; corrupt")
            pads = paddings[g]
        total = starts[-1]
        offset = 0
        for i, (name, shape) in enumerate(shapes):
            numel = math.prod(shape)
            if offset + numel > total:
                raise InputError(f"{f0.path}: parameter '{name}' reaches past the {total} "
                                 f"elements of group {g}'s partitions; the model-state file "
                                 "and the optimizer-state files come from different saves")
            chunks: list[Chunk] = []
            e = offset
            while e < offset + numel:
                r = bisect.bisect_right(starts, e) - 1
                n = min(offset + numel, starts[r + 1]) - e
                chunks += _chunks(shape, e - offset, n, parts[r], e - starts[r])
                e += n
            out[name] = _Param(parts[0].dtype, shape, chunks)
            offset += numel
            if pads is not None:
                pad = pads[i]
                if type(pad) is not int or pad < 0:
                    raise InputError(f"{f0.path}: param_alignment_paddings holds {pad!r}; "
                                     "corrupt")
                offset += pad
        align = 2 * world
        if offset > total or -(-offset // align) != -(-total // align):
            raise InputError(f"{f0.path}: group {g}'s parameters take {offset} of its {total} "
                             "elements; the model-state file and the optimizer-state files "
                             "come from different saves")
    return out


def _zero3(m0: _File, flats: list[list[_Flat]], param_shapes: list[Any], world: int
           ) -> dict[str, _Param]:
    """ZeRO-3: every parameter split over the ranks on its own, at one offset of each rank's
    concatenated groups."""
    lengths = [g.numel for g in flats[0]]
    if any([g.numel for g in fl] != lengths for fl in flats):
        raise InputError(f"{m0.path}: the ranks' fp32 partitions differ in length; the files "
                         "come from different saves")
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    shapes = [s for g, group in enumerate(param_shapes) for s in _group_shapes(m0, group, g)]
    out: dict[str, _Param] = {}
    offset = 0
    dtype = flats[0][0].dtype if lengths else None
    for name, shape in shapes:
        numel = math.prod(shape)
        per = -(-numel // world)
        if offset + per > starts[-1]:
            raise InputError(f"{m0.path}: parameter '{name}' reaches past the {starts[-1]} "
                             "elements of each rank's partitions; the model-state and "
                             "optimizer-state files come from different saves")
        chunks: list[Chunk] = []
        for r in range(world):
            lo = min(r * per, numel)
            count = min(per, numel - lo)
            pos = 0
            while pos < count:  # the piece may cross from one group into the next
                at = offset + pos
                g = bisect.bisect_right(starts, at) - 1
                n = min(count - pos, starts[g + 1] - at)
                chunks += _chunks(shape, lo + pos, n, flats[r][g], at - starts[g])
                pos += n
        if name in out:
            raise InputError(f"{m0.path}: parameter '{name}' is listed twice; corrupt")
        assert dtype is not None
        out[name] = _Param(dtype, shape, chunks)
        offset += per
    if offset != starts[-1]:
        raise InputError(f"{m0.path}: the parameters take {offset} of the {starts[-1]} "
                         "elements of each rank's partitions; the model-state and "
                         "optimizer-state files come from different saves")
    return out


def _frozen(model_files: list[_File], stage: int, world: int, name: str,
            shape: tuple[int, ...]) -> _Param:
    """A parameter the optimizer does not own: whole in the model-state file (ZeRO-1/2), split
    like a ZeRO-3 parameter over the ranks' model-state files (ZeRO-3)."""
    numel = math.prod(shape)
    per = -(-numel // world) if stage == 3 else numel
    chunks: list[Chunk] = []
    dtype: DType | None = None
    for r, f in enumerate(model_files):
        fragments = _field(f, f.value, "frozen_param_fragments", dict)
        if name not in fragments:
            raise InputError(f"{f.path}: frozen parameter '{name}' has no fragment; corrupt")
        frag = _flat(f, fragments[name], f"frozen parameter '{name}'")
        dtype = dtype or frag.dtype
        if frag.dtype != dtype:
            raise InputError(f"{f.path}: frozen parameter '{name}' is {frag.dtype.name} here, "
                             f"{dtype.name} on rank 0; the files come from different saves")
        lo = min(r * per, numel)
        count = min(per, numel - lo)
        if frag.numel < count:
            raise InputError(f"{f.path}: frozen parameter '{name}' holds {frag.numel} elements "
                             f"where {count} belong; the files come from different saves")
        if stage < 3 and frag.crc32 is not None:
            chunks.append(Chunk((0,) * len(shape), shape, frag.file, frag.start,
                                numel * frag.dtype.itemsize, encoding=RAW, crc32=frag.crc32))
        else:
            chunks += _chunks(shape, lo, count, frag, 0)
    assert dtype is not None
    return _Param(dtype, shape, chunks)


class ZeroReader(Reader):
    """Raw chunks are read by the neutral reader; the CRC-32 of every archive entry that no
    chunk carries (the fp32 partitions, which hold many parameters each, the pickles, the
    optimizer moments) is listed for ``verify``, once per entry."""

    def other_checksums(self) -> tuple[list[Checksummed], list[Problem]]:
        detail: Detail = self.info.detail
        covered = {(c.file, c.offset) for t in self.info.tensors for c in t.chunks
                   if c.crc32 is not None}
        return [Checksummed(file, e.data_offset, e.size, e.crc32, f"entry '{e.name}'")
                for file, entries in detail.entries.items() for e in entries
                if (file, e.data_offset) not in covered], []


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> ZeroReader:
    return ZeroReader(info, store)


__all__ = ["LATEST", "NAME", "SUMMARY", "WRITTEN_BY",
           "deepspeed_global", "detect", "flat_boxes", "is_tag_dir",
           "open_reader", "pending", "read_info"]
