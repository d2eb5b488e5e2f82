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
* Throughput and the decision (issue 37, ``benchmarks/s3_clients.py``, figures in
  docs/design.md "Object stores"): on moto, obstore reads 16 MB ranges in a quarter less time
  with the same client CPU, and spends a third of boto3's CPU per small GET; uploads are
  even. ckpttool's reads are coalesced 16 MB GETs, and obstore reaches profiles and SSO only
  through boto3 itself (``Boto3CredentialProvider``) and ignores a profile's
  ``endpoint_url`` (MinIO, R2): so S3 keeps boto3, one :class:`~ckpttool.storage.objects.Backend`
  as :mod:`ckpttool.storage.objstore` is for GCS and Azure.

How a remote checkpoint is read: see :mod:`ckpttool.storage.objtree`.

Nothing here prints or stores credentials; they never appear on the command line.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpttool import settings
from ckpttool.errors import (
    AccessError,
    CkptError,
    InputError,
    TransportError,
    UnsupportedError,
)
from ckpttool.storage import locks, objects, outputs, places, ranged

EXTRA = "pip install 'ckpttool[s3]'"

# Requests in flight (ranged GETs: storage/ranged.py; parts of an upload).
CONCURRENCY = ranged.CONCURRENCY
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

    def fetch() -> bytes:
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

    return ranged.retried(url, offset, size, fetch, ranged.Retry(
        RETRIES, BACKOFF, MIN_RATE, _transient, lambda e: error(e, url, "reading"), _why))


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
                    size = o.get("Size")  # -1: none listed (the object tree refuses it)
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
# Reading: the store (ranged.RemoteStore plans, coalesces and fetches ahead)


class RemoteStore(ranged.RemoteStore):
    """The data files of a remote S3 checkpoint (:class:`ckpttool.storage.ranged.RemoteStore`),
    read by this module's ranged GETs."""

    def _get_range(self, url: Any, offset: int, size: int, etag: str | None) -> bytes:
        return get_range(url, offset, size, etag)


# --------------------------------------------------------------------------------------------
# Writing: multipart uploads


OutputNames = objects.OutputNames
completing = objects.completing


def check_output(value: str, *, overwrite: bool, names: OutputNames) -> Url:
    """The output URL, checked before any work: the bucket exists and is listed with these
    credentials, and holds no weights unless ``overwrite``
    (:func:`ckpttool.storage.objects.check_output`).

    Raises:
        InputError: bad credentials, missing bucket. OutputError: weights there already.
    """
    url = parse(value)
    return objects.check_output(url, list_objects(url), overwrite=overwrite, names=names)


LOCK_NAME = locks.LOCK_NAME


class Lock(locks.ObjectLock):
    """One writer per output prefix (:class:`~ckpttool.storage.locks.ObjectLock`), created
    with a conditional put (``If-None-Match: *``: S3, MinIO and R2 refuse it when it
    exists)."""

    def remove_command(self) -> str:
        return f"aws s3 rm {self.url}"

    def _create(self, body: bytes) -> bool:
        try:
            client(self.url).put_object(Bucket=self.url.bucket, Key=self.url.key, Body=body,
                                        IfNoneMatch="*")
        except Exception as e:
            if _status(e) in (409, 412):
                return False
            raise error(e, self.url, "locking the output") or e from e
        return True

    def _put(self, body: bytes) -> None:
        with errors(self.url, "renewing the lock"):
            client(self.url).put_object(Bucket=self.url.bucket, Key=self.url.key, Body=body)

    def _get(self) -> bytes | None:
        try:
            r = client(self.url).get_object(Bucket=self.url.bucket, Key=self.url.key)
        except Exception as e:
            if _status(e) == 404:
                return None
            raise error(e, self.url, "reading the lock") or e from e
        return bytes(r["Body"].read())

    def _remove(self) -> None:
        with errors(self.url, "removing the lock"):
            client(self.url).delete_object(Bucket=self.url.bucket, Key=self.url.key)


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


class Upload(objects.Upload):
    """A finished output published below ``url`` in :class:`~ckpttool.storage.objects.Upload`'s
    order; each large file a multipart upload of parallel parts (an object replaced by a PUT
    or a completed upload changes at once, never half). On any failure or Ctrl-C every
    multipart upload in progress is aborted and the objects this upload created (that did not
    exist before) are deleted; objects it replaced keep their new content, without the
    completing object."""

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





class Parts:
    """Shared uploads on S3 (:class:`ckpttool.storage.objects.Parts`): one multipart upload
    per object, its parts sent by any process, joined by the one that completes it."""

    limits = objects.Limits("S3", max_parts=MAX_PARTS, min_part=5 << 20, max_part=5 << 30)

    def get(self, url: Url) -> bytes | None:
        try:
            r = client(url).get_object(Bucket=url.bucket, Key=url.key)
            data: bytes = r["Body"].read()
            return data
        except Exception as e:
            mapped = error(e, url, "reading")
            if isinstance(mapped, InputError) and "no such object" in str(mapped):
                return None
            raise mapped or e from e

    def put(self, url: Url, data: bytes, *, create: bool = False) -> bool:
        extra = {"IfNoneMatch": "*"} if create else {}
        try:
            client(url).put_object(Bucket=url.bucket, Key=url.key, Body=data, **extra)
        except Exception as e:
            if create and _status(e) in (409, 412):
                return False
            raise error(e, url, "writing") or e from e
        return True

    def delete(self, url: Url) -> None:
        with errors(url, "removing"):
            client(url).delete_object(Bucket=url.bucket, Key=url.key)

    def listing(self, url: Url) -> dict[str, tuple[int, str]]:
        return list_objects(url)

    def start(self, url: Url, staging: Url) -> str:
        with errors(url, "starting an upload"):
            upload: str = client(url).create_multipart_upload(
                Bucket=url.bucket, Key=url.key)["UploadId"]
            return upload

    def abort(self, url: Url, upload: str) -> None:
        _abort(url, upload)

    def put_part(self, url: Url, upload: str, number: int, data: bytes) -> str:
        with errors(url, f"uploading part {number}"):
            r = client(url).upload_part(Bucket=url.bucket, Key=url.key, UploadId=upload,
                                        PartNumber=number, Body=data)
            return str(r["ETag"])

    def complete(self, url: Url, upload: str, parts: list[tuple[int, str]]) -> None:
        """Join the parts; done already (a retry after a timeout, a finish run again after
        it was killed there) when the object is the one these parts make."""
        try:
            with errors(url, "completing an upload"):
                client(url).complete_multipart_upload(
                    Bucket=url.bucket, Key=url.key, UploadId=upload,
                    MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in parts]})
        except CkptError:
            found = head(url)
            if found is None or found[1].strip('"') != _multipart_etag(parts):
                raise


def _multipart_etag(parts: list[tuple[int, str]]) -> str:
    """The ETag S3 gives the object these parts make: the MD5 of their MD5s, a dash, their
    count."""
    joined = b"".join(bytes.fromhex(e.strip('"')) for _, e in parts)
    return f"{hashlib.md5(joined, usedforsecurity=False).hexdigest()}-{len(parts)}"


def _abort(url: Url, upload: str) -> None:
    objects.quietly(lambda: client(url).abort_multipart_upload(
        Bucket=url.bucket, Key=url.key, UploadId=upload))
