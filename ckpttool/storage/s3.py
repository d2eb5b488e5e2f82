"""Object storage (S3 and S3-compatible stores: MinIO, Ceph, R2) as a checkpoint's store.

Why boto3/botocore, not obstore or s3fs (compared for this module):

* Credentials and endpoint. botocore's chain is the AWS CLI's own: AWS_PROFILE, AWS_ACCESS_KEY_ID
  and friends, ``~/.aws/config`` and ``credentials`` (profiles, SSO, ``credential_process``,
  assumed roles), container and instance roles, and AWS_ENDPOINT_URL (or a profile's
  ``endpoint_url``) for MinIO, Ceph and R2. obstore (Rust ``object_store``) reads the
  environment variables but not profiles or config files unless boto3 is installed as its
  credential provider anyway; s3fs is aiobotocore, the same chain with an async layer on top.
* Throughput. A ranged GET moves the same bytes with any client: the cost that matters is
  how many requests there are and how many are in flight, which this module decides itself
  (coalesced 8-16 MB GETs over a bounded pool). Against moto on localhost, a plain parallel
  download with boto3 and this store's merge run side by side (``benchmarks/remote.py``).
* Writes. The multipart calls (create, upload_part, complete, abort) are explicit, so every
  upload that has not completed can be aborted on a failure or Ctrl-C, and nothing that looks
  finished is left behind; s3fs and obstore hide them behind writers that finish on close.

How a remote checkpoint is read: :class:`Mirror` lists the prefix once, downloads the small
files (``.metadata``, JSON, tokenizer files, small ``torch.save`` side files) into a private
temporary directory and creates each large data file there (``.distcp``, ``.safetensors``) as
a sparse placeholder of its listed size, so that every format's detection and listing works
unchanged. A safetensors placeholder holds its real header bytes (fetched here), the only
bytes of a data file a format reads while describing it. The mirror's directory is registered
in :mod:`ckpttool.storage.store`, so readers opened on it get a :class:`RemoteStore`, which
serves every data byte by ranged GETs; a format never reads a placeholder's zeros.

Nothing here prints or stores credentials; they never appear on the command line.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, InputError, OutputError, UnsupportedError
from ckpttool.storage import store as stores

SCHEME = "s3://"
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
# Files other than .distcp/.safetensors data files are downloaded whole into the mirror up to
# this size (configs, tokenizers, .metadata, small torch.save side files); a larger one would
# be a data file that only a local read can describe.
DOWNLOAD_LIMIT = 64 << 20
# Data files read in place by ranged GETs; their formats read headers through the store.
RANGED_SUFFIXES = (".distcp", ".safetensors")
# Transient failures of a response body (botocore retries the requests themselves).
RETRIES = 4


def is_url(value: object) -> bool:
    """Whether ``value`` (a str or path) names object storage (``s3://bucket/key``)."""
    return isinstance(value, str) and value.startswith(SCHEME)


@dataclass(frozen=True)
class Url:
    bucket: str
    key: str  # no leading or trailing slash; "" for the bucket itself

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    @property
    def prefix(self) -> str:
        """The key prefix of the objects "in" this URL as a directory."""
        return f"{self.key}/" if self.key else ""

    def child(self, name: str) -> Url:
        return Url(self.bucket, f"{self.prefix}{name}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1] if self.key else self.bucket


def parse(value: str) -> Url:
    """``s3://bucket/some/key`` -> :class:`Url`.

    Raises:
        InputError: no bucket named.
    """
    rest = value[len(SCHEME):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise InputError(f"{value}: names no bucket; use s3://BUCKET/PREFIX")
    return Url(bucket, key.strip("/"))


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
            config = Config(retries={"max_attempts": 6, "mode": "standard"},
                            max_pool_connections=2 * CONCURRENCY, connect_timeout=20,
                            read_timeout=120)
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
        return InputError(f"{url}: cannot reach the object store ({where}); check "
                          "AWS_ENDPOINT_URL and the network")
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
            return InputError(f"{url}: access denied while {doing} ({code}); check the "
                              "credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID...) and the "
                              "bucket's permissions")
        if code in ("PreconditionFailed", "412") or status == 412:
            return InputError(f"{url}: the object changed while it was being read; run again "
                              "once it is no longer being written")
        return InputError(f"{url}: {doing} failed ({code or status})")
    if isinstance(e, bx.BotoCoreError):
        return InputError(f"{url}: {doing} failed ({type(e).__name__})")
    return None


@contextlib.contextmanager
def errors(url: Url | str, doing: str) -> Iterator[None]:
    """Map botocore failures inside the block to one-line errors naming ``url``."""
    try:
        yield
    except CkptError:
        raise
    except Exception as e:
        mapped = error(e, url, doing)
        if mapped is None:
            raise
        raise mapped from e


def _transient(e: BaseException) -> bool:
    from botocore import exceptions as bx
    from urllib3 import exceptions as ux

    return isinstance(e, bx.ReadTimeoutError | bx.ConnectionClosedError
                      | bx.ResponseStreamingError | bx.IncompleteReadError
                      | ux.ProtocolError | ux.ReadTimeoutError | ConnectionError)


def get_range(url: Url, offset: int, size: int, etag: str | None = None) -> bytes:
    """``size`` bytes of the object at ``offset`` (exactly; the caller clamps to its size).

    A body that breaks off (a reset connection, a timeout) is fetched again with backoff;
    a complete response of the wrong length is an error, never retried.

    Raises:
        InputError: the object is shorter than asked, changed (``etag``), or unreadable.
    """
    if size <= 0:
        return b""
    c = client(url)
    extra = {"IfMatch": etag} if etag else {}
    for attempt in range(RETRIES + 1):
        try:
            with errors(url, "reading"):
                r = c.get_object(Bucket=url.bucket, Key=url.key,
                                 Range=f"bytes={offset}-{offset + size - 1}", **extra)
                body = r["Body"]
                try:
                    data: bytes = body.read()
                finally:
                    body.close()
        except Exception as e:
            if attempt < RETRIES and _transient(e):
                time.sleep(0.2 * 2 ** attempt)
                continue
            raise
        if len(data) != size:
            raise InputError(f"{url}: a read of {size} bytes at byte {offset} returned "
                             f"{len(data)}; the object is shorter than its checkpoint says")
        return data
    raise AssertionError("unreachable")


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
                    found[rel] = (int(o["Size"]), str(o.get("ETag", "")))
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


class Mirror:
    """A remote checkpoint (a prefix, or one object) described by a local temporary
    directory, whose data files a :class:`RemoteStore` serves. A context manager: the
    directory is removed on exit.

    Raises (on construction):
        InputError: nothing at the URL, the bucket is missing, access is denied.
        UnsupportedError: a large data file of a format that is only read locally.
    """

    def __init__(self, value: str) -> None:
        self.url = parse(value)
        objects = list_objects(self.url)
        self.tmp = Path(tempfile.mkdtemp(prefix="ckpttool-s3-"))
        try:
            if objects:  # a prefix: the directory it stands for
                self.base_url = self.url
                self.dir = self.root = self.tmp / self.url.name
            else:  # one object, in the directory of its parent prefix
                single = head(self.url) if self.url.key else None
                if single is None:
                    raise InputError(f"{self.url}: no such object or prefix; check the URL")
                self.base_url = Url(self.url.bucket, self.url.key.rpartition("/")[0])
                objects = {self.url.name: single}
                self.dir = self.tmp / self.base_url.name
                self.root = self.dir / self.url.name
            # ``self.dir`` stands for ``base_url``; every file lies below it.
            self.objects = objects
            self._build()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        stores.register_mirror(self.dir, self._store)

    def _build(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        downloads: list[tuple[str, int, str]] = []
        heads: list[tuple[str, int, str]] = []
        for rel, (size, etag) in sorted(self.objects.items()):
            target = self.dir / rel
            if not _inside(self.dir, target):
                continue  # a key with ".." segments: not part of any checkpoint we read
            target.parent.mkdir(parents=True, exist_ok=True)
            if rel.endswith(RANGED_SUFFIXES):
                with open(target, "wb") as f:
                    f.truncate(size)  # sparse: no bytes stored, the size listed
                if rel.endswith(".safetensors"):
                    heads.append((rel, size, etag))
            elif size <= DOWNLOAD_LIMIT:
                downloads.append((rel, size, etag))
            else:
                raise UnsupportedError(
                    f"{self.base_url.child(rel)}: a {size:,}-byte file that ckpttool reads "
                    "only from a local disk (it reads .distcp and .safetensors data files "
                    "from object storage); download the checkpoint first (aws s3 cp "
                    f"--recursive {self.url} DIR) and pass DIR")
        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            jobs = [pool.submit(self._download, *d) for d in downloads]
            jobs += [pool.submit(self._fill_header, *h) for h in heads]
            for j in jobs:
                j.result()

    def _download(self, rel: str, size: int, etag: str) -> None:
        data = get_range(self.base_url.child(rel), 0, size, etag)
        (self.dir / rel).write_bytes(data)

    def _fill_header(self, rel: str, size: int, etag: str) -> None:
        """The real bytes of a safetensors file's header in its placeholder: what describing
        it reads (the length, then the JSON), and nothing else."""
        url = self.base_url.child(rel)
        first = get_range(url, 0, min(size, 64 << 10), etag)
        if len(first) >= 8:
            n = int.from_bytes(first[:8], "little")
            end = min(size, 8 + n)
            if n <= 100 << 20 and end > len(first):
                first += get_range(url, len(first), end - len(first), etag)
            first = first[:max(8, end)] if n <= 100 << 20 else first[:8]
        with open(self.dir / rel, "r+b") as f:
            f.write(first)

    def _store(self, base: Path, metadata_name: str) -> RemoteStore:
        rel = base.relative_to(self.dir).as_posix()
        url = self.base_url if rel == "." else self.base_url.child(rel)
        prefix = "" if rel == "." else rel + "/"
        objects = {k[len(prefix):]: v for k, v in self.objects.items() if k.startswith(prefix)}
        return RemoteStore(base, url, objects, metadata_name)

    def to_url(self, text: str) -> str:
        """``text`` with the mirror's paths written as the URLs they stand for."""
        return text.replace(str(self.dir), str(self.base_url))

    def close(self) -> None:
        stores.unregister_mirror(self.dir)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def local(self) -> Path:
        """The local path that stands for the URL given."""
        return self.root


def _inside(base: Path, target: Path) -> bool:
    real, inside = os.path.normpath(target), os.path.normpath(base)
    return os.path.commonpath([real, inside]) == inside


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

    # Threads that keep the pool busy: the copy workers of a remote merge (core/merge.py).
    workers = CONCURRENCY

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
            piece = self._piece(name, offset + done, size - done)
            stores.pwrite_all(dst_fd, piece, dst_offset + done)
            done += len(piece)

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
            return get_range(self.url.child(name), offset, n, self.objects[name][1])
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

    def _fetch(self, g: _Group) -> bytes:
        data = get_range(self.url.child(g.file), g.start, g.end - g.start,
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


def _is_weight(name: str) -> bool:
    """Objects an output of ckpttool replaces: weights, their indexes and DCP files."""
    return name.endswith((".safetensors", ".safetensors.index.json", ".distcp")) or \
        name == ".metadata"


def is_last(name: str) -> bool:
    """What makes an output look complete: written after everything else."""
    return name.endswith(".index.json") or name == ".metadata"


def existing_weights(url: Url) -> list[str]:
    """Weight objects directly below ``url`` (what an output would replace)."""
    return sorted(n for n in list_objects(url) if "/" not in n and _is_weight(n))


def check_output(value: str, *, overwrite: bool) -> Url:
    """The output URL, checked before any work: the bucket exists and is writable by these
    credentials (as far as a listing tells), and holds no weights unless ``overwrite``.

    Raises:
        InputError: bad credentials, missing bucket. OutputError: weights there already.
    """
    url = parse(value)
    existing = existing_weights(url)
    if existing and not overwrite:
        raise OutputError(f"{url}: already holds {', '.join(existing[:3])}"
                          f"{' and more' if len(existing) > 3 else ''}; pass --overwrite to "
                          "replace them or choose an empty prefix")
    return url


class Upload:
    """Files of a finished local directory uploaded below ``url``: data files first (each
    a multipart upload of parallel parts when large), stale weights removed (``overwrite``),
    then the index or ``.metadata`` last, only after everything else completed. On any failure
    or Ctrl-C every multipart upload in progress is aborted and the objects this upload
    created are deleted, so nothing that looks finished is left.
    """

    def __init__(self, url: Url, *, overwrite: bool) -> None:
        self.url = url
        self.overwrite = overwrite
        self._uploads: dict[str, str] = {}  # key -> UploadId in progress
        self._created: list[str] = []  # keys this upload completed
        self._lock = threading.Lock()

    def run(self, local: Path) -> list[str]:
        """Upload every file of ``local`` (recursively); returns the names uploaded."""
        names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        before = set(existing_weights(self.url))
        first = [n for n in names if not is_last(n)]
        # Weights before everything else, then the configs, the index last.
        first.sort(key=lambda n: (not _is_weight(n), n))
        last = [n for n in names if is_last(n)]
        pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="ckpttool-put")
        try:
            for name in first:
                self._put(pool, local / name, name, name in before)
            if self.overwrite:
                stale = sorted(before - set(names))
                for name in stale:
                    with errors(self.url.child(name), "removing an old file"):
                        client(self.url).delete_object(Bucket=self.url.bucket,
                                                       Key=self.url.child(name).key)
            for name in last:
                self._put(pool, local / name, name, name in before)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            self.abort()
            raise
        pool.shutdown(wait=True)
        return names

    def _put(self, pool: ThreadPoolExecutor, path: Path, name: str, existed: bool) -> None:
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


def staging_dir() -> Path:
    """A private local directory (under TMPDIR) where an output is written before upload."""
    return Path(tempfile.mkdtemp(prefix="ckpttool-out-"))



