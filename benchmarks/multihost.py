"""``ckpttool merge`` shared by 1, 2 and 4 processes (torchrun, gloo on CPU) on the 3 GB
benchmark checkpoint: plan balance per process count, and wall time.

    .venv/bin/python benchmarks/multihost.py [--size 3] [--ranks 1,2,4] [--repeat 2]
        [--dtype keep] [--max-shard-size 5GB] [--workdir /tmp/ckpttool-bench]

1. Reuses ``benchmarks/merge.py``'s generator (real DCP from 4 gloo ranks; cached).
2. Balance, from the plan alone (what every process computes): bytes per process, largest /
   mean, for 1..64 processes, into one output file (the default 5GB shard limit) and into
   shards (``--max-shard-size``).
3. Wall time of ``ckpttool merge`` alone, then under ``torchrun --standalone
   --nproc-per-node N`` (page cache warm), best of ``--repeat``, each output checked equal to
   the one-process output byte for byte.

On a 2-core machine more processes cannot copy faster than the disk and the cores allow; what
carries to many hosts is the balance (each host writes its share, with no messages between
them while copying), and the fixed cost per launch measured here.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _measure as M  # noqa: E402
import merge as bench  # noqa: E402

from ckpttool.core import dtype_policy  # noqa: E402
from ckpttool.core.checkpoint.discover import discover  # noqa: E402
from ckpttool.core.merge import partition  # noqa: E402
from ckpttool.core.merge.plan import plan_merge  # noqa: E402
from ckpttool.units import parse_size  # noqa: E402


def balance_rows(src: Path, dtype: str, shard: str) -> list[list[object]]:
    ckpt = discover(src, command="merge")
    policy = dtype_policy.resolve(dtype, None)
    rows = []
    for limit in ("5GB", shard) if shard != "5GB" else ("5GB",):
        plan = plan_merge([(t.name, t.tensor) for t in ckpt.tensors], policy=policy,
                          max_shard_size=parse_size(limit))
        for n in (1, 2, 4, 8, 64):
            t1 = time.perf_counter()
            shares = partition.split(plan, n)
            split_ms = (time.perf_counter() - t1) * 1e3
            sizes = partition.rank_bytes(shares)
            cut = sum(u.elements is not None for s in shares for u in s)
            rows.append([f"{len(plan.files)} file{'s' if len(plan.files) > 1 else ''}", n,
                         f"{min(sizes) / 1e6:.1f}", f"{max(sizes) / 1e6:.1f}",
                         f"{partition.balance(shares):.4f}", cut, f"{split_ms:.1f}"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=3.0)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dtype", default="keep")
    ap.add_argument("--max-shard-size", default="1GB")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    args = ap.parse_args()
    src, _ = bench.ensure_checkpoint(args.workdir, args.size)
    print(f"# multihost merge: {src} ({M.dir_bytes(src) / 1e9:.2f} GB), --dtype {args.dtype}")
    print(f"machine: {M.machine_info()}\n")
    print("## Balance (from the plan; what each process writes)\n")
    print(M.markdown_table(["output", "processes", "least MB", "most MB", "most / mean",
                            "chunks cut", "split ms"],
                           balance_rows(src, args.dtype, args.max_shard_size)))
    out_root = args.workdir / "multihost-out"
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir(parents=True)
    alone = out_root / "alone"
    rows = []
    M.warm_page_cache(src)
    for n in [int(x) for x in args.ranks.split(",")]:
        best = None
        for _ in range(args.repeat):
            out = out_root / f"n{n}"
            shutil.rmtree(out, ignore_errors=True)
            merge = [str(src), str(out), "--dtype", args.dtype, "-q"]
            argv = ([sys.executable, "-m", "ckpttool", "merge", *merge] if n == 1 else
                    [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", str(n), "-m", "ckpttool", "merge", *merge])
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
            wall = time.perf_counter() - t0
            best = wall if best is None else min(best, wall)
            if n == 1 and not alone.exists():
                out.rename(alone)
            elif alone.exists():
                names = sorted(p.name for p in alone.iterdir())
                same = filecmp.cmpfiles(alone, out, names, shallow=False)[0]
                assert same == names, f"{n} processes: output differs from one process's"
        rows.append([n, "alone" if n == 1 else "torchrun", f"{best:.2f}"])
    print(f"\n## Wall time (best of {args.repeat}; includes Python + torch start-up per "
          "process)\n")
    print(M.markdown_table(["processes", "launch", "wall s"], rows))
    shutil.rmtree(out_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
