"""The store contract on S3 (moto's server on localhost), through the object tree that opens it,
and the object-store contract (tests/storage/objects.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ckpttool.storage import objects
from ckpttool.storage.store import Store
from tests.remote.conftest import BUCKET, S3
from tests.storage.contract import StoreTests, remote_tree
from tests.storage.objects import ObjectStoreTests

_prefixes = itertools.count()


class TestS3Store(StoreTests):
    @pytest.fixture(autouse=True)
    def _server(self, s3: S3) -> None:
        self.s3 = s3

    def store_of(self, files: dict[str, bytes], tmp: Path) -> Store:
        prefix = f"contract/{next(_prefixes)}"
        for name, data in files.items():
            self.s3.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
        return remote_tree(f"s3://{BUCKET}/{prefix}")


class TestS3Objects(ObjectStoreTests):
    """The object-store contract on S3 (moto), as the in-memory backend runs it."""

    scheme = "s3"

    @pytest.fixture(autouse=True)
    def _server(self, s3: S3) -> None:
        from ckpttool.storage import s3 as backend

        self.s3 = s3
        self.backend = backend

    def prefix(self, files: dict[str, bytes]) -> str:
        prefix = f"objects/{next(_prefixes)}"
        for name, data in files.items():
            self.s3.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
        return f"s3://{BUCKET}/{prefix}"

    def replace(self, url: str, data: bytes) -> None:
        bucket, _, key = url.removeprefix("s3://").partition("/")
        self.s3.client.put_object(Bucket=bucket, Key=key, Body=data)

    def parts(self) -> objects.Parts:
        from ckpttool.storage import s3 as backend

        return backend.Parts()
