"""A store that misbehaves (issue 20, items 10 and 11): a proxy on localhost in front of
moto's server resets connections, cuts bodies short, answers 503 or trickles bytes, for the
first few ranged GETs or for all of them. Transient failures are retried and the bytes come
out right; failures that last are one line naming the object (exit 3), never reported as
damage in the checkpoint. Listings a directory cannot stand for are one line or skipped with
a warning."""

from __future__ import annotations

import errno
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.errors import InputError, TransportError
from ckpttool.storage import s3 as remote
from ckpttool.storage.objtree import ObjectTree
from tests.proxy import Proxy
from tests.remote.conftest import BUCKET, S3


@pytest.fixture
def proxy(s3: S3, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxy]:
    p = Proxy(s3.env["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    monkeypatch.setattr(remote, "_client", None)  # a client for the proxy's endpoint
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    monkeypatch.setattr(remote, "ATTEMPTS", 2)
    yield p
    remote._client = None


@pytest.fixture
def blob(s3: S3) -> tuple[remote.Url, bytes]:
    data = bytes(range(256)) * 4096
    s3.client.put_object(Bucket=BUCKET, Key="transport/data.distcp", Body=data)
    return remote.parse(f"s3://{BUCKET}/transport/data.distcp"), data


@pytest.mark.parametrize("fault", ["reset", "short", "503"])
def test_a_transient_failure_is_retried(proxy: Proxy, blob: tuple[remote.Url, bytes],
                                        fault: str) -> None:
    url, data = blob
    proxy.set(fault, 2)
    assert remote.get_range(url, 1000, 300_000) == data[1000:301_000]
    assert proxy.faulted == 2


@pytest.mark.parametrize("fault", ["reset", "short", "503"])
def test_a_lasting_failure_is_one_line_naming_the_object(
        proxy: Proxy, blob: tuple[remote.Url, bytes], fault: str) -> None:
    url, _ = blob
    proxy.set(fault, None)
    with pytest.raises(TransportError) as e:
        remote.get_range(url, 1000, 300_000)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{url}: ")
    assert "failing (not the checkpoint)" in text or "run again later" in text


def test_a_trickling_body_is_given_up(proxy: Proxy, blob: tuple[remote.Url, bytes],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url, data = blob
    monkeypatch.setenv("CKPTTOOL_REQUEST_TIMEOUT", "1")
    proxy.set("trickle", 1)
    started = time.monotonic()
    assert remote.get_range(url, 0, 4096) == data[:4096]
    assert time.monotonic() - started < 10


def test_a_store_that_never_answers_is_given_up(
        proxy: Proxy, blob: tuple[remote.Url, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepted and never answered (issue 34: merge stayed silent past 900 s): a deadline on
    every request (CKPTTOOL_REQUEST_TIMEOUT), then one line naming the object."""
    url, _ = blob
    monkeypatch.setenv("CKPTTOOL_REQUEST_TIMEOUT", "0.5")
    monkeypatch.setattr(remote, "RETRIES", 50)  # the deadline ends it, not the count
    proxy.set("hang", None)
    with pytest.raises(TransportError) as e:
        remote.get_range(url, 1000, 300_000)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{url}: reading 300,000 bytes at byte 1,000 "
                                                "failed ")
    assert proxy.faulted < 2 * 51


def test_merge_from_a_store_that_never_answers_is_exit_3(
        proxy: Proxy, s3: S3, remote_llama: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTTOOL_REQUEST_TIMEOUT", "0.5")
    proxy.set("hang", None)
    r = CliRunner().invoke(app, ["merge", remote_llama, str(tmp_path / "out")])
    assert r.exit_code == 3, r.output
    assert r.stderr.count("\n") == 1 and "failing (not the checkpoint)" in r.stderr
    assert not (tmp_path / "out").exists()


def test_data_reads_refused_are_an_access_error_not_damage(
        proxy: Proxy, s3: S3, remote_llama: str, tmp_path: Path) -> None:
    """403 on the data reads only: one line naming the object and the credentials, exit 3,
    from verify as from merge (verify said record-corrupt for every record)."""
    proxy.set("403", None)
    for args in (["verify", remote_llama], ["merge", remote_llama, str(tmp_path / "out")]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 3, r.output
        assert r.output.count("\n") == 1 and "record-corrupt" not in r.output, r.output
        assert r.output.startswith(f"ckpttool: error: {remote_llama}/")
        assert "access denied while reading (AccessDenied); check the credentials" in r.output


def test_verify_on_a_failing_store_is_exit_3_not_damage(
        proxy: Proxy, s3: S3, remote_llama: str) -> None:
    proxy.set("reset", None)
    r = CliRunner().invoke(app, ["verify", remote_llama])
    assert r.exit_code == 3, r.output
    assert r.output.count("\n") == 1 and "record-corrupt" not in r.output
    assert "failing (not the checkpoint)" in r.output


def test_odd_listings(s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    long = "x" * 300 + ".json"
    for key in ("config.json", "x.distcp", "x.distcp/child", long):
        s3.client.put_object(Bucket=BUCKET, Key=f"odd/{key}", Body=b"{}")
    with ObjectTree(f"s3://{BUCKET}/odd") as m:
        assert sorted(m.objects) == ["config.json", "x.distcp/child"]
    err = capsys.readouterr().err
    assert f"warning: s3://{BUCKET}/odd/x.distcp: skipped, also a prefix of other objects" in err
    assert "skipped, a name longer than 255 bytes" in err


@pytest.mark.parametrize("size", [2 ** 62, -1])
def test_an_impossible_listed_size_is_one_line(s3: S3, size: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "list_objects",
                        lambda url: {"model.safetensors": (size, '"e"')})
    with pytest.raises(InputError, match=r"model.safetensors: the store lists an impossible "
                       rf"size \({size}\)"):
        ObjectTree(f"s3://{BUCKET}/sizes")


def test_no_temporary_directory_is_one_line(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.client.put_object(Bucket=BUCKET, Key="nospace/config.json", Body=b"{}")

    def full(*args: object, **kwargs: object) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", full)
    with pytest.raises(InputError, match=r"cannot make a temporary directory in .* \(No space "
                       r"left on device\); set TMPDIR to a writable directory"):
        ObjectTree(f"s3://{BUCKET}/nospace")
