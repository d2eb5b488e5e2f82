"""The store contract on Google Cloud Storage (fake-gcs-server) and Azure Blob Storage
(Azurite), through the object tree that opens them, as for S3 (tests/remote/test_s3_store.py); and
the object-store contract (tests/storage/objects.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ckpttool.storage import objects, objstore, remote
from ckpttool.storage.store import Store
from tests.clouds.conftest import Cloud
from tests.storage.contract import StoreTests, remote_tree
from tests.storage.objects import ObjectStoreTests

_prefixes = itertools.count()


class CloudStoreTests(StoreTests):
    cloud: Cloud

    def store_of(self, files: dict[str, bytes], tmp: Path) -> Store:
        prefix = f"contract/{next(_prefixes)}"
        for name, data in files.items():
            self.cloud.put(f"{prefix}/{name}", data)
        return remote_tree(self.cloud.url(prefix))


class TestGcsStore(CloudStoreTests):
    @pytest.fixture(autouse=True)
    def _server(self, gcs: Cloud) -> None:
        self.cloud = gcs


class TestAzureStore(CloudStoreTests):
    @pytest.fixture(autouse=True)
    def _server(self, azure: Cloud) -> None:
        self.cloud = azure


class TestCloudObjects(ObjectStoreTests):
    """The object-store contract (tests/storage/objects.py) on each emulator."""

    backend = objstore

    @pytest.fixture(autouse=True)
    def _server(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self.scheme = cloud.scheme

    def prefix(self, files: dict[str, bytes]) -> str:
        prefix = f"objects/{next(_prefixes)}"
        for name, data in files.items():
            self.cloud.put(f"{prefix}/{name}", data)
        return self.cloud.url(prefix)

    def replace(self, url: str, data: bytes) -> None:
        self.cloud.put(url.partition("://")[2].partition("/")[2], data)

    def parts(self) -> objects.Parts:
        found: objects.Parts = remote.parts(self.cloud.url("x"))
        return found
