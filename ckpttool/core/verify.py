"""``verify``: prove a checkpoint is whole, sane and (with ``against``) equal to another.

The checks, each a source of :class:`Problem` with a severity and a location:

* structure (pure, from the description): chunks tile every tensor; every data file exists
  and holds every byte range; no stray data files; a safetensors index agrees with its shards;
* content (one streaming pass over the data, bounded memory): every record decodes as
  ``.metadata`` promises and its CRC-32 matches; NaN / Inf counts; all-zero tensors;
* ties (pure, given whether the pair is identical) and dtypes (pure);
* ``against``: names, shapes, dtypes and bytes of another checkpoint, in the same pass;
* ``manifest``: a SHA-256 per tensor, written or checked, in the same pass.

Only values (NaN counts, casts) need torch; the CRC pass does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpttool.core import chunks as chunk_geometry
from ckpttool.core import dtypes as dtype_policy
from ckpttool.core import source, ties
from ckpttool.core import tensors as sources
from ckpttool.core.dtypes import DTypePolicy
from ckpttool.core.fileio import AtomicOutputs
from ckpttool.core.inspect import (
    BLOCK_BYTES,
    Checkpoint,
    SafetensorsInfo,
    Stats,
    TensorView,
    blocks,
    open_checkpoint,
    open_source,
    tie_pair,
)
from ckpttool.core.torch_threads import one_torch_thread
from ckpttool.errors import InputError
from ckpttool.formats import dcp, torchfile
from ckpttool.formats import safetensors as st
from ckpttool.formats.dtypes import DType

SCHEMA = 1
MANIFEST_KIND = "ckpttool-manifest"
SEVERITIES = ("error", "warning", "info")
Progress = Callable[[int], None]  # called with the number of bytes just read


@dataclass(frozen=True)
class Location:
    file: str | None = None  # relative to the checkpoint directory, or the file itself
    tensor: str | None = None  # canonical name
    offset: int | None = None  # byte offset in ``file``

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "tensor": self.tensor, "offset": self.offset}


@dataclass(frozen=True)
class Problem:
    """One finding. ``error`` fails verification (exit 1); ``warning`` and ``info`` do not."""

    severity: str  # "error", "warning" or "info"
    code: str  # short and stable: "crc-mismatch", "chunk-overlap", "tie-broken"...
    message: str  # one line: what, where, what to do
    location: Location = Location()

    def to_json(self) -> dict[str, Any]:
        return {"severity": self.severity, "code": self.code, "message": self.message,
                "location": self.location.to_json()}


def _error(code: str, message: str, **where: Any) -> Problem:
    return Problem("error", code, message, Location(**where))


def _warning(code: str, message: str, **where: Any) -> Problem:
    return Problem("warning", code, message, Location(**where))


def _info(code: str, message: str, **where: Any) -> Problem:
    return Problem("info", code, message, Location(**where))


# --------------------------------------------------------------------------------------------
# Structure: pure, from the description


def check_structure(ckpt: Checkpoint) -> list[Problem]:
    """Files, byte ranges, chunk coverage, stray files, safetensors index consistency."""
    problems: list[Problem] = []
    if isinstance(ckpt.detail, dcp.DcpInfo):
        problems += _dcp_files(ckpt, ckpt.detail)
    elif isinstance(ckpt.detail, SafetensorsInfo):
        problems += _safetensors_structure(ckpt, ckpt.detail)
    for name in ckpt.stray:
        problems.append(_warning(
            "stray-file", f"{ckpt.base / name}: not referenced by the checkpoint's metadata; "
            "left over from another save, or the metadata belongs to a different save",
            file=name))
    for t in ckpt.tensors:
        reason = chunk_geometry.coverage_problem(t.shape, t.boxes)
        if reason is not None:
            problems.append(_error(_coverage_code(reason),
                                   f"{ckpt.root}: tensor '{t.name}': {reason}; the checkpoint is "
                                   "incomplete or corrupt", tensor=t.name))
    return problems


def _coverage_code(reason: str) -> str:
    # coverage_problem explains in words; these are the three ways a tiling fails.
    if "overlap" in reason:
        return "chunk-overlap"
    if "missing" in reason:
        return "chunk-gap"
    return "chunk-bounds"


def _dcp_files(ckpt: Checkpoint, info: dcp.DcpInfo) -> list[Problem]:
    problems = []
    sizes = {f.name: f.size for f in ckpt.files}
    for file, ends in sorted(dcp.extents(info).items()):
        size = sizes.get(file)
        path = ckpt.root / file
        if size is None:
            problems.append(_error(
                "missing-file", f"{path}: data file is missing; .metadata references it "
                f"({len(ends)} entries, e.g. {ends[0][1]}). Copy the whole checkpoint directory "
                "again", file=file))
            continue
        beyond = [e for e in ends if e[0] > size]
        if beyond:
            end, what, _ = max(beyond)
            problems.append(_error(
                "truncated-file", f"{path}: truncated: .metadata places {what} up to byte {end} "
                f"but the file has {size} bytes; copy the checkpoint again",
                file=file, offset=size))
    return problems


def damaged_tensors(ckpt: Checkpoint) -> set[str]:
    """Canonical names of tensors whose bytes structure checks already found missing: the
    content pass skips them instead of reporting the same damage again."""
    bad: set[str] = set()
    sizes = {f.name: f.size for f in ckpt.files}
    detail = ckpt.detail
    if isinstance(detail, dcp.DcpInfo):
        stored = {t.stored_name: t.name for t in ckpt.tensors}
        for entry in detail.tensors:
            for c in entry.chunks:
                size = sizes.get(c.file)
                if size is None or c.offset + c.length > size:
                    bad.add(stored[entry.fqn])
    for t in ckpt.tensors:
        if chunk_geometry.coverage_problem(t.shape, t.boxes) is not None:
            bad.add(t.name)
    if isinstance(detail, SafetensorsInfo):
        readable = {s.name for s in detail.shards if s.error is None}
        bad |= {t.name for t in ckpt.tensors if t.files[0] not in readable}
    return bad


def _safetensors_structure(ckpt: Checkpoint, info: SafetensorsInfo) -> list[Problem]:
    problems = []
    sizes = {f.name: f.size for f in ckpt.files}
    holders: dict[str, list[str]] = {}
    for shard in info.shards:
        if shard.error is not None:
            if sizes.get(shard.name) is None:
                named = f" named in {info.index.path.name}" if info.index else ""
                problems.append(_error("missing-file", f"{info.root / shard.name}: shard{named} "
                                       "is missing; copy the whole directory again",
                                       file=shard.name))
            else:
                problems.append(_error("header-corrupt", shard.error, file=shard.name))
            continue
        previous = None
        for slot in shard.slots:
            holders.setdefault(slot.name, []).append(shard.name)
            need = math.prod(slot.shape) * slot.dtype.itemsize
            if slot.nbytes != need:
                problems.append(_error(
                    "bad-offsets", f"{info.root / shard.name}: tensor '{slot.name}' spans "
                    f"{slot.nbytes} bytes but {slot.dtype.name} {list(slot.shape)} needs {need}; "
                    "corrupt header", file=shard.name, tensor=slot.name, offset=slot.begin))
            if previous is not None and slot.begin < previous.end:
                problems.append(_error(
                    "bad-offsets", f"{info.root / shard.name}: tensors '{previous.name}' and "
                    f"'{slot.name}' overlap at byte {slot.begin}; corrupt header",
                    file=shard.name, tensor=slot.name, offset=slot.begin))
            previous = slot
    for name, files in holders.items():
        if len(files) > 1:
            problems.append(_error("duplicate-tensor", f"{info.root}: tensor '{name}' is stored "
                                   f"in {len(files)} places ({', '.join(files)}); a loader keeps "
                                   "one of them at random", tensor=name, file=files[1]))
    index = info.index
    if index is None:
        return problems
    where = index.path
    for name in index.duplicates:
        problems.append(_error("index-duplicate", f"{where}: lists '{name}' more than once",
                               file=where.name, tensor=name))
    readable = {s.name for s in info.shards if s.error is None}
    for name, file in index.weight_map.items():
        if file in readable and file not in holders.get(name, []):
            problems.append(_error(
                "index-missing-tensor", f"{where}: places '{name}' in {file}, which does not "
                "hold it; a loader will fail on it", file=file, tensor=name))
    for name, files in holders.items():
        if name not in index.weight_map:
            problems.append(_error(
                "index-extra-tensor", f"{info.root / files[0]}: holds '{name}', which "
                f"{where.name} does not list; loaders will not see it", file=files[0],
                tensor=name))
    if index.total_size is not None and readable == {s.name for s in info.shards}:
        total = sum(s.nbytes for shard in info.shards for s in shard.slots)
        if total != index.total_size:
            problems.append(_warning(
                "index-total-size", f"{where}: metadata.total_size is {index.total_size} but the "
                f"shards hold {total} bytes of tensors", file=where.name))
    return problems


# --------------------------------------------------------------------------------------------
# Ties and dtypes: pure


def check_ties(ckpt: Checkpoint, identical: bool | None) -> list[Problem]:
    """Tied embeddings against config.json.

    Args:
        identical: whether the output and input embeddings hold the same bytes (None: unknown,
            e.g. unreadable).
    """
    if ckpt.kind != "model":
        return []
    config_ties = source.ties_word_embeddings(ckpt.hf.config)
    config = ckpt.hf.config_path.name if ckpt.hf.config_path else "config.json"
    names = ckpt.by_name()
    pair = tie_pair(ckpt)
    head = ties.OUTPUT_EMBEDDING
    if pair is None:
        embed = next((n for n in ties.INPUT_EMBEDDINGS if n in names), None)
        if head in names or embed is None or config_ties is None:
            return []
        if config_ties:
            return [_info("tie-ok", f"'{head}' is absent and {config} ties it to '{embed}': "
                          "stored once, as transformers saves it", tensor=embed)]
        return [_error("tie-missing", f"{config} sets tie_word_embeddings false but the "
                       f"checkpoint has no '{head}' (only '{embed}'); the trained output "
                       "embedding is lost. Export it again, or set tie_word_embeddings to true if "
                       "the model is tied", tensor=head)]
    head, embed = pair
    state = {True: "identical", False: "different", None: "not comparable"}[identical]
    if config_ties is None:
        return [_info("tie-candidate", f"'{head}' and '{embed}' have one shape and are {state}; "
                      "no config.json says whether they are tied (pass --config to check)",
                      tensor=head)]
    if not config_ties:
        return []
    if identical:
        return [_info("tie-ok", f"'{head}' is identical to '{embed}', as {config} ties them",
                      tensor=head)]
    if identical is False:
        return [_error("tie-broken", f"{config} ties word embeddings but '{head}' differs from "
                       f"'{embed}'; transformers will tie them on load and drop the trained "
                       f"'{head}'. Set tie_word_embeddings to false in {config} to keep it",
                       tensor=head)]
    return []


def check_dtypes(ckpt: Checkpoint, expect: DTypePolicy | None) -> list[Problem]:
    """Floating tensors against an expected dtype (``--expect-dtype``); float8, integer and
    bool tensors are judged apart; an ``FSDP`` prefix in config.json's architectures."""
    problems: list[Problem] = []
    config = ckpt.hf.config
    config_name = ckpt.hf.config_path.name if ckpt.hf.config_path else "config.json"
    if config is not None:
        _, changes = source.strip_fsdp_prefix(config)
        if changes:
            # merge fixes it on the way out; in weights that are served as they are, it is fatal.
            make = _warning if ckpt.format == "dcp" else _error
            problems.append(make("fsdp-prefix", f"{ckpt.hf.config_path}: architectures names "
                                 f"{', '.join(c.split(' -> ')[0] for c in changes)}, a class no "
                                 "library defines (vLLM picks the model class from it); ckpttool "
                                 f"merge writes {', '.join(c.split(' -> ')[1] for c in changes)}",
                                 file=config_name))
    if ckpt.kind != "model":
        return problems
    floats = [t for t in ckpt.tensors if t.dtype.is_float]
    if expect is None or expect.target is None:
        if expect is not None:
            problems.append(_info("dtype-unknown", f"--expect-dtype {expect.requested}: "
                                  f"{expect.source}; dtypes not checked"))
            return problems
        policy = dtype_policy.resolve("auto", config, config_name)
        other = sorted({t.dtype.name for t in floats} - ({policy.target.name}
                                                         if policy.target else set()))
        if policy.target is not None and other:
            problems.append(_info("dtype-differs-from-config",
                                  f"floating tensors are {', '.join(other)} but {policy.source}; "
                                  "ckpttool merge --dtype auto casts them (check with "
                                  "--expect-dtype auto)"))
        return problems
    target = expect.target
    why = expect.source if expect.requested == "auto" else f"--expect-dtype {expect.requested}"
    for t in floats:
        if t.dtype == target:
            continue
        if t.dtype.itemsize > target.itemsize:
            problems.append(_error(
                "dtype-upcast", f"tensor '{t.name}' is {t.dtype.name}, wider than the expected "
                f"{target.name} ({why}): mixed precision's fp32 copy? ckpttool merge "
                f"--dtype {expect.requested} casts it", tensor=t.name))
        else:
            problems.append(_error(
                "dtype-mismatch", f"tensor '{t.name}' is {t.dtype.name}, not the expected "
                f"{target.name} ({why})", tensor=t.name))
    for kind, label in (("float8", "float8"), ("int", "integer"), ("bool", "bool")):
        found = [t for t in ckpt.tensors if t.dtype.kind == kind]
        if found:
            dts = ", ".join(sorted({t.dtype.name for t in found}))
            problems.append(_info(
                f"{kind}-tensors", f"{len(found)} {label} tensors ({dts}, e.g. '{found[0].name}') "
                f"are kept as stored; --expect-dtype does not apply to them"))
    return problems


# --------------------------------------------------------------------------------------------
# Against: which tensors to compare, and how (pure)


@dataclass(frozen=True)
class Pair:
    a: TensorView
    b: TensorView
    cast: str | None  # None: bytes must match; "a" or "b": that side is cast to the other's dtype


@dataclass(frozen=True)
class AgainstPlan:
    pairs: tuple[Pair, ...]
    problems: tuple[Problem, ...]
    # Names present on one side only but with their tie partner on both: decided after the
    # data pass (a deduplicated tie is not an error).
    tied_missing: tuple[tuple[str, str], ...]  # (missing from B, its partner), A's names
    tied_extra: tuple[tuple[str, str], ...]  # (missing from A, its partner), B's names


def plan_against(a: Checkpoint, b: Checkpoint, *, policy: DTypePolicy | None) -> AgainstPlan:
    """Match tensors of ``a`` and ``b`` by canonical name. ``policy`` (``--allow-cast``): the
    dtype conversion that ``merge --dtype`` would apply; without it dtypes must be equal."""
    names_a, names_b = a.by_name(), b.by_name()
    problems: list[Problem] = []
    tied_missing: list[tuple[str, str]] = []
    tied_extra: list[tuple[str, str]] = []
    pairs: list[Pair] = []

    def partner(ckpt: Checkpoint, name: str) -> str | None:
        pair = tie_pair(ckpt)
        if pair is None or name not in pair:
            return None
        return pair[1] if name == pair[0] else pair[0]

    for name, ta in names_a.items():
        tb = names_b.get(name)
        if tb is None:
            other = partner(a, name)
            if other is not None and other in names_b:
                tied_missing.append((name, other))
            else:
                problems.append(_error("missing-tensor", f"tensor '{name}' ({ta.dtype.name} "
                                       f"{list(ta.shape)}) is in {a.root} but not in {b.root}",
                                       tensor=name))
            continue
        if ta.shape != tb.shape:
            problems.append(_error("shape-differs", f"tensor '{name}' is {list(ta.shape)} in "
                                   f"{a.root} but {list(tb.shape)} in {b.root}", tensor=name))
            continue
        cast = _cast_side(ta.dtype, tb.dtype, policy)
        if ta.dtype != tb.dtype and cast is None:
            hint = (" (pass --allow-cast, with --dtype, to compare after the cast merge applies)"
                    if ta.dtype.is_float and tb.dtype.is_float else "")
            problems.append(_error("dtype-differs", f"tensor '{name}' is {ta.dtype.name} in "
                                   f"{a.root} but {tb.dtype.name} in {b.root}{hint}", tensor=name))
            continue
        pairs.append(Pair(ta, tb, cast))
    for name, tb in names_b.items():
        if name in names_a:
            continue
        other = partner(b, name)
        if other is not None and other in names_a:
            tied_extra.append((name, other))
        else:
            problems.append(_error("extra-tensor", f"tensor '{name}' ({tb.dtype.name} "
                                   f"{list(tb.shape)}) is in {b.root} but not in {a.root}",
                                   tensor=name))
    return AgainstPlan(tuple(pairs), tuple(problems), tuple(tied_missing), tuple(tied_extra))


def _cast_side(da: DType, db: DType, policy: DTypePolicy | None) -> str | None:
    if da == db or policy is None:
        return None
    if policy.output_dtype(da) == db:
        return "a"
    if policy.output_dtype(db) == da:
        return "b"
    return None


# --------------------------------------------------------------------------------------------
# The data pass


class _Unreadable(Exception):
    """A tensor's bytes cannot be read; the problem saying why is already recorded."""


@dataclass
class _Result:
    """What the data pass found for one tensor of the checkpoint being verified."""

    problems: list[Problem] = field(default_factory=list)
    digest: str | None = None
    equal: bool | None = None  # against: None when not compared
    bytes_read: int = 0


@dataclass
class _Crc:
    value: int = 0  # CRC-32 of the bytes fed so far


class _Scanner:
    """Streams each tensor of one checkpoint once, in C order where its layout allows,
    checking CRCs as the bytes go by."""

    def __init__(self, ckpt: Checkpoint, src: sources.Source, report: Progress) -> None:
        self.ckpt = ckpt
        self.src = src
        self.report = report
        self.detail = ckpt.detail
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._crc_done: set[int] = set()  # torch.save storages checked while streaming
        self.dcp_entries: dict[str, dcp.TensorEntry] = {}
        self.torch_entries: dict[str, torchfile.TensorEntry] = {}
        self.torch_crcs: dict[int, int] = {}  # storage data offset -> recorded CRC-32
        self.slots: dict[tuple[str, str], st.Slot] = {}  # (shard, stored name) -> slot
        if isinstance(self.detail, dcp.DcpInfo):
            self.dcp_entries = {t.fqn: t for t in self.detail.tensors}
        elif isinstance(self.detail, torchfile.TorchFileInfo):
            self.torch_entries = {t.name: t for t in self.detail.tensors}
            self.torch_crcs = {e.data_offset: e.crc32 for e in self.detail.entries}
        elif isinstance(self.detail, SafetensorsInfo):
            self.slots = {(shard.name, slot.name): slot for shard in self.detail.shards
                          for slot in shard.slots}

    def __enter__(self) -> _Scanner:
        for f in self.ckpt.files:  # every present data file, before threads share them
            if f.size is not None:
                self.fd(f.name)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.ckpt.base / name, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # -- streams: (first element or None when not in C order, bytes)

    def stream(self, t: TensorView, result: _Result) -> Iterator[tuple[int | None, memoryview]]:
        if isinstance(self.detail, dcp.DcpInfo):
            yield from self._dcp(t, self.dcp_entries[t.stored_name], result)
        elif isinstance(self.detail, torchfile.TorchFileInfo):
            yield from self._torch(t, self.torch_entries[t.stored_name], result)
        else:
            slot = self.slots[(t.files[0], t.stored_name)]
            yield from self._range(t.files[0], slot.begin, slot.nbytes, 0, slot.nbytes, 0, t,
                                   result)

    def _range(self, file: str, offset: int, size: int, first: int, length: int,
               start: int | None, t: TensorView, result: _Result, crc: _Crc | None = None
               ) -> Iterator[tuple[int | None, memoryview]]:
        """Read ``size`` bytes at ``offset`` of ``file`` in blocks (all into ``crc``), yielding
        the part ``[first, first + length)`` of them; ``start`` is its first element."""
        fd = self.fd(file)
        item = t.dtype.itemsize
        buf = bytearray(min(BLOCK_BYTES, size))
        done = 0
        while done < size:
            n = min(len(buf), size - done)
            view = memoryview(buf)[:n]
            got = os.preadv(fd, [view], offset + done)
            if got != n:
                result.problems.append(_error(
                    "truncated-file", f"{self.ckpt.base / file}: ends at byte "
                    f"{offset + done + got}, inside tensor '{t.name}'; copy the checkpoint again",
                    file=file, tensor=t.name, offset=offset + done + got))
                raise _Unreadable
            self.report(n)
            result.bytes_read += n
            if crc is not None:
                crc.value = zlib.crc32(view, crc.value)
            lo, hi = max(done, first), min(done + n, first + length)
            if lo < hi:
                yield (None if start is None else start + (lo - first) // item,
                       view[lo - done : hi - done])
            done += n

    def _dcp(self, t: TensorView, entry: dcp.TensorEntry, result: _Result
             ) -> Iterator[tuple[int | None, memoryview]]:
        assert isinstance(self.src, sources.DcpSource)
        reader = self.src.reader
        records = []
        for c in entry.chunks:
            try:
                rec = reader.record(entry, c)
                if not c.raw:
                    self._check_small_entries(c.file, c.offset, c.length, rec.data_offset,
                                              t.name, result)
            except InputError as e:
                result.problems.append(_error("record-corrupt", str(e), file=c.file,
                                              tensor=t.name, offset=c.offset))
                raise _Unreadable from None
            records.append((c, rec))
        item = t.dtype.itemsize
        # Chunks that are each one run of the tensor (Shard(0), whole), read in the order of
        # their first elements, give the tensor in C order; others (Shard(1)) do not.
        ordered = all(rec.is_contiguous and chunk_geometry.is_single_run(t.shape, c.offsets,
                                                                         c.sizes)
                      for c, rec in records)
        firsts = {c.offsets: next(iter(chunk_geometry.runs(t.shape, c.offsets, c.sizes)),
                                  (0, 0, 0))[1] for c, _ in records}
        if ordered:
            records.sort(key=lambda cr: firsts[cr[0].offsets])
        for c, rec in records:
            start = firsts[c.offsets] if ordered else None
            crc = _Crc()
            if rec.is_contiguous:
                yield from self._range(c.file, rec.data_offset, rec.data_size,
                                       rec.storage_offset * item, c.numel * item, start, t,
                                       result, crc)
            else:  # a strided view (rare): CRC over the storage, then gather the view
                for _ in self._range(c.file, rec.data_offset, rec.data_size, 0, 0, None, t,
                                     result, crc):
                    pass
                yield None, memoryview(bytearray(reader.read_chunk(entry, c)))
            if rec.crc32 is not None and crc.value != rec.crc32:
                result.problems.append(self._crc_problem(c.file, rec.data_offset, t.name,
                                                         crc.value, rec.crc32,
                                                         f"chunk at offsets {list(c.offsets)}"))

    def _check_small_entries(self, file: str, offset: int, length: int, data_offset: int,
                             tensor: str | None, result: _Result) -> None:
        """CRC of a record's headers (data.pkl, byteorder...); the storage is checked while
        it streams."""
        fd = self.fd(file)
        where = f"{self.ckpt.base / file} at byte {offset}"
        for e in dcp.record_entries(fd, offset=offset, length=length, where=where):
            if e.data_offset == data_offset:
                continue
            got = dcp.crc32_of(fd, e.data_offset, e.size)
            if got != e.crc32:
                result.problems.append(self._crc_problem(file, e.data_offset, tensor, got,
                                                         e.crc32, f"record entry '{e.name}'"))

    def _crc_problem(self, file: str, offset: int, tensor: str | None, got: int, want: int,
                     what: str) -> Problem:
        about = f"tensor '{tensor}', {what}" if tensor else what
        return _error("crc-mismatch", f"{self.ckpt.base / file} at byte {offset} ({about}): "
                      f"CRC-32 of the stored bytes is {got:08x} but the record says {want:08x}; "
                      "the bytes changed after they were written (bit rot, a bad copy). Copy the "
                      "checkpoint again from a good source", file=file, tensor=tensor,
                      offset=offset)

    def _torch(self, t: TensorView, entry: torchfile.TensorEntry, result: _Result
               ) -> Iterator[tuple[int | None, memoryview]]:
        file = t.files[0]
        item = t.dtype.itemsize
        if entry.is_contiguous:
            whole = entry.storage_offset == 0 and entry.nbytes == entry.data_size
            with self._lock:
                whole = whole and entry.data_offset not in self._crc_done
                if whole:
                    self._crc_done.add(entry.data_offset)
            crc = _Crc() if whole else None
            yield from self._range(file, entry.data_offset + entry.storage_offset * item,
                                   entry.nbytes, 0, entry.nbytes, 0, t, result, crc)
            if crc is not None:
                stored = self.torch_crcs[entry.data_offset]
                if crc.value != stored:
                    result.problems.append(self._crc_problem(
                        file, entry.data_offset, t.name, crc.value, stored,
                        f"storage data/{entry.storage}"))
            return
        data = self.src.read(t.stored_name, 0, t.numel)
        self.report(len(data))
        result.bytes_read += len(data)
        yield 0, memoryview(data)

    def leftover_crcs(self) -> list[Problem]:
        """Entries the tensor streams did not cover: DCP non-tensor records, and in a
        torch.save file its pickle, small entries and storages shared or partly viewed."""
        problems: list[Problem] = []
        scratch = _Result()
        if isinstance(self.detail, dcp.DcpInfo):
            sizes = {f.name: f.size for f in self.ckpt.files}
            for o in self.detail.objects:
                size = sizes.get(o.file)
                if size is None or o.offset + o.length > size:
                    continue
                try:
                    self._check_small_entries(o.file, o.offset, o.length, -1, None, scratch)
                except InputError as e:
                    problems.append(_error("record-corrupt", str(e), file=o.file,
                                           offset=o.offset))
        elif isinstance(self.detail, torchfile.TorchFileInfo):
            file = self.detail.path.name
            fd = self.fd(file)
            for zipped in self.detail.entries:
                if zipped.data_offset in self._crc_done:
                    continue
                got = dcp.crc32_of(fd, zipped.data_offset, zipped.size)
                self.report(zipped.size)
                if got != zipped.crc32:
                    scratch.problems.append(self._crc_problem(
                        file, zipped.data_offset, None, got, zipped.crc32,
                        f"entry '{zipped.name}'"))
        return problems + scratch.problems


class _Compare:
    """Feeds blocks of a tensor of A and compares them with the same elements of B."""

    def __init__(self, pair: Pair, a: Checkpoint, b: Checkpoint, src_b: sources.Source,
                 report: Progress) -> None:
        self.pair, self.a, self.b, self.src_b, self.report = pair, a, b, src_b, report
        self.problem: Problem | None = None
        self.bytes_read = 0

    def feed(self, start: int, data: memoryview) -> None:
        if self.problem is not None:
            return
        pair = self.pair
        n = len(data) // pair.a.dtype.itemsize
        try:
            other = self.src_b.read(pair.b.stored_name, start, start + n)
        except InputError as e:
            self.problem = _error("read-error", f"{e}", file=pair.b.files[0],
                                  tensor=pair.b.name)
            return
        self.report(len(other))
        self.bytes_read += len(other)
        if pair.cast is None:
            if data == other:
                return
            first = _first_difference(data, other) // pair.a.dtype.itemsize
        else:
            found = _cast_difference(data, pair.a.dtype, other, pair.b.dtype, pair.cast)
            if found is None:
                return
            first = found
        element = start + first
        index = _unravel(element, pair.a.shape)
        how = ""
        if pair.cast is not None:
            src_dt, dst_dt = ((pair.a.dtype, pair.b.dtype) if pair.cast == "a"
                              else (pair.b.dtype, pair.a.dtype))
            how = f" after casting {src_dt.name} to {dst_dt.name}"
        self.problem = _error(
            "data-differs", f"tensor '{pair.a.name}' differs between {self.a.root} and "
            f"{self.b.root}{how}: first at element {element} (index {list(index)})",
            tensor=pair.a.name, **_byte_location(self.b, pair.b, element))


def _first_difference(a: memoryview | bytes | bytearray, b: memoryview | bytes | bytearray
                      ) -> int:
    """Index of the first differing byte (the two differ), by halving: O(log n) compares."""
    lo, hi = 0, min(len(a), len(b))
    if bytes(a[:hi]) == bytes(b[:hi]):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] != b[lo:mid]:
            hi = mid
        else:
            lo = mid
    return lo


def _cast_difference(a: memoryview, da: DType, b: bytearray, db: DType, side: str) -> int | None:
    """First element where A and B differ once ``side`` is cast to the other's dtype; a NaN
    equals a NaN (PyTorch's casts do not fix the NaN payload)."""
    import torch  # only a cast needs torch

    ta = torch.frombuffer(a, dtype=getattr(torch, da.torch_name))
    tb = torch.frombuffer(b, dtype=getattr(torch, db.torch_name))
    if side == "a":
        ta = ta.to(tb.dtype)
    else:
        tb = tb.to(ta.dtype)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ta.element_size()]
    diff = ta.view(bits) != tb.view(bits)
    if ta.is_floating_point():
        diff &= ~(torch.isnan(ta) & torch.isnan(tb))
    where = diff.nonzero()
    return int(where[0, 0]) if where.numel() else None


def _unravel(element: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for n in reversed(shape):
        index.append(element % n if n else 0)
        element = element // n if n else 0
    return tuple(reversed(index))


def _byte_location(ckpt: Checkpoint, t: TensorView, element: int) -> dict[str, Any]:
    """file and byte offset of element ``element`` of ``t``, where the format makes that one
    number (a safetensors slot, a contiguous torch.save tensor); the chunk's file in DCP."""
    detail = ckpt.detail
    item = t.dtype.itemsize
    if isinstance(detail, SafetensorsInfo):
        shard = next(s for s in detail.shards if s.name == t.files[0])
        slot = next(s for s in shard.slots if s.name == t.stored_name)
        return {"file": shard.name, "offset": slot.begin + element * item}
    if isinstance(detail, torchfile.TorchFileInfo):
        e = next(x for x in detail.tensors if x.name == t.stored_name)
        offset = e.data_offset + (e.storage_offset + element) * item if e.is_contiguous else None
        return {"file": t.files[0], "offset": offset}
    if isinstance(detail, dcp.DcpInfo):
        index = _unravel(element, t.shape)
        entry = detail.tensor(t.stored_name)
        for c in entry.chunks:
            if all(o <= i < o + s for i, o, s in zip(index, c.offsets, c.sizes, strict=True)):
                return {"file": c.file, "offset": None}
    return {"file": None, "offset": None}


def _scan_tensor(scanner: _Scanner, t: TensorView, *, digest: bool, compare: _Compare | None
                 ) -> _Result:
    """One tensor: CRCs and values from a single read; a second read in C order only when the
    layout is not (a Shard(1) tensor) and a digest or a comparison needs order."""
    result = _Result()
    stats = Stats(t.dtype, full=False)
    hasher = hashlib.sha256() if digest else None
    ordered = True
    try:
        for start, data in scanner.stream(t, result):
            stats.update(data)
            if start is None:
                ordered = False
                continue
            if hasher is not None:
                hasher.update(data)
            if compare is not None:
                compare.feed(start, data)
        if not ordered and (hasher is not None or compare is not None):
            hasher = hashlib.sha256() if digest else None
            for start_elem, block in blocks(scanner.src, t):
                scanner.report(len(block))
                result.bytes_read += len(block)
                if hasher is not None:
                    hasher.update(block)
                if compare is not None:
                    compare.feed(start_elem, memoryview(block))
    except _Unreadable:
        return result
    except InputError as e:
        result.problems.append(_error("read-error", str(e), tensor=t.name))
        return result
    if hasher is not None:
        result.digest = hasher.hexdigest()
    if compare is not None:
        result.bytes_read += compare.bytes_read
        if compare.problem is not None:
            result.problems.append(compare.problem)
        result.equal = compare.problem is None
    s = stats.result()
    if s.nan:
        result.problems.append(_warning("nan", f"tensor '{t.name}' holds {s.nan} NaN "
                                        f"values (of {t.numel})", tensor=t.name))
    if s.inf:
        result.problems.append(_warning("inf", f"tensor '{t.name}' holds {s.inf} infinite "
                                        f"values (of {t.numel})", tensor=t.name))
    if s.all_zero and t.numel:
        result.problems.append(_warning("all-zero", f"tensor '{t.name}' is entirely zero",
                                        tensor=t.name))
    return result


def _same(src_x: sources.Source, x: TensorView, src_y: sources.Source, y: TensorView,
          report: Progress) -> bool:
    """Bytes equal (same dtype and shape required), compared block by block."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    for start, block in blocks(src_x, x):
        report(2 * len(block))
        if src_y.read(y.stored_name, start, start + len(block) // x.dtype.itemsize) != block:
            return False
    return True


# --------------------------------------------------------------------------------------------
# Manifests


def _manifest_doc(ckpt: Checkpoint, digests: dict[str, str]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "kind": MANIFEST_KIND,
        "algorithm": "sha256",
        "about": "SHA-256 of each tensor's bytes in C order, under canonical names; any format",
        "tensors": {t.name: {"dtype": t.dtype.name, "shape": list(t.shape),
                             "sha256": digests[t.name]}
                    for t in sorted(ckpt.tensors, key=lambda t: t.name) if t.name in digests},
    }


def read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors of a manifest written by ``verify --manifest``.

    Raises:
        InputError: not a ckpttool manifest.
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the manifest ({e}); pass a file that "
                         "verify --manifest wrote, or a new path to write one") from None
    if not isinstance(doc, dict) or doc.get("kind") != MANIFEST_KIND or not isinstance(
            doc.get("tensors"), dict):
        raise InputError(f"{path}: not a ckpttool manifest (--manifest); pass a file that "
                         "verify --manifest wrote, or a new path to write one")
    tensors: dict[str, dict[str, Any]] = doc["tensors"]
    return tensors


def check_manifest(ckpt: Checkpoint, expected: dict[str, dict[str, Any]],
                   digests: dict[str, str], unreadable: set[str], manifest: Path
                   ) -> list[Problem]:
    """Each tensor's dtype, shape and SHA-256 against the manifest. Pure."""
    problems = []
    have = ckpt.by_name()
    for name, want in expected.items():
        t = have.get(name)
        if t is None:
            problems.append(_error("manifest-missing", f"tensor '{name}' is in {manifest} but "
                                   "not in the checkpoint", tensor=name))
        elif (want.get("dtype"), want.get("shape")) != (t.dtype.name, list(t.shape)):
            problems.append(_error("manifest-mismatch", f"tensor '{name}' is {t.dtype.name} "
                                   f"{list(t.shape)} but {manifest} recorded {want.get('dtype')} "
                                   f"{want.get('shape')}", tensor=name))
        elif name not in unreadable and digests.get(name) != want.get("sha256"):
            problems.append(_error("manifest-mismatch", f"tensor '{name}': SHA-256 "
                                   f"{digests.get(name)} differs from {want.get('sha256')} in "
                                   f"{manifest}; the data changed since the manifest was "
                                   "written", tensor=name, file=t.files[0]))
    for name in have:
        if name not in expected:
            problems.append(_error("manifest-extra", f"tensor '{name}' is not in {manifest}",
                                   tensor=name))
    return problems


# --------------------------------------------------------------------------------------------
# The whole operation


@dataclass
class VerifyReport:
    """What ``verify`` found, for people (CLI) and programs (``to_json``)."""

    path: str
    checkpoint: str
    format: str
    kind: str
    against: dict[str, str] | None = None
    manifest: dict[str, Any] | None = None
    parts: list[dict[str, str]] = field(default_factory=list)  # other checkpoints verified
    checks: list[str] = field(default_factory=list)
    num_tensors: int = 0
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(1 for p in self.problems if p.severity == s) for s in SEVERITIES}

    @property
    def ok(self) -> bool:
        """True when nothing at error severity was found."""
        return self.counts["error"] == 0

    def to_json(self) -> dict[str, Any]:
        doc = {"schema": SCHEMA, "command": "verify", **self.__dict__}
        doc["problems"] = [p.to_json() for p in self.problems]
        doc["counts"] = self.counts
        doc["ok"] = self.ok
        return doc


def verify(
    path: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | None = None,
    allow_cast: bool = False,
    dtype: str | None = None,
    expect_dtype: str | None = None,
    config: str | os.PathLike[str] | None = None,
    manifest: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check the checkpoint at ``path``; problems are reported, not raised.

    Args:
        path: any supported checkpoint (see :func:`~ckpttool.core.inspect.open_checkpoint`).
        against: another checkpoint (any format) that must hold the same tensors, bit for bit.
        allow_cast: with ``against``, compare after the cast ``merge --dtype`` would apply.
        dtype: that ``--dtype`` (default ``auto``: the config's); only with ``allow_cast``.
        expect_dtype: ``auto``, ``bf16``, ``fp16`` or ``fp32``: floating tensors of another
            dtype are errors.
        config: config.json (or its directory) instead of the one beside ``path``.
        manifest: a file to write SHA-256 digests to, or to check them against if it exists.
        workers: tensors read in parallel (default: number of CPUs).
        progress: called with bytes read.
        on_start: called once with the bytes about to be read.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False when an error was found.

    Raises:
        InputError: ``path`` (or ``against``) cannot be read at all, or a bad option.
        UnsupportedError: a format or layout ckpttool does not read yet.
        OutputError: the manifest cannot be written.
    """
    started = time.perf_counter()
    if dtype is not None and not allow_cast:
        raise InputError("--dtype applies to the cast that --allow-cast allows; pass "
                         "--allow-cast too, or leave --dtype out")
    if allow_cast and against is None:
        raise InputError("--allow-cast needs --against OTHER")
    ckpt = open_checkpoint(path, config=config)
    other = open_checkpoint(against) if against is not None else None
    config_name = str(ckpt.hf.config_path) if ckpt.hf.config_path else "config.json"
    expect = None
    if expect_dtype is not None:
        if expect_dtype.lower() == "keep":
            raise InputError("--expect-dtype keep checks nothing; use auto, bf16, fp16 or fp32")
        expect = dtype_policy.resolve(expect_dtype, ckpt.hf.config, config_name)
    cast_policy = (dtype_policy.resolve(dtype or "auto", ckpt.hf.config, config_name)
                   if allow_cast else None)
    manifest_path = Path(manifest) if manifest is not None else None
    expected = read_manifest(manifest_path) if manifest_path and manifest_path.exists() else None

    report = VerifyReport(path=str(ckpt.path), checkpoint=str(ckpt.root), format=ckpt.format,
                          kind=ckpt.kind, num_tensors=len(ckpt.tensors))
    report.checks = ["structure", "content", "ties", "dtypes"]
    plan = None
    if other is not None:
        report.checks.append("against")
        report.against = {"path": str(other.path), "checkpoint": str(other.root),
                          "format": other.format}
        plan = plan_against(ckpt, other, policy=cast_policy)
    if manifest_path is not None:
        report.checks.append("manifest")
    parts = _other_parts(ckpt)
    lock = threading.Lock()

    def read(n: int) -> None:
        if progress is not None and n:
            with lock:
                progress(n)

    if on_start is not None:
        on_start(sum(t.nbytes for c in (ckpt, other, *(p for _, p in parts)) if c is not None
                     for t in c.tensors))
    pair = tie_pair(ckpt) if ckpt.kind == "model" else None
    want_digest = set(pair or ()) | ({t.name for t in ckpt.tensors} if manifest_path else set())
    problems = check_structure(ckpt)
    if other is not None:
        problems += check_structure(other)
    done = _data_pass(ckpt, other, plan, want_digest, workers, read)
    problems += done.problems
    digests = done.digests
    same = None
    if pair is not None and pair[0] in digests and pair[1] in digests:
        same = digests[pair[0]] == digests[pair[1]]
    problems += check_ties(ckpt, same)
    problems += check_dtypes(ckpt, expect)
    if plan is not None:
        problems += [*plan.problems, *done.tied]
    bytes_read = done.bytes_read
    for name, part in parts:  # the rest of a training checkpoint must be whole too
        part_pass = _data_pass(part, None, None, set(), workers, read)
        for p in check_structure(part) + part_pass.problems:
            file = p.location.file
            problems.append(replace(p, location=replace(
                p.location, file=None if file is None else f"{name}/{file}")))
        bytes_read += part_pass.bytes_read
    report.parts = [{"path": name, "kind": part.kind, "format": part.format}
                    for name, part in parts]
    if manifest_path is not None:
        unreadable = {t.name for t in ckpt.tensors} - set(digests)
        if expected is not None:
            problems += check_manifest(ckpt, expected, digests, unreadable, manifest_path)
            report.manifest = {"path": str(manifest_path), "action": "checked",
                               "tensors": len(expected)}
        elif unreadable:
            problems.append(_error("manifest-incomplete", f"{manifest_path}: not written: "
                                   f"{len(unreadable)} tensors could not be read"))
        else:
            _write_manifest(manifest_path, _manifest_doc(ckpt, digests))
            report.manifest = {"path": str(manifest_path), "action": "written",
                               "tensors": len(digests)}
    report.problems = problems
    report.bytes_read = bytes_read
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _other_parts(ckpt: Checkpoint) -> list[tuple[str, Checkpoint]]:
    """The other checkpoints of a training directory (optimizer_0/ beside the model's
    pytorch_model_fsdp_0/), each verified for structure and content too."""
    out = []
    for part in ckpt.parts:
        target = ckpt.path / part.path
        if part.format != "dcp" or target == ckpt.root:
            continue
        out.append((part.path, open_checkpoint(target)))
    return out


@dataclass
class _Pass:
    problems: list[Problem]  # content problems of the checkpoint read
    tied: list[Problem]  # against: tensors on one side only, decided once the data is read
    digests: dict[str, str]
    bytes_read: int


def _data_pass(ckpt: Checkpoint, other: Checkpoint | None, plan: AgainstPlan | None,
               want_digest: set[str], workers: int | None, read: Progress) -> _Pass:
    """Read every undamaged tensor of ``ckpt`` once: CRCs, values, digests (``want_digest``),
    and the comparisons ``plan`` asks for with ``other``."""
    skip = damaged_tensors(ckpt)
    skip_b = damaged_tensors(other) if other is not None else set()
    todo = [t for t in ckpt.tensors if t.name not in skip]
    comparisons = {p.a.name: p for p in (plan.pairs if plan else ()) if p.b.name not in skip_b}
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(open_source(ckpt))
        src_b = stack.enter_context(open_source(other)) if other is not None else None
        scanner = stack.enter_context(_Scanner(ckpt, src, read))
        _warm(src)
        if src_b is not None:
            _warm(src_b)

        def job(t: TensorView) -> _Result:
            p = comparisons.get(t.name)
            compare = None
            if p is not None and src_b is not None and other is not None:
                compare = _Compare(p, ckpt, other, src_b, read)
            return _scan_tensor(scanner, t, digest=t.name in want_digest, compare=compare)

        results = _run(job, todo, workers)
        problems = [p for t in todo for p in results[t.name].problems]
        problems += scanner.leftover_crcs()
        digests = {n: r.digest for n, r in results.items() if r.digest is not None}
        tied = []
        if plan is not None and other is not None and src_b is not None:
            tied = _decide_tied(ckpt, other, plan, results, digests, src_b, read)
    return _Pass(problems, tied, digests, sum(r.bytes_read for r in results.values()))


def _run(job: Callable[[TensorView], _Result], todo: list[TensorView], workers: int | None
         ) -> dict[str, _Result]:
    """``job`` on every tensor, in ``workers`` threads (tensors are independent)."""
    n_workers = max(1, workers or os.cpu_count() or 1)
    with one_torch_thread():
        if n_workers == 1:
            return {t.name: job(t) for t in todo}
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            return {t.name: r for t, r in zip(todo, pool.map(job, todo), strict=True)}


def _warm(src: sources.Source) -> None:
    """Open the files of a source before threads share it (each opens lazily)."""
    seen: set[str] = set()
    for t in src.tensors:
        key = t.key
        if key not in seen and t.numel:
            seen.add(key)
            src.read(key, 0, 0)
    if isinstance(src, sources.DcpSource):
        for f in src.info.files:
            with contextlib.suppress(InputError):  # missing: reported by check_structure
                src.reader.fd(f)


def _decide_tied(a: Checkpoint, b: Checkpoint, plan: AgainstPlan, results: dict[str, _Result],
                 digests: dict[str, str], src_b: sources.Source, report: Progress
                 ) -> list[Problem]:
    """A tensor on one side only whose tie partner is on both: fine when it is identical to
    that partner (a deduplicated tie, as merge writes it), unless the config unties them."""
    problems = []
    config_ties = source.ties_word_embeddings(a.hf.config)
    for name, partner in plan.tied_missing:
        equal_partner = results.get(partner, _Result()).equal
        identical = name in digests and digests.get(name) == digests.get(partner)
        if identical and equal_partner and config_ties is not False:
            problems.append(_info("tie-deduplicated", f"'{name}' is not in {b.root}, but it is "
                                  f"identical to '{partner}' here: a tied copy stored once",
                                  tensor=name))
        else:
            why = ("it differs from its tie partner" if not identical
                   else "config.json unties them" if config_ties is False
                   else "its tie partner differs")
            problems.append(_error("missing-tensor", f"tensor '{name}' is in {a.root} but not "
                                   f"in {b.root} ({why} '{partner}', so it is not a deduplicated "
                                   "tie)", tensor=name))
    by_b = b.by_name()
    for name, partner in plan.tied_extra:
        equal_partner = results.get(partner, _Result()).equal
        try:
            identical = _same(src_b, by_b[name], src_b, by_b[partner], report)
        except InputError:
            identical = False
        if identical and equal_partner:
            problems.append(_info("tie-deduplicated", f"'{name}' is only in {b.root}, where it "
                                  f"is identical to '{partner}': a tied copy stored once here",
                                  tensor=name))
        else:
            problems.append(_error("extra-tensor", f"tensor '{name}' is in {b.root} but not in "
                                   f"{a.root}, and it is not identical to '{partner}'",
                                   tensor=name))
    return problems


def _write_manifest(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with AtomicOutputs(path.parent) as out:
        out.write_bytes(path.name, (json.dumps(doc, indent=2) + "\n").encode())
        out.commit()
