"""``verify``'s data pass: every tensor read once, in bounded blocks, with every check that
needs its bytes done as they go by (CRC-32s the format records, NaN/Inf/all-zero, SHA-256
digests, the comparison with another checkpoint).

Format-neutral: a chunk's :class:`~ckpttool.formats.base.Payload` says where its stored bytes
are and which checksums cover them; what lies outside every chunk (object records, an
archive's pickle) comes from the reader's ``other_checksums``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from ckpttool._gc import gc_paused
from ckpttool.core import values
from ckpttool.core.checkpoint import geometry, non_tensor, tensors
from ckpttool.core.checkpoint.discover import Checkpoint, TensorView, open_reader
from ckpttool.core.checkpoint.tensors import BLOCK_BYTES
from ckpttool.core.runtime import forked
from ckpttool.core.runtime.report import Progress
from ckpttool.core.runtime.torch_threads import default_workers, one_torch_thread, workers_for
from ckpttool.core.verify.against import AgainstPlan, Compare, compare_computed, decide_tied
from ckpttool.errors import InputError, UnreadableError
from ckpttool.formats.base import (
    Blocks,
    Checksummed,
    Chunk,
    Decode,
    Elements,
    Payload,
    Problem,
    Reader,
    Span,
    Whole,
    error,
    warning,
)
from ckpttool.formats.codecs.crc import crc32

# Bytes read at a time: checked (CRC-32, values) while they are still in the CPU's caches.
# Measured on 3 GB: 2 MB blocks took 15% less time than 16 MB ones, and than mapping the
# files (mapped pages come cold to each check).
READ_BLOCK = 2 << 20

# Stored bytes that one tensor's payloads may hold from their records' reads (beyond it, they
# are read again as they are streamed): memory stays bounded whatever the number of chunks.
HELD_BYTES = 64 << 20


# A tensor made whole from its records and checked (every CRC-32 matched), and the bytes
# those checksums covered.
Given = tuple[bytearray | memoryview, int]


class _Unreadable(Exception):
    """A tensor's bytes cannot be read; the problem saying why is already recorded."""


@dataclass
class Result:
    """What the data pass found for one tensor of the checkpoint being verified."""

    problems: list[Problem] = field(default_factory=list)
    digest: str | None = None
    equal: bool | None = None  # against: None when not compared
    bytes_read: int = 0
    complete: bool = False  # every byte was read (CRCs may still have failed)

    def to_json(self) -> dict[str, Any]:
        return {"problems": [p.to_json() for p in self.problems], "digest": self.digest,
                "equal": self.equal, "bytes_read": self.bytes_read, "complete": self.complete}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Result:
        return cls([Problem.from_json(p) for p in doc["problems"]], doc["digest"],
                   doc["equal"], doc["bytes_read"], doc["complete"])


@dataclass
class Pass:
    problems: list[Problem]  # content problems of the checkpoint read
    # against: tensors on one side only, and those merge computes (a LoRA fold, a name
    # map's parts), decided once the data is read
    tied: list[Problem]
    digests: dict[str, str]
    bytes_read: int
    complete: set[str] = field(default_factory=set)  # tensors whose every byte was read


class Scanner:
    """Streams each tensor of one checkpoint once, in C order where its layout allows,
    checking CRCs as the bytes go by."""

    def __init__(self, reader: Reader, report: Progress) -> None:
        self.reader = reader
        self.report = report
        self._local = threading.local()

    def _buffer(self) -> bytearray:
        """This thread's read buffer, made once: a new one per chunk costs a page fault per
        4 KB of it."""
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = bytearray(READ_BLOCK)
        return buf

    def path(self, file: str) -> str:
        return str(self.reader.path(file))

    def stream(self, t: TensorView, result: Result, given: Given | None = None
               ) -> Iterator[tuple[int | None, memoryview]]:
        """``(first element, bytes)`` blocks; the first element is None when the chunks do
        not give the tensor in C order (a column split, a strided view).

        Args:
            given: the tensor made whole from its records, every checksum of which matched,
                and the bytes they cover (:func:`scan_group`).
        """
        tensor = t.tensor
        if given is not None:
            made, checked = given
            self.report(checked)
            result.bytes_read += checked
            yield 0, memoryview(made)
            return
        decoded: list[tuple[Chunk, Payload]] = []
        damaged: set[Chunk] = set()  # compressed chunks whose CRCs already failed
        held = 0  # bytes of stored data the payloads hold (read with their records)
        chunks = tensor.chunks
        payloads = self.reader.read(Decode([(tensor, c) for c in chunks], checksums=True))
        for c in chunks:
            try:
                p = next(payloads)
                if p.data is not None:
                    held += len(p.data)
                    if held > HELD_BYTES:  # a tensor of very many chunks: read them again
                        p = replace(p, data=None)
                found = len(result.problems)
                for side in p.side:
                    self._check(side, t.name, result)
                if p.checked:
                    self.report(p.checked)
                    result.bytes_read += p.checked
                if p.compression is not None and len(result.problems) > found:
                    damaged.add(c)
            except InputError as e:
                result.problems.append(error("record-corrupt", str(e), file=c.file,
                                             tensor=t.name, offset=c.offset))
                raise _Unreadable from e
            decoded.append((c, p))
        item = t.dtype.itemsize
        # Chunks that are each one run of the tensor (Shard(0), whole), read in the order of
        # their first elements, give the tensor in C order; others (Shard(1)) do not. A
        # compressed chunk comes decompressed, in C order.
        ordered = all((p.start is not None or p.compression is not None)
                      and geometry.is_single_run(t.shape, c.offsets, c.sizes)
                      for c, p in decoded)
        firsts = {c.offsets: geometry.single_run_start(t.shape, c.offsets, c.sizes) or 0
                  for c, _ in decoded} if ordered else {}
        if ordered:
            decoded.sort(key=lambda cp: firsts[cp[0].offsets])
        whole = len(tensor.chunks) == 1 and not self.reader.info.sharded
        for c, p in decoded:
            first = firsts[c.offsets] if ordered else None
            crc = 0 if p.crc32 is not None else None
            nbytes = c.numel * item
            if p.compression is not None:
                # Decompressed one record at a time by the reader; its CRCs (the archive's,
                # in ``side``) were checked above.
                try:
                    data = self.reader.read(Elements(tensor, c))
                except InputError as e:
                    if c not in damaged:
                        result.problems.append(error("record-corrupt", str(e), file=c.file,
                                                     tensor=t.name, offset=c.offset))
                    raise _Unreadable from e
                self.report(p.storage_size)
                result.bytes_read += p.storage_size
                yield first, memoryview(data)
                continue
            if p.start is not None and p.data is not None:
                # Read already, with its record: checked and handed on from memory.
                if crc is not None:
                    crc = crc32(p.data)
                at = p.start - p.storage_offset
                self.report(len(p.data))
                result.bytes_read += len(p.data)
                # A writable copy: value checks view it through torch.frombuffer.
                yield first, memoryview(bytearray(memoryview(p.data)[at : at + nbytes]))
            elif p.start is not None:
                # Read the whole stored range when a checksum covers it, else just the chunk.
                offset, size = ((p.storage_offset, p.storage_size) if crc is not None
                                else (p.start, nbytes))
                crc = yield from self._range(p.file, offset, size, p.start - offset, nbytes,
                                             first, t, result, crc)
            else:  # a strided view (rare): CRC over the storage, then gather the view
                crc = yield from self._range(p.file, p.storage_offset, p.storage_size, 0, 0,
                                             None, t, result, crc)
                yield None, memoryview(bytearray(self.reader.read(Elements(tensor, c))))
            if p.crc32 is not None and crc != p.crc32:
                what = "its bytes" if whole else f"chunk at offsets {list(c.offsets)}"
                result.problems.append(self._crc_problem(p.file, p.storage_offset, t.name,
                                                         crc or 0, p.crc32, what))

    def _range(self, file: str, offset: int, size: int, first: int, length: int,
               start: int | None, t: TensorView, result: Result, crc: int | None
               ) -> Generator[tuple[int | None, memoryview], None, int | None]:
        """Read ``size`` bytes at ``offset`` of ``file`` in blocks (all into ``crc``), yielding
        the part ``[first, first + length)`` of them; ``start`` is its first element. Returns
        the CRC."""
        item = t.dtype.itemsize
        done = 0
        for view in self.reader.read(Blocks(file, offset, size, memoryview(self._buffer()),
                                            mapped=False)):
            n = len(view)
            self.report(n)
            result.bytes_read += n
            if crc is not None:
                crc = crc32(view, crc)
            lo, hi = max(done, first), min(done + n, first + length)
            if lo < hi:
                yield (None if start is None else start + (lo - first) // item,
                       view[lo - done : hi - done])
            done += n
        if done != size:
            result.problems.append(error(
                "truncated-file", f"{self.path(file)}: ends at byte {offset + done}, "
                f"inside tensor '{t.name}'; copy the checkpoint again",
                file=file, tensor=t.name, offset=offset + done))
            raise _Unreadable
        return crc

    def _check(self, s: Checksummed, tensor: str | None, result: Result) -> None:
        got = crc32(s.data) if s.data is not None else crc32_of(self.reader, s.file, s.offset,
                                                                  s.size)
        self.report(s.size)
        result.bytes_read += s.size
        if got != s.crc32:
            result.problems.append(self._crc_problem(s.file, s.offset, tensor, got, s.crc32,
                                                     s.what))

    def _crc_problem(self, file: str, offset: int, tensor: str | None, got: int, want: int,
                     what: str) -> Problem:
        about = f"tensor '{tensor}', {what}" if tensor else what
        return error("crc-mismatch", f"{self.path(file)} at byte {offset} ({about}): CRC-32 of "
                     f"the stored bytes is {got:08x} but the record says {want:08x}; the bytes "
                     "changed after they were written (bit rot, a bad copy). Copy the checkpoint "
                     "again from a good source", file=file, tensor=tensor, offset=offset)

    def other_checksums(self) -> Result:
        """The checksums outside every chunk (object records, an archive's pickle...)."""
        result = Result()
        sums, problems = self.reader.other_checksums()
        result.problems += problems
        for s in sums:
            try:
                self._check(s, None, result)
            except InputError as e:
                result.problems.append(error("read-error", str(e), file=s.file, offset=s.offset))
        return result


def crc32_of(reader: Reader, file: str, offset: int, size: int, *, block: int = BLOCK_BYTES
             ) -> int:
    """CRC-32 of ``size`` bytes at ``offset`` of ``file``, read in blocks.

    Raises:
        InputError: the file ends first.
    """
    crc = 0
    done = 0
    while done < size:
        n = min(block, size - done)
        crc = crc32(reader.read(Span(file, offset + done, n, "a record")), crc)
        done += n
    return crc


def scan_tensor(scanner: Scanner, t: TensorView, *, digest: bool, compare: Compare | None,
                given: Given | None = None) -> Result:
    """One tensor: CRCs and values from a single read; a second read in C order only when the
    layout is not (a Shard(1) tensor) and a digest or a comparison needs order.

    Args:
        given: the tensor, made whole and checked already (:func:`scan_group`).
    """
    result = Result()
    stats = values.check(t.dtype)
    hasher = hashlib.sha256() if digest else None
    ordered = True
    try:
        for start, data in scanner.stream(t, result, given):
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
            for start_elem, block in tensors.blocks(scanner.reader, t.tensor):
                scanner.report(len(block))
                result.bytes_read += len(block)
                if hasher is not None:
                    hasher.update(block)
                if compare is not None:
                    compare.feed(start_elem, memoryview(block))
    except _Unreadable:
        return result
    except InputError as e:
        result.problems.append(error("read-error", str(e), tensor=t.name))
        return result
    result.complete = True
    if hasher is not None:
        result.digest = hasher.hexdigest()
    if compare is not None:
        result.bytes_read += compare.bytes_read
        if compare.problem is not None:
            result.problems.append(compare.problem)
        result.equal = compare.problem is None
    s = stats.result()
    if s.nan:
        result.problems.append(warning("nan", f"tensor '{t.name}' holds {s.nan} NaN "
                                       f"values (of {t.numel})", tensor=t.name))
    if s.inf:
        result.problems.append(warning("inf", f"tensor '{t.name}' holds {s.inf} infinite "
                                       f"values (of {t.numel})", tensor=t.name))
    if s.all_zero and t.numel:
        result.problems.append(warning("all-zero", f"tensor '{t.name}' is entirely zero",
                                       tensor=t.name))
    return result


# A tensor below this many bytes is read in a group of others, of at most this many stored
# bytes: their chunks decoded in stored order (a read per span of records, not per chunk).
GROUP_TENSOR = 1 << 20
GROUP_STORED = 32 << 20


def groups(todo: list[TensorView]) -> list[list[TensorView]]:
    """``todo`` cut into jobs: runs of small tensors (in stored order, which keeps a group's
    records together), and every other tensor alone."""
    out: list[list[TensorView]] = []
    stored = 0
    group: list[TensorView] | None = None
    for t in todo:
        n = t.tensor.stored_bytes if t.nbytes < GROUP_TENSOR else GROUP_STORED + 1
        if n > GROUP_STORED:
            out.append([t])
            continue
        if group is None or stored + n > GROUP_STORED:
            group, stored = [], 0
            out.append(group)
        group.append(t)
        stored += n
    return out


def scan_group(scanner: Scanner, group: list[TensorView],
               job: Callable[[TensorView, Given | None], Result]) -> list[Result]:
    """``job`` on each tensor of ``group``. Small tensors of row chunks are first made whole
    together, every checksum of their records checked, all at once
    (a :class:`Whole` read, not strict); a tensor that does not cover (a failed checksum, a record
    unlike the others, another layout) is read on its own, by the path that says what is
    wrong."""
    ts = [t.tensor for t in group]
    if len(group) == 1 and group[0].nbytes >= GROUP_TENSOR:
        return [job(group[0], None)]
    rows = [i for i, t in enumerate(ts) if tensors.row_starts(t) is not None]
    dsts = list(itertools.accumulate((ts[i].nbytes for i in rows), initial=0))
    made = bytearray(dsts[-1])
    view = memoryview(made)
    wholes: list[memoryview | None] = [None] * len(ts)
    checked = [0] * len(ts)
    try:
        filled = scanner.reader.read(Whole([ts[i] for i in rows], made, dsts[:-1],
                                           checksums=True, strict=False))
    except InputError:  # a file that cannot be read: each tensor says so on its own
        filled = [None] * len(rows)
    for i, at, got in zip(rows, dsts, filled, strict=False):
        if got is not None:
            wholes[i], checked[i] = view[at : at + ts[i].nbytes], got
    return [job(t, None if w is None else (w, n))
            for t, w, n in zip(group, wholes, checked, strict=True)]


def data_pass(ckpt: Checkpoint, other: Checkpoint | None, plan: AgainstPlan | None,
              want_digest: set[str], workers: int | None, read: Progress, *,
              skip: set[str], skip_b: Set[str] = frozenset(), follow_links: bool = False
              ) -> Pass:
    """Read every undamaged tensor of ``ckpt`` once: CRCs, values, digests (``want_digest``),
    and the comparisons ``plan`` asks for with ``other``.

    Args:
        skip, skip_b: stored names of tensors of ``ckpt`` and ``other`` that structure checks
            found unreadable (:func:`ckpttool.core.checkpoint.structure.check`'s ``damaged``).
    """
    assert ckpt.info is not None
    todo = [t for t in ckpt.tensors if t.stored_name not in skip]
    # By stored name: the plan may name A's tensors inside one part (core.discover.select).
    comparisons = {p.a.stored_name: p for p in (plan.pairs if plan else ())
                   if p.b.stored_name not in skip_b}
    workers = workers or default_workers()
    with contextlib.ExitStack() as stack:
        stack.enter_context(gc_paused())  # millions of live chunk objects, none garbage
        reader = stack.enter_context(open_reader(ckpt, follow_links=follow_links))
        reader_b = (stack.enter_context(open_reader(other, follow_links=follow_links))
                    if other is not None else None)
        for r in (reader, reader_b):
            if r is not None:
                # Before threads share them (the store also opens safely on first use): a file
                # that cannot be opened is reported by the tensors that need it, but one this
                # process may not read stops verify (exit 3): no damage to report.
                try:
                    r.open_files()
                except UnreadableError:
                    raise
                except InputError:
                    pass
        for r, side in ((reader, todo), (reader_b, [v for p in comparisons.values()
                                                    for v in p.views_b])):
            if r is not None and r.capabilities.many_ranges:
                # object storage: coalesced GETs, read ahead in order
                r.plan_reads([(c.file, c.offset, c.length) for t in side
                              for c in t.tensor.chunks])
        scanner = Scanner(reader, read)

        def job(t: TensorView, given: Given | None) -> Result:
            p = comparisons.get(t.stored_name)
            compare = None
            if p is not None and reader_b is not None and other is not None:
                compare = Compare(p, ckpt, other, reader_b, read)
            return scan_tensor(scanner, t, digest=t.name in want_digest, compare=compare,
                               given=given)

        # torch only where a value check or a comparison after a cast needs it: importing it
        # costs more than checking gigabytes.
        casts = any(p.cast is not None for p in comparisons.values())
        torch = casts or any(values.needs_torch(t.dtype) for t in todo)
        # Largest first, so that no thread is left with a big tensor at the end; object
        # storage reads ahead in stored order, which the jobs then keep.
        jobs = groups(todo)
        if not reader.capabilities.many_ranges:
            jobs.sort(key=lambda g: -sum(t.nbytes for t in g))
        results = _run(lambda group: scan_group(scanner, group, job), jobs, workers,
                       fork=all(r.capabilities.local_files for r in (reader, reader_b)
                                if r is not None),
                       report=read, scanner=scanner, torch=torch)
        problems = [p for t in todo for p in results[t.name].problems]
        rest = scanner.other_checksums()
        problems += rest.problems
        problems += reader.check_copies()
        problems += _object_problems(ckpt, reader)
        digests = {n: r.digest for n, r in results.items() if r.digest is not None}
        tied = []
        if plan is not None and other is not None and reader_b is not None:
            tied = decide_tied(ckpt, other, plan, {n: r.equal for n, r in results.items()},
                               digests, reader_b, read)
            tied += compare_computed(ckpt, other, plan, reader, reader_b, read, skip=skip,
                                     skip_b=set(skip_b))
    return Pass(problems, tied, digests,
                sum(r.bytes_read for r in results.values()) + rest.bytes_read,
                {n for n, r in results.items() if r.complete})


def _object_problems(ckpt: Checkpoint, reader: Reader) -> list[Problem]:
    """Non-tensor entries that cannot be read safely: one that asks for code is an error."""
    problems: list[Problem] = []
    for o in ckpt.objects:
        try:
            value = non_tensor.read(reader, o.entry)
        except InputError:
            continue  # a damaged record: its CRCs report it
        found = non_tensor.problem(o.name, value, o.entry.file)
        if found is not None:
            problems.append(found)
    return problems


def _run(job: Callable[[list[TensorView]], list[Result]], todo: list[list[TensorView]],
         workers: int, *, fork: bool, report: Progress, scanner: Scanner, torch: bool
         ) -> dict[str, Result]:
    """``job`` on every group of tensors, in ``workers`` threads (they are independent); or,
    where the work is Python per chunk (kilobyte-sized chunks), in up to ``workers`` forked
    processes (:mod:`ckpttool.core.runtime.forked`), each sending its results back. With ``torch``
    (value checks or comparisons that need it), torch held at one thread of its own."""
    chunks = sum(len(t.tensor.chunks) for g in todo for t in g)
    threads = workers_for(workers, nbytes=sum(t.nbytes for g in todo for t in g), chunks=chunks)
    if threads < workers and len(todo) > 1 and fork and forked.available(needs_torch=torch):
        def share(groups: Iterable[list[TensorView]], progress: Progress, stop: threading.Event
                  ) -> dict[str, Any]:
            scanner.report = progress  # this process's own scanner (a forked copy)
            done: dict[str, Any] = {}
            with one_torch_thread() if torch else contextlib.nullcontext():
                for g in groups:
                    if stop.is_set():
                        break
                    done.update((t.name, r.to_json()) for t, r in zip(g, job(g), strict=True))
            return done

        parent = scanner.report
        try:
            # Each process takes the next group not taken yet (none waits on a slower one).
            with forked.Pulled(todo, lambda g: sum(len(t.tensor.chunks) for t in g)) as queue:
                found = forked.run([functools.partial(share, queue)] * min(workers, len(todo)),
                                   report)
        finally:
            scanner.report = parent
        return {name: Result.from_json(doc) for part in found for name, doc in part.items()}
    with one_torch_thread() if torch else contextlib.nullcontext():
        if threads == 1:
            done = list(map(job, todo))
        else:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                done = list(pool.map(job, todo))
    return {t.name: r for g, rs in zip(todo, done, strict=True) for t, r in zip(g, rs, strict=True)}
