"""A misbehaving HTTP/1.1 proxy on localhost, in front of a local object store (moto,
Azurite): it resets connections, cuts bodies short, answers 403 or 503, trickles bytes or
hangs, for the first few ranged GETs or for all of them. Used by tests/remote/test_transport.py
and tests/clouds/test_cloud_transport.py."""

from __future__ import annotations

import socket
import struct
import threading
import time
from urllib.parse import urlparse


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
