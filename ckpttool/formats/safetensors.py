"""safetensors files and sharded directories (``model.safetensors.index.json``): reading them
as checkpoints, and laying out the files ``merge`` and ``reshard`` write.

A file is an 8-byte little-endian header length, a JSON header (``{"__metadata__": {...},
name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets relative to the end of the
header) and the tensor bytes. We write the header ourselves so output files can be filled at
known offsets, in parallel and with kernel-side copies.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import InputError
from ckpttool.formats.base import (
    RAW,
    CheckpointInfo,
    Chunk,
    DataFile,
    Problem,
    Reader,
    Tensor,
    error,
    warning,
)
from ckpttool.formats.codecs import dtypes
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.storage import sidefiles
from ckpttool.storage.store import LOCAL, Store, Stores, pread_of

NAME = "safetensors"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = 'a `.safetensors` file, or a directory with `model.safetensors` or an index and shards'
WRITTEN_BY = 'transformers, `ckpttool merge`'
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_HEADER_LIMIT = 100 * 1024 * 1024


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a safetensors file."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Layout:
    header: bytes  # the 8-byte length and the JSON, padded to 8 bytes
    slots: tuple[Slot, ...]

    @property
    def file_size(self) -> int:
        return self.slots[-1].end if self.slots else len(self.header)


def layout(
    tensors: list[tuple[str, DType, tuple[int, ...]]],
    metadata: dict[str, str] | None = None,
) -> Layout:
    """Lay tensors out as safetensors does: larger items first, then by name, so each tensor
    starts at a multiple of its item size (the header is padded to 8 bytes)."""
    ordered = sorted(tensors, key=lambda t: (-t[1].itemsize, t[0]))
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    pos = 0
    rel: list[tuple[str, DType, tuple[int, ...], int, int]] = []
    for name, dtype, shape in ordered:
        n = dtype.itemsize
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype.name, "shape": list(shape), "data_offsets": [pos, pos + n]}
        rel.append((name, dtype, shape, pos, pos + n))
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    base = len(head)
    return Layout(head, tuple(Slot(nm, dt, sh, base + b, base + e) for nm, dt, sh, b, e in rel))


@dataclass(frozen=True)
class FilePlan:
    name: str
    layout: Layout


def plan_files(
    tensors: list[tuple[str, DType, tuple[int, ...]]], max_shard_size: int, stem: str = "model"
) -> tuple[tuple[FilePlan, ...], bytes | None]:
    """Split tensors (in model order) into shards as transformers does: fill a shard until the
    next tensor would pass ``max_shard_size`` (tensor bytes); a larger tensor gets its own.

    Returns:
        The files with their layouts, and the index JSON (None for a single file).
    """
    for name, _, _ in tensors:
        problem = name_problem(name)
        if problem is not None:
            raise InputError(f"tensor {name!r}: {problem}; a safetensors file cannot carry it, "
                             "so nothing was written")
    shards: list[list[tuple[str, DType, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, dtype, shape in tensors:
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        if shards[-1] and shard_bytes + nbytes > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, dtype, shape))
        shard_bytes += nbytes
    files = tuple(FilePlan(n, layout(members))
                  for n, members in zip(shard_names(len(shards), stem), shards, strict=True))
    if len(files) == 1:
        return files, None
    weight_map = {s.name: f.name for f in files for s in f.layout.slots}
    total = sum(s.nbytes for f in files for s in f.layout.slots)
    params = sum(s.nbytes // s.dtype.itemsize for f in files for s in f.layout.slots)
    return files, index_json(weight_map, total, params)


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a tensor name in a safetensors header, or None."""
    if name == "__metadata__":
        return "the name is the header's metadata key"
    if not name:
        return "the name is empty"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "the name is not valid Unicode (a lone surrogate)"
    return None


# An index or a config.json of a real model is megabytes at most.
JSON_LIMIT = 256 * 1000 * 1000
_JSON_FILE = sidefiles.Kind("JSON index or config", JSON_LIMIT)


def read_json_text(path: Path, stores: Stores = LOCAL) -> str:
    """The text of a small JSON file (an index, a config), read only when it is a regular file
    of at most :data:`JSON_LIMIT` bytes (a FIFO is never waited on).

    Raises:
        FileNotFoundError: no such file.
        InputError: not a regular file, or too large.
        UnicodeDecodeError: not UTF-8.
    """
    return stores.read_small(path, _JSON_FILE).decode("utf-8")


def json_error(e: Exception) -> str:
    """What went wrong parsing JSON, in a few words."""
    return "arrays or objects nested too deeply" if isinstance(e, RecursionError) else str(e)


# The bytes a header's first read asks for (most headers are smaller).
_FIRST_READ = 64 << 10


def read_layout(path: Path, *, offset: int = 0, exact: bool = False,
                stores: Stores = LOCAL
                ) -> tuple[dict[str, str], tuple[Slot, ...]]:
    """Read and check a safetensors file's header (no tensor data).

    Args:
        offset: where the safetensors data starts in ``path`` (0: a file of its own; DCP's
            ``SerializationFormat.SAFETENSORS`` appends it after the rank's other records).
            Slots are absolute offsets in ``path`` either way; past the start, their ends are
            not checked against the file size (the caller's structure checks report that).
        exact: (a file of its own) the tensors must tile the data area exactly, as the
            safetensors format requires and its library checks: no gap, no overlap, no byte
            after the last tensor. A header that moves one tensor by a few bytes would
            otherwise be read as shifted values.

    Raises:
        InputError: the header is truncated, corrupt or inconsistent with the file size.
    """
    if stores.is_dir(path):
        raise InputError(f"{path}: not a regular file")
    where = f"{path} at byte {offset}" if offset else str(path)
    try:
        # Through the store's pread: a remote checkpoint's data file is read by ranged GETs.
        with pread_of(path, stores) as pread:
            # One read for most headers (a remote one: one ranged GET), a second for the rest.
            raw = pread(_FIRST_READ, offset)
            if len(raw) < 8:
                raise InputError(f"{where}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", raw[:8])
            if n > _HEADER_LIMIT:
                raise InputError(f"{where}: header length {n} is implausible; not safetensors")
            text = raw[8:8 + n]
            if len(text) < n and len(raw) == _FIRST_READ:
                text += pread(n - len(text), offset + 8 + len(text))
            size = stores.file_size(path) if not offset else None
    except FileNotFoundError as err:
        raise InputError(f"{path}: no such file") from err
    except OSError as e:  # a FIFO or device: never read as a file
        raise InputError(f"{path}: cannot read it ({e.strerror or e}); not a regular "
                         "file") from e
    if len(text) < n:
        raise InputError(f"{where}: truncated safetensors header")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested too deep
        raise InputError(f"{path}: corrupt safetensors header ({json_error(e)})") from e
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict):
        raise InputError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    base = offset + 8 + n
    slots = []
    for name, v in header.items():
        slots.append(_slot(path, name, v, base, size))
    ordered = tuple(sorted(slots, key=lambda s: (s.begin, s.end)))
    if exact and size is not None:
        problem = tiling_problem(ordered, base, size)
        if problem is not None:
            raise InputError(f"{path}: {problem}; corrupt header (the safetensors library "
                             "refuses this file too)")
    return meta, ordered


def tiling_problem(slots: tuple[Slot, ...], begin: int, end: int) -> str | None:
    """How ``slots`` (sorted by offset) fail to tile the bytes ``[begin, end)`` exactly, or
    None: the first gap, overlap or trailing byte, with its offset."""
    pos = begin
    for slot in slots:
        if slot.begin < pos:
            return (f"tensor '{slot.name}' starts at byte {slot.begin}, inside the "
                    f"{'header' if pos == begin else 'tensor before it'} (which ends at {pos})")
        if slot.begin > pos:
            return (f"tensor '{slot.name}' starts at byte {slot.begin}, leaving bytes "
                    f"{pos}-{slot.begin - 1} that no tensor holds")
        pos = slot.end
    if pos != end:
        return f"bytes {pos}-{end - 1} after the last tensor belong to no tensor"
    return None


def _slot(path: Path, name: str, v: object, base: int, size: int | None) -> Slot:
    """One header entry, checked field by field: a mangled header is bad input, not a crash."""
    where = f"{path}: tensor {name!r}"
    problem = name_problem(name) if name else None  # an empty name loads; writing refuses it
    if problem is not None:
        raise InputError(f"{where}: {problem}; safetensors rejects this header")
    if not isinstance(v, dict):
        raise InputError(f"{where}: header entry is not an object; corrupt header")
    dtype_name = v.get("dtype")
    dtype = dtypes.BY_NAME.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise InputError(f"{where} has unknown dtype {v.get('dtype')!r}")
    shape, offsets = v.get("shape"), v.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise InputError(f"{where} has an invalid shape {shape!r}; corrupt header")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise InputError(f"{where} has invalid data_offsets {offsets!r}; corrupt header")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize:
        raise InputError(f"{where}: data_offsets span {end - begin} bytes but {dtype.name} "
                         f"{shape} needs {numel * dtype.itemsize}; corrupt header")
    if size is not None and base + end > size:
        raise InputError(
            f"{where} ends at byte {base + end} but the file has {size} bytes; truncated"
        )
    return Slot(name, dtype, tuple(shape), base + begin, base + end)


def shard_names(num_shards: int, stem: str = "model") -> list[str]:
    """Output file names as transformers writes them (``stem`` "optimizer" for optimizer
    state)."""
    if num_shards == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def index_name(stem: str = "model") -> str:
    return f"{stem}.safetensors.index.json"


def index_json(weight_map: dict[str, str], total_size: int, total_parameters: int) -> bytes:
    """``model.safetensors.index.json`` as transformers writes it (sorted keys, indent 2)."""
    doc = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def is_weight_file(name: str, stem: str = "model") -> bool:
    """True for the names a ``stem`` checkpoint is written under (``model.safetensors``, its
    shards and index): what --overwrite replaces, and nothing else."""
    return (name in (f"{stem}.safetensors", index_name(stem))
            or re.fullmatch(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.safetensors", name)
            is not None)


@dataclass(frozen=True)
class Index:
    """A ``*.safetensors.index.json``: which shard holds each tensor."""

    path: Path
    weight_map: dict[str, str]  # tensor name -> shard file name
    total_size: int | None  # metadata.total_size, as written
    duplicates: tuple[str, ...]  # names the weight_map lists more than once


def read_index(path: Path, stores: Stores = LOCAL) -> Index:
    """Read a sharded checkpoint's index (no shard is opened).

    Raises:
        InputError: the file is missing or not an index (no ``weight_map`` of names to files).
    """
    dup: list[str] = []

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        seen: dict[str, object] = {}
        for k, v in items:
            if k in seen and isinstance(v, str):
                dup.append(k)
            seen[k] = v
        return seen

    try:
        doc = json.loads(read_json_text(path, stores), object_pairs_hook=pairs)
    except FileNotFoundError as err:
        raise InputError(f"{path}: no such file") from err
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{path}: not valid JSON ({json_error(e)}); not a safetensors "
                         "index") from e
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise InputError(f"{path}: has no weight_map of tensor names to files; not a "
                         "safetensors index")
    for name, file in weight_map.items():
        # Shards sit beside their index: a path elsewhere is never followed.
        if not file or "\0" in file or file in (".", "..") or Path(file).name != file or (
                "\\" in file):
            raise InputError(f"{path}: weight_map places '{name}' in '{file}', which is not a "
                             "file name in this directory; refusing to read it")
    meta = doc.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return Index(path, dict(weight_map), total if isinstance(total, int) else None,
                 tuple(dup))


def is_safetensors_file(path: Path, stores: Stores = LOCAL) -> bool:
    """True if ``path`` starts like a safetensors file (a length, then a JSON object)."""
    try:
        with stores.reading(path) as pread:
            head = pread(9, 0)
    except (OSError, InputError):
        return False
    return len(head) == 9 and head[8:9] == b"{"


# --------------------------------------------------------------------------------------------
# Reading a checkpoint: a file, or a directory of shards


def detect(path: Path, stores: Stores = LOCAL) -> bool:
    """A safetensors file, or a directory that holds one model in safetensors: an index,
    ``model.safetensors``, the shards of one set (``model-00001-of-00002.safetensors``...), or
    a single ``*.safetensors`` file and no subdirectory.

    Several unrelated files, or one beside subdirectories, are not one model: such a directory
    is a training directory, whose candidates the recogniser lists and chooses from (a loose
    ``ref.safetensors`` beside ``pytorch_model_fsdp_0/`` must never win over it).
    """
    if stores.file_size(path) is not None:
        return is_safetensors_file(path, stores)
    names = stores.listdir(path)
    if any(names.get(index_name(s)) is not None or names.get(f"{s}.safetensors") is not None
           for s in _STEMS):
        return True
    files = _safetensors_files(path, names)
    if _shard_set(files) is not None:
        return True
    return len(files) == 1 and not any(stores.is_dir(path / n)
                                       for n, size in names.items() if size is None)


_SHARD = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.safetensors")


def _shard_set(files: list[str]) -> list[str] | None:
    """``files`` when they are the shards of one set (one stem, one count), else None."""
    matches = [_SHARD.fullmatch(p) for p in files]
    if not matches or any(m is None for m in matches):
        return None
    if len({(m.group(1), m.group(3)) for m in matches if m is not None}) != 1:
        return None
    return files


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> Reader:
    """Tensors are raw byte ranges: the neutral reader reads them."""
    return Reader(info, store)


def pending(path: Path) -> str | None:
    """A file shorter than its header says is still being written; so is a directory of
    shards whose index is not written yet (save_pretrained writes it last) or whose shards
    are short."""
    if path.is_file():
        return pending_file(path)
    names = LOCAL.listdir(path)
    files = _safetensors_files(path, names)
    sharded = any(re.fullmatch(r".+-\d+-of-(\d+)\.safetensors", f) for f in files)
    if sharded and not any(names.get(index_name(s)) is not None for s in _STEMS):
        return "shards but no index yet (save_pretrained writes the index last)"
    for f in files:
        why = pending_file(path / f)
        if why is not None:
            return why
    return None


def pending_file(path: Path) -> str | None:
    """Why the safetensors file at ``path`` is incomplete (shorter than its header says, or
    its header not all there), from its first bytes and size; None when it is whole."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = os.fstat(f.fileno()).st_size
            if len(head) < 8:
                return f"{path.name}: {size} bytes, no header yet"
            (n,) = struct.unpack("<Q", head)
            if n > _HEADER_LIMIT:
                return None  # not ours to judge: read_info says what is wrong
            if size < 8 + n:
                return f"{path.name}: header not all written yet"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2
            and isinstance(v["data_offsets"][1], int)] if isinstance(header, dict) else []
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{path.name}: {size:,} of {need:,} bytes written so far"
    return None


_STEMS = ("model", "optimizer")


def _safetensors_files(path: Path, names: dict[str, int | None] | None = None) -> list[str]:
    """The ``*.safetensors`` files in ``path`` (``names``: its listing, when at hand)."""
    listed = LOCAL.listdir(path) if names is None else names
    return sorted(n for n, size in listed.items()
                  if size is not None and n.endswith(".safetensors"))


def read_info(path: str | Path, *, stores: Stores = LOCAL) -> CheckpointInfo:
    """Describe a safetensors file or directory from its headers (and index).

    A shard whose header cannot be read, or an index that disagrees with the shards, does not
    stop the description: each is a problem in ``info.problems``, for ``verify`` to report and
    for ``merge`` to refuse.

    Raises:
        InputError: no safetensors file there, or an index that is not one.
    """
    root = Path(path)
    index: Index | None = None
    stem = "model"
    single = stores.file_size(root) is not None
    if single:
        shard_names = [root.name]
        base = root.parent
    else:
        base = root
        names = stores.listdir(root)
        files = _safetensors_files(root, names)
        shard_names = _shard_set(files) or (files if len(files) == 1 else [])
        for s in _STEMS:
            if names.get(index_name(s)) is not None:
                index = read_index(root / index_name(s), stores)
                shard_names, stem = list(dict.fromkeys(index.weight_map.values())), s
                break
            if names.get(f"{s}.safetensors") is not None:
                shard_names, stem = [f"{s}.safetensors"], s
                break
        if not shard_names:
            raise InputError(f"{root}: no {SINGLE_NAME} or {INDEX_NAME} here" + (
                f" (and {len(files)} unrelated *.safetensors files: pass one of them)"
                if files else ""))
    problems: list[Problem] = []
    holders: dict[str, list[str]] = {}
    tensors: dict[str, Tensor] = {}
    readable: set[str] = set()
    slot_bytes = 0
    for name in shard_names:
        slots = _read_shard(base, name, index, problems, stores)
        if slots is None:
            continue
        readable.add(name)
        slot_bytes += sum(s.nbytes for s in slots)
        problems += _slot_problems(base / name, slots)
        for slot in slots:
            holders.setdefault(slot.name, []).append(name)
            # A name in two shards is a duplicate-tensor problem; describe it once.
            tensors.setdefault(slot.name, Tensor(
                slot.name, (slot.name,), slot.dtype, slot.shape,
                (Chunk((0,) * len(slot.shape), slot.shape, name, slot.begin, slot.nbytes,
                       encoding=RAW),)))
    problems += duplicate_problems(base, holders)
    if index is None and not single:
        problems += _unindexed_set_problems(root, shard_names)
    if index is not None:
        problems += index_problems(base, index, holders, readable,
                                    complete=readable == set(shard_names),
                                    total=slot_bytes)
    stray = () if index is None else tuple(
        n for n in _safetensors_files(base, stores.listdir(base))
        if n not in shard_names and n.startswith(f"{stem}-"))
    return CheckpointInfo(
        format=NAME, root=root, tensors=tuple(tensors.values()), objects=(),
        files=tuple(DataFile(n, stores.file_size(base / n)) for n in shard_names),
        metadata_name=index.path.name if index else "the safetensors header",
        problems=tuple(problems), stray=stray, single_file=single)


def _unindexed_set_problems(root: Path, shard_names: list[str]) -> list[Problem]:
    """Shards of a set (``model-00001-of-00002.safetensors``...) with no index beside them: a
    save or a publish that did not finish (the index is written last; a replaced output's
    index goes first), which loaders refuse; and each shard of the set that is not there."""
    matches = [m for n in shard_names if (m := _SHARD.fullmatch(n)) is not None]
    if not matches:
        return []
    stem, count = matches[0].group(1), int(matches[0].group(3))
    problems = [error("index-missing", f"{root}: {len(matches)} of {count} shards of "
                      f"{stem}-*-of-{count:05d}.safetensors but no {index_name(stem)}: a save "
                      "or publish that did not finish (the index is written last); run it "
                      "again (with --overwrite, or --finish for slices)",
                      file=index_name(stem))]
    have = {int(m.group(2)) for m in matches}
    for i in range(1, min(count, 100_000) + 1):
        if i not in have:
            name = f"{stem}-{i:05d}-of-{count:05d}.safetensors"
            problems.append(error("missing-file", f"{root / name}: shard {i} of {count} is "
                                  "missing; copy the whole directory again", file=name))
    return problems


def _read_shard(base: Path, name: str, index: Index | None, problems: list[Problem],
                stores: Stores) -> tuple[Slot, ...] | None:
    path = base / name
    if stores.file_size(path) is None:
        named = f" named in {index.path.name}" if index else ""
        problems.append(error("missing-file", f"{path}: shard{named} is missing; copy the "
                              "whole directory again", file=name))
        return None
    try:
        return read_layout(path, exact=True, stores=stores)[1]
    except InputError as e:
        problems.append(error("header-corrupt", str(e), file=name))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        problems.append(error("header-corrupt", f"{path}: corrupt safetensors header "
                              f"({type(e).__name__}: {e})", file=name))
    return None


def _slot_problems(path: Path, slots: tuple[Slot, ...]) -> list[Problem]:
    problems = []
    previous = None
    for slot in slots:
        need = math.prod(slot.shape) * slot.dtype.itemsize
        if slot.nbytes != need:
            problems.append(error(
                "bad-offsets", f"{path}: tensor '{slot.name}' spans {slot.nbytes} bytes but "
                f"{slot.dtype.name} {list(slot.shape)} needs {need}; corrupt header",
                file=path.name, tensor=slot.name, offset=slot.begin))
        if previous is not None and slot.begin < previous.end:
            problems.append(error(
                "bad-offsets", f"{path}: tensors '{previous.name}' and '{slot.name}' overlap at "
                f"byte {slot.begin}; corrupt header", file=path.name, tensor=slot.name,
                offset=slot.begin))
        previous = slot
    return problems


def duplicate_problems(base: Path, holders: dict[str, list[str]]) -> list[Problem]:
    """A tensor name in several shards (``holders``: name -> the shards holding it)."""
    return [error("duplicate-tensor", f"{base}: tensor '{name}' is stored in {len(files)} "
                  f"places ({', '.join(files)}); a loader keeps one of them at random",
                  tensor=name, file=files[1])
            for name, files in holders.items() if len(files) > 1]


def index_problems(base: Path, index: Index, holders: dict[str, list[str]],
                    readable: set[str], *, complete: bool, total: int) -> list[Problem]:
    problems = []
    where = index.path
    for name in index.duplicates:
        problems.append(error("index-duplicate", f"{where}: lists '{name}' more than once",
                              file=where.name, tensor=name))
    for name, file in index.weight_map.items():
        if file in readable and file not in holders.get(name, []):
            problems.append(error(
                "index-missing-tensor", f"{where}: places '{name}' in {file}, which does not "
                "hold it; a loader will fail on it", file=file, tensor=name))
    for name, files in holders.items():
        if name not in index.weight_map:
            problems.append(error(
                "index-extra-tensor", f"{base / files[0]}: holds '{name}', which "
                f"{where.name} does not list; loaders will not see it", file=files[0],
                tensor=name))
    if index.total_size is not None and complete and total != index.total_size:
        problems.append(warning(
            "index-total-size", f"{where}: metadata.total_size is {index.total_size} but the "
            f"shards hold {total} bytes of tensors", file=where.name))
    return problems


