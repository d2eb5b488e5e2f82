"""``Reader.fill_rows`` alone over a cached checkpoint: every tensor, in windows of about the
stored bytes a merge window takes, without then with checksums (as merge and verify run it);
CPU and wall time with the load beside each, and a digest of what was filled (the same in
every tree). Compare trees side by side in one run:

    for tree in /work/wt/base5 .; do python benchmarks/fill_rows.py /work/bench/scale/moe-1M \\
        --tree $tree; done

``--profile`` prints the functions that took the most time (cProfile)."""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import os
import pstats
import sys
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--tree", default=".", help="the ckpttool checkout to import")
    ap.add_argument("--window-mb", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    from ckpttool.formats.dcp.reader import open_reader, read_info

    t0 = time.perf_counter()
    info = read_info(args.checkpoint)
    print(f"[{args.tree}] .metadata read {time.perf_counter() - t0:.2f} s wall, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    windows: list[list[Any]] = [[]]
    stored = 0
    for t in info.tensors:
        windows[-1].append(t)
        stored += t.stored_bytes
        if stored > args.window_mb << 20:
            windows.append([])
            stored = 0

    def run(checksums: bool) -> tuple[str, int, int]:
        r = open_reader(info)
        digest = hashlib.sha256()
        withheld = checked = 0
        for w in windows:
            dsts, at = [], 0
            for t in w:
                dsts.append(at)
                at += t.nbytes
            out = bytearray(at)
            got = r.fill_rows(w, out, dsts, checksums=checksums)
            withheld += sum(g is None for g in got)
            checked += sum(g or 0 for g in got)
            digest.update(out)
        r.close()
        return digest.hexdigest()[:16], withheld, checked

    for checksums in (False, True):
        prof = cProfile.Profile() if args.profile else None
        c0, w0 = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        digest, withheld, checked = run(checksums)
        if prof:
            prof.disable()
        print(f"[{args.tree}] checksums={checksums}: CPU {time.process_time() - c0:.2f} s, "
              f"wall {time.perf_counter() - w0:.2f} s, load {os.getloadavg()[0]:.2f}; "
              f"digest {digest}, withheld {withheld}, checked {checked} B", flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
