"""Merge from object storage vs a plain parallel download of the same objects (same run).

Starts moto's S3 server on localhost (a subprocess, so that it does not share this process's
interpreter lock), writes a DCP checkpoint of about ``--size-mb`` MB with
``torch.distributed.checkpoint.save`` (one process, ``--files`` data files), uploads it, then
times, alternating, ``--repeat`` times each:

* download: every object of the checkpoint fetched with boto3 by 16 MB ranged GETs over 16
  threads into local files (what any tool must at least do to read the bytes);
* obstore: the same GETs with obstore (Rust ``object_store``), when it is installed: the
  client issue 26 asks to compare with boto3 on the S3 path;
* merge: ``ckpttool merge s3://bench/ckpt OUT`` (the library call, in this process).

and prints the median of each and their ratio (target: merge at most 1.3x the download).
moto serves a few hundred MB/s at best: sizes of 0.25-1 GB are enough to see the ratio.

    python benchmarks/remote.py --size-mb 512
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import boto3

    work = Path(tempfile.mkdtemp(prefix="ckpttool-bench-s3-"))
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
        ckpt = work / "ckpt"
        write_checkpoint(ckpt, args.size_mb, args.files)
        c = boto3.session.Session().client("s3")
        c.create_bucket(Bucket="bench")
        objects = []
        for p in sorted(ckpt.iterdir()):
            c.upload_file(str(p), "bench", f"ckpt/{p.name}")
            objects.append((f"ckpt/{p.name}", p.stat().st_size))
        total = sum(s for _, s in objects)
        print(f"checkpoint: {total / 1e6:.0f} MB in {len(objects)} objects")

        def download() -> float:
            dst = work / "download"
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir()
            started = time.perf_counter()
            fds = {k: os.open(dst / k.rsplit("/", 1)[1], os.O_WRONLY | os.O_CREAT, 0o644)
                   for k, _ in objects}
            step = 16 << 20

            def get(key: str, offset: int, size: int) -> None:
                body = c.get_object(Bucket="bench", Key=key,
                                    Range=f"bytes={offset}-{offset + size - 1}")["Body"]
                os.pwrite(fds[key], body.read(), offset)

            with ThreadPoolExecutor(16) as pool:
                for f in [pool.submit(get, k, o, min(step, s - o)) for k, s in objects
                          for o in range(0, s, step)]:
                    f.result()
            for fd in fds.values():
                os.close(fd)
            return time.perf_counter() - started

        def obstore_download() -> float:
            import obstore
            from obstore.store import S3Store

            store = S3Store("bench", endpoint=endpoint, access_key_id="bench",
                            secret_access_key="bench", region="us-east-1",
                            client_options={"allow_http": True})
            dst = work / "download-obstore"
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir()
            started = time.perf_counter()
            fds = {k: os.open(dst / k.rsplit("/", 1)[1], os.O_WRONLY | os.O_CREAT, 0o644)
                   for k, _ in objects}
            step = 16 << 20

            def get(key: str, offset: int, size: int) -> None:
                data = obstore.get_range(store, key, start=offset, end=offset + size)
                os.pwrite(fds[key], memoryview(data), offset)

            with ThreadPoolExecutor(16) as pool:
                for f in [pool.submit(get, k, o, min(step, s - o)) for k, s in objects
                          for o in range(0, s, step)]:
                    f.result()
            for fd in fds.values():
                os.close(fd)
            return time.perf_counter() - started

        def merge() -> float:
            from ckpttool.core.merge.operation import merge as ck_merge

            out = work / "merged"
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            ck_merge("s3://bench/ckpt", out, dtype="keep")
            return time.perf_counter() - started

        try:
            import obstore  # noqa: F401
            have_obstore = True
        except ImportError:
            have_obstore = False
        times: dict[str, list[float]] = {"download": [], "obstore": [], "merge": []}
        for _ in range(args.repeat):
            times["download"].append(download())
            if have_obstore:
                times["obstore"].append(obstore_download())
            times["merge"].append(merge())
        d, m = statistics.median(times["download"]), statistics.median(times["merge"])
        print(f"plain parallel download (boto3, 16 x 16 MB GETs): {d:.2f} s "
              f"({total / d / 1e6:.0f} MB/s)")
        if times["obstore"]:
            o = statistics.median(times["obstore"])
            print(f"plain parallel download (obstore, same GETs):     {o:.2f} s "
                  f"({total / o / 1e6:.0f} MB/s); obstore / boto3: {o / d:.2f}x")
        print(f"ckpttool merge s3://... OUT:                      {m:.2f} s "
              f"({total / m / 1e6:.0f} MB/s)")
        print(f"ratio merge / download: {m / d:.2f}x (target <= 1.3x)")
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
