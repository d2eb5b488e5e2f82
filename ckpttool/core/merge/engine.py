"""The merge engine: fill planned output files at their offsets, then publish them.

Each chunk of each tensor lands at a byte range the plan fixed in advance, so chunks are
independent jobs: kernel-side copies where a chunk is one contiguous range of its tensor and no
cast is needed (a merge costs about what a copy costs), casts in bounded blocks, windows of
small tensors made whole in memory, and shares of Python-bound work in forked processes.
Torch is imported only to cast.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import overload

from ckpttool.core.checkpoint import geometry, tensors
from ckpttool.core.merge import guards
from ckpttool.core.merge.partition import Unit
from ckpttool.core.merge.plan import MergePlan, OutTensor
from ckpttool.core.runtime import forked, scratch
from ckpttool.core.runtime.report import Progress, locked
from ckpttool.core.runtime.torch_threads import one_torch_thread, workers_for
from ckpttool.core.transforms.derive import (
    Derived,
    is_selection,
    materialise,
    stream,
)
from ckpttool.errors import InputError, OutputError
from ckpttool.formats import safetensors
from ckpttool.formats.base import (
    Blocks,
    Chunk,
    CopyOut,
    Decode,
    Elements,
    Payload,
    Reader,
    Span,
    Tensor,
    Whole,
)
from ckpttool.formats.codecs.dtypes import cast_without_torch, f32_to_bf16
from ckpttool.storage.outputs import (
    AtomicOutputs,
    existing_outputs,
    pwrite_all,
    remove_stale,
    write_behind,
)


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
    fds = []
    for f in plan.files:
        fd = outputs.create(f.name, f.size)
        fds.append(fd)
        pwrite_all(fd, f.layout.header, 0)
    execute_into(plan, reader, fds, workers=workers, progress=progress)


def execute_into(
    plan: MergePlan,
    reader: Reader,
    fds: Sequence[int],
    *,
    workers: int = 1,
    progress: Progress | None = None,
) -> None:
    """Write every tensor of ``plan`` into ``fds`` (one per ``plan.files``: files that exist
    at their full size, headers written), as :func:`execute` does: also what a resumed merge
    (:mod:`ckpttool.core.merge.resume`) calls for each piece still missing, with a plan of
    that piece's tensors."""
    report = locked(progress)
    jobs: list[_Job] = []
    casts = False
    for f, fd in zip(plan.files, fds, strict=True):
        jobs += _jobs(fd, f.tensors)
        casts = casts or any(_needs_torch(t) for t in f.tensors)
    with write_behind(list(fds), report) as counted:
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
        casts = casts or _needs_torch(t)
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


def _needs_torch(t: OutTensor) -> bool:
    """A cast (but a small float32 -> bfloat16 one: :func:`_pure_cast`), or a tensor
    computed by torch (a selection of stored bytes is not)."""
    if isinstance(t.source, Derived) and not is_selection(t.source):
        return True
    return t.cast and not _pure_cast(t)


def _pure_cast(t: OutTensor) -> bool:
    return cast_without_torch(t.source.dtype, t.dtype, t.source.numel)


def _run(jobs: list[_Job], reader: Reader, *, workers: int, casts: bool, report: Progress,
         fork: bool = False) -> None:
    """Run ``jobs`` in up to ``workers`` threads: largest first, or in stored order where the
    store reads ahead (object storage). Jobs whose cost is Python per chunk (kilobyte-sized
    chunks) run in up to ``workers`` processes instead, where ``fork`` allows
    (:mod:`ckpttool.core.runtime.forked`)."""
    try:
        _run_all(jobs, reader, workers=workers, casts=casts, report=report, fork=fork)
    finally:
        tensors.release_grids()


def _run_all(jobs: list[_Job], reader: Reader, *, workers: int, casts: bool,
             report: Progress, fork: bool) -> None:
    reader.open_files()  # before threads share the reader
    if not reader.capabilities.many_ranges:
        jobs.sort(key=lambda j: -j.nbytes)
    else:
        jobs = _stored_order(jobs, reader.plan_reads)
    threads = workers_for(workers, nbytes=sum(j.nbytes for j in jobs),
                          chunks=sum(len(j.chunks) for j in jobs))
    if threads < workers and len(jobs) > 1 and fork and reader.capabilities.local_files \
            and forked.available(needs_torch=casts):
        # Python per chunk: processes of their own, each writing the next job not taken yet.
        with forked.Pulled(jobs, lambda j: len(j.chunks)) as queue:
            forked.run([functools.partial(_run_share, queue, reader, casts)]
                       * min(workers, len(jobs)), report)
        return
    _run_share(jobs, reader, casts, report, threading.Event(), threads)


def _run_share(jobs: list[_Job] | forked.Pulled[_Job], reader: Reader, casts: bool,
               report: Progress, stop: threading.Event, threads: int = 1) -> None:
    if not casts:
        _run_jobs(jobs, reader, threads, report, stop)  # no torch at all
        return
    if isinstance(jobs, forked.Pulled):  # taken one by one, beside other processes
        with one_torch_thread():
            _run_jobs(jobs, reader, 1, report, stop, {})
        return
    locks = _write_locks(jobs, reader, threads + 1)
    # The jobs that need no torch (copies, in the kernel: the interpreter stays free) start in
    # a thread of their own while torch is imported (a second or more of one core), and run
    # on beside the workers that need it.
    early: threading.Thread | None = None
    failed: list[BaseException] = []
    if "torch" not in sys.modules:
        plain = [j for j in jobs if not _job_needs_torch(j)]
        jobs = [j for j in jobs if _job_needs_torch(j)]

        def copy_plain() -> None:
            try:
                _run_jobs(plain, reader, 1, report, stop, locks)
            except BaseException as e:  # raised in the caller's thread, below
                failed.append(e)
                stop.set()

        if plain:
            early = threading.Thread(target=copy_plain, name="ckpttool-copies", daemon=True)
            early.start()
    try:
        # Loaded once here, before the workers (who would queue on the import), with one
        # intra-op thread while they cast.
        with one_torch_thread():
            _run_jobs(jobs, reader, threads, report, stop, locks)
    except BaseException:
        stop.set()
        raise
    finally:
        if early is not None:
            early.join()
    if failed:
        raise failed[0]


def _job_needs_torch(job: _Job) -> bool:
    if isinstance(job, _Window):
        return any(_needs_torch(t) for t in job.tensors)
    if isinstance(job.chunks, _Small):
        return any(_needs_torch(t) for _, _, t, _ in job.chunks.items)
    return any(_needs_torch(t) for t, _ in job.chunks)


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
    together (a :class:`Decode` read); every chunk's place in the output is known, so the
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


def _write_locks(jobs: Iterable[_Job], reader: Reader, workers: int
                 ) -> dict[int, threading.Lock]:
    """A lock per output file that ``workers`` threads write into. Large writes into one
    output file take turns (local sources; object storage waits on the network, not on the
    file): the kernel serialises writes to a file on its inode lock, and a thread waiting there
    spins on a CPU that a cast could use (measured: two threads copying 3 GB into one file took
    2.7 s, one thread 1.7 s). Casts still run side by side."""
    local = not reader.capabilities.many_ranges
    return {j.fd: threading.Lock() for j in jobs} if local and workers > 1 else {}


def _run_jobs(jobs: Iterable[_Job], reader: Reader, workers: int, report: Progress,
              stop: threading.Event, locks: dict[int, threading.Lock] | None = None) -> None:
    """``locks``: shared with other threads writing into the same files (else made here).
    ``jobs`` is a list where ``workers`` > 1."""
    if locks is None:
        assert workers <= 1 or isinstance(jobs, list)
        locks = _write_locks(jobs, reader, workers)

    def run(job: _Job) -> None:
        if isinstance(job, _Window):
            _write_window(reader, job, report, stop)
            return
        if len(job.chunks) > 1:
            _write_batch(reader, job, report, stop)
            return
        ((t, c),) = job.chunks
        if c is None:
            _write_derived(reader, job.fd, t, report, locks.get(job.fd))
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
            scratch.release()  # this thread goes on: give its buffers back
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


def _write_derived(reader: Reader, dst: int, t: OutTensor, report: Progress,
                   lock: threading.Lock | None = None) -> None:
    assert isinstance(t.source, Derived)
    if is_selection(t.source):
        _write_selection(reader, dst, t, report, lock)
        return
    if t.source.pieces is not None:
        # Each piece written while it is in the cache (measured: 1 GB written from a 23 MB
        # buffer cost 0.9-1.8 s of system time, from a 1 MB one 0.45 s).
        at = t.slot.begin
        for piece in stream(reader, t.source, t.dtype):
            with lock or contextlib.nullcontext():
                pwrite_all(dst, piece, at)
            at += len(piece)
        report(at - t.slot.begin)
        return
    data = materialise(reader, t.source, t.dtype)
    with lock or contextlib.nullcontext():
        pwrite_all(dst, data, t.slot.begin)
    report(len(data))


# A run of a selection at least this long is copied file to file; a selection with shorter
# runs (a slice of a chunk cut along its last dim: a row-parallel weight's layer) is gathered
# in memory (a syscall per row would cost more), in blocks of GATHER_BLOCK bytes written one
# by one (small enough to stay in a core's cache from the reads to the write:
# tensors.selection_blocks) where nothing is cast, else whole...
COPY_RUN = 64 << 10
GATHER_BLOCK = 1 << 20
# ...its stored bytes then coming in blocks of this size (mapped from the page cache, or read
# into a buffer this large: tensors.read_boxes).
SELECTION_BLOCK = 4 << 20


def _write_selection(reader: Reader, dst: int, t: OutTensor, report: Progress,
                     lock: threading.Lock | None) -> None:
    """A selection of a stored tensor (Megatron's layer, q/k/v, gate/up, expert and
    vocabulary slices): each run of stored bytes copied into place file to file (in the
    kernel) when no run is short and nothing is cast; else gathered a block at a time and
    written block by block when nothing is cast; else read whole (one read per chunk it
    touches), cast, and written at once. Memory: at most the output tensor, never the stacked
    one."""
    d = t.source
    assert isinstance(d, Derived) and d.boxes[0] is not None
    src = d.inputs[0]
    item = src.dtype.itemsize
    pieces = tensors.box_pieces(src, d.boxes[0])
    payloads = [tensors.payload(reader, src, c) for c, _, _ in pieces]
    if not t.cast and all(p.start is not None for p in payloads) and all(
            n * item >= COPY_RUN for _, _, runs in pieces for _, _, n in runs):
        for (_, pos, runs), p in zip(pieces, payloads, strict=True):
            assert p.start is not None
            for a, b, n in runs:
                _copy(reader, p.file, p.start + a * item, dst,
                      t.slot.begin + (pos + b) * item, n * item, lock)
        report(t.slot.nbytes)
        return
    if not t.cast and all(p.start is not None for p in payloads):
        # Short runs (a row-parallel layer's rows): gathered and written a block at a time,
        # the lock held only to write (another thread's reads go on meanwhile).
        at = t.slot.begin
        for block in tensors.selection_blocks(reader, src, pieces, payloads,
                                              scratch.buffer("gather", GATHER_BLOCK)):
            with lock or contextlib.nullcontext():
                pwrite_all(dst, block, at)
            at += len(block)
        report(at - t.slot.begin)
        return
    data = tensors.read_boxes(reader, src, d.boxes[0], pieces=pieces,
                              out=scratch.buffer("selection", sum(
                                  math.prod(sizes) for _, sizes in d.boxes[0]) * item),
                              buf=scratch.buffer("block", SELECTION_BLOCK))
    if t.cast:
        data = _cast_bytes(data, t)
    with lock or contextlib.nullcontext():
        pwrite_all(dst, data, t.slot.begin)
    report(len(data))


# A copy in the kernel into a file that other threads write too holds the file's lock for at
# most this many bytes at a time: a thread gathering a row-parallel layer (reading while the
# copy goes on) then writes its block between two steps instead of waiting for a whole
# stacked tensor's copy (measured on a 2.1 GB Megatron run: the gathering thread spent most of
# its time waiting for the lock, the merge used one core of two).
COPY_STEP = 8 << 20


def _copy(reader: Reader, file: str, src: int, dst: int, at: int, n: int,
          lock: threading.Lock | None) -> None:
    """``n`` stored bytes copied file to file (:class:`CopyOut`), in steps of
    :data:`COPY_STEP` under ``lock`` where other threads write into ``dst`` too, else at
    once (object storage: one ranged read)."""
    if lock is None:
        reader.read(CopyOut(file, src, n, dst, at))
        return
    for k in range(0, n, COPY_STEP):
        with lock:
            reader.read(CopyOut(file, src + k, min(COPY_STEP, n - k), dst, at + k))


def _write_batch(reader: Reader, job: _Job, report: Progress, stop: threading.Event) -> None:
    """Small chunks, decoded together: a chunk whose stored bytes came with its record and
    that is one run of its tensor (Shard(0), whole) is written from memory, with no further
    read; any other goes the way of :func:`_write_chunk`."""
    items = [(t, c) for t, c in job.chunks if c is not None]
    done = 0
    sources = [(t.source, c) for t, c in items if isinstance(t.source, Tensor)]
    for (t, c), p in zip(items, reader.read(Decode(sources)), strict=True):
        if stop.is_set():
            break
        entry = t.source
        assert isinstance(entry, Tensor)
        data, start = p.data, p.start
        first = None if data is None or start is None or t.cast else \
            geometry.single_run_start(entry.shape, c.offsets, c.sizes)
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
    """The window's tensors made whole in memory by the reader (:class:`Whole`: it fills
    tensors of rows all at once where it can, and reads the others chunk by chunk), then
    written at once. A tensor to cast is made whole in its own dtype after the window's
    bytes, then cast into place."""
    entries = [_stored(t) for t in job.tensors]
    dsts = [t.slot.begin - job.begin for t in job.tensors]
    cast = [i for i, t in enumerate(job.tensors) if t.cast]
    end = job.nbytes
    for i in cast:
        dsts[i], end = end, end + entries[i].nbytes
    out = bytearray(end)
    view = memoryview(out)
    reader.read(Whole(entries, out, dsts))
    if stop.is_set():
        return
    for i in cast:
        t = job.tensors[i]
        at = t.slot.begin - job.begin
        view[at : at + t.slot.nbytes] = _cast_bytes(view[dsts[i] : dsts[i] + entries[i].nbytes],
                                                    t)
    pwrite_all(job.fd, view[: job.nbytes], job.begin)
    report(job.nbytes)


def _write_chunk(reader: Reader, dst: int, t: OutTensor, c: Chunk, report: Progress,
                 payload: Payload | None = None, elements: tuple[int, int] | None = None,
                 lock: threading.Lock | None = None) -> None:
    """``lock``: held while writing into ``dst`` (:func:`_run_jobs`)."""
    turn = lock or contextlib.nullcontext()
    entry = t.source
    assert isinstance(entry, Tensor)
    payload = payload or tensors.payload(reader, entry, c)
    dst_item = t.dtype.itemsize
    start = payload.start
    single = geometry.is_single_run(entry.shape, c.offsets, c.sizes)
    if single:
        ((_, dst_elem, n),) = geometry.runs(entry.shape, c.offsets, c.sizes)
        lo, hi = elements or (0, n)
        at = t.slot.begin + (dst_elem + lo) * dst_item
        if start is not None:
            src = start + lo * entry.dtype.itemsize
            if t.cast:
                _cast_range(reader, payload.file, src, dst, at, hi - lo, t, report, lock)
            else:
                _copy(reader, payload.file, src, dst, at, (hi - lo) * entry.dtype.itemsize,
                      lock)
                report((hi - lo) * dst_item)
            return
    # A strided placement (Shard(1)...): the chunk's rows land apart, so read it whole (so are
    # elements reached only through a whole read: a compressed record, a strided storage).
    data = memoryview(reader.read(Elements(entry, c)))
    if t.cast:
        data = _cast_bytes(data, t)
    if elements is not None:  # a part of a single run (core.partition splits nothing else)
        assert single
        with turn:
            pwrite_all(dst, data[lo * dst_item : hi * dst_item], at)
        report((hi - lo) * dst_item)
        return
    with turn:
        for src_elem, dst_elem, n in geometry.runs(entry.shape, c.offsets, c.sizes):
            pwrite_all(dst, data[src_elem * dst_item : (src_elem + n) * dst_item],
                       t.slot.begin + dst_elem * dst_item)
    report(c.numel * dst_item)


# Source bytes cast per step: a multiple of every vector width, small enough that memory stays
# flat whatever the tensor size, large enough that per-call overhead vanishes.
CAST_BLOCK = 8 << 20

def _cast_range(reader: Reader, file: str, src_offset: int, dst: int, dst_offset: int,
                numel: int, t: OutTensor, report: Progress,
                lock: threading.Lock | None = None) -> None:
    assert isinstance(t.source, Tensor)
    if _pure_cast(t):  # a few float32 norm weights: no torch
        data = f32_to_bf16(reader.read(Span(file, src_offset, numel * t.source.dtype.itemsize,
                                            f"tensor '{t.source.name}'")))
        with lock or contextlib.nullcontext():
            pwrite_all(dst, data, dst_offset)
        report(len(data))
        return
    import torch  # only casting needs torch

    src_dtype = getattr(torch, t.source.dtype.torch_name)
    dst_dtype = getattr(torch, t.dtype.torch_name)
    src_item, dst_item = t.source.dtype.itemsize, t.dtype.itemsize
    block = min(numel, CAST_BLOCK // src_item)
    # The output tensor lives in our own buffer (torch.frombuffer): no numpy, which torch
    # needs for .numpy() and which a user's own torch install may lack.
    out_bytes = scratch.buffer("out", block * dst_item)
    out = torch.frombuffer(out_bytes, dtype=dst_dtype, count=block)
    done = 0
    # Cast straight from the page cache where the store maps the file, else from our buffer.
    for view in reader.read(Blocks(file, src_offset, numel * src_item,
                                   scratch.buffer("in", block * src_item))):
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
        raise InputError(f"{reader.path(file)}: ended early while reading "
                         f"'{t.source.name}'; it is truncated")


def _cast_bytes(data: memoryview, t: OutTensor) -> memoryview:
    if _pure_cast(t):
        return memoryview(f32_to_bf16(data))
    import torch

    src = torch.frombuffer(bytearray(data), dtype=getattr(torch, t.source.dtype.torch_name))
    out = bytearray(len(src) * t.dtype.itemsize)
    if out:
        torch.frombuffer(out, dtype=getattr(torch, t.dtype.torch_name)).copy_(src)
    return memoryview(out)



def write(plan: MergePlan, reader: Reader, out: Path, extra: list[tuple[str, bytes]], *,
           stem: str, overwrite: bool, workers: int, progress: Progress | None) -> None:
    """Write ``plan`` and the small ``extra`` files into ``out``, all or nothing."""
    # Under the output's lock, OUT is looked at again: another run may have written it.
    with AtomicOutputs(out, check=lambda: check_existing(
            out, [name for name, _ in extra], overwrite, stem)) as outputs:
        execute(plan, reader, outputs, workers=workers, progress=progress)
        commit_outputs(outputs, plan, extra, overwrite=overwrite, stem=stem)


def commit_outputs(outputs: AtomicOutputs, plan: MergePlan, extra: list[tuple[str, bytes]],
                   *, overwrite: bool, stem: str) -> None:
    """Write the index and the side files (``extra``: config, tokenizer...), then rename
    everything into place, the object that completes the model last: the index, or the
    single weight file of an output without one (with ``overwrite``, a previous output's
    index and single weight file are removed first, its other weight files just before the
    last rename), so that no moment shows a complete model beside another run's side files
    (a new model.safetensors beside the previous config.json, or the reverse). The caller's
    checks run first (:mod:`ckpttool.core.merge.guards`: a source re-saved meanwhile is never
    published)."""
    guards.check()
    out = outputs.out_dir
    if plan.index is not None:
        outputs.write_bytes(plan.index_name, plan.index)
    for name, data in extra:
        outputs.write_bytes(name, data)
    keep = {f.name for f in plan.files} | {n for n, _ in extra}
    if plan.index is not None:
        keep.add(plan.index_name)
    completes = (plan.index_name,) if plan.index is not None else tuple(
        f.name for f in plan.files)
    outputs.commit(
        # Either kind of previous output's completing file goes first, whatever the new one is.
        last=tuple(dict.fromkeys((plan.index_name, safetensors.shard_names(1, stem)[0],
                                  *completes))),
        before_last=(lambda: remove_stale(out, keep,
                                          lambda name: safetensors.is_weight_file(name, stem)))
        if overwrite else None)



def check_existing(out: Path, extra: list[str], overwrite: bool, stem: str) -> None:
    """OUT holds no weights of this kind (nor the files written beside them), unless
    ``overwrite``. Creates nothing."""
    existing = existing_outputs(
        out, lambda name: safetensors.is_weight_file(name, stem) or name in extra)
    if existing and not overwrite:
        raise OutputError(
            f"{out}: already holds {', '.join(existing[:3])}"
            f"{' and more' if len(existing) > 3 else ''}; pass --overwrite to replace them "
            "or choose an empty directory"
        )

