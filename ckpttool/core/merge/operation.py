"""``merge``: a checkpoint of any format to Hugging Face safetensors.

Plan first: from the metadata alone, decide every output tensor's name, dtype, file and byte
range (:func:`plan_merge`, pure). Then execute: fill the output files at those offsets, with
kernel-side copies where a chunk is one contiguous range of its tensor and no cast is needed,
so that a merge costs about what a copy costs. Torch is imported only to cast.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from ckpttool.core import dtype_policy, ties
from ckpttool.core.checkpoint import geometry as chunk_geometry
from ckpttool.core.checkpoint import hf, names, non_tensor, structure, tensors
from ckpttool.core.checkpoint.discover import (
    Checkpoint,
    ObjectView,
    Part,
    discover,
    open_reader,
    select,
)
from ckpttool.core.checkpoint.names import detected_wrappers
from ckpttool.core.checkpoint.parts import MERGEABLE
from ckpttool.core.dtype_policy import DTypePolicy
from ckpttool.core.merge.partition import Unit
from ckpttool.core.runtime import forked
from ckpttool.core.runtime import urls as remote
from ckpttool.core.runtime.report import SCHEMA, Progress, locked
from ckpttool.core.runtime.torch_threads import default_workers, one_torch_thread, workers_for
from ckpttool.core.transforms import lora as adapters
from ckpttool.core.transforms import namemaps
from ckpttool.core.transforms.derive import Derived, materialise
from ckpttool.errors import InputError, OutputError, UnsupportedError
from ckpttool.formats import registry
from ckpttool.formats import safetensors as st
from ckpttool.formats.base import Chunk, Payload, Reader, Tensor
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.formats.codecs.torchsave import gc_paused
from ckpttool.storage.outputs import (
    AtomicOutputs,
    check_apart,
    check_space,
    existing_outputs,
    pwrite_all,
    remove_stale,
    write_behind,
)
from ckpttool.storage.store import LocalStore, read_blocks

if TYPE_CHECKING:
    from ckpttool.core.merge.multihost import Shared

# --------------------------------------------------------------------------------------------
# The plan


# What an output tensor is made from: a stored tensor (copied, or cast on the way), or a tensor
# computed from whole stored ones (a LoRA update folded in, a fused projection split).
Source = Tensor | Derived


@dataclass(frozen=True)
class OutTensor:
    name: str
    source: Source
    dtype: DType  # as written
    slot: st.Slot

    @property
    def cast(self) -> bool:
        return self.dtype != self.source.dtype


@dataclass(frozen=True)
class OutFile:
    name: str
    layout: st.Layout
    tensors: tuple[OutTensor, ...]

    @property
    def size(self) -> int:
        return self.layout.file_size


@dataclass(frozen=True)
class MergePlan:
    files: tuple[OutFile, ...]
    index: bytes | None  # model.safetensors.index.json, when sharded
    dropped: tuple[str, ...]  # canonical names left out (a deduplicated tied weight)
    index_name: str = st.INDEX_NAME

    @property
    def total_bytes(self) -> int:
        return sum(t.slot.nbytes for f in self.files for t in f.tensors)

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.files) + len(self.index or b"")


def plan_merge(
    tensors: list[tuple[str, Source]],
    *,
    policy: DTypePolicy,
    max_shard_size: int,
    drop: frozenset[str] = frozenset(),
    stem: str = "model",
) -> MergePlan:
    """Assign every tensor to an output file and a byte range. Pure: no I/O.

    Args:
        tensors: (canonical name, source entry) in model order.
        policy: which dtype each tensor is written in.
        max_shard_size: shard limit in tensor bytes, as transformers counts it.
        drop: canonical names not to write (a deduplicated tied weight).
        stem: output file stem: "model", or "optimizer" for optimizer state.
    """
    kept = [(name, entry) for name, entry in tensors if name not in drop]
    by_name = {name: entry for name, entry in kept}
    file_plans, index = st.plan_files(
        [(name, policy.output_dtype(entry.dtype), entry.shape) for name, entry in kept],
        max_shard_size,
        stem,
    )
    files = tuple(
        OutFile(f.name, f.layout, tuple(OutTensor(s.name, by_name[s.name], s.dtype, s)
                                        for s in f.layout.slots))
        for f in file_plans
    )
    return MergePlan(files, index, tuple(sorted(drop)), st.index_name(stem))


# --------------------------------------------------------------------------------------------
# Execution


def execute(
    plan: MergePlan,
    reader: Reader,
    outputs: AtomicOutputs,
    *,
    workers: int = 1,
    progress: Progress | None = None,
) -> None:
    """Write every planned file under its temporary name.

    Each chunk of each tensor lands at a known offset, so chunks are independent jobs that
    workers balance by bytes, largest first; small chunks go in batches (a thread-pool task
    per kilobyte-sized chunk would cost more than copying it).
    """
    report = locked(progress)
    jobs: list[_Job] = []
    casts = False
    fds = []
    for f in plan.files:
        fd = outputs.create(f.name, f.size)
        fds.append(fd)
        pwrite_all(fd, f.layout.header, 0)
        jobs += _jobs(fd, f.tensors)
        casts = casts or any(t.cast or isinstance(t.source, Derived) for t in f.tensors)
    with write_behind(fds, report) as counted:
        _run(jobs, reader, workers=workers, casts=casts, report=counted, fork=True)


def execute_share(
    plan: MergePlan,
    share: list[Unit],
    reader: Reader,
    fds: dict[int, int],
    *,
    workers: int = 1,
    progress: Progress | None = None,
) -> None:
    """Write one process's share of ``plan`` (:func:`ckpttool.core.merge.partition.split`) into
    output files that exist already at their full size, headers written (``fds``: index in
    ``plan.files`` -> writable descriptor): the copy of a merge that several processes share
    (:mod:`ckpttool.core.merge.multihost`). Parts of chunks are jobs of their own; small whole
    chunks
    go in batches, as in :func:`execute`."""
    report = locked(progress)
    jobs: list[_Job] = []
    batches: dict[int, _Job] = {}
    casts = False
    for u in share:
        t = plan.files[u.file].tensors[u.tensor]
        fd = fds[u.file]
        casts = casts or t.cast or isinstance(t.source, Derived)
        if u.chunk is None:
            jobs.append(_Job(fd, [(t, None)], u.nbytes))
            continue
        assert isinstance(t.source, Tensor)
        c = t.source.chunks[u.chunk]
        if u.elements is not None or u.nbytes >= SMALL_CHUNK:
            jobs.append(_Job(fd, [(t, c)], u.nbytes, u.elements))
            continue
        batch = batches.setdefault(u.file, _Job(fd, [], 0))
        assert isinstance(batch.chunks, list)
        batch.chunks.append((t, c))
        batch.nbytes += u.nbytes
        if len(batch.chunks) >= BATCH_CHUNKS or batch.nbytes >= BATCH_BYTES:
            jobs.append(batches.pop(u.file))
    jobs += batches.values()
    _run(jobs, reader, workers=workers, casts=casts, report=report)


def _run(jobs: list[_Job], reader: Reader, *, workers: int, casts: bool, report: Progress,
         fork: bool = False) -> None:
    """Run ``jobs`` in up to ``workers`` threads: largest first, or in stored order where the
    store reads ahead (object storage). Jobs whose cost is Python per chunk (kilobyte-sized
    chunks) run in up to ``workers`` processes instead, where ``fork`` allows
    (:mod:`ckpttool.core.runtime.forked`)."""
    reader.open_files()  # before threads share the reader
    plan_reads = getattr(reader.store, "plan_reads", None)
    if plan_reads is None:
        jobs.sort(key=lambda j: -j.nbytes)
    else:
        jobs = _stored_order(jobs, plan_reads)
    threads = workers_for(workers, nbytes=sum(j.nbytes for j in jobs),
                          chunks=sum(len(j.chunks) for j in jobs))
    if threads < workers and len(jobs) > 1 and fork and isinstance(reader.store, LocalStore) \
            and forked.available(needs_torch=casts):
        # Python per chunk: shares in processes of their own, each writing its own jobs.
        forked.run([functools.partial(_run_share, share, reader, casts)
                    for share in forked.deal(jobs, workers, lambda j: len(j.chunks))], report)
        return
    _run_share(jobs, reader, casts, report, threading.Event(), threads)


def _run_share(jobs: list[_Job], reader: Reader, casts: bool, report: Progress,
               stop: threading.Event, threads: int = 1) -> None:
    if not casts:
        _run_jobs(jobs, reader, threads, report, stop)  # no torch at all
        return
    # Loaded once here, before the workers (who would queue on the import), with one intra-op
    # thread while they cast.
    with one_torch_thread():
        _run_jobs(jobs, reader, threads, report, stop)


# A chunk below this many bytes is copied in a batch with others of its file...
SMALL_CHUNK = 1 << 20
# ...of at most this many chunks or bytes.
BATCH_CHUNKS = 512
BATCH_BYTES = 16 << 20


@dataclass
class _Job:
    fd: int
    # None: a derived tensor, computed whole
    chunks: list[tuple[OutTensor, Chunk | None]] | _Small | _WindowChunks
    nbytes: int
    # A part [lo, hi) of a one-chunk job's single run, in elements (core.partition); None: all
    elements: tuple[int, int] | None = None


class _Window(_Job):
    """Small tensors that lie back to back in the output: made whole in memory (their chunks
    read in the order they are stored, back-to-back records together) and written in one
    piece. What a checkpoint of millions of kilobyte-sized chunks (mixture-of-experts) is
    made of; the cost is then a decode per chunk, not a write."""

    def __init__(self, fd: int, first: OutTensor) -> None:
        self.tensors: list[OutTensor] = []
        super().__init__(fd, _WindowChunks(self.tensors), 0)
        self.begin = first.slot.begin
        self.stored = 0  # bytes its chunks take in the source files

    def fits(self, t: OutTensor, stored: int) -> bool:
        return (t.slot.begin == self.begin + self.nbytes
                and self.nbytes + t.slot.nbytes <= WINDOW_BYTES
                and self.stored + stored <= WINDOW_STORED)

    def add(self, t: OutTensor, stored: int) -> None:
        self.tensors.append(t)
        self.nbytes += t.slot.nbytes
        self.stored += stored


class _WindowChunks(Collection[tuple[OutTensor, Chunk | None]]):
    """Every ``(tensor, chunk)`` of a window, built when asked for (only for object storage's
    read planning: the window itself reads from columns)."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[OutTensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return sum(len(_stored(t).chunks) for t in self.tensors)

    def __contains__(self, item: object) -> bool:
        return any(x == item for x in self)

    def __iter__(self) -> Iterator[tuple[OutTensor, Chunk | None]]:
        for t in self.tensors:
            for c in _stored(t).chunks:
                yield t, c


def _stored(t: OutTensor) -> Tensor:
    assert isinstance(t.source, Tensor)
    return t.source


# A tensor below this many bytes (stored and written) goes in a window of others; a window
# holds at most this many bytes of output, and of stored chunks (records with headers).
WINDOW_TENSOR = 1 << 20
WINDOW_BYTES = 16 << 20
WINDOW_STORED = 32 << 20


def _jobs(fd: int, tensors: tuple[OutTensor, ...]) -> list[_Job]:
    """A window of small tensors, a job per large chunk or derived tensor, and batches of
    the small chunks of large tensors, for one output file. Small chunks are batched in the
    order their bytes lie in the source files, so that a batch reads back-to-back records
    together (:meth:`Reader.payloads`); every chunk's place in the output is known, so the
    order of writes does not matter."""
    jobs: list[_Job] = []
    # (place in the source files, bytes, tensor, chunk number): a small chunk's Chunk is built
    # again when it is copied, so that a merge of a million chunks holds no Chunk objects.
    small: list[tuple[int, int, OutTensor, int]] = []
    file_ids: dict[str, int] = {}
    window: _Window | None = None
    for t in tensors:
        if isinstance(t.source, Derived):
            jobs.append(_Job(fd, [(t, None)], t.slot.nbytes))
            continue
        if max(t.slot.nbytes, t.source.nbytes) < WINDOW_TENSOR:
            stored = t.source.stored_bytes
            if stored <= WINDOW_STORED:
                if window is None or not window.fits(t, stored):
                    window = _Window(fd, t)
                    jobs.append(window)
                window.add(t, stored)
                continue
        item = t.source.dtype.itemsize
        for k, c in enumerate(t.source.chunks):
            n = c.numel * item
            if not n:
                continue
            if n >= SMALL_CHUNK:
                jobs.append(_Job(fd, [(t, c)], n))
                continue
            fid = file_ids.setdefault(c.file, len(file_ids))
            small.append(((fid << 48) | c.offset, n, t, k))
    small.sort(key=lambda s: s[0])
    start = nbytes = 0
    for i, (_, n, _, _) in enumerate(small):
        nbytes += n
        if i + 1 - start >= BATCH_CHUNKS or nbytes >= BATCH_BYTES or i + 1 == len(small):
            jobs.append(_Job(fd, _Small(small[start : i + 1]), nbytes))
            start, nbytes = i + 1, 0
    return jobs


class _Small(Sequence[tuple[OutTensor, Chunk | None]]):
    """A batch of small chunks as ``(sort key, bytes, tensor, chunk number)``, each
    ``(tensor, Chunk)`` built when asked for."""

    __slots__ = ("items",)

    def __init__(self, items: list[tuple[int, int, OutTensor, int]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, i: int) -> tuple[OutTensor, Chunk | None]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[OutTensor, Chunk | None]]: ...

    def __getitem__(self, i: int | slice
                    ) -> tuple[OutTensor, Chunk | None] | list[tuple[OutTensor, Chunk | None]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.items)))]
        _, _, t, k = self.items[i]
        assert isinstance(t.source, Tensor)
        return t, t.source.chunks[k]


def _stored_order(jobs: list[_Job], plan_reads: Callable[[list[tuple[str, int, int]]], None]
                  ) -> list[_Job]:
    """Object storage (``formats/remote.py``): jobs in stored order, every range they read
    told to the store first, which turns them into coalesced GETs fetched ahead in that order
    (largest-first would scatter the reads over the files and defeat the read-ahead)."""
    def first(job: _Job) -> tuple[str, int]:
        return min(((c.file, c.offset) for _, c in job.chunks if c is not None),
                   default=("", 0))

    jobs = sorted(jobs, key=first)
    plan_reads([(c.file, c.offset, c.length) for j in jobs for _, c in j.chunks
                if c is not None])
    return jobs


def _run_jobs(jobs: list[_Job], reader: Reader, workers: int, report: Progress,
              stop: threading.Event) -> None:
    # Large writes into one output file take turns (local sources; object storage waits on the
    # network, not on the file): the kernel serialises writes to a file on its inode lock, and
    # a thread waiting there spins on a CPU that a cast could use (measured: two threads
    # copying 3 GB into one file took 2.7 s, one thread 1.7 s). Casts still run side by side.
    local = getattr(reader.store, "plan_reads", None) is None
    locks = {j.fd: threading.Lock() for j in jobs} if local and workers > 1 else {}

    def run(job: _Job) -> None:
        if isinstance(job, _Window):
            _write_window(reader, job, report, stop)
            return
        if len(job.chunks) > 1:
            _write_batch(reader, job, report, stop)
            return
        ((t, c),) = job.chunks
        if c is None:
            _write_derived(reader, job.fd, t, report)
        else:
            _write_chunk(reader, job.fd, t, c, report, elements=job.elements,
                         lock=locks.get(job.fd))

    if workers <= 1:
        try:
            for job in jobs:
                if stop.is_set():
                    return
                run(job)
        finally:
            _scratch.__dict__.clear()  # this thread goes on: give its buffers back
        return
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        for fut in [pool.submit(run, job) for job in jobs]:
            fut.result()
    except BaseException:
        # Ctrl-C or a failed chunk: drop the queued jobs (and the rest of the running
        # batches) instead of finishing the merge first.
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _write_derived(reader: Reader, dst: int, t: OutTensor, report: Progress) -> None:
    assert isinstance(t.source, Derived)
    data = materialise(reader, t.source, t.dtype)
    pwrite_all(dst, data, t.slot.begin)
    report(len(data))


def _write_batch(reader: Reader, job: _Job, report: Progress, stop: threading.Event) -> None:
    """Small chunks, decoded together: a chunk whose stored bytes came with its record and
    that is one run of its tensor (Shard(0), whole) is written from memory, with no further
    read; any other goes the way of :func:`_write_chunk`."""
    items = [(t, c) for t, c in job.chunks if c is not None]
    done = 0
    sources = [(t.source, c) for t, c in items if isinstance(t.source, Tensor)]
    for (t, c), p in zip(items, reader.payloads(sources), strict=True):
        if stop.is_set():
            break
        entry = t.source
        assert isinstance(entry, Tensor)
        data, start = p.data, p.start
        first = None if data is None or start is None or t.cast else \
            chunk_geometry.single_run_start(entry.shape, c.offsets, c.sizes)
        if data is None or start is None or first is None:
            _write_chunk(reader, job.fd, t, c, lambda n: None, payload=p)
        else:
            at = start - p.storage_offset
            n = c.numel * entry.dtype.itemsize
            pwrite_all(job.fd, data[at : at + n], t.slot.begin + first * t.dtype.itemsize)
        done += c.numel * t.dtype.itemsize
    report(done)


def _write_window(reader: Reader, job: _Window, report: Progress, stop: threading.Event
                  ) -> None:
    """The window's tensors made whole in memory, then written at once. Chunks are read in
    the order they are stored (:meth:`Reader.elements`); a chunk of a tensor of rows
    (Shard(0)) whose elements came that way is copied in place, any other is read in C order
    (:meth:`Reader.read_chunk` where they did not come) and placed run by run. A tensor to
    cast is made whole in its own dtype first."""
    out = bytearray(job.nbytes)
    view = memoryview(out)
    # Per tensor: where its elements go (the window, or a buffer in its own dtype to cast).
    targets: list[memoryview] = []
    entries = [_stored(t) for t in job.tensors]
    for t, entry in zip(job.tensors, entries, strict=True):
        at = t.slot.begin - job.begin
        targets.append(memoryview(bytearray(entry.nbytes)) if t.cast
                       else view[at : at + t.slot.nbytes])
    # Per tensor, where each chunk begins when every chunk is rows (Shard(0)).
    starts = [tensors.row_starts(entry) for entry in entries]
    order = tensors.stored_order(entries, empty=False)
    items = [(entries[i], k) for _, _, i, k in order]
    for (entry, k), data, row_starts, target in zip(
            items, reader.elements(items), (starts[i] for _, _, i, _ in order),
            (targets[i] for _, _, i, _ in order), strict=True):
        if stop.is_set():
            return
        if data is not None and row_starts is not None:  # rows, from memory: the usual case
            target[row_starts[k] : row_starts[k] + len(data)] = data
            continue
        item = entry.dtype.itemsize
        c = entry.chunks[k]
        whole = memoryview(data if data is not None else reader.read_chunk(entry, c))
        for src, dst, n in chunk_geometry.runs(entry.shape, c.offsets, c.sizes):
            target[dst * item : (dst + n) * item] = whole[src * item : (src + n) * item]
    for t, target in zip(job.tensors, targets, strict=True):
        if t.cast:
            at = t.slot.begin - job.begin
            view[at : at + t.slot.nbytes] = _cast_bytes(target, t)
    pwrite_all(job.fd, view, job.begin)
    report(job.nbytes)


def _write_chunk(reader: Reader, dst: int, t: OutTensor, c: Chunk, report: Progress,
                 payload: Payload | None = None, elements: tuple[int, int] | None = None,
                 lock: threading.Lock | None = None) -> None:
    """``lock``: held while writing into ``dst`` (:func:`_run_jobs`)."""
    turn = lock or contextlib.nullcontext()
    entry = t.source
    assert isinstance(entry, Tensor)
    payload = payload or reader.payload(entry, c)
    dst_item = t.dtype.itemsize
    start = payload.start
    single = chunk_geometry.is_single_run(entry.shape, c.offsets, c.sizes)
    if single:
        ((_, dst_elem, n),) = chunk_geometry.runs(entry.shape, c.offsets, c.sizes)
        lo, hi = elements or (0, n)
        at = t.slot.begin + (dst_elem + lo) * dst_item
        if start is not None:
            src = start + lo * entry.dtype.itemsize
            if t.cast:
                _cast_range(reader, payload.file, src, dst, at, hi - lo, t, report, lock)
            else:
                with turn:
                    reader.store.copy_to(payload.file, src, dst, at,
                                         (hi - lo) * entry.dtype.itemsize)
                report((hi - lo) * dst_item)
            return
    # A strided placement (Shard(1)...): the chunk's rows land apart, so read it whole (so are
    # elements reached only through a whole read: a compressed record, a strided storage).
    data = memoryview(reader.read_chunk(entry, c))
    if t.cast:
        data = _cast_bytes(data, t)
    if elements is not None:  # a part of a single run (core.partition splits nothing else)
        assert single
        with turn:
            pwrite_all(dst, data[lo * dst_item : hi * dst_item], at)
        report((hi - lo) * dst_item)
        return
    with turn:
        for src_elem, dst_elem, n in chunk_geometry.runs(entry.shape, c.offsets, c.sizes):
            pwrite_all(dst, data[src_elem * dst_item : (src_elem + n) * dst_item],
                       t.slot.begin + dst_elem * dst_item)
    report(c.numel * dst_item)


# Source bytes cast per step: a multiple of every vector width, small enough that memory stays
# flat whatever the tensor size, large enough that per-call overhead vanishes.
CAST_BLOCK = 8 << 20

# Each thread's cast buffers, made once and kept while it copies (a new pair per chunk cost a
# page fault per 4 KB of them, 12 MB a chunk).
_scratch = threading.local()


def _buffer(name: str, size: int) -> bytearray:
    buf: bytearray | None = getattr(_scratch, name, None)
    if buf is None or len(buf) < size:
        buf = bytearray(size)
        setattr(_scratch, name, buf)
    return buf


def _cast_range(reader: Reader, file: str, src_offset: int, dst: int, dst_offset: int,
                numel: int, t: OutTensor, report: Progress,
                lock: threading.Lock | None = None) -> None:
    import torch  # only casting needs torch

    assert isinstance(t.source, Tensor)
    src_dtype = getattr(torch, t.source.dtype.torch_name)
    dst_dtype = getattr(torch, t.dtype.torch_name)
    src_item, dst_item = t.source.dtype.itemsize, t.dtype.itemsize
    block = min(numel, CAST_BLOCK // src_item)
    # The output tensor lives in our own buffer (torch.frombuffer): no numpy, which torch
    # needs for .numpy() and which a user's own torch install may lack.
    out_bytes = _buffer("out", block * dst_item)
    out = torch.frombuffer(out_bytes, dtype=dst_dtype, count=block)
    done = 0
    # Cast straight from the page cache where the store maps the file, else from our buffer.
    for view in read_blocks(reader.store, file, src_offset, numel * src_item,
                            memoryview(_buffer("in", block * src_item))[: block * src_item]):
        n = len(view) // src_item
        if not n:
            break
        # Tensor.to semantics (round to nearest even); into a preallocated buffer.
        out[:n].copy_(torch.frombuffer(view, dtype=src_dtype, count=n))
        with lock or contextlib.nullcontext():
            pwrite_all(dst, memoryview(out_bytes)[: n * dst_item], dst_offset + done * dst_item)
        done += n
        report(n * dst_item)
    if done != numel:
        raise InputError(f"{reader.store.path(file)}: ended early while reading "
                         f"'{t.source.name}'; it is truncated")


def _cast_bytes(data: memoryview, t: OutTensor) -> memoryview:
    import torch

    src = torch.frombuffer(bytearray(data), dtype=getattr(torch, t.source.dtype.torch_name))
    out = bytearray(len(src) * t.dtype.itemsize)
    if out:
        torch.frombuffer(out, dtype=getattr(torch, t.dtype.torch_name)).copy_(src)
    return memoryview(out)


# --------------------------------------------------------------------------------------------
# The whole operation


@dataclass
class MergeReport:
    """What a merge did, for people (CLI) and programs (``to_json``)."""

    src: str
    checkpoint: str
    out: str
    kind: str = "model"  # or "optimizer"
    format: str = ""  # the source format's NAME
    storage: dict[str, Any] = field(default_factory=dict)  # CheckpointInfo.storage
    files: list[dict[str, Any]] = field(default_factory=list)
    num_tensors: int = 0
    num_parameters: int = 0
    total_bytes: int = 0
    dtype: dict[str, Any] = field(default_factory=dict)
    bytes_before: dict[str, int] = field(default_factory=dict)
    bytes_after: dict[str, int] = field(default_factory=dict)
    renames: list[dict[str, str]] = field(default_factory=list)
    wrappers_removed: list[str] = field(default_factory=list)
    tie: dict[str, Any] | None = None
    name_map: dict[str, Any] | None = None  # --names: the map and what it did to each tensor
    lora: dict[str, Any] | None = None  # the adapter found, and what was done with it
    non_tensor: list[dict[str, Any]] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    config_changes: list[str] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)  # a training directory's entries
    skipped: list[dict[str, str]] = field(default_factory=list)  # its other checkpoints
    part: str = "model"  # what was written: "model" or "optimizer" (core.parts)
    contents: list[dict[str, Any]] = field(default_factory=list)  # every part of the source
    left_out: list[dict[str, Any]] = field(default_factory=list)  # the parts not written
    warnings: list[str] = field(default_factory=list)
    dry_run: bool = False  # nothing was written: files and tensors are what would be
    # dry_run only: every tensor as it would be written ({"name", "file", "dtype",
    # "source_dtype", "shape", "bytes", "offsets": [begin, end], byte offsets in the file})
    tensors: list[dict[str, Any]] = field(default_factory=list)
    # A merge several processes shared (core.multihost): how, and the bytes each wrote.
    distributed: dict[str, Any] | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        doc = {"schema": SCHEMA, "command": "merge", **self.__dict__}
        doc["parts"] = [p.to_json() for p in self.parts]
        return doc


@remote.urls(sources=("src",), output="out")
def merge(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    config: str | os.PathLike[str] | None = None,
    keep_tied: bool = False,
    overwrite: bool = False,
    workers: int | None = None,
    follow_links: bool = False,
    lora: str | None = None,
    adapter: str | os.PathLike[str] | None = None,
    adapter_config: str | os.PathLike[str] | None = None,
    part: str | None = None,
    names: str | None = None,
    dry_run: bool = False,
    shared: Shared | None = None,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
) -> MergeReport:
    """Merge the checkpoint at ``src`` into Hugging Face safetensors in ``out``.

    Args:
        src: any checkpoint ckpttool reads (a DCP directory, per-rank files, safetensors, a
            torch.save file), or a training checkpoint directory holding one model.
        out: output directory (created if missing).
        dtype: ``auto`` (from config.json), ``keep``, ``bf16``, ``fp16`` or ``fp32``.
        max_shard_size: largest shard, e.g. ``"5GB"``; a single file if everything fits.
        config: a config.json (or its directory) to use instead of the one beside ``src``.
        keep_tied: write both copies of tied embeddings even when they are identical.
        overwrite: replace model weights already in ``out``.
        workers: parallel copy threads (default: the CPUs this process may use).
        follow_links: read data files that are links out of the checkpoint directory
            (shared-storage layouts); refused otherwise.
        lora: for a checkpoint holding a LoRA adapter: ``"fuse"`` (default when the base
            weights are there: fold ``W + scale * B @ A`` into a plain model) or ``"adapter"``
            (a PEFT adapter directory: ``adapter_model.safetensors`` + ``adapter_config.json``).
        adapter: a PEFT adapter (directory or ``adapter_model.safetensors``) to fold into
            ``src``, a model with full weights.
        adapter_config: PEFT's ``adapter_config.json`` (or its directory), where it is not
            beside the checkpoint or the adapter.
        part: what to write of a checkpoint that holds more than the model (optimizer,
            lr scheduler, dataloader...): ``"model"`` (model.safetensors) or ``"optimizer"``
            (optimizer.safetensors and optimizer.json). Default: the model, or the optimizer
            state of a checkpoint that holds nothing else. The rest is reported, not written.
        names: a name map (``namemaps.NAMES``, e.g. ``"torchtitan-llama3"``) from the
            training framework's names and layouts to the Hugging Face model family's.
        dry_run: plan the merge and report it (files, sizes, every tensor's name, dtype,
            shape and place: ``report.tensors``) without writing or creating anything. Every
            check a merge makes before writing is made (a tie is decided by reading both
            embeddings), except free space.
        shared: this process's part in a merge that several processes share
            (:mod:`ckpttool.core.merge.multihost`: a torchrun ``Team``, a ``Slice``, a ``Finish``);
            every process calls ``merge`` with the same arguments. None: this process alone.
        progress: called with bytes written, as the merge goes.
        on_start: called once with the total bytes to write, before any are written.

    Returns:
        A :class:`MergeReport`.

    Raises:
        InputError: ``src`` is not a readable checkpoint, or is damaged.
        UnsupportedError: the checkpoint uses something ckpttool cannot merge yet.
        OutputError: ``out`` holds weights already (without ``overwrite``), or lacks space.
    """
    started = time.perf_counter()
    src_path, out_path = Path(src), Path(out)
    shard_limit = st.parse_size(str(max_shard_size))
    if part not in (None, *MERGEABLE):
        raise InputError(f"part {part!r} cannot be merged; choose one of {', '.join(MERGEABLE)}")
    ckpt = discover(src_path, config=config, command="merge")
    if ckpt.chosen is not None and ckpt.kind == "optimizer" and part is None:
        raise InputError(
            f"{src_path}: holds only optimizer state ({ckpt.chosen}), no model checkpoint; to "
            f"merge the optimizer state, pass its directory: ckpttool merge "
            f"{src_path / ckpt.chosen} OUT")
    assert ckpt.info is not None  # discover(require=True) chose one
    info = ckpt.info
    check_apart(out_path, src_path, info.root)
    structure.raise_first(structure.check(info, ckpt.canonical()))
    whole, ckpt = ckpt, select(ckpt, part or ckpt.kind)  # one part; the rest is reported
    files = ckpt.hf
    optimizer = ckpt.kind == "optimizer"
    if not ckpt.tensors:
        # An empty model file is worse than an error: say what is there instead.
        held = f"only {len(ckpt.objects)} non-tensor entries" if ckpt.objects else "nothing"
        raise InputError(f"{info.root}: holds no tensors ({held}); there is no model to merge. "
                         f"See what it holds with: ckpttool inspect {src_path}")
    named = [(t.name, t.tensor) for t in ckpt.tensors]
    adapted = None if optimizer else _adapted(ckpt, named, lora, adapter, adapter_config)
    mode = adapted.mode if adapted is not None else None
    if optimizer:
        # Optimizer state: keep its dtypes unless asked; no config, tokenizer or ties.
        policy = (dtype_policy.DTypePolicy("auto", None, "optimizer state keeps its dtypes")
                  if dtype == "auto" else dtype_policy.resolve(dtype, None))
        stem = "optimizer"
    elif mode == "adapter":
        # An adapter keeps the dtypes it trained in, as save_pretrained does, unless asked.
        policy = (dtype_policy.DTypePolicy("auto", None, "a LoRA adapter keeps its dtypes")
                  if dtype == "auto" else dtype_policy.resolve(dtype, None))
        stem = adapters.ADAPTER_FILE.removesuffix(".safetensors")
        files = hf.HfFiles(None, None, ())
    else:
        policy = dtype_policy.resolve(dtype, files.config, str(files.config_path)
                                      if files.config_path else "config.json")
        stem = "model"
    sources: list[tuple[str, Source]] = list(named) if adapted is None else adapted.sources
    mapped = None
    if names is not None:
        if optimizer:
            raise InputError(f"{info.root}: holds optimizer state; --names maps a model's "
                             "weights: pass the model checkpoint")
        if adapted is not None:
            raise UnsupportedError(f"{info.root}: --names with a LoRA adapter is not supported "
                                   "yet; merge without the adapter, or without --names")
        mapped = namemaps.apply(names, named, files.config, config_path=str(
            files.config_path) if files.config_path else None)
        sources = list(mapped.tensors)

    report = MergeReport(src=str(src_path), checkpoint=str(info.root), out=str(out_path),
                         kind=ckpt.kind, format=info.format, storage=dict(info.storage),
                         part=ckpt.kind)
    report.contents = [c.to_json() for c in whole.contents()]
    report.left_out = [c for c in report.contents if c["part"] != ckpt.kind or c["file"]]
    report.parts = list(ckpt.parts)
    report.skipped = [{"path": str(src_path / p.path), "kind": p.kind} for p in ckpt.parts
                      if p.path != ckpt.chosen and p.kind != "other"
                      and registry.is_format(p.format)]
    renamed = [t for t in ckpt.tensors if t.name != t.stored_name]
    report.renames = [{"from": t.stored_name, "to": t.name} for t in renamed]
    report.wrappers_removed = detected_wrappers((t.path for t in renamed), ckpt.top_level)
    report.dtype = {"requested": policy.requested,
                    "target": policy.target.name if policy.target else None,
                    "source": policy.source}
    if adapted is not None:
        report.lora = adapted.report
        if adapted.report.get("assumed"):
            report.warnings.append(adapters.assumed_warning(adapted.report))
    if mapped is not None:
        report.name_map = mapped.to_json()
    extra_names = [p.name for p in files.files] + ([OPTIMIZER_JSON] if optimizer else [])
    if mode == "adapter":
        extra_names.append(hf.ADAPTER_CONFIG)
    # Before reading any tensor data (the tie check reads both embeddings): fail fast.
    _check_existing(out_path, extra_names, overwrite, stem)

    # No cyclic collection while millions of chunk objects live: none are garbage, and each
    # collection would walk them all.
    # The adapter's own reader (--adapter) is closed with the checkpoint's.
    adapter_reader = adapted.reader if adapted is not None else None
    with (open_reader(ckpt, follow_links=follow_links) as reader,
          adapter_reader if adapter_reader is not None else contextlib.nullcontext(),
          gc_paused()):
        if adapter_reader is not None:
            adapter_reader.open_files()

        def decide() -> dict[str, Any]:
            """What reads tensor data before the plan: done once when processes share it."""
            # Chunks several ranks stored (use_collectives=False) must agree before one is used.
            structure.raise_first(reader.check_copies())
            drop = (frozenset() if optimizer or mode == "adapter"
                    else _decide_tie(reader, sources, files.config, keep_tied, report))
            if mapped is not None:
                report.warnings += namemaps.check_dropped(reader, mapped)
            return {"drop": sorted(drop), "tie": report.tie, "warnings": report.warnings}

        decided = decide() if shared is None else shared.once(decide)
        drop = frozenset(decided["drop"])
        report.tie, report.warnings = decided["tie"], list(decided["warnings"])
        objects = [(o, non_tensor.read(reader, o.entry)) for o in whole.objects]
        report.non_tensor = [{**non_tensor.describe(o.name, value), "part": o.part}
                             for o, value in objects]
        objects = [(o, value) for o, value in objects if o.part == ckpt.kind]
        plan = plan_merge(sources, policy=policy,
                          max_shard_size=shard_limit if mode != "adapter" else 1 << 62,
                          drop=drop, stem=stem)
        config_bytes, report.config_changes = _config_output(files)
        # Small files (config, tokenizer, optimizer.json) written beside the weights.
        extra: list[tuple[str, bytes]] = [
            (p.name, config_bytes if p == files.config_path and config_bytes is not None
             else p.read_bytes()) for p in files.files]
        report.copied = [p.name for p in files.files]
        report.warnings += list(files.skipped)
        if optimizer:
            extra.append((OPTIMIZER_JSON, _optimizer_json(objects, ckpt.top_level)))
        if adapted is not None and mode == "adapter":
            extra.append((hf.ADAPTER_CONFIG, adapted.config_bytes))
            report.copied.append(hf.ADAPTER_CONFIG)
        # A dry run stops here: the plan it reports is the one a merge would write.
        if not dry_run:
            check_space(out_path, plan.file_bytes + sum(len(data) for _, data in extra))
            if shared is not None:  # this process writes its share (core.multihost)
                report.distributed = shared.write(
                    plan, reader, out_path, extra, overwrite=overwrite, stem=stem,
                    workers=workers, progress=progress, on_start=on_start)
            else:
                if on_start is not None:
                    on_start(plan.total_bytes)
                _write(plan, reader, out_path, extra, stem=stem, overwrite=overwrite,
                       workers=workers or default_workers(), progress=progress)

    _summarise(report, ckpt, plan, dict(extra).get(OPTIMIZER_JSON))
    if dry_run:
        report.dry_run = True
        report.tensors = [{"name": t.name, "file": f.name, "dtype": t.dtype.name,
                           "source_dtype": t.source.dtype.name, "shape": list(t.slot.shape),
                           "bytes": t.slot.nbytes, "offsets": [t.slot.begin, t.slot.end]}
                          for f in plan.files for t in f.tensors]
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _write(plan: MergePlan, reader: Reader, out: Path, extra: list[tuple[str, bytes]], *,
           stem: str, overwrite: bool, workers: int, progress: Progress | None) -> None:
    """Write ``plan`` and the small ``extra`` files into ``out``, all or nothing."""
    # Under the output's lock, OUT is looked at again: another run may have written it.
    with AtomicOutputs(out, check=lambda: _check_existing(
            out, [name for name, _ in extra], overwrite, stem)) as outputs:
        execute(plan, reader, outputs, workers=workers, progress=progress)
        commit_outputs(outputs, plan, extra, overwrite=overwrite, stem=stem)


def commit_outputs(outputs: AtomicOutputs, plan: MergePlan, extra: list[tuple[str, bytes]],
                   *, overwrite: bool, stem: str) -> None:
    """Write the index and the side files (``extra``: config, tokenizer...), then rename
    everything into place, the index last (with ``overwrite``, a previous output's other
    weight files are removed just before it)."""
    out = outputs.out_dir
    if plan.index is not None:
        outputs.write_bytes(plan.index_name, plan.index)
    for name, data in extra:
        outputs.write_bytes(name, data)
    keep = {f.name for f in plan.files} | {n for n, _ in extra}
    if plan.index is not None:
        keep.add(plan.index_name)
    outputs.commit(
        last=(plan.index_name,),
        before_last=(lambda: remove_stale(out, keep, lambda name: st.is_weight_file(name, stem)))
        if overwrite else None)


def _summarise(report: MergeReport, ckpt: Checkpoint, plan: MergePlan,
               optimizer_json: bytes | None) -> None:
    """Files, counts and bytes per dtype before and after, into ``report``."""
    report.files = [{"name": f.name, "bytes": f.size, "tensors": len(f.tensors)}
                    for f in plan.files]
    if plan.index is not None:
        report.files.append({"name": plan.index_name, "bytes": len(plan.index), "tensors": 0})
    if optimizer_json is not None:
        report.files.append({"name": OPTIMIZER_JSON, "bytes": len(optimizer_json),
                             "tensors": 0})
    written_tensors = [t for f in plan.files for t in f.tensors]
    report.num_tensors = len(written_tensors)
    report.num_parameters = sum(t.source.numel for t in written_tensors)
    report.total_bytes = plan.total_bytes
    for entry in ckpt.tensors:
        name = entry.dtype.name
        report.bytes_before[name] = report.bytes_before.get(name, 0) + entry.nbytes
    for out_tensor in written_tensors:
        name = out_tensor.dtype.name
        report.bytes_after[name] = report.bytes_after.get(name, 0) + out_tensor.slot.nbytes


def _decide_tie(
    reader: Reader,
    sources: list[tuple[str, Source]],
    config: dict[str, Any] | None,
    keep_tied: bool,
    report: MergeReport,
) -> frozenset[str]:
    by_name = dict(sources)
    pair = ties.find_pair(by_name)
    if pair is None:
        return frozenset()
    head, embed = pair
    tied = hf.ties_word_embeddings(config)
    a, b = by_name[head], by_name[embed]
    if isinstance(a, Derived) or isinstance(b, Derived):
        # A LoRA fold changed one of them. Tied in the config: transformers ties the output
        # embedding to the (fused) input one on load, as PEFT's merge did to the shared
        # weight, so one copy is written.
        if tied and not keep_tied and isinstance(b, Derived) and not isinstance(a, Derived):
            report.tie = {"output": head, "input": embed, "config_ties": True,
                          "identical": None, "action": "deduplicated (input embedding fused)"}
            return frozenset({head})
        report.tie = {"output": head, "input": embed, "config_ties": tied, "identical": None,
                      "action": "both written"}
        if tied:
            report.warnings.append(
                f"config ties word embeddings but the LoRA fold changed '{head}' and not "
                f"'{embed}' alike; both were written, but transformers will tie them on load "
                f"and drop the folded '{head}'. Set tie_word_embeddings to false in "
                "config.json to keep it")
        return frozenset()
    same = tensors.identical(reader, a, reader, b, block_bytes=ties.COMPARE_BLOCK)
    report.tie = {"output": head, "input": embed, "config_ties": tied, "identical": same}
    if tied and same and not keep_tied:
        report.tie["action"] = "deduplicated"
        return frozenset({head})
    if tied and not same:
        report.tie["action"] = "both written"
        report.warnings.append(
            f"tie broken: config ties word embeddings but '{head}' differs from '{embed}'; both "
            "were written, but transformers will tie them on load and drop the trained "
            f"'{head}'. Set tie_word_embeddings to false in config.json to keep it"
        )
    elif tied is None and same:
        report.tie["action"] = "both written"
        report.warnings.append(
            f"'{head}' and '{embed}' are identical and look tied, but no config.json says so; "
            "both were written (pass --config to deduplicate)"
        )
    else:
        report.tie["action"] = "both written"
    return frozenset()


@dataclass
class _Adapted:
    """A LoRA adapter found for this merge, and what it turns the merge into."""

    mode: str  # "fuse" or "adapter"
    sources: list[tuple[str, Source]]
    report: dict[str, Any]
    config_bytes: bytes = b""
    reader: Reader | None = None  # the adapter's, when it is not in SRC (--adapter)


def _adapted(ckpt: Checkpoint, named: list[tuple[str, Tensor]], mode: str | None,
             adapter: str | os.PathLike[str] | None,
             adapter_config: str | os.PathLike[str] | None) -> _Adapted | None:
    """The LoRA adapter in ``ckpt`` (or given with ``adapter``) planned into merge sources;
    None for a checkpoint without one.

    Raises:
        InputError: no alpha anywhere, an incomplete adapter, shapes that disagree, or a mode
            that cannot apply.
        UnsupportedError: DoRA, several adapters, another PEFT method.
    """
    if mode is not None and mode not in adapters.MODES:
        raise InputError(f"unknown --lora '{mode}'; use one of: {', '.join(adapters.MODES)}")
    explicit = Path(adapter_config) if adapter_config is not None else None
    found = adapters.parse(named)
    other = "--lora adapter"
    if adapter is not None:
        if found is not None:
            raise InputError(f"{ckpt.path}: holds a LoRA adapter itself; --adapter folds an "
                             "adapter into a model with plain weights")
        if mode == "adapter":
            raise InputError("--adapter folds an adapter into SRC; --lora adapter would write "
                             "the adapter alone: use one or the other")
        given = Path(adapter)
        target = (next((given / n for n in adapters.ADAPTER_FILES if (given / n).exists()),
                       given / adapters.ADAPTER_FILE) if given.is_dir() else given)
        adapter_ckpt = discover(target, command="merge")
        structure.raise_first(structure.check(adapter_ckpt.info, adapter_ckpt.canonical())
                              if adapter_ckpt.info is not None else [])
        found = adapters.parse([(t.name, t.tensor) for t in adapter_ckpt.tensors])
        if found is None or not found.modules:
            raise InputError(f"{target}: holds no LoRA matrices (lora_A / lora_B); pass a PEFT "
                             "adapter directory to --adapter")
        found = adapters.as_adapter_file(found)
        doc, where = hf.find_adapter_config(target.parent, explicit, given=given)
        if doc is None or where is None:
            raise adapters.missing_config(str(given))
        config = adapters.read_config(doc, str(where))
        reader = open_reader(adapter_ckpt)
        try:
            sources = adapters.plan_fuse(found, config, base=named, adapter_reader=reader)
        except BaseException:
            reader.close()
            raise
        report = {"mode": "fuse", "adapter": str(given), **adapters.describe(found, config),
                  "fused": sum(isinstance(s, Derived) for _, s in sources)}
        return _Adapted("fuse", sources, report, reader=reader)
    if found is None:
        if mode is not None:
            raise InputError(f"{ckpt.path}: holds no LoRA adapter (no lora_A / lora_B "
                             "tensors); --lora applies to PEFT checkpoints only")
        return None
    assert ckpt.info is not None
    known = adapters.find_config(ckpt.root if ckpt.root.is_dir() else ckpt.info.base, explicit,
                                 given=ckpt.path, layout=found)
    chosen = mode or ("fuse" if found.has_base else "adapter")
    if known.config is None and chosen == "fuse":
        raise adapters.missing_config(str(ckpt.path))
    if chosen == "fuse":
        assert known.config is not None
        config = known.config
        if not found.has_base:
            raise InputError(
                f"{ckpt.path}: holds the LoRA adapter alone, no base weights to fold it into; "
                f"write it with --lora adapter, then fold it into the base model with: "
                f"ckpttool merge BASE OUT --adapter ADAPTER_OUT")
        sources = adapters.plan_fuse(found, config)
        report = {"mode": "fuse", **adapters.describe(found, config),
                  "fused": sum(isinstance(s, Derived) for _, s in sources),
                  "other": f"the adapter alone instead: {other}"}
        return _Adapted("fuse", sources, report)
    adapter_sources: list[tuple[str, Source]] = list(adapters.plan_adapter(found))
    report = {"mode": "adapter", **adapters.describe(found, known.config),
              "other": ("a full model with the adapter folded in instead: --lora fuse")
              if found.has_base else None,
              "config_from": known.source, "assumed": list(known.assumed)}
    if known.config is None:
        report["config"] = "built from the weights (assumed values: see the warning)"
    return _Adapted("adapter", adapter_sources, report, config_bytes=known.text)


OPTIMIZER_JSON = "optimizer.json"


def _optimizer_json(objects: list[tuple[ObjectView, Any]], top: str = "optimizer") -> bytes:
    """Non-tensor optimizer state (param groups, hyper-parameters) nested as it was saved
    (below its top-level key ``top``), with parameter names in canonical form."""
    root: dict[str, Any] = {}
    unreadable = []
    for view, value in objects:
        stored = view.entry.path
        path = stored[1:] if len(stored) > 1 and stored[0] == top else stored
        if isinstance(value, non_tensor.Unreadable):
            unreadable.append(".".join(path))
            continue
        if path[-1] == "params" and isinstance(value, list):
            value = [names.strip_wrappers(v) if isinstance(v, str) else v for v in value]
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = non_tensor.jsonable(value)
    doc = _lists(root)
    if unreadable:
        doc["not_read"] = unreadable
    return (json.dumps(doc, indent=2) + "\n").encode()


def _lists(node: Any) -> Any:
    """Dicts keyed "0", "1"... (flattened lists) back into lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node) and sorted(map(int, node)) == list(
            range(len(node))):
        return [node[str(i)] for i in range(len(node))]
    return node


def _config_output(files: hf.HfFiles) -> tuple[bytes | None, list[str]]:
    if files.config is None:
        return None, []
    fixed, changes = hf.strip_fsdp_prefix(files.config)
    if not changes:
        return None, []
    return (json.dumps(fixed, indent=2) + "\n").encode(), [f"architectures: {c}" for c in changes]


def _check_existing(out: Path, extra: list[str], overwrite: bool, stem: str) -> None:
    """OUT holds no weights of this kind (nor the files written beside them), unless
    ``overwrite``. Creates nothing."""
    existing = existing_outputs(out, lambda name: st.is_weight_file(name, stem) or name in extra)
    if existing and not overwrite:
        raise OutputError(
            f"{out}: already holds {', '.join(existing[:3])}"
            f"{' and more' if len(existing) > 3 else ''}; pass --overwrite to replace them "
            "or choose an empty directory"
        )



