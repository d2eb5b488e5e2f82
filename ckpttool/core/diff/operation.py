"""``diff A B``: every tensor of two checkpoints (any formats) compared under canonical names,
streamed block by block (memory: a few blocks per thread, whatever the sizes), with the
statuses, counts and sizes of what changed; ``write_delta`` adds a delta that rebuilds B from
A (:mod:`ckpttool.core.diff.delta`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.core.checkpoint.discover import Checkpoint, discover, open_reader
from ckpttool.core.diff import stream
from ckpttool.core.diff.plan import (
    ADDED,
    CHANGED,
    DTYPE_CHANGED,
    IDENTICAL,
    REMOVED,
    RESHAPED,
    STATUSES,
    DiffPlan,
    Entry,
    View,
    named,
    plan_diff,
)
from ckpttool.core.diff.values import Change, Measured, TensorDiff
from ckpttool.core.runtime import urls
from ckpttool.core.runtime.report import Progress, Section, document, locked, section
from ckpttool.core.runtime.torch_threads import default_workers
from ckpttool.errors import InputError
from ckpttool.formats.base import Problem, Reader, info, warning
from ckpttool.storage.store import LOCAL, Stores

# Bytes of each side compared at a time.
BLOCK_BYTES = 8 << 20


@section
class DiffSummary(Section):
    """``diff``'s ``summary``: tensors per status, the bytes compared, and the bytes of B that
    differ from A (changed elements, and every byte of an added, reshaped or dtype-changed
    tensor)."""

    identical: int
    changed: int
    added: int
    removed: int
    reshaped: int
    dtype_changed: int
    bytes_compared: int
    bytes_changed: int

    KEYS = {"dtype_changed": "dtype-changed"}


@section
class TiedOnce(Section):
    """A tensor stored on one side only as a tie (``lm_head.weight`` left out where it equals
    the input embedding): compared through its partner there."""

    name: str
    partner: str
    side: str  # "a" or "b": where it is stored once


@dataclass
class DiffReport:
    """What ``diff`` found, for people (CLI) and programs (``to_json``)."""

    a: str
    b: str
    format_a: str
    format_b: str
    identical: bool = True
    filter: str | None = None
    summary: DiffSummary | None = None
    tensors: list[TensorDiff] = field(default_factory=list)
    tied: list[TiedOnce] = field(default_factory=list)
    delta: Any = None  # core.diff.delta.DeltaSummary, when one was written
    bytes_read: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return document("diff", self)


@urls.urls(sources=("a", "b"))
def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    filter: str | None = None,
    write_delta: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    follow_links: bool = False,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    stores: Stores = LOCAL,
) -> DiffReport:
    """Compare checkpoint ``b`` with checkpoint ``a``, tensor by tensor, bit for bit.

    Args:
        a, b: any checkpoints ckpttool reads (formats may differ); of a training checkpoint,
            its model.
        filter: a glob on canonical or stored names; only those tensors are compared.
        write_delta: a directory to write a delta into that rebuilds B from A
            (``ckpttool apply``); not with ``filter``.
        overwrite: replace a delta already in ``write_delta``.
        workers: tensors compared in parallel (default: the CPUs this process may use).
        follow_links: read data files that are links out of the checkpoint directories.
        progress: called with bytes read.
        on_start: called once with the bytes about to be read.

    Returns:
        A :class:`DiffReport`; ``report.identical`` is False when anything differs.

    Raises:
        InputError: ``a`` or ``b`` cannot be read, or ``filter`` with ``write_delta``.
        UnsupportedError: a format or layout ckpttool does not read yet.
        OutputError: the delta cannot be written (or exists, without ``overwrite``).
    """
    started = time.perf_counter()
    if write_delta is not None and filter is not None:
        raise InputError("--filter compares part of the tensors, and a delta must rebuild all "
                         "of B; leave out one of --filter and --write-delta")
    ckpt_a = named(discover(a, command="diff", stores=stores))
    ckpt_b = named(discover(b, command="diff", stores=stores))
    if write_delta is not None:
        from ckpttool.core.diff import delta

        delta.check_output(Path(write_delta), overwrite=overwrite, sources=(ckpt_a, ckpt_b))
    plan = plan_diff(ckpt_a, ckpt_b, pattern=filter)
    report = DiffReport(str(ckpt_a.root), str(ckpt_b.root), ckpt_a.ckpt.format,
                        ckpt_b.ckpt.format, filter=filter)
    report.tied = [TiedOnce(e.name, (e.a if e.a_tied else e.b).name,  # type: ignore[union-attr]
                            "a" if e.a_tied else "b")
                   for e in plan.entries if e.a_tied or e.b_tied]
    with (open_reader(ckpt_a.ckpt, follow_links=follow_links) as reader_a,
          open_reader(ckpt_b.ckpt, follow_links=follow_links) as reader_b):
        measured = measure(plan, reader_a, reader_b, digests=write_delta is not None,
                           workers=workers, progress=progress, on_start=on_start)
        report.tensors = [m.row for m in measured]
        report.summary = summarize(plan, report.tensors)
        report.identical = all(r.status == IDENTICAL for r in report.tensors)
        report.bytes_read = sum(m.bytes_read for m in measured)
        if write_delta is not None:
            from ckpttool.core.diff import delta

            report.delta = delta.write(Path(write_delta), plan, measured, ckpt_a, ckpt_b,
                                       reader_a, reader_b, overwrite=overwrite)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def measure(plan: DiffPlan, reader_a: Reader, reader_b: Reader, *, digests: bool,
            workers: int | None, progress: Progress | None = None,
            on_start: Callable[[int], None] | None = None) -> list[Measured]:
    """The data pass: every entry of ``plan`` compared (and, with ``digests``, every tensor
    stored on either side hashed), in the plan's order."""
    report = locked(progress)
    if on_start is not None:
        on_start(sum(_to_read(e, digests) for e in plan.entries))

    def one(e: Entry) -> Measured:
        return _measure(e, reader_a, reader_b, digests=digests, report=report)

    n = max(1, min(workers or default_workers(), len(plan.entries)))
    if n == 1:
        return [one(e) for e in plan.entries]
    with ThreadPoolExecutor(n, thread_name_prefix="ckpttool-diff") as pool:
        return list(pool.map(one, plan.entries))


def _to_read(e: Entry, digests: bool) -> int:
    if e.status is None:
        return e.a.nbytes + e.b.nbytes  # type: ignore[union-attr]
    if not digests:
        return 0
    return sum(t.nbytes for t, tied in ((e.a, e.a_tied), (e.b, e.b_tied))
               if t is not None and not tied)


def _measure(e: Entry, reader_a: Reader, reader_b: Reader, *, digests: bool,
             report: Progress) -> Measured:
    status = e.status
    if status is not None:
        got = Measured(TensorDiff(e.name, status, None, None, None))
        if digests:  # the delta's manifests name every stored tensor
            if e.a is not None and not e.a_tied:
                got.sha_a = _sha(reader_a, e.a, report)
                got.bytes_read += e.a.nbytes
            if e.b is not None and not e.b_tied:
                got.sha_b = _sha(reader_b, e.b, report)
                got.bytes_read += e.b.nbytes
        return got
    assert e.a is not None and e.b is not None
    ta, tb = e.a.source, e.b.source
    dtype = ta.dtype
    change = Change()
    ha = hashlib.sha256() if digests and not e.a_tied else None
    hb = hashlib.sha256() if digests and not e.b_tied else None
    side_a, side_b = stream.Side(reader_a, ta), stream.Side(reader_b, tb)
    buf_a, buf_b = _buffers()
    normed = 0  # elements of A whose share of ||A||^2 is in change.a_sq
    step = max(1, BLOCK_BYTES // dtype.itemsize)
    for start, stop in stream.pairs(side_a, side_b, step):
        for da in side_a.read(start, stop, buf_a):
            for db in side_b.read(start, stop, buf_b):
                report(len(da) + len(db))
                if ha is not None:
                    ha.update(da)
                if hb is not None:
                    hb.update(db)
                same = stream.equal(da, db)
                if same and not change.changed:
                    continue
                if not same and normed < start:
                    # The first change: A's norm over the blocks before it.
                    _norm(side_a, normed, start, step, change)
                change.add(da, db, dtype, compare=not same)
                normed = stop
    if change.changed:
        row = TensorDiff(e.name, CHANGED, change.changed, change.max_abs, change.rel_l2)
    else:
        row = TensorDiff(e.name, IDENTICAL, 0, 0.0, 0.0)
    return Measured(row, ha.hexdigest() if ha else None, hb.hexdigest() if hb else None,
                    ta.nbytes + tb.nbytes)


def _norm(side: stream.Side, start: int, stop: int, step: int, change: Change) -> None:
    """Add A's elements ``[start, stop)`` to ``change.a_sq`` (read into a buffer of their own:
    the block buffers hold the block being compared)."""
    buf = memoryview(bytearray(min(stop - start, step) * side.tensor.dtype.itemsize))
    for lo in range(start, stop, step):
        for data in side.read(lo, min(stop, lo + step), buf):
            change.add(data, data, side.tensor.dtype, compare=False)


_local = threading.local()


def _buffers() -> tuple[memoryview, memoryview]:
    """This thread's two block buffers, made once (a new one per block costs a page fault per
    4 KB of it)."""
    bufs: tuple[memoryview, memoryview] | None = getattr(_local, "bufs", None)
    if bufs is None or len(bufs[0]) != BLOCK_BYTES:
        bufs = _local.bufs = (memoryview(bytearray(BLOCK_BYTES)),
                              memoryview(bytearray(BLOCK_BYTES)))
    return bufs


def _sha(reader: Reader, t: View, report: Progress) -> str:
    return sha256(stream.Side(reader, t.source), BLOCK_BYTES, report)


def sha256(side: stream.Side, block_bytes: int, report: Progress | None = None) -> str:
    """The SHA-256 of a tensor's bytes in C order."""
    h = hashlib.sha256()
    step = max(1, block_bytes // side.tensor.dtype.itemsize)
    buf = memoryview(bytearray(min(step, max(side.tensor.numel, 1)) * side.tensor.dtype.itemsize))
    for start in range(0, side.tensor.numel, step):
        for data in side.read(start, min(side.tensor.numel, start + step), buf):
            if report is not None:
                report(len(data))
            h.update(data)
    return h.hexdigest()


def summarize(plan: DiffPlan, rows: list[TensorDiff]) -> DiffSummary:
    counts = {s: 0 for s in STATUSES}
    compared = changed = 0
    for e, r in zip(plan.entries, rows, strict=True):
        counts[r.status] += 1
        if r.changed_elements is not None:
            assert e.a is not None and e.b is not None
            compared += e.a.nbytes
            changed += r.changed_elements * e.a.dtype.itemsize
        elif e.b is not None and r.status != REMOVED:
            changed += e.b.nbytes
    return DiffSummary(counts[IDENTICAL], counts[CHANGED], counts[ADDED],
                       counts[REMOVED], counts[RESHAPED],
                       counts[DTYPE_CHANGED], compared, changed)


def against_base(ckpt: Checkpoint, base: Checkpoint, *, workers: int | None,
                 follow_links: bool, progress: Progress | None = None) -> list[Problem]:
    """``verify OUT --base BASE``: a model identical to the base it was made from (every
    tensor bit for bit, ties aside) is a warning: the merge, fold or training step that made
    it changed nothing. Otherwise a note of how much changed."""
    plan = plan_diff(named(base), named(ckpt))
    with (open_reader(base, follow_links=follow_links) as reader_a,
          open_reader(ckpt, follow_links=follow_links) as reader_b):
        rows = [m.row for m in measure(plan, reader_a, reader_b, digests=False, workers=workers,
                                       progress=progress)]
    summary = summarize(plan, rows)
    if all(r.status == IDENTICAL for r in rows):
        return [warning("identical-to-base", f"every tensor of {ckpt.root} is bit-identical "
                        f"to {base.root} ({count_of(len(rows))}): whatever made it (a merge, "
                        "a LoRA fold, a training step) changed nothing. Check that the "
                        "adapter or the trained weights were the ones saved")]
    differ = len(rows) - summary.identical
    return [info("differs-from-base", f"{differ} of {count_of(len(rows))} differ from "
                 f"{base.root} ({summary.bytes_changed:,} bytes changed); ckpttool diff "
                 f"{base.root} {ckpt.root} lists them")]


def count_of(n: int) -> str:
    return f"{n:,} tensor{'' if n == 1 else 's'}"
