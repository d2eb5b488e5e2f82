"""The pieces of ``inspect --json`` alone over a cached checkpoint: the ``.metadata`` walk and
its conversion to columns (formats/dcp/columns.py), ``read_info``, the whole library
``inspect()``, the report's JSON and its layout as ``print_json`` writes it; CPU (user+sys)
and wall time of each with the load beside it. Compare trees side by side, alternating:

    for i in 1 2 3; do for tree in /work/wt/base6 .; do
        python benchmarks/inspect_pieces.py /work/bench/scale/moe-1M --tree $tree; done; done
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(tree: str, label: str, fn: Callable[[], Any]) -> Any:
    c0, w0 = _cpu(), time.perf_counter()
    out = fn()
    print(f"[{tree}] {label:18s} cpu {_cpu() - c0:6.3f} s  wall {time.perf_counter() - w0:6.3f} s"
          f"  load {os.getloadavg()[0]:.2f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--tree", default=".", help="the ckpttool checkout to import")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    import numpy  # noqa: F401 - imported by every piece below: not timed in the first

    from ckpttool.cli.common import _layout
    from ckpttool.core.inspect import inspect
    from ckpttool.formats.codecs import torchsave
    from ckpttool.formats.dcp import columns
    from ckpttool.formats.dcp.reader import _metadata_global, read_info

    tree = args.tree
    md = Path(args.checkpoint) / ".metadata"

    def walk() -> Any:
        with open(md, "rb") as f, torchsave.gc_paused():
            size = f.seek(0, 2)
            f.seek(0)
            vm = columns._Machine(f, size, _metadata_global)
            return vm, vm.run()

    walked = [_timed(tree, ".metadata walk", walk)]

    def convert() -> Any:
        vm, obj = walked.pop()
        with torchsave.gc_paused():
            return columns._convert(vm, obj, ".metadata")

    _timed(tree, "columns convert", convert)
    _timed(tree, "read_info", lambda: read_info(args.checkpoint))
    report = _timed(tree, "inspect()", lambda: inspect(args.checkpoint))
    doc = _timed(tree, "report to_json", report.to_json)
    text = _timed(tree, "print_json layout", lambda: _layout(doc))
    print(f"[{tree}] {len(text):,} characters of JSON, peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB", flush=True)


if __name__ == "__main__":
    main()
