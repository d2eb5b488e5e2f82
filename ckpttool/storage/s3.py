"""Object storage (S3 and S3-compatible stores: MinIO, Ceph, R2): the client, its errors in
the user's terms, ranged GETs, :class:`RemoteStore` and multipart uploads. Names no format:
which objects an output replaces and which goes last are the caller's to say.

Why boto3/botocore, not obstore or s3fs (compared for this module):

* Credentials and endpoint. botocore's chain is the AWS CLI's own: AWS_PROFILE, AWS_ACCESS_KEY_ID
  and friends, ``~/.aws/config`` and ``credentials`` (profiles, SSO, ``credential_process``,
  assumed roles), container and instance roles, and AWS_ENDPOINT_URL (or a profile's
  ``endpoint_url``) for MinIO, Ceph and R2. obstore (Rust ``object_store``) reads the
  environment variables but not profiles or config files unless boto3 is installed as its
  credential provider anyway; s3fs is aiobotocore, the same chain with an async layer on top.
* Throughput. A ranged GET moves the same bytes with any client: the cost that matters is
  how many requests there are and how many are in flight, which this module decides itself
  (coalesced 8-16 MB GETs over a bounded pool). Measured (``benchmarks/remote.py``, moto,
  268 MB, load 16.6): a plain parallel download took 3.84 s with boto3 and 2.41 s with
  obstore, so obstore is the faster client; GCS and Azure use it (:mod:`objstore`).
* Why S3 still uses boto3 (issue 26): obstore would need boto3 anyway for the profile chain
  above (its ``Boto3CredentialProvider``), so the extra would not get lighter; and the S3
  tests pin this module's explicit multipart calls (parts counted, ``ListMultipartUploads``
  empty after a Ctrl-C). obstore does abort a multipart upload whose input fails (checked
  against moto), so switching is possible: it is the next step, with those tests rewritten.

How a remote checkpoint is read: see :mod:`ckpttool.storage.mirror`.

Nothing here prints or stores credentials; they never appear on the command line.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import random
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ckpttool import settings
from ckpttool.errors import (
    AccessError,
    CkptError,
    InputError,
    OutputError,
    TransportError,
    UnsupportedError,
)
from ckpttool.storage import outputs, places
from ckpttool.storage import store as stores

EXTRA = "pip install 'ckpttool[s3]'"

# Ranged GETs: ranges closer than GAP are read in one request (a few wasted bytes cost less
# than a round trip), up to GET bytes per request; at most CONCURRENCY requests in flight,
# and at most CACHE bytes of fetched ranges held (the memory bound of a remote read).
GET = 16 << 20
GAP = 1 << 20
CONCURRENCY = 16
CACHE = 2 * CONCURRENCY * GET
# Multipart uploads: parts of at least PART bytes (S3 allows 10,000 parts per object).
PART = 16 << 20
MAX_PARTS = 10_000
# Timeouts and retries. botocore retries a request that fails before its body (connection
# errors, 5xx, throttling) with its own backoff, up to ATTEMPTS times; a body that breaks off,
# arrives short or stalls is fetched again here, RETRIES times with backoff. Then the failure
# is a one-line TransportError naming the object, never "corrupt".
CONNECT_TIMEOUT = 10  # s at most, to open a connection
# Any single read from the socket waits at most settings.request_timeout() (30 s by default);
# a request and its retries give up after settings.request_deadline().
ATTEMPTS = 5
RETRIES = 4
BACKOFF = 0.25  # s, doubled at each retry (with jitter)
# A body slower than this (after a request timeout of grace) is given up and fetched again: a
# server that trickles a byte at a time never trips the socket timeout.
MIN_RATE = 256 << 10  # bytes per second


# One URL type for every store (storage/places.py).
Url = places.Url


def parse(value: str) -> Url:
    """``s3://bucket/some/key`` -> :class:`Url`.

    Raises:
        InputError: no bucket named.
    """
    return places.parse_url(value)


# --------------------------------------------------------------------------------------------
# The client and its errors


_client: Any = None
_client_lock = threading.Lock()


def client(url: Url) -> Any:
    """One boto3 S3 client for the process (thread-safe), configured from the standard places
    (environment, ``~/.aws/config``, profiles).

    Raises:
        UnsupportedError: the ``s3`` extra (boto3) is not installed.
    """
    global _client
    with _client_lock:
        if _client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as err:
                raise UnsupportedError(f"{url}: object storage needs the s3 extra; install it "
                                       f"with: {EXTRA}") from err
            config = Config(retries={"max_attempts": ATTEMPTS, "mode": "standard"},
                            max_pool_connections=2 * CONCURRENCY,
                            connect_timeout=min(CONNECT_TIMEOUT, settings.request_timeout()),
                            read_timeout=settings.request_timeout())
            _client = boto3.session.Session().client("s3", config=config)
        return _client


def error(e: Exception, url: Url | str, doing: str) -> CkptError | None:
    """A botocore failure in the user's terms, naming ``url`` (never a credential); None
    for an exception that is not botocore's."""
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - only called once boto3 imported
        return None
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return InputError(f"{url}: no AWS credentials found; set AWS_PROFILE, or "
                          "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or ~/.aws/credentials")
    if isinstance(e, bx.ProfileNotFound):
        return InputError(f"{url}: {e}; check AWS_PROFILE and ~/.aws/config")
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectTimeoutError):
        where = e.kwargs.get("endpoint_url", "")
        return TransportError(f"{url}: cannot reach the object store ({where}); check "
                              "AWS_ENDPOINT_URL and the network")
    if _transient(e):
        return TransportError(f"{url}: {doing} failed after {ATTEMPTS} tries "
                              f"({type(e).__name__}); the network or the object store is "
                              "failing, run again later")
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            bucket = url.bucket if isinstance(url, Url) else url
            return InputError(f"{url}: bucket '{bucket}' does not exist; check the URL "
                              "(and AWS_ENDPOINT_URL for an S3-compatible store)")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return InputError(f"{url}: no such object; check the URL")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                    "InvalidToken", "ExpiredToken", "Forbidden") or status == 403:
            return AccessError(f"{url}: access denied while {doing} ({code}); check the "
                               "credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID...) and the "
                               "bucket's permissions")
        if code in ("PreconditionFailed", "412") or status == 412:
            return InputError(f"{url}: the object changed while it was being read; run again "
                              "once it is no longer being written")
        if (isinstance(status, int) and status >= 500) or code in _THROTTLED:
            return TransportError(f"{url}: {doing} failed after {ATTEMPTS} tries (the store "
                                  f"answered {code or status}); run again later")
        return InputError(f"{url}: {doing} failed ({code or status})")
    if isinstance(e, bx.BotoCoreError):
        return InputError(f"{url}: {doing} failed ({type(e).__name__})")
    return None


@contextlib.contextmanager
def mapped_errors(mapper: Callable[[Exception, Any, str], CkptError | None], url: Any,
                  doing: str) -> Iterator[None]:
    """Failures inside the block turned by ``mapper`` (a backend's ``error``) into one-line
    errors naming ``url``; what it does not know is raised as it is."""
    try:
        yield
    except CkptError:
        raise
    except Exception as e:
        mapped = mapper(e, url, doing)
        if mapped is None:
            raise
        raise mapped from e


def errors(url: Url | str, doing: str) -> contextlib.AbstractContextManager[None]:
    """Map botocore failures inside the block to one-line errors naming ``url``."""
    return mapped_errors(error, url, doing)


_THROTTLED = ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
              "RequestTimeTooSkewed", "ServiceUnavailable", "InternalError", "503", "500")


def _transient(e: BaseException) -> bool:
    """A failure worth one more try: the connection or the body, not the request."""
    from botocore import exceptions as bx
    from urllib3 import exceptions as ux

    if isinstance(e, bx.ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(e.response.get("Error", {}).get("Code", ""))
        return (isinstance(status, int) and status >= 500) or code in _THROTTLED
    return isinstance(e, bx.ReadTimeoutError | bx.ConnectionClosedError
                      | bx.ResponseStreamingError | bx.IncompleteReadError
                      | bx.EndpointConnectionError | bx.ConnectTimeoutError
                      | ux.ProtocolError | ux.ReadTimeoutError | ux.HTTPError
                      | ConnectionError | TimeoutError | _Stalled)


class _Stalled(Exception):
    """A body slower than :data:`MIN_RATE`, or shorter than its headers said."""


def _read_body(body: Any, size: int) -> bytes:
    """The whole body of a ranged GET of ``size`` bytes, given up (:class:`_Stalled`) when
    it arrives slower than :data:`MIN_RATE` after a request timeout of grace.

    Reads with ``read1`` of the urllib3 response under botocore's ``StreamingBody`` (a
    private attribute, touched here only): ``StreamingBody.read(n)`` waits for all ``n``
    bytes, so a server sending a byte every few seconds would keep it forever, while
    ``read1`` returns whatever came, and the deadline is checked between reads.
    """
    raw = getattr(body, "_raw_stream", None)
    read1 = getattr(raw, "read1", None)
    if read1 is None:  # pragma: no cover - another botocore: one blocking read
        data: bytes = body.read()
        return data
    grace = settings.request_timeout()
    deadline = time.monotonic() + grace + size / MIN_RATE
    parts = []
    got = 0
    while got < size:
        piece = read1(min(size - got, 1 << 20))
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
        if time.monotonic() > deadline:
            raise _Stalled(f"{got} of {size} bytes in {grace + size / MIN_RATE:.0f} s")
    return b"".join(parts)


def get_range(url: Url, offset: int, size: int, etag: str | None = None) -> bytes:
    """``size`` bytes of the object at ``offset`` (exactly; the caller clamps to its size).

    A body that breaks off (a reset connection, a timeout), stalls or arrives shorter than
    its own headers say is fetched again with backoff; a response whose headers say the
    object itself is shorter is an error at once.

    Raises:
        InputError: the object is shorter than asked, changed (``etag``), or unreadable.
        TransportError: the store kept failing (network, 5xx, throttling) after the retries.
    """
    if size <= 0:
        return b""
    c = client(url)
    extra = {"IfMatch": etag} if etag else {}
    failure: BaseException | None = None
    # A store that accepts requests and never answers: given up here, whatever the retries.
    deadline = time.monotonic() + settings.request_deadline() + size / MIN_RATE
    tries = 0
    for attempt in range(RETRIES + 1):
        if attempt:
            if time.monotonic() >= deadline:
                break
            time.sleep(BACKOFF * 2 ** (attempt - 1) * (0.5 + random.random()))
        tries += 1
        try:
            r = c.get_object(Bucket=url.bucket, Key=url.key,
                             Range=f"bytes={offset}-{offset + size - 1}", **extra)
            body = r["Body"]
            try:
                data = _read_body(body, size)
            finally:
                body.close()
            promised = int(r.get("ContentLength", len(data)))
            if promised < size:
                raise InputError(f"{url}: a read of {size} bytes at byte {offset} returned "
                                 f"{promised}; the object is shorter than its checkpoint says")
            if len(data) != size:
                raise _Stalled(f"{len(data)} of {size} bytes, then the body ended")
            return data
        except CkptError:
            raise
        except Exception as e:
            if not _transient(e):
                raise error(e, url, "reading") or e from e
            failure = e
    raise TransportError(
        f"{url}: reading {size:,} bytes at byte {offset:,} failed {tries} times "
        f"({_why(failure)}); the network or the object store is failing (not the "
        "checkpoint), run again later") from failure


def _why(e: BaseException | None) -> str:
    text = str(e).splitlines()[0] if e is not None and str(e) else ""
    name = type(e).__name__ if e is not None else "?"
    return f"{name}: {text[:120]}" if text and not isinstance(e, _Stalled) else \
        (text or name)


def list_objects(url: Url) -> dict[str, tuple[int, str]]:
    """Every object below ``url`` as a directory: relative name -> (size, ETag).

    Raises:
        InputError: the bucket is missing, access is denied.
    """
    c = client(url)
    found: dict[str, tuple[int, str]] = {}
    with errors(url, "listing"):
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=url.bucket,
                                                                 Prefix=url.prefix):
            for o in page.get("Contents", ()):
                rel = o["Key"][len(url.prefix):]
                if rel and not rel.endswith("/"):
                    size = o.get("Size")  # -1: none listed (the mirror refuses it)
                    found[rel] = (size if isinstance(size, int) else -1, str(o.get("ETag", "")))
    return found


def head(url: Url) -> tuple[int, str] | None:
    """(size, ETag) of the object ``url``, None if there is none."""
    c = client(url)
    try:
        r = c.head_object(Bucket=url.bucket, Key=url.key)
    except Exception as e:
        mapped = error(e, url, "reading")
        if isinstance(mapped, InputError) and "no such object" in str(mapped):
            return None
        raise mapped or e from e
    return int(r["ContentLength"]), str(r.get("ETag", ""))


# --------------------------------------------------------------------------------------------
# Reading: the mirror and the store


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

    capabilities: ClassVar[stores.Capabilities] = stores.Capabilities(
        many_ranges=True, local_files=False, listing=True, multipart_writes=True,
        workers=CONCURRENCY)

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
            raise InputError(stores.missing_message(self.path(name), self.metadata_name))
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
            raise stores.truncated(self.path(name), offset + len(data), what)
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

    def read_ranges(self, name: str, ranges: list[tuple[int, int]], *, what: str
                    ) -> list[bytes]:
        self.plan_reads([(name, offset, size) for offset, size in ranges])
        return [self.read_exact(name, offset, size, what=what) for offset, size in ranges]

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

    def list_files(self) -> dict[str, int]:
        return {name: size for name, (size, _) in self.objects.items()}

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
        """One ranged GET, pinned to ``etag``: the store's own (a subclass for another
        store's client; the module's function here, looked up at each call)."""
        return get_range(url, offset, size, etag)

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


# --------------------------------------------------------------------------------------------
# Writing: multipart uploads


@dataclass(frozen=True)
class OutputNames:
    """Which objects of an output matter, told by the caller (storage names no format)."""

    replaces: Callable[[str], bool]  # objects a new output replaces (weights, indexes...)
    last: Callable[[str], bool]  # what makes an output look complete: uploaded after the rest


def existing_weights(url: Url, names: OutputNames) -> list[str]:
    """Objects directly below ``url`` that an output would replace."""
    return sorted(n for n in list_objects(url) if "/" not in n and names.replaces(n))


def check_output(value: str, *, overwrite: bool, names: OutputNames) -> Url:
    """The output URL, checked before any work: the bucket exists and is writable by these
    credentials (as far as a listing tells), and holds no weights unless ``overwrite``.

    Raises:
        InputError: bad credentials, missing bucket. OutputError: weights there already.
    """
    url = parse(value)
    existing = existing_weights(url, names)
    if existing and not overwrite:
        raise OutputError(f"{url}: already holds {', '.join(existing[:3])}"
                          f"{' and more' if len(existing) > 3 else ''}; pass --overwrite to "
                          "replace them or choose an empty prefix")
    return url


LOCK_NAME = ".ckpttool-lock"


class Lock:
    """One writer per output prefix: the object ``PREFIX/.ckpttool-lock``, created with a
    conditional put (``If-None-Match: *``: S3, MinIO and R2 refuse it when it exists) and
    read back (a store that ignored the condition and let another run's put win shows it
    here). Released at the end of the run, whatever the outcome; a killed run leaves it,
    and the next run is refused with the command that removes it.

    Raises (``acquire``):
        OutputError: another run holds the prefix.
    """

    def __init__(self, url: Url) -> None:
        self.out = url
        self.url = url.child(LOCK_NAME)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        self.held = False

    def _refused(self, holder: str) -> OutputError:
        return OutputError(
            f"{self.out}: another ckpttool run is writing this output ({LOCK_NAME} by "
            f"{holder or 'another run'}); "
            "wait for it to finish. If none is running (a killed run left the lock), check "
            f"the output with ckpttool verify, then remove the lock: {self.remove_command()}")

    def remove_command(self) -> str:
        """The store's own command line that removes the lock object."""
        return f"aws s3 rm {self.url}"

    def acquire(self) -> None:
        c = client(self.url)
        body = json.dumps({"run": self.token, "started": time.time()}).encode()
        try:
            c.put_object(Bucket=self.url.bucket, Key=self.url.key, Body=body, IfNoneMatch="*")
        except Exception as e:
            if _status(e) in (409, 412):
                raise self._refused(self._holder()) from e
            raise error(e, self.url, "locking the output") or e from e
        self.held = True
        holder = self._holder()
        if self.token not in holder:
            self.held = False
            raise self._refused(holder)

    def _holder(self) -> str:
        try:
            with errors(self.url, "reading the lock"):
                r = client(self.url).get_object(Bucket=self.url.bucket, Key=self.url.key)
                doc = json.loads(r["Body"].read())
            return str(doc.get("run", ""))
        except (CkptError, ValueError, AttributeError):
            return ""

    def release(self) -> None:
        """Remove the lock if it is still ours (best effort: a failure here is not the run's)."""
        if not self.held:
            return
        self.held = False
        with contextlib.suppress(Exception):
            if self.token in self._holder():
                client(self.url).delete_object(Bucket=self.url.bucket, Key=self.url.key)


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def completing(names: Iterable[str], rule: OutputNames) -> list[str]:
    """The objects of an output that make it read as complete: its index (``rule.last``),
    or, in an output without one, its weight files (``rule.replaces``: a single
    ``model.safetensors``). Top-level names only."""
    top = [n for n in names if "/" not in n]
    found = [n for n in top if rule.last(n)]
    return found or [n for n in top if rule.replaces(n)]


class Upload:
    """Files of a finished local directory uploaded below ``url``, in an order that never
    shows a finished-looking mixed output (the remote counterpart of
    :meth:`~ckpttool.storage.outputs.AtomicOutputs.commit`; S3 has no rename):

    1. with ``overwrite``, the object that completes the previous output is deleted first:
       its index (``names.last``), or the weight file of an output without one: from then
       on nothing there reads as a complete model;
    2. the data files (``names.replaces``) go up (each a multipart upload of parallel parts
       when large; an object replaced by a PUT changes at once, never half), then the rest
       (config, tokenizer...);
    3. previous data files the new output lacks are deleted;
    4. the object that completes the new output goes up last, only after everything else
       completed: its index, or the weight file of an output without one.

    A process killed at any step leaves the previous output, the new one, or no complete
    model: never a complete model beside the other run's side files (a new
    ``model.safetensors`` beside the previous ``config.json``), whichever layout each has.
    On any failure or Ctrl-C every multipart upload in progress is aborted and the objects
    this upload created (that did not exist before) are deleted; objects it replaced keep
    their new content, without the completing object.
    """

    def __init__(self, url: Url, *, overwrite: bool, names: OutputNames) -> None:
        self.url = url
        self.overwrite = overwrite
        self.names = names
        self._uploads: dict[str, str] = {}  # key -> UploadId in progress
        self._created: list[str] = []  # keys this upload completed
        self._lock = threading.Lock()

    def run(self, local: Path) -> list[str]:
        """Upload every file of ``local`` (recursively); returns the names uploaded."""
        names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        rule = self.names
        existing = set(self._list())
        replaced = {n for n in existing if "/" not in n and rule.replaces(n)}
        last = completing(names, rule)
        first = [n for n in names if n not in last]
        # Weights before everything else, then the configs, the completing object last.
        first.sort(key=lambda n: (not rule.replaces(n), n))
        old_last = completing(sorted(replaced), rule)
        pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="ckpttool-put")
        try:
            if self.overwrite:
                for name in old_last:
                    self._delete(name)
            for name in first:
                self._put(pool, local / name, name, name in existing)
            if self.overwrite:
                for name in sorted(replaced - set(names) - set(old_last)):
                    self._delete(name)
            for name in last:
                self._put(pool, local / name, name, name in existing)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            self.abort()
            raise
        pool.shutdown(wait=True)
        return names

    def _list(self) -> dict[str, tuple[int, str]]:
        return list_objects(self.url)

    def _delete(self, name: str) -> None:
        outputs.fault_step()
        url = self.url.child(name)
        with errors(url, "removing an old file"):
            client(url).delete_object(Bucket=url.bucket, Key=url.key)

    def _put(self, pool: ThreadPoolExecutor, path: Path, name: str, existed: bool) -> None:
        outputs.fault_step()
        url = self.url.child(name)
        c = client(url)
        size = path.stat().st_size
        with errors(url, "uploading"):
            if size <= PART:
                c.put_object(Bucket=url.bucket, Key=url.key, Body=path.read_bytes())
            else:
                self._multipart(pool, path, url, size)
        if not existed:
            self._created.append(url.key)

    def _multipart(self, pool: ThreadPoolExecutor, path: Path, url: Url, size: int) -> None:
        c = client(url)
        part = max(PART, -(-size // MAX_PARTS))
        upload_id = c.create_multipart_upload(Bucket=url.bucket, Key=url.key)["UploadId"]
        with self._lock:
            self._uploads[url.key] = upload_id
        fd = os.open(path, os.O_RDONLY)
        try:
            def send(number: int) -> dict[str, Any]:
                offset = (number - 1) * part
                body = os.pread(fd, min(part, size - offset), offset)
                r = c.upload_part(Bucket=url.bucket, Key=url.key, UploadId=upload_id,
                                  PartNumber=number, Body=body)
                return {"PartNumber": number, "ETag": r["ETag"]}

            numbers = range(1, -(-size // part) + 1)
            # At most CONCURRENCY parts in memory: submitted in windows.
            parts = []
            for k in range(0, len(numbers), CONCURRENCY):
                futures = [pool.submit(send, n) for n in numbers[k:k + CONCURRENCY]]
                parts += [f.result() for f in futures]
            c.complete_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id,
                                        MultipartUpload={"Parts": parts})
        finally:
            os.close(fd)
        with self._lock:
            del self._uploads[url.key]

    def abort(self) -> None:
        """Abort every multipart upload in progress and delete what this upload created
        (best effort: the first failure is what the user sees)."""
        c = client(self.url)
        with self._lock:
            uploads, self._uploads = dict(self._uploads), {}
        for key, upload_id in uploads.items():
            with contextlib.suppress(Exception):
                c.abort_multipart_upload(Bucket=self.url.bucket, Key=key, UploadId=upload_id)
        for key in self._created:
            with contextlib.suppress(Exception):
                c.delete_object(Bucket=self.url.bucket, Key=key)


STAGING_PREFIX = "ckpttool-out-"


def staging_dir() -> Path:
    """A private local directory (under TMPDIR) where an output is written before upload;
    those of killed runs are removed first (:func:`ckpttool.storage.outputs.staging_dir`)."""
    return outputs.staging_dir(STAGING_PREFIX)



