"""S3 through boto3 (ckpttool's ``storage/s3.py``) against S3 through obstore, on moto's
server: what issue 37 asked before keeping one S3 backend.

Throughput, alternating the two clients ``--repeat`` times, median of each:

* ranged read: one ``--size-mb`` object read whole by 16 MB ranged GETs over 16 threads
  (boto3: ``ckpttool.storage.s3.get_range``, the backend's own path with its ETag pin and
  retries; obstore: ``obstore.get_range``), and ``--small`` 64 KB ranges at random offsets of a
  4 MB object
  over 16 threads (the per-request cost);
* upload: the object put from a local file in 16 MB parts, 16 in flight (boto3:
  ``ckpttool.storage.s3.Upload``; obstore: ``obstore.put`` with ``chunk_size`` and
  ``max_concurrency``, as ``storage/objstore.py`` uploads to GCS and Azure).

Each figure has the wall time, the CPU seconds of this process (the client) and of the moto
server, and the 1-minute load average: moto is a Python server on the same cores, so the
client's CPU time is the figure that tells the clients apart on a busy machine.

The credential chain: which sources each client finds, each checked by listing the bucket
with nothing else set (moto accepts any key, so a listing that succeeds means the client
found credentials and signed with them): environment variables; a profile in the shared
credentials file (``AWS_PROFILE``); a ``credential_process`` profile; an IAM Identity Center
(SSO) profile whose token is in the SSO cache, its ``GetRoleCredentials`` answered by a
local stand-in of the SSO portal (``AWS_ENDPOINT_URL_SSO``); and a profile's
``endpoint_url`` (MinIO, Ceph, R2). obstore is tried alone (``S3Store`` from the
environment) and with ``obstore.auth.boto3.Boto3CredentialProvider``.

    python benchmarks/s3_clients.py --size-mb 256 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import http.server
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUCKET = "bench"
STEP = 16 << 20
THREADS = 16
SMALL_OBJECT = 4 << 20
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
            "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_SSO", "AWS_DEFAULT_REGION", "AWS_REGION", "HOME")


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def moto() -> Iterator[tuple[str, int]]:
    """moto's server (a subprocess), as the tests start theirs; its endpoint and pid."""
    from tests.clouds.conftest import _free_port, _wait_port, stop

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, server, "moto")
        yield f"http://127.0.0.1:{port}", server.pid
    finally:
        stop(server)


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Only ``values`` of the AWS variables set while the block runs."""
    saved = {k: os.environ.pop(k, None) for k in AWS_VARS}
    os.environ.update(values)
    try:
        yield
    finally:
        for k in AWS_VARS:
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def fresh_clients() -> None:
    """Forget the clients ckpttool built (each check resolves its credentials anew)."""
    from ckpttool.storage import s3

    s3._client = None


# --------------------------------------------------------------------------------------------
# Throughput


def timed(fn: Callable[[], object], server: int) -> tuple[float, float, float]:
    """(wall s, this process's CPU s, the server's CPU s) of ``fn()``."""
    c0, s0, t0 = cpu_self(), cpu_of(server), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_self() - c0, cpu_of(server) - s0


def throughput(endpoint: str, server: int, size_mb: int, small: int, repeat: int,
               work: Path) -> list[tuple[str, str, float, float, float, float, float]]:
    import obstore
    from obstore.store import S3Store

    from ckpttool.storage import objects, s3

    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    rows = []
    with environment(**env):
        fresh_clients()
        client = s3.client(s3.parse(f"s3://{BUCKET}/x"))
        client.create_bucket(Bucket=BUCKET)
        size = size_mb << 20
        local = work / "up"
        local.mkdir()
        (local / "blob.bin").write_bytes(os.urandom(size))
        client.upload_file(str(local / "blob.bin"), BUCKET, "read/blob.bin")
        url = s3.parse(f"s3://{BUCKET}/read/blob.bin")
        etag = s3.head(url)
        assert etag is not None
        # The small ranges from an object of their own: moto copies the whole object for
        # every ranged GET, so a large one would measure moto, not the client.
        client.put_object(Bucket=BUCKET, Key="read/small.bin", Body=os.urandom(SMALL_OBJECT))
        small_url = s3.parse(f"s3://{BUCKET}/read/small.bin")
        small_etag = s3.head(small_url)
        assert small_etag is not None
        store = S3Store(BUCKET, client_options={"allow_http": True})
        rng = random.Random(0)
        smalls = [rng.randrange(0, SMALL_OBJECT - (64 << 10)) for _ in range(small)]
        names = objects.OutputNames(replaces=lambda n: False, last=lambda n: False)

        def boto3_read() -> None:
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(lambda o: s3.get_range(url, o, min(STEP, size - o), etag[1]),
                              range(0, size, STEP)))

        def obstore_read() -> None:
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(lambda o: obstore.get_range(store, url.key, start=o,
                                                          end=min(o + STEP, size)),
                              range(0, size, STEP)))

        def boto3_small() -> None:
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(lambda o: s3.get_range(small_url, o, 64 << 10, small_etag[1]),
                              smalls))

        def obstore_small() -> None:
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(lambda o: obstore.get_range(store, small_url.key, start=o,
                                                          end=o + (64 << 10)), smalls))

        def boto3_upload() -> None:
            s3.Upload(s3.parse(f"s3://{BUCKET}/up-boto3"), overwrite=True, names=names
                      ).run(local)

        def obstore_upload() -> None:
            def parts() -> Iterator[bytes]:
                with open(local / "blob.bin", "rb") as f:
                    while piece := f.read(STEP):
                        yield piece

            obstore.put(store, "up-obstore/blob.bin", parts(), chunk_size=STEP,
                        max_concurrency=THREADS)

        cases = {"ranged read, 16 MB GETs x 16": (boto3_read, obstore_read, size),
                 f"ranged read, {small} x 64 KB GETs x 16": (boto3_small, obstore_small,
                                                            small * (64 << 10)),
                 "upload, 16 MB parts x 16": (boto3_upload, obstore_upload, size)}
        for what, (b, o, nbytes) in cases.items():
            got: dict[str, list[tuple[float, float, float]]] = {"boto3": [], "obstore": []}
            loads = []
            b(), o()  # warm: connections, the first request's set-up
            for _ in range(repeat):
                got["boto3"].append(timed(b, server))
                got["obstore"].append(timed(o, server))
                loads.append(os.getloadavg()[0])
            for name, runs in got.items():
                wall = statistics.median(r[0] for r in runs)
                rows.append((what, name, wall, nbytes / wall / 1e6,
                             statistics.median(r[1] for r in runs),
                             statistics.median(r[2] for r in runs), statistics.median(loads)))
                print(*rows[-1], flush=True)  # as it goes: a busy machine may stop the rest
        head = client.head_object(Bucket=BUCKET, Key="up-obstore/blob.bin")
        assert head["ContentLength"] == size
        back = obstore.get(store, "up-boto3/blob.bin").bytes()
        assert hashlib.sha256(bytes(back)).digest() == \
            hashlib.sha256((local / "blob.bin").read_bytes()).digest()
    return rows


# --------------------------------------------------------------------------------------------
# The credential chain


class _Portal(http.server.BaseHTTPRequestHandler):
    """A stand-in of the IAM Identity Center portal's GetRoleCredentials (what an SSO
    profile's credentials come from, once ``aws sso login`` has cached a token)."""

    calls = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        _Portal.calls += 1
        ok = (self.path.startswith("/federation/credentials")
              and self.headers.get("x-amz-sso_bearer_token") == "sso-token")
        body = json.dumps({"roleCredentials": {
            "accessKeyId": "sso-key", "secretAccessKey": "sso-secret",
            "sessionToken": "sso-session", "expiration": int(time.time() + 3600) * 1000}}
        ).encode() if ok else b'{"message": "no"}'
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def credential_sources(endpoint: str, work: Path) -> list[tuple[str, dict[str, str]]]:
    """(source, environment) for each credential source, its files under ``work``."""
    home = work / "home" / ".aws"  # the SSO token cache is ~/.aws/sso/cache, whatever else
    (home / "sso" / "cache").mkdir(parents=True)
    start = "https://bench.awsapps.com/start"
    token = {"startUrl": start, "region": "us-east-1", "accessToken": "sso-token",
             "expiresAt": "2099-01-01T00:00:00Z"}
    cache = hashlib.sha1(start.encode(), usedforsecurity=False).hexdigest()
    (home / "sso" / "cache" / f"{cache}.json").write_text(json.dumps(token))
    proc = work / "creds.sh"
    proc.write_text('#!/bin/sh\necho \'{"Version": 1, "AccessKeyId": "proc-key", '
                    '"SecretAccessKey": "proc-secret"}\'\n')
    proc.chmod(0o755)
    (home / "credentials").write_text("[keys]\naws_access_key_id = profile-key\n"
                                      "aws_secret_access_key = profile-secret\n")
    (home / "config").write_text(
        "[profile keys]\nregion = us-east-1\n"
        f"[profile process]\nregion = us-east-1\ncredential_process = {proc}\n"
        f"[profile sso]\nregion = us-east-1\nsso_start_url = {start}\nsso_region = us-east-1\n"
        "sso_account_id = 123456789012\nsso_role_name = Bench\n"
        "[profile endpoint]\nregion = us-east-1\naws_access_key_id = e\n"
        f"aws_secret_access_key = e\nendpoint_url = {endpoint}\n")
    files = {"AWS_CONFIG_FILE": str(home / "config"),
             "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials"),
             "AWS_DEFAULT_REGION": "us-east-1", "HOME": str(home.parent)}
    return [
        ("environment variables (AWS_ACCESS_KEY_ID...)",
         {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": endpoint,
          "AWS_DEFAULT_REGION": "us-east-1"}),
        ("a profile's keys (AWS_PROFILE, ~/.aws/credentials)",
         {**files, "AWS_PROFILE": "keys", "AWS_ENDPOINT_URL": endpoint}),
        ("credential_process profile", {**files, "AWS_PROFILE": "process",
                                        "AWS_ENDPOINT_URL": endpoint}),
        ("SSO profile (token cached by aws sso login)", {**files, "AWS_PROFILE": "sso",
                                                         "AWS_ENDPOINT_URL": endpoint}),
        ("a profile's endpoint_url (MinIO, Ceph, R2)", {**files, "AWS_PROFILE": "endpoint"}),
    ]


def chain(endpoint: str, work: Path) -> list[tuple[str, str, str, str]]:
    """Each credential source checked in a process of its own (botocore fixes the SSO cache's
    directory from HOME when imported, and caches credentials)."""
    portal = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Portal)
    threading.Thread(target=portal.serve_forever, daemon=True).start()
    sso = f"http://127.0.0.1:{portal.server_address[1]}"
    rows = []
    base = {k: v for k, v in os.environ.items() if k not in AWS_VARS}
    try:
        for source, env in credential_sources(endpoint, work):
            r = subprocess.run([sys.executable, __file__, "--chain-row"],
                               env={**base, **env, "AWS_ENDPOINT_URL_SSO": sso},
                               capture_output=True, text=True, timeout=120)
            got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                [f"no (exit {r.returncode}: {r.stderr.strip()[-150:]})"] * 3
            rows.append((source, *got))
    finally:
        portal.shutdown()
    return rows


def chain_row() -> list[str]:
    """Whether each client lists the bucket with the credentials this process's environment
    leads to."""
    import obstore
    from obstore.auth.boto3 import Boto3CredentialProvider
    from obstore.store import S3Store

    from ckpttool.storage import s3

    def attempt(fn: Callable[[], object]) -> str:
        try:
            fn()
            return "yes"
        except Exception as e:  # the reason, short
            text = str(e).splitlines()[0][:110] if str(e) else ""
            return f"no ({type(e).__name__}: {text})"

    def store(**extra: Any) -> Any:
        return S3Store(BUCKET, client_options={"allow_http": True, "timeout": "5s",
                                               "connect_timeout": "2s"},
                       retry_config={"max_retries": 0,
                                     "retry_timeout": datetime.timedelta(seconds=3)}, **extra)

    def provided() -> None:
        import boto3

        obstore.list(store(credential_provider=Boto3CredentialProvider(boto3.Session())),
                     "read/").collect()

    return [attempt(lambda: s3.list_objects(s3.parse(f"s3://{BUCKET}/read"))),
            attempt(lambda: obstore.list(store(), "read/").collect()), attempt(provided)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chain-row", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.chain_row:
        print(json.dumps(chain_row()))
        return 0
    work = Path(tempfile.mkdtemp(prefix="ckpttool-bench-s3-"))
    try:
        with moto() as (endpoint, pid):
            rows = throughput(endpoint, pid, args.size_mb, args.small, args.repeat, work)
            creds = chain(endpoint, work)
        print(f"\nS3 on moto, {args.size_mb} MB object, median of {args.repeat}, alternating\n")
        print("| what | client | seconds | MB/s | client CPU s | moto CPU s | load (1 min) |")
        print("|---|---|---|---|---|---|---|")
        for what, name, wall, rate, cpu, server, load in rows:
            print(f"| {what} | {name} | {wall:.2f} | {rate:.0f} | {cpu:.2f} | {server:.2f} | "
                  f"{load:.1f} |")
        print("\n| credential source | boto3 (storage/s3.py) | obstore alone | "
              "obstore + Boto3CredentialProvider |")
        print("|---|---|---|---|")
        for source, b, alone, provided in creds:
            print(f"| {source} | {b} | {alone} | {provided} |")
        print(f"\n(the SSO portal's stand-in answered {_Portal.calls} GetRoleCredentials "
              "requests)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
