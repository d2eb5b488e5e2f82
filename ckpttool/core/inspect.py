"""``inspect``: what is in a checkpoint of any supported format, from metadata and headers.

:func:`open_checkpoint` recognises what a path holds (a DCP directory, a safetensors file or
sharded directory, a ``torch.save`` state dict, or a training checkpoint directory with several
parts) and describes it the same way for every format: a :class:`Checkpoint` of
:class:`TensorView` under canonical names. It reads ``.metadata``, safetensors headers and the
pickle of a ``torch.save`` file, never tensor data. ``verify`` builds on the same description.

``--stats`` streams the data (:class:`Stats`, the only part that imports torch).
"""

from __future__ import annotations

import fnmatch
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.core import dtypes as dtype_policy
from ckpttool.core import names, source, ties
from ckpttool.core import objects as non_tensor
from ckpttool.core import tensors as sources
from ckpttool.errors import InputError
from ckpttool.formats import dcp, torchfile
from ckpttool.formats import safetensors as st
from ckpttool.formats.dtypes import DType

SCHEMA = 1
Progress = Callable[[int], None]  # called with the number of bytes just read

# Bytes read per step when data is streamed: memory stays flat whatever the tensor size.
BLOCK_BYTES = 16 << 20

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of one chunk


# --------------------------------------------------------------------------------------------
# The description, the same for every format


@dataclass(frozen=True)
class Part:
    """One entry of a training checkpoint directory and what it is."""

    path: str  # relative to the directory
    kind: str  # "model", "optimizer" or "other"
    format: str  # "dcp", "safetensors", "torch-save", "pickle", "json", "directory", "file"
    note: str = ""

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "kind": self.kind, "format": self.format, "note": self.note}


@dataclass(frozen=True)
class TensorView:
    """A tensor under its canonical name, wherever and however it is stored."""

    name: str  # canonical: wrapper segments and accelerate's "model" level removed
    stored_name: str  # the key as stored (DCP flat key, safetensors name, dotted torch key)
    path: tuple[str, ...]  # the nested keys it was saved under
    dtype: DType
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]  # the stored pieces: one whole box outside DCP
    files: tuple[str, ...]  # data files holding it, relative to the checkpoint root

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ObjectView:
    """A non-tensor entry: read later (DCP records) or already read (torch.save pickle)."""

    name: str
    stored_name: str
    entry: dcp.ObjectEntry | torchfile.ObjectEntry


@dataclass(frozen=True)
class DataFile:
    name: str  # relative to the checkpoint root (the file's own name for a single file)
    size: int | None  # None: missing


@dataclass(frozen=True)
class Shard:
    """A safetensors file of a checkpoint, its header read (or why it could not be)."""

    name: str
    slots: tuple[st.Slot, ...]
    metadata: dict[str, str]
    error: str | None  # the header could not be read: the InputError's message


@dataclass(frozen=True)
class SafetensorsInfo:
    root: Path  # the directory (or the file's directory)
    index: st.Index | None
    shards: tuple[Shard, ...]


Detail = dcp.DcpInfo | SafetensorsInfo | torchfile.TorchFileInfo


@dataclass(frozen=True)
class Checkpoint:
    """What a path holds, from metadata and headers only."""

    path: Path  # as given
    root: Path  # the DCP or safetensors directory, or the file, actually described
    format: str  # "dcp", "safetensors", "torch-save"; "none" when a directory holds no choice
    kind: str  # "model" or "optimizer"
    tensors: tuple[TensorView, ...]  # in stored order
    objects: tuple[ObjectView, ...]
    files: tuple[DataFile, ...]
    parts: tuple[Part, ...]  # entries of a training checkpoint directory (empty otherwise)
    hf: source.HfFiles
    detail: Detail | None
    notes: tuple[str, ...] = ()
    stray: tuple[str, ...] = ()  # data files in the directory that nothing references

    @property
    def num_ranks(self) -> int | None:
        if not isinstance(self.detail, dcp.DcpInfo):
            return None
        ranks = {dcp.rank_of(f.name) for f in self.files}
        return None if None in ranks else len(ranks)

    @property
    def base(self) -> Path:
        """The directory that file names are relative to."""
        return self.root if self.root.is_dir() else self.root.parent

    def by_name(self) -> dict[str, TensorView]:
        return {t.name: t for t in self.tensors}


def open_checkpoint(path: str | os.PathLike[str], *, config: str | os.PathLike[str] | None = None,
                    require: bool = True) -> Checkpoint:
    """Recognise and describe the checkpoint at ``path``. Reads no tensor data.

    Args:
        path: a DCP directory, a safetensors file or sharded directory, a ``torch.save`` file,
            or a training checkpoint directory holding one of those.
        config: a config.json (or its directory) to use instead of the one found beside it.
        require: raise if a directory holds several model checkpoints (else describe its parts
            with format "none").

    Raises:
        InputError: nothing readable there, a damaged ``.metadata``, an unsafe pickle, or
            (with ``require``) several model checkpoints to choose from.
        UnsupportedError: a layout or format ckpttool does not read yet.
    """
    given = Path(path)
    config_path = Path(config) if config is not None else None
    if not given.exists():
        raise InputError(f"{given}: no such file or directory")
    if given.is_file():
        return _open_file(given, given, config_path, ())
    info = source.checkpoint_at(given)
    if info is not None:
        return _open_dcp(given, given, info, config_path, ())
    if (given / dcp.METADATA_FILE).exists() or any(given.glob("*" + dcp.DATA_SUFFIX)):
        source.locate_model(given)  # raises the precise reason (no or unreadable .metadata)
    if _safetensors_files(given):
        return _open_safetensors(given, given, config_path, tuple(list_parts(given)[0]))
    found, infos = list_parts(given)
    parts = tuple(found)
    chosen = _choose(parts)
    if chosen is None:
        candidates = ([p.path for p in parts if p.kind == "model" and p.format != "safetensors"]
                      or [p.path for p in parts if p.kind == "optimizer" and p.format == "dcp"])
        if not candidates:
            raise InputError(
                f"{given}: no checkpoint here (no .metadata, *.safetensors or torch.save file, "
                "here or in a subdirectory); pass the directory training saved, e.g. "
                "checkpoint-500/pytorch_model_fsdp_0"
            )
        message = (f"{given}: holds {len(candidates)} checkpoints ({', '.join(candidates)}); "
                   f"pass one of them, e.g. {given / candidates[0]}")
        if require:
            raise InputError(message)
        return Checkpoint(given, given, "none", "model", (), (), (), parts,
                          source.find_hf_files(given, config_path), None, (message,))
    target = given / chosen.path
    if chosen.format == "dcp":
        return _open_dcp(given, target, infos[chosen.path], config_path, parts)
    return _open_file(given, target, config_path, parts)


def _safetensors_files(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.safetensors") if p.is_file())


def _open_file(given: Path, file: Path, config: Path | None, parts: tuple[Part, ...]
               ) -> Checkpoint:
    if file.name == dcp.METADATA_FILE:
        raise InputError(f"{file}: pass the DCP directory that holds it: {file.parent}")
    if torchfile.is_torch_file(file):
        return _open_torchfile(given, file, config, parts)
    if st.is_safetensors_file(file):
        return _open_safetensors(given, file, config, parts)
    if file.suffix == ".pkl":
        raise InputError(f"{file}: a Python pickle, not a checkpoint; ckpttool never unpickles "
                         "arbitrary pickles")
    raise InputError(f"{file}: not a checkpoint file (expected .safetensors, or a torch.save "
                     ".bin/.pt state dict)")


def _canonical(entries: Iterable[tuple[str, tuple[str, ...]]], kind: str) -> dict[str, str]:
    top_level = "optimizer" if kind == "optimizer" else names.TOP_LEVEL_WRAPPER
    return names.canonical_names(entries, top_level)


def _open_dcp(given: Path, root: Path, info: dcp.DcpInfo, config: Path | None,
              parts: tuple[Part, ...]) -> Checkpoint:
    kind = source.kind_of(info)
    renamed = _canonical(((t.fqn, t.path) for t in info.tensors), kind)
    tensors = tuple(
        TensorView(renamed[t.fqn], t.fqn, t.path, t.dtype, t.shape,
                   tuple((c.offsets, c.sizes) for c in t.chunks),
                   tuple(sorted({c.file for c in t.chunks})))
        for t in info.tensors
    )
    top_level = "optimizer" if kind == "optimizer" else names.TOP_LEVEL_WRAPPER
    objects = tuple(ObjectView(names.canonical_fqn(o.path, top_level), o.fqn, o)
                    for o in info.objects)
    files = tuple(DataFile(f, _size_of(root / f)) for f in info.files)
    return Checkpoint(given, root, "dcp", kind, tensors, objects, files, parts,
                      _hf_files(root, config, kind), info, stray=tuple(dcp.stray_files(info)))


def _open_safetensors(given: Path, path: Path, config: Path | None, parts: tuple[Part, ...]
                      ) -> Checkpoint:
    root = path if path.is_dir() else path.parent
    index: st.Index | None = None
    kind = "model"
    if path.is_file():
        shard_names = [path.name]
        kind = "optimizer" if path.name.startswith("optimizer") else "model"
    else:
        shard_names = [p.name for p in _safetensors_files(path)]
        for stem in ("model", "optimizer"):
            if (path / st.index_name(stem)).is_file():
                index = st.read_index(path / st.index_name(stem))
                shard_names, kind = list(dict.fromkeys(index.weight_map.values())), stem
                break
            if (path / f"{stem}.safetensors").is_file():
                shard_names, kind = [f"{stem}.safetensors"], stem
                break
    shards = tuple(_read_shard(root, name) for name in shard_names)
    stored: list[tuple[str, st.Slot]] = []
    seen: set[str] = set()
    for shard in shards:  # a name in two shards is verify's duplicate-tensor; show it once
        stored += [(shard.name, slot) for slot in shard.slots if slot.name not in seen]
        seen.update(slot.name for slot in shard.slots)
    renamed = _canonical(((slot.name, (slot.name,)) for _, slot in stored), kind)
    tensors = tuple(TensorView(renamed[slot.name], slot.name, (slot.name,), slot.dtype,
                               slot.shape,
                               ((_zeros(slot.shape), slot.shape),), (file,))
                    for file, slot in stored)
    files = tuple(DataFile(name, _size_of(root / name)) for name in shard_names)
    info = SafetensorsInfo(root, index, shards)
    target = path if path.is_dir() else root
    stray = () if index is None else tuple(
        p.name for p in _safetensors_files(root)
        if p.name not in shard_names and p.name.startswith(f"{kind}-"))
    return Checkpoint(given, path, "safetensors", kind, tensors, (), files, parts,
                      _hf_files(target, config, kind), info, stray=stray)


def _read_shard(root: Path, name: str) -> Shard:
    try:
        meta, slots = st.read_layout(root / name)
    except InputError as e:
        return Shard(name, (), {}, str(e))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # read_layout trusts the header's field types; a mangled one is a corrupt file here.
        return Shard(name, (), {}, f"{root / name}: corrupt safetensors header "
                                   f"({type(e).__name__}: {e})")
    return Shard(name, slots, dict(meta), None)


def _open_torchfile(given: Path, file: Path, config: Path | None, parts: tuple[Part, ...]
                    ) -> Checkpoint:
    info = torchfile.read_info(file)
    kind = "optimizer" if file.name.startswith("optimizer") else "model"
    renamed = _canonical(((t.name, t.path) for t in info.tensors), kind)
    tensors = tuple(TensorView(renamed[t.name], t.name, t.path, t.dtype, t.shape,
                               ((_zeros(t.shape), t.shape),), (file.name,))
                    for t in info.tensors)
    top_level = "optimizer" if kind == "optimizer" else names.TOP_LEVEL_WRAPPER
    objects = tuple(ObjectView(names.canonical_fqn(o.path, top_level) if o.path else o.name,
                               o.name, o) for o in info.objects)
    return Checkpoint(given, file, "torch-save", kind, tensors, objects,
                      (DataFile(file.name, info.size),), parts,
                      _hf_files(file.parent, config, kind), info)


def _hf_files(directory: Path, config: Path | None, kind: str) -> source.HfFiles:
    if kind == "optimizer" and config is None:
        return source.HfFiles(None, None, ())
    return source.find_hf_files(directory, config)


def _size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _zeros(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (0,) * len(shape)


# --------------------------------------------------------------------------------------------
# Training checkpoint directories: what each entry is, without unpickling anything


_TORCH_SUFFIXES = frozenset(torchfile.SUFFIXES)


def list_parts(directory: Path) -> tuple[list[Part], dict[str, dcp.DcpInfo]]:
    """Every entry of ``directory``, sorted, with its kind and format (by content for
    checkpoints, by name for the rest), and the DCP checkpoints found, by entry name. Pickles
    are listed, never opened."""
    parts = []
    infos: dict[str, dcp.DcpInfo] = {}
    for p in sorted(directory.iterdir(), key=lambda q: q.name):
        if p.is_dir():
            try:
                info = source.checkpoint_at(p)
            except InputError as e:
                parts.append(Part(p.name, "other", "dcp", f"unreadable: {e}"))
                continue
            if info is None:
                parts.append(Part(p.name, "other", "directory"))
            else:
                infos[p.name] = info
                parts.append(Part(p.name, source.kind_of(info), "dcp",
                                  f"{len(info.tensors)} tensors, {len(info.files)} files"))
        else:
            parts.append(_file_part(p))
    return parts, infos


def _file_part(p: Path) -> Part:
    name = p.name
    stem_kind = ("optimizer" if name.startswith("optimizer")
                 else "model" if name.startswith(("pytorch_model", "model")) else "other")
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
        return Part(name, "optimizer" if stem_kind == "optimizer" else "model", "safetensors")
    if p.suffix in _TORCH_SUFFIXES:
        fmt = "torch-save" if torchfile.is_torch_file(p) else "file"
        return Part(name, stem_kind, fmt)
    if p.suffix == ".pkl":
        return Part(name, "other", "pickle", "not unpickled")
    if p.suffix == ".json":
        return Part(name, "other", "json")
    return Part(name, "other", "file")


def _choose(parts: tuple[Part, ...]) -> Part | None:
    """The one checkpoint a directory holds: its single model (a DCP directory or a torch.save
    file), else its single optimizer DCP; None when there are several or none."""
    models = [p for p in parts if p.kind == "model" and p.format in ("dcp", "torch-save")]
    if models:
        return models[0] if len(models) == 1 else None
    optimizers = [p for p in parts if p.kind == "optimizer" and p.format == "dcp"]
    return optimizers[0] if len(optimizers) == 1 else None


# --------------------------------------------------------------------------------------------
# Pure descriptions


def placement(shape: tuple[int, ...], boxes: tuple[Box, ...]) -> str:
    """How the pieces split the tensor: ``whole``, ``Shard(0) x4``, ``Shard(0)+Shard(1) x4``,
    ``none`` when nothing is stored."""
    if not boxes:
        return "none"
    if len(boxes) == 1 and boxes[0][1] == shape:
        return "whole"
    split = sorted({d for _, sizes in boxes for d, (s, n) in enumerate(zip(sizes, shape,
                                                                          strict=False))
                    if s != n})
    if not split:
        return f"Replicate x{len(boxes)}"
    return "+".join(f"Shard({d})" for d in split) + f" x{len(boxes)}"


def tie_pair(ckpt: Checkpoint) -> tuple[str, str] | None:
    """(output, input) embedding names when both exist with one shape."""
    return ties.find_pair(ckpt.by_name())


def summary(ckpt: Checkpoint) -> dict[str, Any]:
    """The summary block of ``inspect``: counts, bytes per dtype, the size ``merge --dtype
    auto`` would write, wrappers, tie candidates. Pure."""
    per_dtype: dict[str, int] = {}
    for t in ckpt.tensors:
        per_dtype[t.dtype.name] = per_dtype.get(t.dtype.name, 0) + t.nbytes
    config_name = str(ckpt.hf.config_path) if ckpt.hf.config_path else "config.json"
    policy = (dtype_policy.DTypePolicy("auto", None, "optimizer state keeps its dtypes")
              if ckpt.kind == "optimizer" else dtype_policy.resolve("auto", ckpt.hf.config,
                                                                     config_name))
    pair = tie_pair(ckpt) if ckpt.kind == "model" else None
    config_ties = source.ties_word_embeddings(ckpt.hf.config)
    dropped = pair[0] if pair is not None and config_ties else None
    merged: dict[str, int] = {}
    for t in ckpt.tensors:
        if t.name == dropped:
            continue
        out = policy.output_dtype(t.dtype)
        merged[out.name] = merged.get(out.name, 0) + t.numel * out.itemsize
    return {
        "kind": ckpt.kind,
        "num_ranks": ckpt.num_ranks,
        "num_files": len(ckpt.files),
        "num_tensors": len(ckpt.tensors),
        "num_parameters": sum(t.numel for t in ckpt.tensors),
        "bytes": sum(t.nbytes for t in ckpt.tensors),
        "bytes_per_dtype": dict(sorted(per_dtype.items())),
        "merged": {
            "dtype": policy.target.name if policy.target else None,
            "dtype_source": policy.source,
            "bytes": sum(merged.values()),
            "bytes_per_dtype": dict(sorted(merged.items())),
            "deduplicated": dropped,
        },
        "wrappers": names.detected_wrappers(t.path for t in ckpt.tensors),
        "num_renamed": sum(1 for t in ckpt.tensors if t.name != t.stored_name),
        "tie": None if pair is None else {"output": pair[0], "input": pair[1],
                                          "config_ties": config_ties},
        "num_non_tensor": len(ckpt.objects),
        "config": str(ckpt.hf.config_path) if ckpt.hf.config_path else None,
    }


def tensor_row(t: TensorView) -> dict[str, Any]:
    return {"name": t.name, "stored_name": t.stored_name, "shape": list(t.shape),
            "dtype": t.dtype.name, "bytes": t.nbytes, "chunks": len(t.boxes),
            "placement": placement(t.shape, t.boxes), "files": list(t.files), "stats": None}


def matches(t: TensorView, pattern: str | None) -> bool:
    """``--filter``: a glob on the canonical or the stored name."""
    return pattern is None or fnmatch.fnmatchcase(t.name, pattern) or fnmatch.fnmatchcase(
        t.stored_name, pattern)


# --------------------------------------------------------------------------------------------
# Reading data: every format as a tensors.Source, by element range in C order


def open_source(ckpt: Checkpoint) -> sources.Source:
    """The checkpoint's data, readable by stored name and element range."""
    detail = ckpt.detail
    if isinstance(detail, dcp.DcpInfo):
        return sources.DcpSource(detail)
    if isinstance(detail, torchfile.TorchFileInfo):
        return sources.TorchFileSource(detail)
    if isinstance(detail, SafetensorsInfo):
        return sources.SafetensorsSource(tuple(
            st.StoredTensor(detail.root / s.name, slot) for s in detail.shards
            for slot in s.slots))
    raise InputError(f"{ckpt.path}: holds no single checkpoint to read")


def blocks(src: sources.Source, t: TensorView, block_bytes: int = BLOCK_BYTES
           ) -> Iterator[tuple[int, bytearray]]:
    """The tensor's bytes in C order, ``(first element, bytes)`` per block."""
    step = max(1, block_bytes // t.dtype.itemsize)
    for start in range(0, t.numel, step):
        yield start, src.read(t.stored_name, start, min(start + step, t.numel))


# --------------------------------------------------------------------------------------------
# Values: min, max, mean, NaN and Inf counts (torch, imported only here)


@dataclass
class TensorStats:
    min: float | None = None  # over finite values
    max: float | None = None
    mean: float | None = None
    abs_max: float | None = None
    nan: int = 0
    inf: int = 0
    all_zero: bool | None = None  # None: not known (an empty tensor, an unsupported dtype)

    def to_json(self) -> dict[str, Any]:
        return {"min": self.min, "max": self.max, "mean": self.mean, "abs_max": self.abs_max,
                "nan": self.nan, "inf": self.inf, "all_zero": self.all_zero}


class Stats:
    """Accumulates :class:`TensorStats` over a tensor's blocks.

    ``full=False`` (what ``verify`` needs) costs one min/max pass per block: NaN and Inf are
    counted only in blocks whose extremes are not finite, and all-zero follows from the
    extremes. ``full=True`` adds the mean.
    """

    _SUB = 4 << 20  # elements converted at once for float8 (to float32)

    def __init__(self, dtype: DType, *, full: bool) -> None:
        import torch  # values need torch; everything else in inspect and verify does not

        self._torch = torch
        self.dtype = dtype
        self.full = full
        self.supported = dtype.kind in ("float", "float8", "int", "bool") and dtype.name != "U64"
        self._torch_dtype = getattr(torch, dtype.torch_name) if self.supported else None
        self.stats = TensorStats()
        self._sum = 0.0
        self._finite = 0

    def update(self, data: bytearray | memoryview) -> None:
        if not self.supported or not len(data):
            return
        torch = self._torch
        t = torch.frombuffer(data, dtype=self._torch_dtype)
        if self.dtype.kind == "float8":
            for i in range(0, t.numel(), self._SUB):
                self._update(t[i : i + self._SUB].float())
            return
        if self.dtype.kind == "bool":
            t = t.view(torch.uint8)
        elif self.dtype.name in ("U16", "U32"):
            t = t.to(torch.int64)
        self._update(t)

    def _update(self, t: Any) -> None:
        torch = self._torch
        s = self.stats
        mn, mx = (v.item() for v in torch.aminmax(t))
        is_float = t.is_floating_point()
        if is_float and not (_finite(mn) and _finite(mx)):
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
            s.nan += nan
            s.inf += inf
            t = t[torch.isfinite(t)]
            if not t.numel():
                s.all_zero = False
                return
            mn, mx = (v.item() for v in torch.aminmax(t))
            s.all_zero = False
        elif s.all_zero is not False:
            s.all_zero = mn == 0 and mx == 0
        s.min = mn if s.min is None else min(s.min, mn)
        s.max = mx if s.max is None else max(s.max, mx)
        s.abs_max = max(abs(s.min), abs(s.max))
        if self.full:
            self._sum += float(t.sum(dtype=torch.float64))
            self._finite += t.numel()

    def result(self) -> TensorStats:
        s = self.stats
        if self.full and self._finite:
            s.mean = self._sum / self._finite
        if s.min is not None and s.max is not None and not self.dtype.kind.startswith("float"):
            s.min, s.max, s.abs_max = int(s.min), int(s.max), int(s.abs_max or 0)
        return s


def _finite(v: float) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


# --------------------------------------------------------------------------------------------
# Non-tensor entries


def describe_objects(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """Each non-tensor entry as ``merge`` reports it: ``{"name", "readable", "value"}`` or,
    for one that would need arbitrary unpickling, ``{"name", "readable": false, "note"}``.
    Reads DCP object records (small), never a tensor."""
    out = []
    reader = dcp.Reader(ckpt.detail) if isinstance(ckpt.detail, dcp.DcpInfo) else None
    try:
        for o in ckpt.objects:
            entry = o.entry
            if isinstance(entry, torchfile.ObjectEntry):
                out.append(non_tensor.describe(o.name, entry.value))
                continue
            assert reader is not None
            try:
                out.append(non_tensor.describe(o.name, non_tensor.read(reader, entry)))
            except InputError as e:
                out.append({"name": o.name, "readable": False, "note": f"unreadable: {e}"})
    finally:
        if reader is not None:
            reader.close()
    return out


# --------------------------------------------------------------------------------------------
# The operation


@dataclass
class InspectReport:
    """What ``inspect`` found, for people (CLI) and programs (``to_json``)."""

    path: str
    checkpoint: str
    format: str
    kind: str
    parts: list[dict[str, str]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    tensors: list[dict[str, Any]] = field(default_factory=list)  # the --filter'ed table
    non_tensor: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    filter: str | None = None
    stats: bool = False
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "command": "inspect", **self.__dict__}


def inspect(
    path: str | os.PathLike[str],
    *,
    filter: str | None = None,
    stats: bool = False,
    config: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
) -> InspectReport:
    """Describe the checkpoint at ``path`` from its metadata (and, with ``stats``, its data).

    Args:
        path: any supported checkpoint (see :func:`open_checkpoint`).
        filter: a glob on tensor names; narrows the table (and the tensors ``stats`` reads).
        stats: stream the data and add min, max, mean, abs-max, NaN and Inf counts per tensor.
        config: config.json (or its directory) instead of the one beside the checkpoint.
        progress: called with bytes read (``stats`` only).
        on_start: called once with the bytes ``stats`` will read.

    Returns:
        An :class:`InspectReport`.

    Raises:
        InputError: ``path`` is not a readable checkpoint.
        UnsupportedError: a format or layout ckpttool does not read yet.
    """
    started = time.perf_counter()
    ckpt = open_checkpoint(path, config=config, require=False)
    report = InspectReport(path=str(ckpt.path), checkpoint=str(ckpt.root), format=ckpt.format,
                           kind=ckpt.kind, filter=filter, stats=stats)
    report.parts = [p.to_json() for p in ckpt.parts]
    report.notes = list(ckpt.notes)
    if ckpt.detail is None:
        report.seconds = round(time.perf_counter() - started, 3)
        return report
    report.summary = summary(ckpt)
    shown = [t for t in ckpt.tensors if matches(t, filter)]
    report.tensors = [tensor_row(t) for t in shown]
    report.non_tensor = describe_objects(ckpt)
    missing = [f.name for f in ckpt.files if f.size is None]
    if missing:
        report.notes.append(f"{len(missing)} data files are missing ({', '.join(missing[:3])}"
                            f"{'...' if len(missing) > 3 else ''}); run ckpttool verify "
                            f"{ckpt.path}")
    if isinstance(ckpt.detail, SafetensorsInfo):  # headers are the metadata: cannot go on
        for shard in ckpt.detail.shards:
            if shard.error is not None:
                raise InputError(f"{shard.error}; ckpttool verify {ckpt.path} lists every "
                                 "problem")
    if stats:
        if on_start is not None:
            on_start(sum(t.nbytes for t in shown))
        with open_source(ckpt) as src:
            for t, row in zip(shown, report.tensors, strict=True):
                acc = Stats(t.dtype, full=True)
                for _, data in blocks(src, t):
                    acc.update(data)
                    if progress is not None:
                        progress(len(data))
                row["stats"] = acc.result().to_json()
    report.seconds = round(time.perf_counter() - started, 3)
    return report
