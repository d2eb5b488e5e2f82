"""The contract every object-store backend keeps (:class:`ckpttool.storage.objects.Backend`
and its :class:`~ckpttool.storage.objects.Parts`), as one base class of tests:
:class:`ObjectStoreTests`. It runs on the in-memory backend in ``tests/storage/``
(milliseconds, no server), on S3 (moto) in ``tests/remote/`` and on GCS (fake-gcs-server) and
Azure (Azurite) in ``tests/clouds/``, so that what passes in memory is what the real stores do.

A subclass names its ``backend`` and says how to put objects (:meth:`prefix`), how to change
one behind a reader's back (:meth:`replace`) and which shared-upload primitives it has
(:meth:`parts`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ckpttool.errors import InputError, OutputError
from ckpttool.storage import memory, objects, outputs

FILES = {"a.bin": os.urandom(1 << 20), "config.json": b'{"x": 1}', "sub/b.bin": b"b" * 1000}
INDEX = "model.safetensors.index.json"
NAMES = objects.OutputNames(replaces=lambda n: n.endswith((".safetensors", ".index.json")),
                            last=lambda n: n.endswith(".index.json"))


def upload_tree(local: Path, url: str) -> str:
    """Every file below the directory ``local`` put into the in-memory store under the prefix
    ``url`` (``s3://bucket/prefix``; the bucket is created); returns ``url``."""
    where = memory.parse(url)
    memory.create_bucket(where.bucket)
    for p in sorted(local.rglob("*")):
        if p.is_file():
            memory.put(where.child(p.relative_to(local).as_posix()), p.read_bytes())
    return url


class ObjectStoreTests:
    backend: Any  # an objects.Backend (a module)
    scheme: str  # of the URLs it takes

    def prefix(self, files: dict[str, bytes]) -> str:
        """A new prefix URL holding ``files`` (relative name -> bytes)."""
        raise NotImplementedError

    def replace(self, url: str, data: bytes) -> None:
        """Put ``data`` at the object ``url`` (another writer's put)."""
        raise NotImplementedError

    def parts(self) -> objects.Parts:
        raise NotImplementedError

    def url(self, value: str) -> Any:
        return self.backend.parse(value)

    def test_listing_and_head(self) -> None:
        base = self.prefix(FILES)
        listed = self.backend.list_objects(self.url(base))
        assert {k: v[0] for k, v in listed.items()} == {k: len(v) for k, v in FILES.items()}
        size, etag = self.backend.head(self.url(f"{base}/a.bin"))
        assert (size, etag) == listed["a.bin"]
        assert self.backend.head(self.url(f"{base}/nope.bin")) is None
        assert self.backend.list_objects(self.url(f"{base}/nothing")) == {}

    def test_a_missing_bucket_is_one_line(self) -> None:
        with pytest.raises(InputError, match="does not exist"):
            self.backend.list_objects(self.url(f"{self.scheme}://no-such-bucket-here/x"))

    def test_ranged_reads_pinned_to_the_etag(self) -> None:
        base = self.prefix(FILES)
        url = self.url(f"{base}/a.bin")
        size, etag = self.backend.head(url)
        data = FILES["a.bin"]
        assert self.backend.get_range(url, 5, 100, etag) == data[5:105]
        assert self.backend.get_range(url, 0, size, etag) == data
        assert self.backend.get_range(url, 7, 0, etag) == b""
        with pytest.raises(InputError, match="shorter than its checkpoint says"):
            self.backend.get_range(url, size - 10, 20, etag)
        self.replace(f"{base}/a.bin", data[::-1])
        with pytest.raises(InputError, match="changed while it was being read"):
            self.backend.get_range(url, 0, 10, etag)

    def test_one_writer_per_prefix(self) -> None:
        out = self.url(self.prefix({}))
        first = self.backend.Lock(out)
        first.acquire()
        try:
            second = self.backend.Lock(out)
            with pytest.raises(OutputError, match="another ckpttool run is writing"):
                second.acquire()
            assert self.backend.LOCK_NAME in self.backend.list_objects(out)
        finally:
            first.release()
        assert self.backend.LOCK_NAME not in self.backend.list_objects(out)
        again = self.backend.Lock(out)
        again.acquire()
        again.release()

    def test_an_output_with_weights_needs_overwrite(self) -> None:
        base = self.prefix({"model.safetensors": b"x", "config.json": b"{}"})
        with pytest.raises(OutputError, match="already holds model.safetensors"):
            self.backend.check_output(base, overwrite=False, names=NAMES)
        assert str(self.backend.check_output(base, overwrite=True, names=NAMES)) == base
        empty = self.prefix({"README.md": b"hi"})
        assert str(self.backend.check_output(empty, overwrite=False, names=NAMES)) == empty

    def test_an_overwrite_never_shows_a_mixed_output(self, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
        old = {INDEX: b'{"old": 1}', "model-1.safetensors": b"o1", "model-2.safetensors": b"o2",
               "model-3.safetensors": b"o3", "config.json": b"{}"}
        base = self.prefix(old)
        url = self.url(base)
        new = {INDEX: b'{"new": 2}', "model-1.safetensors": b"n1" * 50,
               "model-2.safetensors": b"n2" * 70, "config.json": b'{"n": 1}'}
        local = tmp_path / "out"
        local.mkdir()
        for name, data in new.items():
            (local / name).write_bytes(data)
        seen: list[dict[str, bytes]] = []

        def step() -> None:  # each object put or deleted: what a reader would list then
            seen.append({n: self.read(url, n) for n in self.backend.list_objects(url)})

        monkeypatch.setattr(outputs, "fault_step", step)
        upload = self.backend.Upload(url, overwrite=True, names=NAMES)
        assert upload.run(local) == sorted(new)
        step()
        assert seen[-1] == new
        for listing in seen:
            if INDEX in listing:  # what reads as complete is the old output or the new one
                whole = old if listing[INDEX] == old[INDEX] else new
                assert {n: listing.get(n) for n in whole if n.endswith(".safetensors")} == \
                    {n: d for n, d in whole.items() if n.endswith(".safetensors")}

    def read(self, url: Any, name: str) -> bytes:
        size, etag = self.backend.list_objects(url)[name]
        data: bytes = self.backend.get_range(url.child(name), 0, size, etag)
        return data

    def test_shared_upload_parts_in_number_order(self) -> None:
        parts = self.parts()
        base = self.url(self.prefix({}))
        target = base.child("joined.bin")
        size = parts.limits.min_part
        pieces = {1: os.urandom(size), 2: os.urandom(size), 3: b"tail"}
        upload = parts.start(target, base.child(".staging/joined"))
        receipts = {n: parts.put_part(target, upload, n, pieces[n]) for n in (3, 1, 2)}
        parts.complete(target, upload, [(n, receipts[n]) for n in (1, 2, 3)])
        assert parts.get(target) == pieces[1] + pieces[2] + pieces[3]
        assert parts.put(base.child("record"), b"r", create=True)
        assert not parts.put(base.child("record"), b"s", create=True)
        assert parts.get(base.child("record")) == b"r"
        parts.delete(base.child("record"))
        assert parts.get(base.child("record")) is None
        assert "joined.bin" in parts.listing(base)
