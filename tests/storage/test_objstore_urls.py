"""gs://, az:// and abfs[s]:// URLs as users paste them, and Azure's connection string: pure
parsing, no store."""

from __future__ import annotations

import pytest

from ckpttool.errors import InputError
from ckpttool.storage import objstore, remote


@pytest.mark.parametrize("value,bucket,key,account", [
    ("gs://b/run/ckpt-1/", "b", "run/ckpt-1", ""),
    ("gs://b", "b", "", ""),
    ("az://c/x/y", "c", "x/y", ""),
    ("abfss://c@acct.dfs.core.windows.net/x/y", "c", "x/y", "acct"),
    ("abfs://c@acct.dfs.core.windows.net", "c", "", "acct"),
])
def test_urls_parse_and_print_as_typed(value: str, bucket: str, key: str, account: str) -> None:
    url = objstore.parse(value)
    assert (url.bucket, url.key, url.account) == (bucket, key, account)
    assert str(url) == value.rstrip("/")
    assert remote.backend(value) is objstore
    assert str(url.child("a.bin")).endswith("/a.bin")
    assert url.child("a.bin").with_key(key) == url


@pytest.mark.parametrize("value,message", [
    ("gs:///x", "gs:///x: names no bucket; use gs://BUCKET/PREFIX"),
    ("az://", "az://: names no container; use az://CONTAINER/PREFIX"),
    ("abfss://c/x", "abfss://c/x: names no container and account; use "
                    "abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX"),
])
def test_a_url_without_a_bucket_is_one_line(value: str, message: str) -> None:
    with pytest.raises(InputError) as e:
        objstore.parse(value)
    assert str(e.value) == message


def test_the_connection_string_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=k==;"
                       "EndpointSuffix=core.windows.net")
    assert objstore.connection_string() == {
        "DefaultEndpointsProtocol": "https", "AccountName": "a", "AccountKey": "k==",
        "EndpointSuffix": "core.windows.net"}
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    fields = objstore.connection_string()
    assert fields["AccountName"] == "devstoreaccount1"
    assert fields["BlobEndpoint"] == "http://127.0.0.1:10000/devstoreaccount1"


def test_the_gcs_emulator_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")
    assert objstore.emulator() == "http://localhost:4443"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "https://h:1/")
    assert objstore.emulator() == "https://h:1"
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    assert objstore.emulator() is None
