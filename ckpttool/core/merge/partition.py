"""Splitting a merge's copy work between processes by bytes, not by files or tensors. Pure.

A merge plan fixes every output byte's place in advance (``core.merge.plan_merge``), so the
copy can be cut anywhere between elements: the work is laid out in output order (file by file,
tensor slot by slot, chunk by chunk) and cut at every ``total * r / N`` bytes. A chunk that is
one contiguous run of its tensor (what ``Shard(0)`` and whole chunks are) is cut inside, at an
element boundary, so one huge tensor, or a single output file, still splits evenly: each process
writes a disjoint byte range of the same file. Only strided chunks (``Shard(1)``: their rows lie
apart in the output) and computed tensors (LoRA folds, name-map splits) are kept whole; each
goes to the side of the cut it overshoots least, so each end of a process's share is off by at
most half of the largest such piece, and the errors never add up (the cut points are fixed).

Cuts inside a chunk fall on output offsets that are multiples of :data:`ALIGN`, so on a shared
filesystem two processes meet at a page boundary wherever the work allows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpttool.core.checkpoint import geometry
from ckpttool.core.transforms.derive import Derived

if TYPE_CHECKING:
    from ckpttool.core.merge.plan import MergePlan

__all__ = ["ALIGN", "Unit", "Window", "balance", "owners", "rank_bytes", "split", "units",
           "windows"]

# Where a cut inside a chunk lands in the output file: a page boundary (and a multiple of every
# element size). A process's share is off by at most half of it.
ALIGN = 4096


@dataclass(frozen=True, slots=True)
class Unit:
    """One piece of copy work: a chunk of a planned output tensor, or a part of it.

    ``file`` and ``tensor`` index ``plan.files`` and that file's ``tensors``; ``chunk`` indexes
    the tensor's source chunks (None: a computed tensor, written whole); ``elements`` is the
    part ``[lo, hi)`` of the chunk's single run, in elements (None: all of it).
    """

    file: int
    tensor: int
    chunk: int | None
    elements: tuple[int, int] | None
    nbytes: int  # output bytes


@dataclass(frozen=True, slots=True)
class _Piece:
    unit: Unit
    begin: int  # output offset of the first element (splittable pieces)
    itemsize: int  # output bytes per element; 0: not splittable
    numel: int
    end: int  # output offset past the last byte it may write (a whole piece: its tensor's)


def _pieces(plan: MergePlan) -> list[_Piece]:
    """Every unit of work, whole, in output order."""
    out: list[_Piece] = []
    for fi, f in enumerate(plan.files):
        for ti, t in enumerate(f.tensors):
            if isinstance(t.source, Derived):
                if t.slot.nbytes:
                    out.append(_Piece(Unit(fi, ti, None, None, t.slot.nbytes), t.slot.begin,
                                      0, 0, t.slot.end))
                continue
            q = t.dtype.itemsize
            entry = t.source
            placed = []
            for ci, c in enumerate(entry.chunks):
                n = c.numel
                if not n:
                    continue
                unit = Unit(fi, ti, ci, None, n * q)
                if geometry.is_single_run(entry.shape, c.offsets, c.sizes):
                    ((_, dst_elem, _),) = geometry.runs(entry.shape, c.offsets, c.sizes)
                    at = t.slot.begin + dst_elem * q
                    placed.append(_Piece(unit, at, q, n, at + n * q))
                else:
                    placed.append(_Piece(unit, t.slot.begin, 0, n, t.slot.end))
            placed.sort(key=lambda p: p.begin)  # stable: strided chunks keep their order
            out += placed
    return out


def units(plan: MergePlan) -> list[Unit]:
    """Every unit of work of ``plan``, whole, in output order."""
    return [p.unit for p in _pieces(plan)]


def split(plan: MergePlan, num_ranks: int, *, align: int = ALIGN) -> list[list[Unit]]:
    """The plan's work in ``num_ranks`` shares of about equal bytes (module docstring).

    Every output tensor byte is in exactly one share; shares may be empty (more processes than
    bytes to copy). Deterministic: every process computes the same shares from the same plan.

    Args:
        align: output offset multiple at which a chunk may be cut (a multiple of 8).
    """
    if num_ranks < 1:
        raise ValueError("num_ranks must be at least 1")
    pieces = _pieces(plan)
    total = sum(p.unit.nbytes for p in pieces)
    targets = [total * (r + 1) // num_ranks for r in range(num_ranks)]
    shares: list[list[Unit]] = [[] for _ in range(num_ranks)]
    last = num_ranks - 1
    r = 0
    pos = 0  # bytes assigned so far
    for p in pieces:
        u = p.unit
        lo = 0  # elements of a splittable piece already assigned
        while True:
            while r < last and pos >= targets[r]:
                r += 1
            left = u.nbytes - lo * p.itemsize
            if r == last or pos + left <= targets[r]:
                shares[r].append(u if lo == 0 else _part(u, lo, p.numel, p.itemsize))
                pos += left
                break
            if not p.itemsize:
                # Kept whole: on the side of the cut it overshoots least.
                if targets[r] - pos < left / 2:
                    r += 1
                shares[r].append(u)
                pos += left
                break
            # Cut at the page boundary nearest the target, inside the piece.
            at = p.begin + lo * p.itemsize + (targets[r] - pos)
            at = (at + align // 2) // align * align
            k = min(max((at - p.begin) // p.itemsize, lo), p.numel)
            if k > lo:
                shares[r].append(_part(u, lo, k, p.itemsize))
                pos += (k - lo) * p.itemsize
                lo = k
            r += 1
            if lo == p.numel:
                break
    return shares


def _part(u: Unit, lo: int, hi: int, itemsize: int) -> Unit:
    return Unit(u.file, u.tensor, u.chunk, (lo, hi), (hi - lo) * itemsize)


def rank_bytes(shares: list[list[Unit]]) -> list[int]:
    """Output bytes each share writes."""
    return [sum(u.nbytes for u in share) for share in shares]


def balance(shares: list[list[Unit]]) -> float:
    """The largest share over the mean share (1.0: perfectly even; also for no work)."""
    sizes = rank_bytes(shares)
    total = sum(sizes)
    if not total:
        return 1.0
    return max(sizes) * len(sizes) / total


# --------------------------------------------------------------------------------------------
# Parts of an upload: a fixed grid of windows instead of a byte split


@dataclass(frozen=True, slots=True)
class Window:
    """Bytes ``[begin, end)`` of output file ``file``: part ``number`` (1-based) of its
    upload, and the work that writes them (``units``). A splittable chunk is cut at the
    window's edges (an element that straddles an edge is in both windows: each writes all of
    it, and each keeps its own bytes); a whole piece (a strided chunk, a computed tensor)
    is in every window its tensor's slot meets, and is written again for each."""

    file: int
    number: int
    begin: int
    end: int
    units: tuple[Unit, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def windows(plan: MergePlan, part_size: dict[int, int]) -> list[Window]:
    """Every output file of ``plan`` cut into windows of ``part_size[file]`` bytes (the last
    one shorter), with the work that writes each, in output order. Pure; every process
    computes the same windows from the same plan."""
    found: dict[int, list[list[Unit]]] = {}
    for fi, f in enumerate(plan.files):
        size = part_size[fi]
        found[fi] = [[] for _ in range(max(1, -(-f.size // size)))]
    for p in _pieces(plan):
        u = p.unit
        size = part_size[u.file]
        parts = found[u.file]
        if p.end <= p.begin:
            continue
        first, last = p.begin // size, (p.end - 1) // size
        for k in range(first, min(last, len(parts) - 1) + 1):
            if not p.itemsize:
                parts[k].append(u)
                continue
            lo = max(0, (k * size - p.begin) // p.itemsize)
            hi = min(p.numel, -(-((k + 1) * size - p.begin) // p.itemsize))
            parts[k].append(u if (lo, hi) == (0, p.numel) else _part(u, lo, hi, p.itemsize))
    out = []
    for fi, f in enumerate(plan.files):
        size = part_size[fi]
        for k, units_k in enumerate(found[fi]):
            out.append(Window(fi, k + 1, k * size, min(f.size, (k + 1) * size),
                              tuple(units_k)))
    return out


def owners(parts: list[Window], num_ranks: int) -> list[int]:
    """Which of ``num_ranks`` processes uploads each window: whole windows, in output order,
    in runs of about equal bytes (a share is off by at most half a window)."""
    total = sum(w.nbytes for w in parts) or 1
    found = []
    pos = 0
    for w in parts:
        found.append(min(num_ranks - 1, (2 * pos + w.nbytes) * num_ranks // (2 * total)))
        pos += w.nbytes
    return found
