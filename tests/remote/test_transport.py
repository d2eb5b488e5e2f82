"""A store that misbehaves (issue 20, items 10 and 11): a proxy on localhost in front of
moto's server resets connections, cuts bodies short, answers 503 or trickles bytes, for the
first few ranged GETs or for all of them. Transient failures are retried and the bytes come
out right; failures that last are one line naming the object (exit 3), never reported as
damage in the checkpoint. Listings a directory cannot stand for are one line or skipped with
a warning."""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.errors import InputError, TransportError
from ckpttool.storage import mirror as mirrors
from ckpttool.storage import s3 as remote
from tests.remote.conftest import BUCKET, S3


class Proxy:
    """Forwards HTTP/1.1 requests to moto one connection at a time; a ranged GET meets
    ``fault`` while ``faults_left`` lasts (None: every time)."""

    def __init__(self, target: str) -> None:
        u = urlparse(target)
        self.target = (u.hostname or "127.0.0.1", u.port or 80)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.fault = "none"
        self.faults_left: int | None = 0
        self.faulted = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def set(self, fault: str, times: int | None) -> None:
        with self._lock:
            self.fault, self.faults_left, self.faulted = fault, times, 0

    def _take(self, request: bytes) -> str:
        if not request.startswith(b"GET ") or b"\r\nrange:" not in request.lower():
            return "none"
        with self._lock:
            if self.faults_left is not None and self.faults_left <= 0:
                return "none"
            if self.faults_left is not None:
                self.faults_left -= 1
            self.faulted += 1
            return self.fault

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            while True:
                request = _read_request(conn)
                if request is None:
                    return
                fault = self._take(request)
                if fault == "hang":  # accepted, never answered: until the client gives up
                    while conn.recv(65536):
                        pass
                    return
                if fault == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if fault == "403":  # the data refused, the listing not (a narrow policy)
                    body = (b"<?xml version=\"1.0\"?><Error><Code>AccessDenied</Code>"
                            b"<Message>Access Denied</Message></Error>")
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml"
                                 b"\r\nContent-Length: " + str(len(body)).encode()
                                 + b"\r\n\r\n" + body)
                    continue
                if fault == "503":
                    body = b"<Error><Code>SlowDown</Code><Message>slow</Message></Error>"
                    conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
                    continue
                response = _forward(self.target, request)
                head, _, body = response.partition(b"\r\n\r\n")
                if fault == "short":
                    conn.sendall(head + b"\r\n\r\n" + body[: len(body) // 2])
                    return
                if fault == "trickle":
                    conn.sendall(head + b"\r\n\r\n")
                    for k in range(len(body)):
                        conn.sendall(body[k:k + 1])
                        time.sleep(0.5)
                    return
                conn.sendall(response)
        except OSError:
            return
        finally:
            conn.close()


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            return None
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v.strip())
    while len(rest) < length:
        rest += conn.recv(65536)
    return head + b"\r\n\r\n" + rest


def _forward(target: tuple[str, int], request: bytes) -> bytes:
    head, _, body = request.partition(b"\r\n\r\n")
    lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    with socket.create_connection(target) as s:
        s.sendall(b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body)
        chunks = []
        while piece := s.recv(1 << 20):
            chunks.append(piece)
    return b"".join(chunks)


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
    with mirrors.Mirror(f"s3://{BUCKET}/odd", data_suffixes=(".distcp",)) as m:
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
        mirrors.Mirror(f"s3://{BUCKET}/sizes", data_suffixes=(".safetensors",))


def test_no_space_for_the_mirror_is_one_line(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.client.put_object(Bucket=BUCKET, Key="nospace/config.json", Body=b"{}")

    def full(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(InputError, match=r"no space left for its local mirror in .*; set "
                       "TMPDIR to a directory with room"):
        mirrors.Mirror(f"s3://{BUCKET}/nospace", data_suffixes=(".distcp",))
