"""A store that misbehaves, for GCS and Azure as tests/remote/test_transport.py does for S3:
transient failures (a proxy that resets connections in front of Azurite) are retried and the
bytes come out right; a store that cannot be reached is one line naming the object, never
damage in the checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.errors import AccessError, TransportError
from ckpttool.storage import objstore
from tests.clouds.conftest import Cloud, _free_port
from tests.proxy import Proxy


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(objstore, "BACKOFF", 0.01)
    monkeypatch.setattr(objstore, "ATTEMPTS", 1)
    monkeypatch.setattr(objstore, "RETRIES", 2)
    objstore._stores.clear()
    yield
    objstore._stores.clear()


def test_a_reset_connection_is_retried(azure: Cloud, quick: None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 4096
    azure.put("transport/data.distcp", data)
    conn = azure.env["AZURE_STORAGE_CONNECTION_STRING"]
    endpoint = conn.split("BlobEndpoint=")[1].split(";")[0]
    target, _, account = endpoint.rpartition("/")
    proxy = Proxy(target)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       conn.replace(endpoint, f"{proxy.url}/{account}"))
    url = objstore.parse(azure.url("transport/data.distcp"))
    proxy.set("reset", 2)
    assert objstore.get_range(url, 1000, 300_000) == data[1000:301_000]
    assert proxy.faulted == 2


def test_an_unreachable_store_is_one_line_naming_the_object(
        cloud: Cloud, quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    if cloud.scheme == "gs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", dead)
    else:
        conn = cloud.env["AZURE_STORAGE_CONNECTION_STRING"]
        endpoint = conn.split("BlobEndpoint=")[1].split(";")[0]
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                           conn.replace(endpoint, f"{dead}/devstoreaccount1"))
    url = objstore.parse(cloud.url("transport/data.distcp"))
    with pytest.raises(TransportError) as e:
        objstore.get_range(url, 0, 4096, "etag")
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{url}: reading 4,096 bytes at byte 0 failed")
    assert "failing (not the checkpoint)" in text


def test_a_store_that_never_answers_is_given_up(azure: Cloud, quick: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepted and never answered: obstore's read timeout and the deadline of
    CKPTTOOL_REQUEST_TIMEOUT end it with one line naming the object."""
    azure.put("transport/hang.distcp", b"x" * 8192)
    conn = azure.env["AZURE_STORAGE_CONNECTION_STRING"]
    endpoint = conn.split("BlobEndpoint=")[1].split(";")[0]
    target, _, account = endpoint.rpartition("/")
    proxy = Proxy(target)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       conn.replace(endpoint, f"{proxy.url}/{account}"))
    monkeypatch.setenv("CKPTTOOL_REQUEST_TIMEOUT", "0.5")
    monkeypatch.setattr(objstore, "RETRIES", 50)  # the deadline ends it, not the count
    url = objstore.parse(azure.url("transport/hang.distcp"))
    proxy.set("hang", None)
    with pytest.raises(TransportError) as e:
        objstore.get_range(url, 0, 4096)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{url}: reading 4,096 bytes at byte 0 failed")
    assert proxy.faulted < 51


def test_data_reads_refused_are_an_access_error_not_damage(
        azure: Cloud, quick: None, tiny_dcp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """403 on the data reads only (the listing allowed): verify stops with one line naming the
    object and the credentials, exit 3, as merge does; never record-corrupt findings."""
    url = azure.upload_dir(tiny_dcp, "refused/dcp")
    conn = azure.env["AZURE_STORAGE_CONNECTION_STRING"]
    endpoint = conn.split("BlobEndpoint=")[1].split(";")[0]
    target, _, account = endpoint.rpartition("/")
    proxy = Proxy(target)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       conn.replace(endpoint, f"{proxy.url}/{account}"))
    proxy.set("403", None)
    with pytest.raises(AccessError):
        objstore.get_range(objstore.parse(f"{url}/__0_0.distcp"), 0, 64)
    r = CliRunner().invoke(app, ["verify", url])
    assert r.exit_code == 3, r.output
    assert r.output.count("\n") == 1 and "record-corrupt" not in r.output, r.output
    assert "access denied while reading" in r.output and "check the credentials" in r.output
