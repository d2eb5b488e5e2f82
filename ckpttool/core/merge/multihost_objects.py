"""Merges that several processes share, written straight into object storage (``s3://``,
``gs://``, ``az://``): no shared filesystem, and nothing large on any process's local disk.

Each output file is uploaded in parts (:mod:`ckpttool.storage.objects`: S3 multipart, Azure
staged blocks, GCS composed objects) on a fixed grid of windows
(:func:`ckpttool.core.merge.partition.windows`); the windows are dealt to the processes in
runs of about equal bytes (:func:`~ckpttool.core.merge.partition.owners`), so every process
computes, from the plan alone, which parts are whose. A process writes one window at a time
into an unnamed temporary file (at the window's offsets: the file is sparse, and holds about
one part), uploads it as that part, and empties the file. Everything a run keeps lies under
``OUT/.ckpttool-staging/PLAN/`` (PLAN: :func:`~ckpttool.core.merge.multihost.plan_key`):

* ``uploads/NAME.json``: the upload of output file NAME (its id and part size), made by the
  first process that needs it (a create-only put, read back);
* ``slices/I-of-N.json``: slice I's receipts (part number -> ETag or block id) for each file,
  written once all its parts are up: any host can run any slice again;
* ``placed/NAME``: a finish is completing NAME (written just before: a finish run again
  knows the object for its own and completes it again; every store's completion is
  idempotent).

``--finish`` (rank 0 under torchrun), under the output's lock, checks that every window of the
plan has a receipt from the slice that owns it, in the upload the plan's record names; then
publishes as one process's upload does (:class:`ckpttool.storage.objects.Upload`: the previous
completing object removed first, the data files completed, the side files put, the object
that completes the model last) and removes the staging prefix, and those of other plans (their
uploads aborted), naming them in the report. Until the last step nothing in the prefix reads
as a finished model; a killed slice or finish leaves only staging and uncommitted parts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool import settings
from ckpttool.core.merge import partition
from ckpttool.core.merge.engine import execute_share
from ckpttool.core.merge.multihost import (
    Finish,
    Slice,
    Team,
    _fault,
    _local_workers,
    plan_key,
    slices_done,
)
from ckpttool.core.merge.plan import MergePlan
from ckpttool.core.merge.sharing import Sharing
from ckpttool.core.runtime.report import Progress
from ckpttool.errors import OutputError
from ckpttool.formats.base import Reader
from ckpttool.storage import objects
from ckpttool.storage.outputs import fault_step, pwrite_all

if TYPE_CHECKING:
    from ckpttool.core.merge.options import ShareOptions, WriteOptions

__all__ = ["STAGING", "Target", "into_store"]

STAGING = ".ckpttool-staging"
_RECORD = re.compile(r"slices/(\d+)-of-(\d+)\.json")


@dataclass(frozen=True)
class Target:
    """Where a shared merge writes: the output URL, its store's primitives and classes."""

    url: objects.Url
    parts: objects.Parts
    lock: Callable[[objects.Url], Any]  # the store's Lock class
    upload: Callable[..., objects.Upload]  # the store's Upload class
    names: objects.OutputNames


def into_store(shared: Any, target: Target) -> StoreShare:
    """``shared`` (a :class:`Slice`, :class:`Finish` or :class:`Team`) writing into
    ``target`` instead of a shared directory."""
    if not isinstance(shared, Slice | Finish | Team):
        raise TypeError(f"cannot share {type(shared).__name__} into object storage")
    return StoreShare(shared, target)


class StoreShare:
    """A :class:`~ckpttool.core.merge.options.Shared` whose output is object storage."""

    def __init__(self, inner: Slice | Finish | Team, target: Target) -> None:
        self.inner = inner
        self.target = target
        self.commits_slices = isinstance(inner, Finish)
        self.remote = True

    @property
    def first(self) -> bool:
        return self.inner.first

    def once(self, decide: Callable[[], Any]) -> Any:
        return self.inner.once(decide)

    def preview(self, plan: MergePlan) -> Sharing | None:
        return self.inner.preview(plan)

    def write(self, plan: MergePlan, reader: Reader, out: Path, extra: list[tuple[str, bytes]],
              stem: str, writing: WriteOptions, share: ShareOptions, *,
              progress: Progress | None, on_start: Callable[[int], None] | None) -> Sharing:
        inner = self.inner
        if isinstance(inner, Slice):
            return self._slice(plan, reader, inner.index, inner.count, writing, share,
                               progress=progress, on_start=on_start)
        if isinstance(inner, Finish):
            return self._finish(plan, extra, writing)
        group = inner.group
        failure: BaseException | None = None
        sharing = None
        try:
            sharing = self._slice(plan, reader, group.rank, group.size, writing, share,
                                  progress=progress, on_start=on_start, mode="torchrun")
        except Exception as e:  # noqa: BLE001 - told to the others, then raised
            failure = e
        inner._agree(failure, "uploading its parts")

        def commit() -> None:
            self._finish(plan, extra, writing)

        inner.on_first(commit, "putting the output in place")
        assert sharing is not None
        return sharing

    # -- the layout of the plan in parts

    def _layout(self, plan: MergePlan) -> tuple[dict[int, int], list[partition.Window]]:
        limits = self.target.parts.limits
        sizes = {i: objects.part_size(f.size, limits, settings.part_size())
                 for i, f in enumerate(plan.files)}
        return sizes, partition.windows(plan, sizes)

    def _stage(self, key: str) -> objects.Url:
        return self.target.url.child(f"{STAGING}/{key}")

    def _json(self, url: objects.Url) -> dict[str, Any] | None:
        data = self.target.parts.get(url)
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise OutputError(f"{url}: unreadable record of a shared merge; remove "
                              f"{self._stage('')} and run every slice again") from e
        return doc if isinstance(doc, dict) else {}

    def _upload(self, name: str, size: int, stage: objects.Url) -> str:
        """The id of output file ``name``'s upload: the one recorded, else one started now
        and recorded with a create-only put (read back: the first process's wins)."""
        parts = self.target.parts
        record = stage.child(f"uploads/{name}.json")
        for _ in range(3):
            doc = self._json(record)
            if doc is not None:
                if doc.get("part_size") != size:
                    raise OutputError(f"{record}: made with parts of {doc.get('part_size')} "
                                      f"bytes, this run uses {size}; set CKPTTOOL_PART_SIZE "
                                      "alike on every process, or remove the staging prefix "
                                      "and run every slice again")
                return str(doc["upload"])
            target = self.target.url.child(name)
            upload = parts.start(target, stage.child(f"parts/{name}"))
            body = json.dumps({"upload": upload, "part_size": size}).encode()
            if parts.put(record, body, create=True):
                doc = self._json(record) or {}
                if doc.get("upload") == upload:
                    return upload
            parts.abort(target, upload)
        raise OutputError(f"{record}: could not agree on the upload of {name}; run again")

    # -- a slice: its windows, uploaded as parts, then its record

    def _slice(self, plan: MergePlan, reader: Reader, index: int, count: int,
               writing: WriteOptions, share: ShareOptions, *, progress: Progress | None,
               on_start: Callable[[int], None] | None, mode: str = "slice") -> Sharing:
        key = plan_key(plan)
        stage = self._stage(key)
        parts = self.target.parts
        sizes, windows = self._layout(plan)
        owner = partition.owners(windows, count)
        mine = [w for w, o in zip(windows, owner, strict=True) if o == index]
        if not writing.overwrite:
            self._check_existing(plan, stage, allow_index=False)
        if on_start is not None:
            on_start(sum(w.nbytes for w in mine))
        uploads = {i: self._upload(plan.files[i].name, sizes[i], stage)
                   for i in sorted({w.file for w in mine})}
        receipts: dict[str, dict[str, str]] = {}
        hook = _fault(progress, str(index))
        peak = 0
        with tempfile.TemporaryFile(prefix="ckpttool-part-") as buffer:
            fd = buffer.fileno()
            for w in mine:
                f = plan.files[w.file]
                os.ftruncate(fd, 0)
                if w.begin < len(f.layout.header):
                    pwrite_all(fd, f.layout.header, 0)
                execute_share(plan, list(w.units), reader, {w.file: fd},
                              workers=_local_workers(share.workers), progress=hook)
                peak = max(peak, os.fstat(fd).st_blocks * 512)
                data = _pread(fd, w.nbytes, w.begin)
                fault_step()  # a slice's steps: each part, then its record
                receipts.setdefault(f.name, {})[str(w.number)] = parts.put_part(
                    self.target.url.child(f.name), uploads[w.file], w.number, data)
        record = {"slice": index, "of": count, "plan": key, "parts": receipts,
                  "uploads": {plan.files[i].name: u for i, u in uploads.items()}}
        fault_step()
        parts.put(stage.child(f"slices/{index}-of-{count}.json"), json.dumps(record).encode())
        return _describe(mode, windows, owner, count, plan=key, local_bytes=peak,
                         **({"rank": index} if mode == "torchrun" else {"slice": index}))

    def _check_existing(self, plan: MergePlan, stage: objects.Url, *, allow_index: bool
                        ) -> tuple[set[str], dict[str, tuple[int, str]]]:
        """The output's weights, but those a finish of this plan put in place, refused
        (without --overwrite); returns those placed and the output's listing."""
        listed = self.target.parts.listing(self.target.url)
        placed_prefix = f"{STAGING}/{stage.name}/placed/"
        placed = {n[len(placed_prefix):] for n in listed if n.startswith(placed_prefix)}
        existing = [n for n in sorted(listed) if "/" not in n and self.target.names.replaces(n)
                    and n not in placed]
        if (allow_index and plan.index is not None and plan.index_name in existing
                and placed >= {f.name for f in plan.files}
                and self.target.parts.get(self.target.url.child(plan.index_name)) == plan.index):
            existing.remove(plan.index_name)  # a finish stopped after its last step
        if existing:
            raise OutputError(f"{self.target.url}: already holds {', '.join(existing[:3])}"
                              f"{' and more' if len(existing) > 3 else ''}; pass --overwrite "
                              "to replace them or choose an empty prefix")
        return placed, listed

    # -- the finish: check every part, publish, clean

    def _finish(self, plan: MergePlan, extra: list[tuple[str, bytes]], writing: WriteOptions
                ) -> Sharing:
        key = plan_key(plan)
        stage = self._stage(key)
        url = self.target.url
        lock = self.target.lock(url)
        lock.acquire()
        try:
            if writing.overwrite:
                placed, listed = self._placed(stage)
            else:
                placed, listed = self._check_existing(plan, stage, allow_index=True)
            records, count = self._records(stage, listed, key)
            sizes, windows = self._layout(plan)
            owner = partition.owners(windows, count)
            uploads: dict[str, str] = {}
            for f in plan.files:
                doc = self._json(stage.child(f"uploads/{f.name}.json"))
                if doc is None:
                    raise OutputError(f"{url}: no upload of {f.name} is recorded (plan {key}); "
                                      "run every slice again")
                uploads[f.name] = str(doc["upload"])
            receipts = _receipts(plan, windows, owner, records, uploads, count, url)
            local = Path(tempfile.mkdtemp(prefix="ckpttool-finish-"))
            try:
                sources: dict[str, objects.Source] = {}
                for f in plan.files:
                    sources[f.name] = _completion(self.target.parts, url, stage, f.name,
                                                  uploads[f.name], receipts[f.name])
                for name, data in [*extra, *([(plan.index_name, plan.index)]
                                             if plan.index is not None else [])]:
                    (local / name).write_bytes(data)
                    sources[name] = local / name
                upload = self.target.upload(url, overwrite=writing.overwrite,
                                            names=self.target.names)
                upload.publish(sources, ours=placed)
            finally:
                shutil.rmtree(local, ignore_errors=True)
            removed = self._clean(key)
        finally:
            lock.release()
        before = [f.name for f in plan.files if f.name in placed and f.name in listed]
        return _describe("slices", windows, owner, count, plan=key,
                         committed=[f.name for f in plan.files if f.name not in before],
                         placed_before=before or None,
                         removed_temporary=removed or None)

    def _placed(self, stage: objects.Url) -> tuple[set[str], dict[str, tuple[int, str]]]:
        listed = self.target.parts.listing(self.target.url)
        prefix = f"{STAGING}/{stage.name}/placed/"
        return {n[len(prefix):] for n in listed if n.startswith(prefix)}, listed

    def _records(self, stage: objects.Url, listed: dict[str, tuple[int, str]], key: str
                 ) -> tuple[dict[int, dict[str, Any]], int]:
        """Every slice's record, checked to be of one N and all there."""
        prefix = f"{STAGING}/{key}/"
        found = {(int(m[1]), int(m[2])): n for n in listed if n.startswith(prefix)
                 and (m := _RECORD.fullmatch(n[len(prefix):]))}
        url = self.target.url
        count = slices_done(found, url, key)
        records = {}
        for (i, _), name in found.items():
            records[i] = self._json(stage.child(name[len(prefix):])) or {}
        return records, count

    def _clean(self, key: str) -> list[str]:
        """Remove this plan's staging, and that of other plans (abandoned or other options:
        their uploads aborted), with the lock held; the other plans' keys, for the report."""
        url = self.target.url
        parts = self.target.parts
        listed = parts.listing(url.child(STAGING))
        listed = {f"{STAGING}/{n}": v for n, v in listed.items()}
        others: set[str] = set()
        for name in sorted(listed):
            if not name.startswith(f"{STAGING}/"):
                continue
            plan = name.split("/")[1]
            if plan != key:
                others.add(plan)
                m = re.fullmatch(rf"{re.escape(STAGING)}/[^/]+/uploads/(.+)\.json", name)
                doc = self._json(url.child(name)) if m else None
                if m and doc and "upload" in doc:
                    parts.abort(url.child(m[1]), str(doc["upload"]))
            with contextlib.suppress(Exception):
                parts.delete(url.child(name))
        return [f"{STAGING}/{k}/" for k in sorted(others)]


def _pread(fd: int, size: int, offset: int) -> bytes:
    chunks = []
    done = 0
    while done < size:
        piece = os.pread(fd, size - done, offset + done)
        if not piece:
            break
        chunks.append(piece)
        done += len(piece)
    data = b"".join(chunks)
    if len(data) != size:
        raise OutputError(f"a part of {size} bytes read back {len(data)} from the local "
                          "buffer (TMPDIR); check its free space and run again")
    return data


def _receipts(plan: MergePlan, windows: list[partition.Window], owner: list[int],
              records: dict[int, dict[str, Any]], uploads: dict[str, str], count: int,
              url: objects.Url) -> dict[str, list[tuple[int, str]]]:
    """Every window's receipt, from the slice that owns it, in the recorded upload.

    Raises:
        OutputError: naming the slice to run again.
    """
    found: dict[str, list[tuple[int, str]]] = {}
    for w, o in zip(windows, owner, strict=True):
        name = plan.files[w.file].name
        record = records[o]
        receipt = record.get("parts", {}).get(name, {}).get(str(w.number))
        if receipt is None or record.get("uploads", {}).get(name) != uploads[name]:
            raise OutputError(f"{url}: part {w.number} of {name} from slice {o}/{count} is "
                              f"missing or in another upload; run ckpttool merge SRC OUT "
                              f"--slice {o}/{count} again, then --finish")
        found.setdefault(name, []).append((w.number, str(receipt)))
    return found


def _completion(parts: objects.Parts, url: objects.Url, stage: objects.Url, name: str,
                upload: str, receipts: list[tuple[int, str]]) -> Callable[[], None]:
    def complete() -> None:
        # Recorded first: a finish run again after a kill knows the object for its own, and
        # completes it again (each store's completion is idempotent).
        parts.put(stage.child(f"placed/{name}"), b"")
        fault_step()
        parts.complete(url.child(name), upload, sorted(receipts))

    return complete


def _describe(mode: str, windows: list[partition.Window], owner: list[int], count: int,
              **more: Any) -> Sharing:
    sizes = [0] * count
    for w, o in zip(windows, owner, strict=True):
        sizes[o] += w.nbytes
    total = sum(sizes)
    balance = max(sizes) * count / total if total else 1.0
    return Sharing(mode, count, sizes, round(balance, 4), **more)
