"""Google Cloud Storage (``gs://``) and Azure Blob Storage (``az://``, ``abfs[s]://``) through
obstore (the Rust ``object_store`` crate): the client of each cloud configured the cloud's own
way, its errors in the user's terms, ranged GETs pinned to the ETag listed, the remote store,
the output lock and uploads. A :class:`ckpttool.storage.objects.Backend`, as
:mod:`ckpttool.storage.s3` is, so the object tree and the URL wrapper serve every store alike;
the coalescing and read-ahead (:mod:`ckpttool.storage.ranged`, with the one retry loop) and
the upload order (:class:`ckpttool.storage.objects.Upload`) are shared, not copied. Names no
format.

Endpoints and credentials, the way each cloud's own tools take them (none printed, none on
the command line):

* GCS: ``STORAGE_EMULATOR_HOST`` (fake-gcs-server, the gcloud emulators) for an emulator;
  otherwise obstore's sources: ``GOOGLE_APPLICATION_CREDENTIALS`` (a service-account key file),
  ``GOOGLE_SERVICE_ACCOUNT[_KEY]``, gcloud's application-default credentials, the metadata
  server of a GCE/GKE machine.
* Azure: ``AZURE_STORAGE_CONNECTION_STRING`` (``az storage``'s; ``UseDevelopmentStorage=true``
  or an explicit ``BlobEndpoint`` for Azurite), else ``AZURE_STORAGE_ACCOUNT_NAME`` (or the
  account an ``abfss://container@ACCOUNT.dfs.core.windows.net`` URL names) with
  ``AZURE_STORAGE_ACCOUNT_KEY``, a SAS (``AZURE_STORAGE_SAS_KEY``), a service principal
  (``AZURE_STORAGE_CLIENT_ID``/``_SECRET``/``_TENANT_ID``), workload or managed identity.

What each store offers and what is done where it does not (checked against the emulators):

* Reads are pinned to the ETag the listing gave: ``If-Match`` on every ranged GET (Azure and
  Azurite refuse a changed blob with 412), and the ETag of each answer compared here as well,
  because fake-gcs-server ignores ``If-Match``.
* The lock object is created with a create-only put (Azure: ``If-None-Match: *``; GCS:
  ``ifGenerationMatch=0``) and read back, as for S3: fake-gcs-server ignores the condition, and
  the read-back is what refuses a second writer there.
* Uploads: Azure block blobs are sent as blocks and committed by one final request, so an
  upload cut short leaves only uncommitted blocks, which no listing shows and Azure discards
  (after 7 days). A Ctrl-C or failure stops the stream of parts obstore reads
  (:func:`_parts`), and obstore then aborts the multipart upload (checked on S3's: none is
  left in progress). GCS objects are sent by obstore's XML API client; against an
  emulator (``STORAGE_EMULATOR_HOST``), whose XML API has no uploads, each object is one JSON
  API media upload of the file, atomic as well (an object appears only when its upload
  completes).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
from ckpttool.storage import objects, outputs, places, ranged, s3

# The extra each cloud needs (which schemes this module serves: storage/remote.py).
EXTRAS = {"gs": "gcs", "az": "azure"}
_NAMES = {"gs": ("bucket", "Google Cloud Storage"), "az": ("container", "Azure Blob Storage")}

# Shared with S3: the read plan's bounds, the lock's name, an output's names.
CONCURRENCY = s3.CONCURRENCY
LOCK_NAME = s3.LOCK_NAME
OutputNames = s3.OutputNames
staging_dir = s3.staging_dir

# Uploads in blocks of PART bytes, at most CONCURRENCY in flight per object.
PART = 16 << 20
# Timeouts and retries: obstore retries a request that fails before or during its answer
# (connection errors, 5xx, timeouts) ATTEMPTS times with its backoff; a body that breaks off
# or arrives short is fetched again here, RETRIES times. Then: a one-line TransportError
# naming the object, never "corrupt".
CONNECT_TIMEOUT = 10  # s at most
# Any single read from the socket waits at most settings.request_timeout() (30 s by default);
# obstore gives a request up after twice that in retries, and a request with the retries
# made here after settings.request_deadline().
ATTEMPTS = 4
RETRIES = 3
BACKOFF = 0.25  # s, doubled at each retry (with jitter)
# A body slower than this (beyond the deadline) is given up, as in s3.
MIN_RATE = s3.MIN_RATE


def _connect_timeout() -> float:
    return min(CONNECT_TIMEOUT, settings.request_timeout())


# One URL type for every store (storage/places.py).
Url = places.Url


def parse(value: str) -> Url:
    """``gs://bucket/key``, ``az://container/key`` or
    ``abfss://container@account.dfs.core.windows.net/key`` -> :class:`Url`.

    Raises:
        InputError: no bucket (container, account) named.
    """
    return places.parse_url(value)


# --------------------------------------------------------------------------------------------
# The client of each bucket, configured from the cloud's standard places


_stores: dict[tuple[str, str, str], Any] = {}
_stores_lock = threading.Lock()


def _options() -> tuple[Any, Any]:
    timeout = settings.request_timeout()
    client = {"connect_timeout": datetime.timedelta(seconds=_connect_timeout()),
              "read_timeout": datetime.timedelta(seconds=timeout)}
    retry = {"max_retries": ATTEMPTS, "retry_timeout": datetime.timedelta(seconds=2 * timeout),
             "backoff": {"init_backoff": datetime.timedelta(seconds=BACKOFF),
                         "max_backoff": datetime.timedelta(seconds=8), "base": 2.0}}
    return client, retry


def _http(options: Any) -> Any:
    """``options`` that also allow plain HTTP (an emulator on localhost)."""
    return {**options, "allow_http": True}


def emulator() -> str | None:
    """The GCS emulator's base URL (``STORAGE_EMULATOR_HOST``, as Google's own clients take
    it); None for Google Cloud Storage itself."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return None
    return (host if "://" in host else f"http://{host}").rstrip("/")


def connection_string() -> dict[str, str]:
    """``AZURE_STORAGE_CONNECTION_STRING`` as its fields (``{}`` when unset)."""
    text = os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "").strip()
    fields: dict[str, str] = {}
    for part in text.split(";"):
        k, sep, v = part.partition("=")
        if sep:
            fields[k.strip()] = v.strip()
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        # Azurite's development account: documented, public values.
        fields.setdefault("AccountName", "devstoreaccount1")
        fields.setdefault("AccountKey", "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErC"
                                        "z4I6tq/K1SZFPTOtr/KBHBeksoGMGw==")
        fields.setdefault("BlobEndpoint", "http://127.0.0.1:10000/devstoreaccount1")
    return fields


def client(url: Url) -> Any:
    """One obstore store per bucket (container) for the process; thread-safe.

    Raises:
        UnsupportedError: the extra (obstore) is not installed.
        InputError: Azure without an account named anywhere.
    """
    ident = (url.cloud, url.bucket, url.account)
    with _stores_lock:
        found = _stores.get(ident)
        if found is not None:
            return found
        extra = EXTRAS[url.cloud]
        try:
            from obstore import store as obstores
        except ImportError as err:
            raise UnsupportedError(
                f"{url}: {_NAMES[url.cloud][1]} needs the {extra} extra; install it with: "
                f"pip install 'ckpttool[{extra}]'") from err
        options, retry = _options()
        try:
            if url.cloud == "gs":
                base = emulator()
                if base is not None:
                    store = obstores.GCSStore(url.bucket, base_url=base, bearer_token="emulator",
                                              client_options=_http(options),
                                              retry_config=retry)
                else:
                    store = obstores.GCSStore(url.bucket, client_options=options,
                                              retry_config=retry)
            else:
                store = _azure(obstores, url, options, retry)
        except CkptError:
            raise
        except Exception as e:
            key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
            if url.cloud == "gs" and key_file:
                raise InputError(f"{url}: cannot use the credentials in {key_file} "
                                 "(GOOGLE_APPLICATION_CREDENTIALS): not a readable service "
                                 "account key; check the file, or unset the variable to use "
                                 "gcloud's application-default credentials") from e
            raise InputError(f"{url}: cannot configure {_NAMES[url.cloud][1]} "
                             f"({_reason(e)}); check its settings") from e
        _stores[ident] = store
        return store


@dataclass(frozen=True)
class AzureAccount:
    """The Azure storage account a URL is on, as obstore's client and the signed block
    uploads (:mod:`ckpttool.storage.objparts`) both take it: one reading of the settings."""

    name: str  # "" where none is named (obstore may still read AZURE_STORAGE_ACCOUNT_NAME)
    endpoint: str | None  # the blob endpoint, no trailing slash; None: the account's default
    key: str | None  # the account key (Shared Key signing)
    sas: str | None  # a shared access signature

    @property
    def blob_endpoint(self) -> str:
        return self.endpoint or f"https://{self.name}.blob.core.windows.net"


def azure_account(url: Url) -> AzureAccount:
    """``url``'s account: named in the URL (``abfss://C@ACCOUNT...``), else in
    ``AZURE_STORAGE_CONNECTION_STRING``, with that string's endpoint, key or SAS."""
    fields = connection_string()
    name = url.account or fields.get("AccountName", "")
    endpoint = fields.get("BlobEndpoint")
    if not endpoint and name and "EndpointSuffix" in fields:
        protocol = fields.get("DefaultEndpointsProtocol", "https")
        endpoint = f"{protocol}://{name}.blob.{fields['EndpointSuffix']}"
    return AzureAccount(name, endpoint.rstrip("/") if endpoint else None,
                        fields.get("AccountKey") or None,
                        fields.get("SharedAccessSignature") or None)


def _azure(obstores: Any, url: Url, options: dict[str, Any], retry: dict[str, Any]) -> Any:
    account = azure_account(url)
    config: dict[str, Any] = {}
    if account.name:
        config["account_name"] = account.name
    if account.key:
        config["account_key"] = account.key
    if account.sas:
        config["sas_key"] = account.sas
    if account.endpoint:
        config["endpoint"] = account.endpoint
        if account.endpoint.startswith("http://"):
            options = _http(options)
    if not account.name and not os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"):
        raise InputError(f"{url}: no Azure storage account named; set "
                         "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME, or "
                         "use abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX")
    return obstores.AzureStore(url.bucket, client_options=options, retry_config=retry, **config)


# --------------------------------------------------------------------------------------------
# Errors in the user's terms


_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>|\"reason\":\s*\"([A-Za-z ]+)\"")


def _reason(e: BaseException) -> str:
    """A short, secret-free reason: the HTTP status and the store's error code, else the
    exception's kind (obstore's text holds request URLs, which may carry a SAS)."""
    text = str(e)
    status = _STATUS.search(text)
    code = _CODE.search(text)
    parts = [status.group(1)] if status else []
    if code:
        parts.append(code.group(1) or code.group(2))
    if "token request" in text.lower():
        parts.append("token request")
    return " ".join(parts) or type(e).__name__


def _status(e: BaseException) -> int | None:
    m = _STATUS.search(str(e))
    return int(m.group(1)) if m else None


def _credentials_hint(url: Url | str) -> str:
    cloud = url.cloud if isinstance(url, Url) else ("gs" if str(url).startswith("gs") else "az")
    if cloud == "gs":
        return ("check the credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth "
                "application-default login) and the bucket's permissions")
    return ("check the credentials (AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_KEY, "
            "a SAS or a managed identity) and the container's permissions")


def error(e: BaseException, url: Url | str, doing: str) -> CkptError | None:
    """An obstore failure in the user's terms, naming ``url`` (never a credential); None
    for an exception that is not obstore's."""
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover - only called once obstore imported
        return None
    if not isinstance(e, ox.BaseError | FileNotFoundError):
        return None
    text = str(e)
    status = _status(e)
    cloud = url.cloud if isinstance(url, Url) else "gs"
    what = _NAMES[cloud][0]
    bucket = url.bucket if isinstance(url, Url) else str(url)
    if isinstance(e, ox.InvalidPathError):  # a name obstore cannot address: no retry helps
        return _unaddressable(e, url, doing)
    if isinstance(e, ox.PreconditionError) or status == 412:
        return InputError(f"{url}: the object changed while it was being read; run again once "
                          "it is no longer being written")
    if ("ContainerNotFound" in text or "NoSuchBucket" in text
            or "The specified bucket does not exist" in text):
        return InputError(f"{url}: {what} '{bucket}' does not exist; check the URL")
    if isinstance(e, FileNotFoundError | ox.NotFoundError) or status == 404:
        return InputError(f"{url}: no such object; check the URL")
    if "token request" in text.lower():
        return InputError(f"{url}: no {_NAMES[cloud][1]} credentials found while {doing}; "
                          f"{_credentials_hint(url)}")
    if (isinstance(e, ox.PermissionDeniedError | ox.UnauthenticatedError)
            or status in (401, 403)):
        return AccessError(f"{url}: access denied while {doing} ({_reason(e)}); "
                           f"{_credentials_hint(url)}")
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return InputError(f"{url}: {doing} failed ({_reason(e)})")
    return TransportError(f"{url}: {doing} failed after {ATTEMPTS + 1} tries ({_reason(e)}); "
                          "the network or the object store is failing, run again later")


# What obstore says of an object name it cannot address, and why.
_BAD_PATH = re.compile(r'Path "((?:[^"\\]|\\.)*)" (contained [^\n]*)')
_BAD_SEGMENT = re.compile(r'Path "((?:[^"\\]|\\.)*)": (Encountered [^\n]*)')


def _unaddressable(e: BaseException, url: Url | str, doing: str) -> InputError:
    """An object whose name the object_store client refuses (``a//b``, a ``..`` or ``.``
    segment, a control character): obstore's listing stops there, so it cannot be skipped
    as S3's listing lets the object tree skip it. One line naming it (escaped), never a retry."""
    text = str(e)
    m = _BAD_PATH.search(text) or _BAD_SEGMENT.search(text)
    name = f" ({m.group(1)!r}: {m.group(2).strip().rstrip('.')})" if m else ""
    return InputError(f"{url}: holds an object whose name Google Cloud Storage and Azure "
                      f"clients cannot address{name} while {doing}; rename or remove it, or "
                      "name a prefix that does not hold it")


def errors(url: Url | str, doing: str) -> contextlib.AbstractContextManager[None]:
    """Map obstore failures inside the block to one-line errors naming ``url``."""
    return s3.mapped_errors(error, url, doing)


def _transient(e: BaseException) -> bool:
    """A failure worth one more try: obstore gave the request up (connection, body,
    timeout, 5xx), not a refusal."""
    mapped = error(e, "", "reading")
    return isinstance(mapped, TransportError) or isinstance(e, ConnectionError | TimeoutError)


def _bare(etag: str | None) -> str:
    return (etag or "").strip().removeprefix("W/").strip('"')


# --------------------------------------------------------------------------------------------
# Reading


def get_range(url: Url, offset: int, size: int, etag: str | None = None) -> bytes:
    """``size`` bytes of the object at ``offset`` (exactly; the caller clamps to its size),
    pinned to ``etag``; a body that breaks off or arrives short is fetched again.

    Raises:
        InputError: shorter than asked, changed (``etag``), missing, access denied.
        TransportError: the store kept failing after the retries.
    """
    if size <= 0:
        return b""
    store = client(url)
    import obstore

    options: Any = {"range": (offset, offset + size)}
    if etag:
        options["if_match"] = f'"{_bare(etag)}"'

    def fetch() -> bytes:
        result = obstore.get(store, url.key, options=options)
        got = _bare(result.meta.get("e_tag"))
        if etag and got and got != _bare(etag):
            raise InputError(f"{url}: the object changed while it was being read; run "
                             "again once it is no longer being written")
        data = bytes(result.bytes())
        if len(data) != size:
            start, end = result.range
            if end - start < size:
                raise InputError(f"{url}: a read of {size} bytes at byte {offset} returned "
                                 f"{end - start}; the object is shorter than its "
                                 "checkpoint says")
            raise ConnectionError(f"{len(data)} of {size} bytes, then the body ended")
        return data

    return ranged.retried(url, offset, size, fetch, ranged.Retry(
        RETRIES, BACKOFF, MIN_RATE, _transient, lambda e: error(e, url, "reading"),
        lambda e: _reason(e) if e is not None else "?"))


def list_objects(url: Url) -> dict[str, tuple[int, str]]:
    """Every object below ``url`` as a directory: relative name -> (size, ETag).

    Raises:
        InputError: the bucket is missing, access is denied.
    """
    store = client(url)
    import obstore

    found: dict[str, tuple[int, str]] = {}
    try:
        for page in obstore.list(store, url.prefix or None, chunk_size=1000):
            for o in page:
                rel = str(o["path"])[len(url.prefix):]
                if rel and not rel.endswith("/"):
                    size = o.get("size")
                    found[rel] = (size if isinstance(size, int) else -1, _bare(o.get("e_tag")))
    except CkptError:
        raise
    except Exception as e:
        if url.cloud == "gs" and emulator() is not None and _no_emulated_bucket(url):
            # fake-gcs-server answers 500 (not 404) to a listing of a missing bucket.
            raise InputError(f"{url}: bucket '{url.bucket}' does not exist; check the URL "
                             "(and STORAGE_EMULATOR_HOST)") from e
        raise error(e, url, "listing") or e from e
    return found


def _no_emulated_bucket(url: Url) -> bool:
    base = emulator()
    quoted = urllib.parse.quote(url.bucket, safe="")
    try:
        with urllib.request.urlopen(f"{base}/storage/v1/b/{quoted}", timeout=_connect_timeout()):
            return False
    except urllib.error.HTTPError as e:
        return e.code == 404
    except OSError:
        return False


def head(url: Url) -> tuple[int, str] | None:
    """(size, ETag) of the object ``url``, None if there is none."""
    store = client(url)
    import obstore

    try:
        meta = obstore.head(store, url.key)
    except Exception as e:
        mapped = error(e, url, "reading")
        if isinstance(mapped, InputError) and "no such object" in str(mapped):
            return None
        raise mapped or e from e
    return int(meta["size"]), _bare(meta.get("e_tag"))


class RemoteStore(s3.RemoteStore):
    """The data files of a remote checkpoint (GCS, Azure), read as
    :class:`ckpttool.storage.s3.RemoteStore` reads S3's: planned ranges coalesced and fetched
    ahead, by this module's ranged GETs."""

    def _get_range(self, url: Any, offset: int, size: int, etag: str | None) -> bytes:
        return get_range(url, offset, size, etag)


# --------------------------------------------------------------------------------------------
# Writing


def check_output(value: str, *, overwrite: bool, names: OutputNames) -> Url:
    """The output URL, checked before any work: the bucket exists and is listed with these
    credentials, and holds no weights unless ``overwrite``
    (:func:`ckpttool.storage.objects.check_output`).

    Raises:
        InputError: bad credentials, missing bucket. OutputError: weights there already.
    """
    url = parse(value)
    return objects.check_output(url, list_objects(url), overwrite=overwrite, names=names)


def _put(url: Url, data: bytes | Path, *, create: bool = False) -> None:
    """Put one object: ``data`` (bytes, or a local file sent in parts), ``create``: only if
    there is none (refused with obstore's AlreadyExistsError)."""
    base = emulator() if url.cloud == "gs" else None
    if base is not None:
        _emulated_put(base, url, data, create=create)
        return
    store = client(url)
    import obstore

    if create:
        body = data.read_bytes() if isinstance(data, Path) else data
        obstore.put(store, url.key, body, mode="create")
    elif isinstance(data, Path) and data.stat().st_size > PART:
        obstore.put(store, url.key, _parts(data), chunk_size=PART, max_concurrency=CONCURRENCY)
    else:
        obstore.put(store, url.key, data.read_bytes() if isinstance(data, Path) else data,
                    use_multipart=False)


def _parts(path: Path) -> Iterator[bytes]:
    """The file's bytes in :data:`PART`-sized pieces, each a step of the upload (a test's
    fault hook, and where a Ctrl-C stops the stream: obstore then sends no commit)."""
    with open(path, "rb") as f:
        while piece := f.read(PART):
            outputs.fault_step()
            yield piece


def http(url: Url, request: urllib.request.Request, doing: str, *, size: int = 0,
         statuses: Mapping[int, BaseException | None] | None = None) -> bytes:
    """The body of one request that obstore does not make (GCS's compose and the emulator's
    uploads, Azure's block uploads), its failures in the user's terms: ``statuses`` says
    what a status code means here (None: nothing, an empty body), 401/403 are refused
    credentials, any other a one-line error; no answer is the network's. ``size``: the bytes
    sent, which lengthen the timeout.

    Raises:
        AccessError, InputError, TransportError: as said; or what ``statuses`` names.
    """
    try:
        with urllib.request.urlopen(request, timeout=settings.request_timeout()
                                    + size / (1 << 20)) as r:
            body: bytes = r.read()
            return body
    except urllib.error.HTTPError as e:
        if statuses is not None and e.code in statuses:
            meant = statuses[e.code]
            if meant is None:
                return b""
            raise meant from e
        if e.code in (401, 403):
            raise AccessError(f"{url}: access denied while {doing} (status code: {e.code}); "
                              "check the credentials and permissions") from e
        raise InputError(f"{url}: {doing} failed (status code: {e.code})") from e
    except OSError as e:
        raise TransportError(f"{url}: {doing} failed ({type(e).__name__}); the network or the "
                             "object store is failing, run again later") from e


def gcs_object(base: str, bucket: str, name: str) -> str:
    """The JSON API's address of object ``name`` of ``bucket`` (at the emulator, or Google's
    ``base``)."""
    return (f"{base}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/"
            f"{urllib.parse.quote(name, safe='')}")


def _emulated_put(base: str, url: Url, data: bytes | Path, *, create: bool) -> None:
    """One JSON API media upload (fake-gcs-server has no XML API uploads)."""
    query = {"uploadType": "media", "name": url.key}
    if create:
        query["ifGenerationMatch"] = "0"
    target = (f"{base}/upload/storage/v1/b/{urllib.parse.quote(url.bucket, safe='')}/o?"
              + urllib.parse.urlencode(query))
    size = data.stat().st_size if isinstance(data, Path) else len(data)
    from obstore.exceptions import AlreadyExistsError

    with contextlib.ExitStack() as stack:
        body: Any = stack.enter_context(open(data, "rb")) if isinstance(data, Path) else data
        request = urllib.request.Request(target, data=body, method="POST", headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(size)})
        http(url, request, "uploading", size=size, statuses={
            412: AlreadyExistsError(f"{url} exists"),
            404: InputError(f"{url}: bucket '{url.bucket}' does not exist; check the URL "
                            "(and STORAGE_EMULATOR_HOST)")})


def _delete(url: Url) -> None:
    base = emulator() if url.cloud == "gs" else None
    if base is not None:
        http(url, urllib.request.Request(gcs_object(base, url.bucket, url.key),
                                         method="DELETE"), "removing", statuses={404: None})
        return
    import obstore

    with contextlib.suppress(FileNotFoundError):
        obstore.delete(client(url), url.key)


def _get_all(url: Url) -> bytes:
    import obstore

    return bytes(obstore.get(client(url), url.key).bytes())


class Lock(s3.Lock):
    """One writer per output prefix (:class:`~ckpttool.storage.locks.ObjectLock`): a
    create-only put of ``PREFIX/.ckpttool-lock``, read back (the read-back is what refuses a
    second writer on a store that ignores the condition: fake-gcs-server)."""

    def remove_command(self) -> str:
        if self.url.cloud == "gs":
            return f"gcloud storage rm {self.url}"
        return (f"az storage blob delete --container-name {self.url.bucket} "
                f"--name {self.url.key}")

    def _create(self, body: bytes) -> bool:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        # A lock already there is refused before the put: fake-gcs-server ignores the
        # create-only condition (the read-back catches a put that raced this check).
        if head(self.url) is not None:
            return False
        try:
            _put(self.url, body, create=True)
        except (AlreadyExistsError, PreconditionError):
            return False
        except CkptError:
            raise
        except Exception as e:
            raise error(e, self.url, "locking the output") or e from e
        return True

    def _put(self, body: bytes) -> None:
        with errors(self.url, "renewing the lock"):
            _put(self.url, body)

    def _get(self) -> bytes | None:
        if head(self.url) is None:
            return None
        with errors(self.url, "reading the lock"):
            return _get_all(self.url)

    def _remove(self) -> None:
        with errors(self.url, "removing the lock"):
            _delete(self.url)


class Upload(s3.Upload):
    """A finished local directory uploaded below ``url``, in the order (and with the
    clean-up on failure) of :class:`ckpttool.storage.s3.Upload`. Nothing of an object is
    visible before its upload completes (see the module's notes), so there is nothing to
    abort but the objects this upload created."""

    def _list(self) -> dict[str, tuple[int, str]]:
        return list_objects(self.url)

    def _delete(self, name: str) -> None:
        outputs.fault_step()
        url = self.url.child(name)
        with errors(url, "removing an old file"):
            _delete(url)

    def _put(self, pool: ThreadPoolExecutor, path: Path, name: str, existed: bool) -> None:
        outputs.fault_step()
        url = self.url.child(name)
        with errors(url, "uploading"):
            _put(url, path)
        if not existed:
            self._created.append(url.key)

    def abort(self) -> None:
        for key in self._created:
            with contextlib.suppress(Exception):
                _delete(self.url.with_key(key))
