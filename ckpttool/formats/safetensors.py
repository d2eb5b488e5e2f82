"""safetensors files and sharded directories (``model.safetensors.index.json``).

A file is an 8-byte little-endian header length, a JSON header (``{"__metadata__": {...},
name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets relative to the end of the
header) and the tensor bytes. We write the header ourselves so output files can be filled at
known offsets, in parallel and with kernel-side copies.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import InputError
from ckpttool.formats import dtypes
from ckpttool.formats.dtypes import DType

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


def read_layout(path: Path) -> tuple[dict[str, str], tuple[Slot, ...]]:
    """Read and check a safetensors file's header (no tensor data).

    Raises:
        InputError: the header is truncated, corrupt or inconsistent with the file size.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise InputError(f"{path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > _HEADER_LIMIT:
                raise InputError(f"{path}: header length {n} is implausible; not safetensors")
            text = f.read(n)
            size = f.seek(0, 2)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    if len(text) < n:
        raise InputError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise InputError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict):
        raise InputError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    base = 8 + n
    slots = []
    for name, v in header.items():
        slots.append(_slot(path, name, v, base, size))
    return meta, tuple(sorted(slots, key=lambda s: s.begin))


def _slot(path: Path, name: str, v: object, base: int, size: int) -> Slot:
    """One header entry, checked field by field: a mangled header is bad input, not a crash."""
    where = f"{path}: tensor '{name}'"
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
    if base + end > size:
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


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"1024"`` -> 1024.

    Raises:
        InputError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not m or float(m.group(1)) <= 0:
        raise InputError(f"invalid size '{text}'; write it like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    slot: Slot


def read_checkpoint(path: Path) -> tuple[StoredTensor, ...]:
    """Every tensor of a safetensors file, or of a directory (``model.safetensors`` or the
    shards its ``model.safetensors.index.json`` names), in file then offset order.

    Raises:
        InputError: missing files, unreadable headers, or an index that disagrees with them.
    """
    if path.is_file():
        return tuple(StoredTensor(path, s) for s in read_layout(path)[1])
    index_path = path / INDEX_NAME
    if index_path.is_file():
        weight_map = read_index(index_path).weight_map
        files = list(dict.fromkeys(weight_map.values()))
        out: list[StoredTensor] = []
        for name in files:
            file_path = path / name
            if not file_path.is_file():
                raise InputError(f"{file_path}: shard named in {INDEX_NAME} is missing")
            slots = read_layout(file_path)[1]
            for s in slots:
                if weight_map.get(s.name) != name:
                    raise InputError(f"{file_path}: holds '{s.name}', which {INDEX_NAME} "
                                     f"places in {weight_map.get(s.name)!r}")
            out += [StoredTensor(file_path, s) for s in slots]
        missing = set(weight_map) - {t.slot.name for t in out}
        if missing:
            raise InputError(f"{index_path}: names {len(missing)} tensors that no shard holds, "
                             f"e.g. '{sorted(missing)[0]}'")
        return tuple(out)
    single = path / SINGLE_NAME
    if single.is_file():
        return tuple(StoredTensor(single, s) for s in read_layout(single)[1])
    raise InputError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME} here")


@dataclass(frozen=True)
class Index:
    """A ``*.safetensors.index.json``: which shard holds each tensor."""

    path: Path
    weight_map: dict[str, str]  # tensor name -> shard file name
    total_size: int | None  # metadata.total_size, as written
    duplicates: tuple[str, ...]  # names the weight_map lists more than once


def read_index(path: Path) -> Index:
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
        doc = json.loads(path.read_text(), object_pairs_hook=pairs)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e}); not a safetensors index") from None
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


def is_safetensors_file(path: Path) -> bool:
    """True if ``path`` starts like a safetensors file (a length, then a JSON object)."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{"
