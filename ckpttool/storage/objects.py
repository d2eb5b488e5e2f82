"""What every object store (S3, GCS, Azure) does alike when it is written: which objects of an
output matter (:class:`OutputNames`), the order in which an output is published
(:class:`Upload`: the object that completes the model last), and the parts of one object
uploaded by several processes on any hosts (:class:`Parts`, the backend protocol each store
module implements, and :func:`part_size`, the store's limits). Names no format.

Parts of a shared upload, per store (each checked against its emulator: moto, fake-gcs-server,
Azurite):

* S3: one multipart upload per object; any process uploads parts by number, the ETag of each
  is its receipt, and ``CompleteMultipartUpload`` joins them. Limits: 10,000 parts, every part
  but the last at least 5 MiB, at most 5 GiB.
* Azure: the blob's staged blocks (``Put Block``, a block id per part) joined by ``Put Block
  List``; uncommitted blocks are invisible and discarded by Azure after 7 days. Limits: 50,000
  blocks of at most 4,000 MiB.
* GCS: each part an object of its own under the run's staging prefix, joined by ``compose``,
  at most 32 sources per call (so in rounds: 32 parts into one, then 32 of those...), then the
  part objects are removed.

A part is a window of the output file at a fixed grid (:func:`part_size`: a multiple of
4 KiB, at least the store's minimum part, large enough that the file needs no more parts than
the store allows). The grid, not the processes' byte split, decides the parts: each process
uploads whole windows, so every part but a file's last has the grid's size, whatever the number
of processes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ckpttool.errors import OutputError, UnsupportedError
from ckpttool.storage import places

if TYPE_CHECKING:
    from ckpttool.storage import locks, ranged

__all__ = ["ALIGN", "Backend", "Limits", "OutputNames", "Parts", "Upload", "check_output",
           "completing", "part_size"]

Url = places.Url

# Part sizes are multiples of this (a page: the unit a byte split of the work cuts at).
ALIGN = 4096
# The part size aimed at: parts this large keep the request count low and the local buffer
# of each process small (one part; see core/merge/objects.py).
PART = 16 << 20


@dataclass(frozen=True)
class Limits:
    """A store's limits on the parts of one object."""

    store: str  # for messages
    max_parts: int
    min_part: int  # every part but the last
    max_part: int
    what: str = "parts"  # how the store calls them (blocks, composed sources)


def part_size(size: int, limits: Limits, wanted: int = PART) -> int:
    """The part size of an object of ``size`` bytes uploaded in parts: ``wanted`` (rounded up
    to :data:`ALIGN` and to the store's minimum part), grown so that the object needs at most
    ``limits.max_parts`` parts.

    Raises:
        UnsupportedError: the object needs parts larger than the store allows.
    """
    floor = max(wanted, limits.min_part)
    need = -(-size // limits.max_parts)
    part = -(-max(floor, need) // ALIGN) * ALIGN
    if part > limits.max_part:
        raise UnsupportedError(
            f"an output file of {size:,} bytes needs more than {limits.max_parts:,} "
            f"{limits.what} of at most {limits.max_part:,} bytes, {limits.store}'s limit; "
            "pass a smaller --max-shard-size")
    return part


class Parts(Protocol):
    """The primitives a store module offers for shared uploads and their records (every
    method raises the store's errors as one-line :class:`~ckpttool.errors.CkptError`)."""

    limits: Limits

    def get(self, url: Url) -> bytes | None:
        """The object's bytes; None where there is none."""

    def put(self, url: Url, data: bytes, *, create: bool = False) -> bool:
        """Put a small object; ``create``: only where there is none (False: refused)."""

    def delete(self, url: Url) -> None:
        """Remove an object (none there: nothing to do)."""

    def listing(self, url: Url) -> dict[str, tuple[int, str]]:
        """Every object below ``url``: relative name -> (size, ETag)."""

    def start(self, url: Url, staging: Url) -> str:
        """Begin the upload of ``url`` in parts; its id (parts kept under ``staging`` where
        the store keeps them as objects)."""

    def put_part(self, url: Url, upload: str, number: int, data: bytes) -> str:
        """Upload part ``number`` (1-based); its receipt (ETag, block id...)."""

    def complete(self, url: Url, upload: str, parts: list[tuple[int, str]]) -> None:
        """Join the parts, in number order, into the object ``url``."""

    def abort(self, url: Url, upload: str) -> None:
        """Drop an upload that will not be completed (best effort)."""


@dataclass(frozen=True)
class OutputNames:
    """Which objects of an output matter, told by the caller (storage names no format)."""

    replaces: Callable[[str], bool]  # objects a new output replaces (weights, indexes...)
    last: Callable[[str], bool]  # what makes an output look complete: uploaded after the rest


def completing(names: Iterable[str], rule: OutputNames) -> list[str]:
    """The objects of an output that make it read as complete: its index (``rule.last``),
    or, in an output without one, its weight files (``rule.replaces``: a single
    ``model.safetensors``). Top-level names only."""
    top = [n for n in names if "/" not in n]
    found = [n for n in top if rule.last(n)]
    return found or [n for n in top if rule.replaces(n)]


# An object of an output: a local file uploaded, or an action that puts it in place (the
# completion of a shared upload).
Source = Path | Callable[[], None]


class Upload:
    """The objects of a finished output published below ``url``, in an order that never
    shows a finished-looking mixed output (the remote counterpart of
    :meth:`~ckpttool.storage.outputs.AtomicOutputs.commit`; object stores have no rename):

    1. with ``overwrite``, the object that completes the previous output is deleted first:
       its index (``names.last``), or the weight file of an output without one: from then
       on nothing there reads as a complete model;
    2. the data files (``names.replaces``) go up, then the rest (config, tokenizer...);
    3. previous data files the new output lacks are deleted;
    4. the object that completes the new output goes up last, only after everything else
       completed: its index, or the weight file of an output without one.

    A process killed at any step leaves the previous output, the new one, or no complete
    model. On any failure or Ctrl-C :meth:`abort` runs (each store's: uploads in progress
    aborted, the objects this upload created from local files deleted). Each store module
    subclasses it with its requests (``_list``, ``_delete``, ``_put``, ``abort``).
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
        self.publish({n: local / n for n in names})
        return names

    def publish(self, sources: dict[str, Source], *, ours: Iterable[str] = ()) -> None:
        """Put every object of ``sources`` in place, in the order above; ``ours``: names an
        earlier run of this output may have put in place already, never deleted first as a
        previous output's (their sources put them in place again, or find them there)."""
        names = sorted(sources)
        kept = set(ours)
        rule = self.names
        existing = set(self._list())
        replaced = {n for n in existing if "/" not in n and rule.replaces(n)}
        last = completing(names, rule)
        first = [n for n in names if n not in last]
        # Weights before everything else, then the configs, the completing object last.
        first.sort(key=lambda n: (not rule.replaces(n), n))
        old_last = [n for n in completing(sorted(replaced), rule) if n not in kept]
        pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="ckpttool-put")
        try:
            if self.overwrite:
                for name in old_last:
                    self._delete(name)
            for name in first:
                self._send(pool, sources[name], name, name in existing)
            if self.overwrite:
                for name in sorted(replaced - set(names) - set(old_last)):
                    self._delete(name)
            for name in last:
                self._send(pool, sources[name], name, name in existing)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            self.abort()
            raise
        pool.shutdown(wait=True)

    def _send(self, pool: ThreadPoolExecutor, source: Source, name: str, existed: bool) -> None:
        if isinstance(source, Path):
            self._put(pool, source, name, existed)
        else:
            from ckpttool.storage import outputs

            outputs.fault_step()
            source()  # a shared upload completed: never deleted by abort (run again instead)

    def _list(self) -> dict[str, tuple[int, str]]:
        raise NotImplementedError

    def _delete(self, name: str) -> None:
        raise NotImplementedError

    def _put(self, pool: ThreadPoolExecutor, path: Path, name: str, existed: bool) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


def quietly(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)``, its failure ignored (clean-up after the failure the user sees)."""
    with contextlib.suppress(Exception):
        fn(*args)


def check_output(url: Url, listing: dict[str, tuple[int, str]], *, overwrite: bool,
                 names: OutputNames) -> Url:
    """``url``, an output prefix whose objects are ``listing``, checked before any work: it
    holds no object an output replaces unless ``overwrite``.

    Raises:
        OutputError: weights there already.
    """
    existing = sorted(n for n in listing if "/" not in n and names.replaces(n))
    if existing and not overwrite:
        raise OutputError(f"{url}: already holds {', '.join(existing[:3])}"
                          f"{' and more' if len(existing) > 3 else ''}; pass --overwrite to "
                          "replace them or choose an empty prefix")
    return url


class Backend(Protocol):
    """What serves one kind of object store: :mod:`ckpttool.storage.s3` (S3, boto3),
    :mod:`ckpttool.storage.objstore` (GCS and Azure, obstore) and
    :mod:`ckpttool.storage.memory` (this process's memory: the contract suite without
    servers). :func:`ckpttool.storage.remote.backend` names the one of a URL; the object tree,
    the URL wrapper and the shared uploads use nothing else of it. Every call raises the
    store's failures as one-line :class:`~ckpttool.errors.CkptError`.
    """

    @property
    def CONCURRENCY(self) -> int:  # a module's constant
        """Requests in flight."""

    @property
    def LOCK_NAME(self) -> str:
        """The lock object of an output prefix (:mod:`ckpttool.storage.locks`)."""

    @property
    def RemoteStore(self) -> type[ranged.RemoteStore]:  # a module's class
        """A remote checkpoint's data files, read by ranged GETs."""

    @property
    def Lock(self) -> type[locks.ObjectLock]:
        """One writer per output prefix."""

    @property
    def Upload(self) -> type[Upload]:
        """A finished output published, its completing object last."""

    def parse(self, value: str) -> Url:
        """The URL ``value``, parsed."""

    def list_objects(self, url: Url) -> dict[str, tuple[int, str]]:
        """Every object below ``url`` as a directory: relative name -> (size, ETag)."""

    def head(self, url: Url) -> tuple[int, str] | None:
        """(size, ETag) of the object ``url``; None where there is none."""

    def get_range(self, url: Url, offset: int, size: int, etag: str | None = None) -> bytes:
        """Exactly ``size`` bytes at ``offset``, pinned to ``etag`` (a changed object is
        refused); retried where the store's transport fails."""

    def check_output(self, value: str, *, overwrite: bool, names: OutputNames) -> Url:
        """The output URL ``value``, checked before any work (:func:`check_output`)."""

    def errors(self, url: Url | str, doing: str) -> contextlib.AbstractContextManager[None]:
        """The store's failures inside the block as one-line errors naming ``url``."""

    def staging_dir(self) -> Path:
        """A private local directory where an output is written before its upload."""

