"""Reading the data files of a remote checkpoint by ranged GETs, the same for every object
store: the ranges a command will read coalesced into sorted GETs, fetched ahead over a bounded
pool, held within a memory bound. Each store module subclasses :class:`RemoteStore` with its
own ranged GET (``_get_range``: retries, ETag pinning, errors in the user's terms)."""

from __future__ import annotations

import bisect
import errno
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ckpttool import settings
from ckpttool.errors import CkptError, InputError, TransportError
from ckpttool.storage import outputs, places, sidefiles, store

Url = places.Url

# Ranged GETs: ranges closer than GAP are read in one request (a few wasted bytes cost less
# than a round trip), up to GET bytes per request; at most CONCURRENCY requests in flight,
# and at most CACHE bytes of fetched ranges held (the memory bound of a remote read).
GET = 16 << 20
GAP = 1 << 20
CONCURRENCY = 16
CACHE = 2 * CONCURRENCY * GET


@dataclass(frozen=True)
class Retry:
    """How a store's ranged GET is tried again (its module's constants, read per call)."""

    retries: int  # fetched again this many times at most
    backoff: float  # s before the first retry, doubled at each (with jitter)
    min_rate: float  # bytes per second: the deadline grows with the size by this rate
    transient: Callable[[BaseException], bool]  # worth one more try
    mapped: Callable[[Exception], BaseException | None]  # a refusal, in the user's terms
    why: Callable[[BaseException | None], str]  # the last failure, short and secret-free


def retried(url: Any, offset: int, size: int, fetch: Callable[[], bytes], how: Retry) -> bytes:
    """``fetch()`` (one ranged GET of ``size`` bytes at ``offset`` of ``url``), tried again
    with backoff while it fails in a way ``how.transient`` says another try may fix, until
    ``how.retries`` retries or the deadline (``settings.request_deadline()``, plus the time
    the size takes at ``how.min_rate``: a store that accepts requests and never answers is
    given up here, whatever the retries). The one retry loop of every store.

    Raises:
        CkptError: what ``fetch`` raised as one (a refusal: never retried).
        TransportError: still failing after the retries, naming the object and the range.
    """
    failure: BaseException | None = None
    deadline = time.monotonic() + settings.request_deadline() + size / how.min_rate
    tries = 0
    for attempt in range(how.retries + 1):
        if attempt:
            if time.monotonic() >= deadline:
                break
            time.sleep(how.backoff * 2 ** (attempt - 1) * (0.5 + random.random()))
        tries += 1
        try:
            return fetch()
        except CkptError:
            raise
        except Exception as e:
            if not how.transient(e):
                raise how.mapped(e) or e from e
            failure = e
    raise TransportError(
        f"{url}: reading {size:,} bytes at byte {offset:,} failed {tries} times "
        f"({how.why(failure)}); the network or the object store is failing (not the "
        "checkpoint), run again later") from failure


@dataclass
class _Group:
    """One coalesced GET: bytes [start, end) of a file."""

    file: str
    start: int
    end: int
    rank: int  # position in the order the plan reads it
    data: bytes | None = None
    future: Future[bytes] | None = None
    used: bool = False


@dataclass
class _Plan:
    by_file: dict[str, list[_Group]] = field(default_factory=dict)
    starts: dict[str, list[int]] = field(default_factory=dict)
    order: list[_Group] = field(default_factory=list)


class RemoteStore:
    """The data files of a remote checkpoint, read by ranged GETs.

    Told the ranges a command will read (:meth:`plan_reads`), it coalesces them into sorted
    GETs of at most :data:`GET` bytes, fetches them ahead of the readers over at most
    :data:`CONCURRENCY` requests, holding at most about :data:`CACHE` bytes, and serves
    reads from them; a read outside the plan is a GET of its own. Thread-safe.
    """

    capabilities: ClassVar[store.Capabilities] = store.Capabilities(
        many_ranges=True, local_files=False, workers=CONCURRENCY)

    def __init__(self, base: Path, url: Url, objects: dict[str, tuple[int, str]],
                 metadata_name: str) -> None:
        self.base = base
        self.url = url
        self.objects = objects
        self.metadata_name = metadata_name
        self._lock = threading.Lock()
        self._plan = _Plan()
        self._held: OrderedDict[int, _Group] = OrderedDict()  # fetched, by id, LRU first
        self._held_bytes = 0
        self._pool: ThreadPoolExecutor | None = None

    # -- the Store protocol

    def path(self, name: str) -> Path:
        return self.base / name

    def size(self, name: str) -> int:
        found = self.objects.get(name)
        if found is None:
            raise InputError(store.missing_message(self.path(name), self.metadata_name))
        return found[0]

    def open_all(self, names: Iterable[str]) -> None:
        for name in names:
            self.size(name)

    def pread(self, name: str, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the object's end)."""
        size = max(0, min(size, self.size(name) - offset))
        parts = []
        done = 0
        while done < size:
            piece = self._piece(name, offset + done, size - done)
            parts.append(piece)
            done += len(piece)
        return b"".join(parts) if len(parts) != 1 else bytes(parts[0])

    def read_exact(self, name: str, offset: int, size: int, *, what: str) -> bytes:
        data = self.pread(name, size, offset)
        if len(data) != size:
            raise store.truncated(self.path(name), offset + len(data), what)
        return data

    def readinto(self, name: str, offset: int, buf: memoryview) -> int:
        view = buf.cast("B")
        size = max(0, min(len(view), self.size(name) - offset))
        done = 0
        while done < size:
            piece = self._piece(name, offset + done, size - done)
            view[done:done + len(piece)] = piece
            done += len(piece)
        return done

    def readv(self, name: str, offset: int, bufs: Sequence[memoryview]) -> int:
        # One ranged read of the whole span, then placed: a request per buffer would cost a
        # round trip per run (a row-parallel layer's rows are thousands of 6 KB runs).
        span = bytearray(sum(len(b) for b in bufs))
        got = self.readinto(name, offset, memoryview(span))
        at = 0
        for buf in bufs:
            if at >= got:
                break
            n = min(len(buf), got - at)
            buf[:n] = span[at : at + n]
            at += n
        return got

    def copy_to(self, name: str, offset: int, dst_fd: int, dst_offset: int, size: int) -> None:
        end = self.size(name)
        done = 0
        while done < size:
            if offset + done >= end:
                raise InputError(f"{self.path(name)}: ends {size - done} bytes before the "
                                 f"tensor bytes its headers promise (at byte {offset + done}); "
                                 "it is truncated")
            piece = self._piece(name, offset + done, min(size - done, end - offset - done))
            outputs.pwrite_all(dst_fd, piece, dst_offset + done)
            done += len(piece)

    def views(self, name: str, offset: int, size: int, block: int) -> Iterator[memoryview]:
        raise NotImplementedError("object storage maps nothing (capabilities.local_files)")

    def read_small(self, name: str, kind: sidefiles.Kind) -> bytes:
        """Its listed size checked against ``kind``'s cap, then one ranged read."""
        found = self.objects.get(name)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT),
                                    str(self.path(name)))
        sidefiles.check_size(self.path(name), found[0], kind)
        return self.read_exact(name, 0, found[0], what=kind.what)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._held.clear()
            self._plan = _Plan()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # -- planned reads

    def plan_reads(self, reads: list[tuple[str, int, int]]) -> None:
        """The ranges (file, offset, size) about to be read, in the order they will be:
        coalesced into GETs and fetched ahead of the readers from then on."""
        ranked = sorted((f, o, min(o + n, self.objects[f][0]), i)
                        for i, (f, o, n) in enumerate(reads)
                        if n > 0 and f in self.objects and o < self.objects[f][0])
        plan = _Plan()
        cur: _Group | None = None
        for f, start, end, i in ranked:
            while start < end:
                if (cur is not None and cur.file == f and start - cur.end <= GAP
                        and end - cur.start <= GET):
                    cur.end = max(cur.end, end)
                    cur.rank = min(cur.rank, i)
                    break
                if cur is not None and cur.file == f and start < cur.end:
                    start = cur.end  # already covered up to there
                    continue
                cur = _Group(f, start, min(end, start + GET), i)
                plan.by_file.setdefault(f, []).append(cur)
                start = cur.end
        for f, groups in plan.by_file.items():
            plan.starts[f] = [g.start for g in groups]
            plan.order += groups
        plan.order.sort(key=lambda g: (g.rank, g.file, g.start))
        for k, g in enumerate(plan.order):
            g.rank = k
        with self._lock:
            self._plan = plan
            self._held.clear()
            self._held_bytes = 0
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=CONCURRENCY,
                                                thread_name_prefix="ckpttool-get")
        self._read_ahead(0)

    def _group(self, name: str, offset: int) -> _Group | None:
        plan = self._plan
        starts = plan.starts.get(name)
        if not starts:
            return None
        k = bisect.bisect_right(starts, offset) - 1
        if k < 0:
            return None
        g = plan.by_file[name][k]
        return g if g.start <= offset < g.end else None

    def _piece(self, name: str, offset: int, size: int) -> bytes | memoryview:
        """Bytes from ``offset``: all ``size`` of them, or as many as one planned GET (or
        one :data:`GET`-sized request outside the plan) holds."""
        g = self._group(name, offset)
        if g is None:
            n = min(size, GET)
            return self._get_range(self.url.child(name), offset, n, self.objects[name][1])
        data = self._fetched(g)
        return memoryview(data)[offset - g.start:min(g.end, offset + size) - g.start]

    def _fetched(self, g: _Group) -> bytes:
        with self._lock:
            data = g.data
            if data is None:
                if g.future is None:
                    self._start(g)
                future = g.future
            else:
                self._held.move_to_end(id(g))
            g.used = True
        if data is None:
            assert future is not None
            data = future.result()
        self._read_ahead(g.rank + 1)
        return data

    def _start(self, g: _Group) -> None:
        """Start fetching ``g`` (called with the lock held)."""
        assert self._pool is not None
        g.future = self._pool.submit(self._fetch, g)

    def _get_range(self, url: Any, offset: int, size: int, etag: str | None) -> bytes:
        """One ranged GET, pinned to ``etag``: each store module's subclass sends its own."""
        raise NotImplementedError

    def _fetch(self, g: _Group) -> bytes:
        data = self._get_range(self.url.child(g.file), g.start, g.end - g.start,
                               self.objects[g.file][1])
        with self._lock:
            g.data = data
            g.future = None
            self._held[id(g)] = g
            self._held_bytes += len(data)
            self._evict()
        return data

    def _evict(self) -> None:
        """Drop the least recently used fetched ranges that were read, over :data:`CACHE`."""
        for key in list(self._held):
            if self._held_bytes <= CACHE:
                break
            g = self._held[key]
            if not g.used:
                continue  # fetched ahead, not read yet
            del self._held[key]
            self._held_bytes -= g.end - g.start
            g.data = None

    def _read_ahead(self, rank: int) -> None:
        """Start the GETs of the plan from ``rank`` on, while the pool and memory allow."""
        with self._lock:
            if self._pool is None:
                return
            in_flight = sum(1 for g in self._plan.order if g.future is not None)
            budget = CACHE - self._held_bytes
            for g in self._plan.order[rank:rank + 2 * CONCURRENCY]:
                if in_flight >= CONCURRENCY or budget < g.end - g.start:
                    break
                if g.data is None and g.future is None:
                    self._start(g)
                    in_flight += 1
                    budget -= g.end - g.start
