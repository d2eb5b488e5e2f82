"""The store contract (:class:`tests.storage.contract.StoreTests`) and the object-store
contract (:class:`tests.storage.objects.ObjectStoreTests`) on the in-memory backend
(:mod:`ckpttool.storage.memory`): every case the S3, GCS and Azure stores pass on their
servers, run here without one."""

from __future__ import annotations

import itertools
from pathlib import Path

from ckpttool.storage import memory, objects
from ckpttool.storage.store import Store
from tests.storage.contract import StoreTests, remote_tree
from tests.storage.objects import ObjectStoreTests

BUCKET = "ckpt"
_prefixes = itertools.count()


def _put(prefix: str, files: dict[str, bytes]) -> str:
    memory.create_bucket(BUCKET)
    for name, data in files.items():
        memory.put(memory.parse(f"s3://{BUCKET}/{prefix}/{name}"), data)
    return f"s3://{BUCKET}/{prefix}"


class TestMemoryStore(StoreTests):
    def store_of(self, files: dict[str, bytes], tmp: Path) -> Store:
        url = _put(f"contract/{next(_prefixes)}", files)
        return remote_tree(url, memory)


class TestMemoryObjects(ObjectStoreTests):
    backend = memory
    scheme = "s3"

    def prefix(self, files: dict[str, bytes]) -> str:
        return _put(f"objects/{next(_prefixes)}", files)

    def parts(self) -> objects.Parts:
        return memory.Parts()

    def replace(self, url: str, data: bytes) -> None:
        memory.put(memory.parse(url), data)
