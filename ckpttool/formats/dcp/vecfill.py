"""Records of one template checked and their elements copied as a byte matrix (numpy):
the per-chunk step of :func:`~ckpttool.formats.dcp.records.fill_rows` without Python per
chunk. numpy is imported by the first call, never on ``--help`` or completion paths."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from ckpttool.formats.codecs.crc import crc32_rows

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# Bytes of records compared in one numpy step: the per-thread scratch the comparison writes
# into (records that lie back to back are read where they are), or the records gathered
# (the others). Large enough that a step's fixed cost (a few microseconds) is small beside
# its work, small enough to stay in the caches.
_COMPARE_BYTES = 1 << 20
# Records that lie back to back in a span, in runs of at least this many, are compared in
# place (a 2-D view of the span); the others are gathered first.
_MIN_RUN = 8
_scratch = threading.local()


class Template(Protocol):
    """What this module reads of a record template (:class:`records.Template` has it):
    declared here, so that the byte matrix needs nothing from the module that calls it."""

    @property
    def length(self) -> int: ...  # bytes of every record of the template
    @property
    def head(self) -> int: ...  # where the storage's data starts in a record
    @property
    def start(self) -> int | None: ...  # first element's byte in the data; None: not dense
    @property
    def checks(self) -> tuple[tuple[int, int, int], ...]: ...  # (offset, size, CRC field)
    @property
    def blank(self) -> bytes: ...  # the template's record, CRC fields zeroed
    @property
    def keep(self) -> bytes: ...  # 0xFF where a byte is compared, 0 where not


def fill_template_rows(template: Template, out: npt.NDArray[np.uint8],
                       flat: npt.NDArray[np.uint8], pos: npt.NDArray[np.int64],
                       dsts: npt.NDArray[np.int64], nbytes: int, checksums: bool
                       ) -> npt.NDArray[np.bool_]:
    """The records of ``template`` at ``pos`` in ``flat`` (the spans read): their ``nbytes``
    of elements copied to ``out`` at ``dsts``; per record, True where it is not the
    template's record (a compared byte differs) or, with ``checksums``, where the CRC-32 of
    an entry it does not share with the template differs from its header's.

    The records are taken in the order they lie in ``flat``: those back to back (the
    records of consecutive tensors in one file) as 2-D views of it, the others gathered,
    a megabyte at a time. Of each such block, the columns that matter (the entries whose
    CRC-32 is computed, the CRC-32 fields, the elements) are copied out into one matrix
    each, then XOR the template's record, AND its mask of compared bytes, and counted
    (a block is looked at row by row only where that count is not zero). The caller bounds
    the number of records (the columns copied: a few hundred bytes per record at most)."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    n, size = len(pos), template.length
    assert template.start is not None
    first = template.head + template.start
    columns = [(first, nbytes)] if nbytes else []
    if checksums:
        for off, length, field in template.checks:
            columns += [(off, length), (field, 4)]
    got = [np.empty((n, w), dtype=np.uint8) for _, w in columns]
    blank = np.frombuffer(template.blank, dtype=np.uint8)
    keep = np.frombuffer(template.keep, dtype=np.uint8)
    bad = np.zeros(n, dtype=np.bool_)
    rows = max(1, _COMPARE_BYTES // size)
    order = np.argsort(pos, kind="stable")
    ordered = pos[order]
    # Runs of records back to back (each starts where the one before ends).
    cuts = np.flatnonzero(np.diff(ordered) != size) + 1
    starts = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts, [n])))
    long = lengths >= _MIN_RUN
    scratch = _scratch_buffer(rows * size)
    blocks: list[tuple[int, int, Any]] = []  # (first row in ``ordered``, rows, its bytes)

    # Each column copied as one item of w bytes per row (a void dtype): numpy's loop for a
    # row of a few bytes costs 2-3x the bytes' copy (a CRC field is 4, an entry 1 to 64).
    voids = [np.dtype((np.void, w)) if w else None for _, w in columns]

    def take(a: int, k: int, block: Any, own: bool) -> None:
        for (off, w), col, void in zip(columns, got, voids, strict=True):
            if void is not None:
                col[a : a + k].view(void)[:, 0] = block[:, off : off + w].view(void)[:, 0]
        x = block if own else scratch[: k * size].reshape(k, size)
        np.bitwise_xor(block, blank, out=x)
        np.bitwise_and(x, keep, out=x)
        if np.count_nonzero(x):
            bad[a + np.flatnonzero(x.any(axis=1))] = True

    done = 0
    for a, m in zip(starts[long].tolist(), lengths[long].tolist(), strict=True):
        p0 = int(ordered[a])
        for b in range(0, m, rows):
            k = min(rows, m - b)
            blocks.append((a + b, k, flat[p0 + b * size : p0 + (b + k) * size].reshape(k, size)))
    # The rows outside long runs, gathered together: put first in the order.
    rest = np.flatnonzero(np.repeat(~long, lengths))
    if len(rest):
        keep_order = np.concatenate((rest, np.flatnonzero(np.repeat(long, lengths))))
        order, ordered = order[keep_order], ordered[keep_order]
        windows = sliding_window_view(flat, size)
        for b in range(0, len(rest), rows):
            at = ordered[b : b + rows]
            take(b, len(at), windows[at], True)  # a copy of its own
        done = len(rest)
        shift = np.empty(n, dtype=np.int64)
        shift[keep_order] = np.arange(n)
        blocks = [(int(shift[a]), k, block) for a, k, block in blocks]
    for a, k, block in blocks:
        take(a, k, block, False)
    assert done + sum(k for _, k, _ in blocks) == n
    i = 0
    if nbytes:
        elements = got[0]
        i = 1
        back = np.empty(n, dtype=np.int64)
        back[order] = np.arange(n)
        elements = elements.take(back, axis=0)  # in the order of ``dsts``
        _scatter(out, elements, dsts, nbytes)
    while i < len(got):
        want = got[i + 1].view("<u4")[:, 0]
        bad |= crc32_rows(got[i]) != want
        i += 2
    result = np.zeros(n, dtype=np.bool_)
    result[order[bad]] = True
    return result


def _scatter(out: npt.NDArray[np.uint8], elements: npt.NDArray[np.uint8],
             dsts: npt.NDArray[np.int64], nbytes: int) -> None:
    """Row ``j`` of ``elements`` to ``out`` at ``dsts[j]``: a slice per run of rows back to
    back (a tensor's rows, consecutive tensors), or one scatter where runs are short."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    n = len(dsts)
    cuts = np.flatnonzero(np.diff(dsts) != nbytes) + 1
    if len(cuts) * _MIN_RUN > n:
        sliding_window_view(out, nbytes, writeable=True)[dsts] = elements
        return
    flat = elements.reshape(-1)
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
        d = int(dsts[a])
        out[d : d + (b - a) * nbytes] = flat[a * nbytes : b * nbytes]


def _scratch_buffer(size: int) -> Any:
    """``size`` bytes for the thread, kept from one call to the next (fresh arrays of a
    megabyte fault their pages in on every step)."""
    import numpy as np

    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < size:
        buf = _scratch.buf = np.empty(size, dtype=np.uint8)
    return buf
