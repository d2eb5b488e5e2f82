"""A merge shared by N slices straight into S3, against one process into the same S3 server
(moto's, on localhost): wall and CPU time, and the bytes each process keeps on its local disk.

    .venv/bin/python benchmarks/multihost_objects.py [--size 0.5] [--slices 1,2,4]
        [--part-size 16777216] [--workdir /tmp/ckpttool-bench]

1. Reuses ``benchmarks/merge.py``'s generator (real DCP from 4 gloo ranks; cached).
2. One process: ``ckpttool merge SRC s3://bench/one`` (the output staged whole under TMPDIR,
   then uploaded).
3. N slices: ``--slice I/N`` started together, each with a TMPDIR and working directory of its
   own, then ``--finish``; the output compared with the one-process output object by object.
4. Local disk: every TMPDIR is polled (every 20 ms) for the bytes its files hold (allocated
   blocks, so a sparse buffer counts what it holds); the slices also report the largest their
   part buffer held (``local_bytes`` in ``--json``). Target: under 2x one part.

moto keeps objects in memory and answers from one Python process beside the benchmark: the
wall times say what this machine does, not what S3 does; the local-disk figures carry over.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _measure as M  # noqa: E402
import merge as bench  # noqa: E402

BUCKET = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def disk_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


class Poller:
    """The largest :func:`disk_bytes` of each directory while running."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs
        self.peak = [0] * len(dirs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, d in enumerate(self.dirs):
                self.peak[i] = max(self.peak[i], disk_bytes(d))
            time.sleep(0.02)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def start(argv: list[str], env: dict[str, str], home: Path) -> subprocess.Popen[str]:
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=home, env={**env, "TMPDIR": str(home / "tmp")})


def wait(procs: list[subprocess.Popen[str]]) -> tuple[float, list[str]]:
    """CPU seconds of all of them (user + system), and their stdout; raises on a failure."""
    cpu = 0.0
    outs = []
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        cpu += usage.ru_utime + usage.ru_stime
        out, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"{p.args}: exit {p.returncode}: {err[-2000:]}")
        outs.append(out)
    return cpu, outs


def objects(client: Any, prefix: str) -> dict[str, bytes]:
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=prefix + "/") for o in page.get("Contents", ())]
    return {k[len(prefix) + 1:]: client.get_object(Bucket=BUCKET, Key=k)["Body"].read()
            for k in keys}


def clear(client: Any, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                 Prefix=prefix + "/"):
        for o in page.get("Contents", ()):
            client.delete_object(Bucket=BUCKET, Key=o["Key"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=0.5)
    ap.add_argument("--slices", default="1,2,4")
    ap.add_argument("--part-size", type=int, default=16 << 20)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    args = ap.parse_args()
    import boto3
    from moto.server import ThreadedMotoServer

    src, _ = bench.ensure_checkpoint(args.workdir, args.size)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
             "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(s3env)
    client = boto3.session.Session().client("s3")
    client.create_bucket(Bucket=BUCKET)
    env = {**os.environ, **s3env, "PYTHONPATH": str(ROOT),
           "CKPTTOOL_PART_SIZE": str(args.part_size), "OMP_NUM_THREADS": "1",
           # moto joins a completed upload's parts in Python: under load that outlasts the
           # default 30 s read timeout, and the retried complete finds no upload (a 500).
           "CKPTTOOL_REQUEST_TIMEOUT": "300"}
    exe = [sys.executable, "-m", "ckpttool", "merge", "--weights-only", str(src)]
    print(f"# shared merge into S3 (moto): {src} ({M.dir_bytes(src) / 1e9:.2f} GB), parts of "
          f"{args.part_size / 2**20:.0f} MiB")
    print(f"machine: {M.machine_info()}\n")
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="ckpttool-mh-bench-"))
    try:
        home = scratch / "one"
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        with Poller([home]) as poll:
            cpu, _ = wait([start([*exe, f"s3://{BUCKET}/one"], env, home)])
        wall = time.perf_counter() - t0
        reference = objects(client, "one")
        rows.append(["1 process", f"{wall:.1f}", f"{cpu:.1f}",
                     f"{poll.peak[0] / 2**20:.1f}", "-", f"{load:.1f}"])
        clear(client, "one")
        for n in [int(x) for x in args.slices.split(",")]:
            prefix = f"slices{n}"
            homes = [scratch / f"{prefix}-{i}" for i in range(n)]
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            with Poller(homes) as poll:
                cpu, outs = wait([start([*exe, f"s3://{BUCKET}/{prefix}", "--slice", f"{i}/{n}",
                                         "--json"], env, h) for i, h in enumerate(homes)])
                finish_home = scratch / f"{prefix}-finish"
                cpu_f, _ = wait([start([*exe, f"s3://{BUCKET}/{prefix}", "--finish"], env,
                                       finish_home)])
            wall = time.perf_counter() - t0
            reported = [json.loads(o)["distributed"]["local_bytes"] for o in outs]
            got = objects(client, prefix)
            same = got == reference
            rows.append([f"{n} slices + finish", f"{wall:.1f}", f"{cpu + cpu_f:.1f}",
                         f"{max(poll.peak) / 2**20:.1f}",
                         f"{max(reported) / 2**20:.1f}", f"{load:.1f}"
                         + ("" if same else " (OUTPUT DIFFERS)")])
            clear(client, prefix)
            if not same:
                print(f"{prefix}: the output differs from one process's", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        server.stop()
    print(M.markdown_table(["run", "wall s", "CPU s (all processes)",
                            "most local disk MiB (polled)", "largest part buffer MiB (reported)",
                            "load1 at start"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
