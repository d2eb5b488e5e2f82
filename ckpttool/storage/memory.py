"""An object store held in this process's memory, behind the same backend protocol as S3,
GCS and Azure (:class:`ckpttool.storage.objects.Backend`, with
:class:`~ckpttool.storage.objects.Parts`): buckets of objects, each with an ETag, ranged
reads pinned to it, create-only puts, multipart uploads. What the store contract suite
(``tests/storage/contract.py``) and the object-store contract (``tests/storage/objects.py``)
run on without a server, in milliseconds on any machine.

It serves no URL scheme of its own: a caller hands it over explicitly
(``ObjectTree(..., backend=memory)``), and the URLs it takes are the other stores' (``s3://``,
``gs://``...), so that every message reads as the real store's would. What it keeps is this
process's: forked processes and torchrun ranks do not share it. Names no format.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError
from ckpttool.storage import locks, objects, outputs, places, ranged, s3

Url = places.Url

CONCURRENCY = ranged.CONCURRENCY
LOCK_NAME = locks.LOCK_NAME
OutputNames = objects.OutputNames
staging_dir = s3.staging_dir


@dataclass
class _Bucket:
    objects: dict[str, tuple[bytes, str]] = field(default_factory=dict)  # key -> (data, ETag)
    uploads: dict[str, dict[int, bytes]] = field(default_factory=dict)  # id -> parts
    completed: dict[str, str] = field(default_factory=dict)  # id -> the ETag it made


_buckets: dict[str, _Bucket] = {}
_lock = threading.Lock()
_versions = itertools.count(1)


def create_bucket(name: str) -> None:
    """An empty bucket ``name`` (kept if there is one)."""
    with _lock:
        _buckets.setdefault(name, _Bucket())


def _bucket(url: Url) -> _Bucket:
    found = _buckets.get(url.bucket)
    if found is None:
        raise InputError(f"{url}: bucket '{url.bucket}' does not exist; check the URL")
    return found


def _etag(data: bytes) -> str:
    # A new ETag for every put, even of the same bytes (as a store's generation).
    return f"{hashlib.md5(data, usedforsecurity=False).hexdigest()}-{next(_versions)}"


def put(url: Url, data: bytes, *, create: bool = False) -> bool:
    """Put the object ``url``; ``create``: only where there is none (False: refused)."""
    with _lock:
        bucket = _bucket(url)
        if create and url.key in bucket.objects:
            return False
        bucket.objects[url.key] = (bytes(data), _etag(data))
    return True


def delete(url: Url) -> None:
    """Remove the object ``url`` (none there: nothing to do)."""
    with _lock:
        _bucket(url).objects.pop(url.key, None)


def get(url: Url) -> bytes | None:
    """The object's bytes; None where there is none."""
    with _lock:
        found = _bucket(url).objects.get(url.key)
    return None if found is None else found[0]


# --------------------------------------------------------------------------------------------
# The backend protocol (objects.Backend)


def parse(value: str) -> Url:
    """``s3://bucket/key`` (any scheme :mod:`ckpttool.storage.places` serves) -> :class:`Url`."""
    return places.parse_url(value)


def list_objects(url: Url) -> dict[str, tuple[int, str]]:
    """Every object below ``url`` as a directory: relative name -> (size, ETag)."""
    with _lock:
        items = list(_bucket(url).objects.items())
    prefix = url.prefix
    return {key[len(prefix):]: (len(data), etag) for key, (data, etag) in items
            if key.startswith(prefix) and key != prefix and not key.endswith("/")}


def head(url: Url) -> tuple[int, str] | None:
    """(size, ETag) of the object ``url``, None if there is none."""
    with _lock:
        found = _bucket(url).objects.get(url.key)
    return None if found is None else (len(found[0]), found[1])


def get_range(url: Url, offset: int, size: int, etag: str | None = None) -> bytes:
    """``size`` bytes of the object at ``offset``, pinned to ``etag``.

    Raises:
        InputError: shorter than asked, changed (``etag``), missing.
    """
    if size <= 0:
        return b""
    with _lock:
        found = _bucket(url).objects.get(url.key)
    if found is None:
        raise InputError(f"{url}: no such object; check the URL")
    data, current = found
    if etag and current != etag:
        raise InputError(f"{url}: the object changed while it was being read; run again once "
                         "it is no longer being written")
    got = data[offset:offset + size]
    if len(got) != size:
        raise InputError(f"{url}: a read of {size} bytes at byte {offset} returned "
                         f"{len(got)}; the object is shorter than its checkpoint says")
    return got


class RemoteStore(ranged.RemoteStore):
    """A checkpoint's data files in memory, read as every store's are
    (:class:`ckpttool.storage.ranged.RemoteStore`)."""

    def _get_range(self, url: Any, offset: int, size: int, etag: str | None) -> bytes:
        return get_range(url, offset, size, etag)


def check_output(value: str, *, overwrite: bool, names: OutputNames) -> Url:
    """The output URL, checked before any work (:func:`ckpttool.storage.objects.check_output`)."""
    url = parse(value)
    return objects.check_output(url, list_objects(url), overwrite=overwrite, names=names)


def errors(url: Url | str, doing: str) -> contextlib.AbstractContextManager[None]:
    """Nothing to map: every failure here is one-line already."""
    return contextlib.nullcontext()


class Lock(locks.ObjectLock):
    """One writer per output prefix (:class:`~ckpttool.storage.locks.ObjectLock`), created
    with a create-only put."""

    def remove_command(self) -> str:
        return f"ckpttool.storage.memory.delete({str(self.url)!r})"

    def _create(self, body: bytes) -> bool:
        return put(self.url, body, create=True)

    def _put(self, body: bytes) -> None:
        put(self.url, body)

    def _get(self) -> bytes | None:
        return get(self.url)

    def _remove(self) -> None:
        delete(self.url)


class Upload(objects.Upload):
    """A finished output published below ``url`` in
    :class:`~ckpttool.storage.objects.Upload`'s order; each object put whole (a put is
    atomic here), and on failure the objects this upload created deleted."""

    def _list(self) -> dict[str, tuple[int, str]]:
        return list_objects(self.url)

    def _delete(self, name: str) -> None:
        outputs.fault_step()
        delete(self.url.child(name))

    def _put(self, pool: ThreadPoolExecutor, path: Path, name: str, existed: bool) -> None:
        outputs.fault_step()
        url = self.url.child(name)
        put(url, path.read_bytes())
        if not existed:
            self._created.append(url.key)

    def abort(self) -> None:
        for key in self._created:
            objects.quietly(delete, self.url.with_key(key))


class Parts:
    """Shared uploads in memory (:class:`ckpttool.storage.objects.Parts`): S3's shape (an
    upload id, parts by number, joined in number order), with S3's limits."""

    limits = objects.Limits("memory", max_parts=10_000, min_part=5 << 20, max_part=5 << 30)

    def get(self, url: Url) -> bytes | None:
        return get(url)

    def put(self, url: Url, data: bytes, *, create: bool = False) -> bool:
        return put(url, data, create=create)

    def delete(self, url: Url) -> None:
        delete(url)

    def listing(self, url: Url) -> dict[str, tuple[int, str]]:
        return list_objects(url)

    def start(self, url: Url, staging: Url) -> str:
        upload = f"{url.key}#{next(_versions)}"
        with _lock:
            _bucket(url).uploads[upload] = {}
        return upload

    def put_part(self, url: Url, upload: str, number: int, data: bytes) -> str:
        with _lock:
            parts = _bucket(url).uploads.get(upload)
            if parts is None:
                raise InputError(f"{url}: uploading part {number} failed: no such upload; "
                                 "run every slice again")
            parts[number] = bytes(data)
        return hashlib.md5(data, usedforsecurity=False).hexdigest()

    def complete(self, url: Url, upload: str, parts: list[tuple[int, str]]) -> None:
        with _lock:
            bucket = _bucket(url)
            staged = bucket.uploads.get(upload)
            now = bucket.objects.get(url.key)
            if staged is None and now is not None and bucket.completed.get(upload) == now[1]:
                return  # done already (a finish run again after it was killed here)
            if staged is None or any(n not in staged for n, _ in parts):
                raise InputError(f"{url}: completing an upload failed: a part is missing; "
                                 "run every slice again")
            data = b"".join(staged[n] for n, _ in sorted(parts))
            bucket.objects[url.key] = (data, _etag(data))
            bucket.completed[upload] = bucket.objects[url.key][1]
            del bucket.uploads[upload]

    def abort(self, url: Url, upload: str) -> None:
        with _lock:
            found = _buckets.get(url.bucket)
            if found is not None:
                found.uploads.pop(upload, None)
