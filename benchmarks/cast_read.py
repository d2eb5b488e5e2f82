"""Casting merges: reading the source through a memory mapping against ``pread`` into a
reused buffer (issue 20, item 9).

    .venv/bin/python benchmarks/cast_read.py [--size-gb 2] [--repeat 5] [--dir DIR]

Writes (once, cached in DIR) an fp32 ``model.safetensors`` of about ``--size-gb`` GB (Llama-like
square and 4x matrices), reads it once into the page cache, then runs
``ckpttool merge SRC OUT --dtype bf16`` in fresh child processes, alternating the two ways of
reading: ``mapped`` (``read_blocks`` maps windows of the page cache, as before) and ``pread``
(every read copied into the thread's reused cast buffer: ``MAP_MIN`` set past any size in the
child, the path every non-local store takes). Prints wall, user and system seconds of each run
with the load average beside it, then the best and the median of each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
from ckpttool.storage import store
if sys.argv[1] == "pread":
    store.MAP_MIN = 1 << 62
from ckpttool.cli import main
sys.argv = ["ckpttool", *sys.argv[2:]]
main()
"""


def make_source(src: Path, size_gb: float) -> None:
    import torch
    from safetensors.torch import save_file

    if (src / "model.safetensors").exists():
        return
    src.mkdir(parents=True, exist_ok=True)
    hidden = 2048
    per_layer = (4 * hidden * hidden + 3 * 4 * hidden * hidden) * 4  # fp32 bytes
    layers = max(1, round(size_gb * 1e9 / per_layer))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        for n in ("q", "k", "v", "o"):
            tensors[f"model.layers.{i}.self_attn.{n}_proj.weight"] = torch.randn(
                hidden, hidden, generator=g)
        for n in ("gate", "up"):
            tensors[f"model.layers.{i}.mlp.{n}_proj.weight"] = torch.randn(
                4 * hidden, hidden, generator=g)
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(
            hidden, 4 * hidden, generator=g)
    save_file(tensors, src / "model.safetensors")


def run_once(mode: str, src: Path, out: Path) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, "merge", str(src), str(out),
                             "--dtype", "bf16", "-q"], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{mode}: exit {os.waitstatus_to_exitcode(status)}")
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime,
            "rss_mb": usage.ru_maxrss / 1024, "load": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckpttool-bench-cast"))
    args = ap.parse_args()
    src, out = args.dir / f"fp32-{args.size_gb:g}GB", args.dir / "out"
    # In a child: a child's peak RSS starts from its parent's (Linux keeps it across exec).
    subprocess.run([sys.executable, __file__, "--make", str(src), str(args.size_gb)],
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    size = (src / "model.safetensors").stat().st_size
    with open(src / "model.safetensors", "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    print(f"source {size / 1e9:.2f} GB fp32 -> bf16; {os.cpu_count()} CPUs", flush=True)
    runs: dict[str, list[dict[str, float]]] = {"mapped": [], "pread": []}
    run_once("mapped", src, out)  # warm-up (imports, output space)
    for i in range(args.repeat):
        for mode in (("mapped", "pread") if i % 2 == 0 else ("pread", "mapped")):
            r = run_once(mode, src, out)
            runs[mode].append(r)
            print(f"  {mode:6} wall {r['wall']:.2f} s  user {r['user']:.2f} s  sys "
                  f"{r['sys']:.2f} s  rss {r['rss_mb']:.0f} MB  (load {r['load']:.2f})",
                  flush=True)
    shutil.rmtree(out, ignore_errors=True)
    for mode, rs in runs.items():
        walls = [r["wall"] for r in rs]
        print(f"{mode:6}: wall best {min(walls):.2f} s, median {statistics.median(walls):.2f} s;"
              f" sys median {statistics.median(r['sys'] for r in rs):.2f} s; user median "
              f"{statistics.median(r['user'] for r in rs):.2f} s; peak RSS "
              f"{max(r['rss_mb'] for r in rs):.0f} MB")
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make_source(Path(sys.argv[2]), float(sys.argv[3]))
    else:
        main()
