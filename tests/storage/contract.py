"""The contract every store keeps, as one base class of tests (zarr's ``StoreTests``):
:class:`StoreTests`. A new store is one module in ``ckpttool/storage/`` plus one subclass
that says how to put files into it (:meth:`StoreTests.store_of`); local files run it in
``tests/storage/test_local_store.py``, object stores on their local servers in
``tests/remote/``.

Only the :class:`~ckpttool.storage.store.Store` protocol is used, and what a store declares it
can do (:class:`~ckpttool.storage.store.Capabilities`) decides which tests apply.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ckpttool.errors import InputError
from ckpttool.storage import objtree, sidefiles
from ckpttool.storage.store import LOCAL, Capabilities, Store, Stores, read_blocks

# Files every test reads: a few sizes around block edges, and one in a subdirectory.
FILES = {
    "a.bin": os.urandom(3 << 20) + b"end",
    "small.json": b'{"x": 1}',
    "empty.bin": b"",
    "sub/b.bin": bytes(range(256)) * 1000,
}
META = ".metadata"


def remote_tree(url: str, backend: Any = None) -> Store:
    """The store of the remote checkpoint at ``url``, as its object tree opens it; closing it
    closes the tree."""
    tree = objtree.ObjectTree(url, backend=backend)
    store = tree.open(tree.dir, metadata_name=META)
    close = store.close

    def closing() -> None:
        close()
        tree.close()

    store.close = closing  # type: ignore[method-assign]
    store.opener = tree  # type: ignore[attr-defined]  # for StoreTests.tree
    return store


class StoreTests:
    """Subclasses implement :meth:`store_of`."""

    def store_of(self, files: dict[str, bytes], tmp: Path) -> Store:
        """A store whose files are ``files`` (relative name -> bytes); ``tmp``: scratch."""
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        store = self.store_of(FILES, tmp_path)
        try:
            yield store
        finally:
            store.close()

    def test_declares_its_capabilities(self, store: Store) -> None:
        caps = store.capabilities
        assert isinstance(caps, Capabilities)
        assert caps.workers >= 0
        # A store that maps local files is not one that plans requests ahead.
        assert not (caps.local_files and caps.many_ranges)

    def test_sizes_and_a_missing_file(self, store: Store) -> None:
        for name, data in FILES.items():
            assert store.size(name) == len(data)
        store.open_all(FILES)
        with pytest.raises(InputError, match="data file is missing; .metadata references it"):
            store.open_all(["nope.bin"])

    def test_ranged_reads(self, store: Store) -> None:
        data = FILES["a.bin"]
        assert store.pread("a.bin", 10, 5) == data[5:15]
        assert store.pread("a.bin", 100, len(data) - 3) == b"end"  # fewer at the end
        assert store.pread("a.bin", 10, len(data)) == b""
        assert store.pread("empty.bin", 10, 0) == b""
        assert store.read_exact("sub/b.bin", 1000, 300, what="x") == FILES["sub/b.bin"][1000:1300]
        assert store.read_exact("a.bin", 0, len(data), what="x") == data

    def test_a_read_past_the_end_names_the_file_and_offset(self, store: Store) -> None:
        size = len(FILES["a.bin"])
        with pytest.raises(InputError, match=rf"a.bin: ends at byte {size}, inside tensor 't'"):
            store.read_exact("a.bin", size - 2, 10, what="tensor 't'")

    def test_readinto(self, store: Store) -> None:
        buf = bytearray(1 << 20)
        assert store.readinto("a.bin", 7, memoryview(buf)) == len(buf)
        assert bytes(buf) == FILES["a.bin"][7:7 + len(buf)]
        small = bytearray(100)
        assert store.readinto("small.json", 0, memoryview(small)) == len(FILES["small.json"])

    def test_readv_fills_each_buffer_in_turn(self, store: Store) -> None:
        data = FILES["a.bin"]
        sizes = [5, 0, 4096, 1, 3000] * 300  # more buffers than one preadv takes
        bufs = [memoryview(bytearray(n)) for n in sizes]
        assert store.readv("a.bin", 11, bufs) == sum(sizes)
        assert b"".join(bytes(b) for b in bufs) == data[11:11 + sum(sizes)]
        tail = [memoryview(bytearray(2)), memoryview(bytearray(10))]
        assert store.readv("a.bin", len(data) - 5, tail) == 5  # fewer at the end
        assert bytes(tail[0]) + bytes(tail[1])[:3] == data[-5:]

    def test_many_ranges_in_the_order_asked(self, store: Store) -> None:
        data = FILES["a.bin"]
        ranges = [(k * 4099 % (len(data) - 500), 500) for k in range(200)][::-1]
        store.plan_reads([("a.bin", o, n) for o, n in ranges])
        got = [store.read_exact("a.bin", o, n, what="x") for o, n in ranges]
        assert got == [data[o:o + n] for o, n in ranges]

    def test_planned_reads_serve_every_thread(self, store: Store) -> None:
        data = FILES["a.bin"]
        reads = [("a.bin", o, 64 << 10) for o in range(0, len(data) - (64 << 10), 50_000)]
        store.plan_reads(reads)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda r: store.read_exact(r[0], r[1], r[2], what="x"), reads))
        assert got == [data[o:o + n] for _, o, n in reads]

    def test_copy_into_an_output_file(self, store: Store) -> None:
        data = FILES["a.bin"]
        with tempfile.TemporaryFile() as f:
            store.copy_to("a.bin", 1000, f.fileno(), 5, len(data) - 1000)
            f.seek(0)
            assert f.read() == bytes(5) + data[1000:]
        with tempfile.TemporaryFile() as f, pytest.raises(InputError, match="truncated"):
            store.copy_to("small.json", 0, f.fileno(), 0, 100)

    @pytest.mark.parametrize("mapped", [True, False])
    def test_blocks(self, store: Store, mapped: bool) -> None:
        data = FILES["a.bin"]
        buf = memoryview(bytearray(1 << 20))
        got = b"".join(bytes(v) for v in read_blocks(store, "a.bin", 3, len(data), buf,
                                                     mapped=mapped))
        assert got == data[3:]  # fewer at the end: the caller says so

    def test_reads_a_small_file_whole_within_its_cap(self, store: Store) -> None:
        small = sidefiles.Kind("metadata JSON file", 100)
        assert store.read_small("small.json", small) == FILES["small.json"]
        assert store.read_small("empty.bin", small) == b""
        with pytest.raises(InputError, match=r"sub/b.bin: 256,000 bytes, more than the 100 "):
            store.read_small("sub/b.bin", small)
        with pytest.raises(FileNotFoundError):
            store.read_small("nope.json", small)

    # The verbs a format describes a checkpoint with, by path through the Stores that opened
    # the store (LOCAL, or the object tree of a remote checkpoint): what its listing says.

    @staticmethod
    def tree(store: Store) -> tuple[Stores, Path]:
        return getattr(store, "opener", LOCAL), store.path("a.bin").parent

    def test_stores_list_a_directory(self, store: Store) -> None:
        stores, base = self.tree(store)
        top = stores.listdir(base)
        assert {k: v for k, v in top.items() if k in ("a.bin", "small.json", "empty.bin",
                                                      "sub")} == \
            {"a.bin": len(FILES["a.bin"]), "small.json": 8, "empty.bin": 0, "sub": None}
        assert stores.listdir(base / "sub") == {"b.bin": 256_000}
        assert stores.listdir(base / "nope") == {}
        assert stores.listdir(base / "a.bin") == {}

    def test_stores_tell_files_from_directories(self, store: Store) -> None:
        stores, base = self.tree(store)
        assert stores.is_dir(base) and stores.is_dir(base / "sub")
        assert not stores.is_dir(base / "a.bin") and not stores.is_dir(base / "nope")
        assert stores.file_size(base / "sub/b.bin") == 256_000
        assert stores.file_size(base / "empty.bin") == 0
        assert stores.file_size(base / "sub") is None
        assert stores.file_size(base / "nope") is None

    def test_stores_read_small_files_and_ranges(self, store: Store) -> None:
        stores, base = self.tree(store)
        assert stores.read_small(base / "small.json", sidefiles.METADATA_JSON) == b'{"x": 1}'
        with pytest.raises(FileNotFoundError):
            stores.read_small(base / "nope.json", sidefiles.METADATA_JSON)
        with pytest.raises(InputError, match="more than the 4,096"):
            stores.read_small(base / "sub/b.bin", sidefiles.TRACKER)
        with stores.reading(base / "sub/b.bin") as pread:
            assert pread(4, 255) == bytes([255, 0, 1, 2])

    def test_mapped_views_only_where_declared(self, store: Store) -> None:
        if not store.capabilities.local_files:
            with pytest.raises(NotImplementedError):
                next(iter(store.views("a.bin", 0, 10, 10)))
            return
        views = list(store.views("a.bin", 1, 3 << 20, 1 << 20))
        assert b"".join(bytes(v) for v in views) == FILES["a.bin"][1:1 + (3 << 20)]
        del views

    def test_paths_name_the_file(self, store: Store) -> None:
        assert store.path("sub/b.bin").as_posix().endswith("sub/b.bin")
