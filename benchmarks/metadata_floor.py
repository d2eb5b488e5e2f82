"""What a compiled ``.metadata`` reader would buy: a measured prototype, not shipped.

Times ``benchmarks/prototype/pickle_walk.c`` (one pass over the pickle's opcodes, every int
copied into a column: what a compiled column reader does at the least) against the shipped
column reader (``formats/dcp/columns.read``) on the same ``.metadata``, CPU seconds, best of
``--repeat``, the load beside each. Needs a C compiler (``cc``); nothing of it is installed.

    .venv/bin/python benchmarks/metadata_floor.py /work/bench/scale/moe-1M/.metadata
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("metadata", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import numpy as np

    from ckpttool.formats.dcp import columns, metadata

    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "walk.so"
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib),
                        str(ROOT / "benchmarks" / "prototype" / "pickle_walk.c")], check=True)
        walk = ctypes.CDLL(str(lib)).walk
        walk.restype = ctypes.c_longlong
        size = args.metadata.stat().st_size
        ints = np.empty(size // 2, dtype=np.int64)  # every int takes 2 bytes of the file or more
        got = ctypes.c_size_t()
        best_c = best_py = float("inf")
        for _ in range(args.repeat):
            c = time.process_time()
            raw = args.metadata.read_bytes()  # the read counts for both
            ops = walk(raw, ctypes.c_size_t(len(raw)), ints.ctypes.data_as(ctypes.c_void_p),
                       ctypes.c_size_t(len(ints)), ctypes.byref(got))
            best_c = min(best_c, time.process_time() - c)
            c = time.process_time()
            table = columns.read(args.metadata, metadata.allowed_global)
            best_py = min(best_py, time.process_time() - c)
            assert table is not None and ops > 0
            del table, raw
            gc.collect()
    print(f"{args.metadata} ({size / 1e6:.0f} MB, {ops:,} opcodes, {got.value:,} ints)")
    print(f"  compiled walk (read + every opcode + every int into a column): {best_c:.3f} s CPU")
    print(f"  shipped column reader (columns.read):                         {best_py:.3f} s CPU")
    print(f"  load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
