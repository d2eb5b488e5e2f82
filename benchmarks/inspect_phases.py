"""The phases of ``inspect --json`` in fresh processes, trees alternating: imports, the
``.metadata`` read (``read_info``), the rest of ``inspect()`` (description, summary, rows),
``to_json`` and ``print_json`` (to /dev/null); CPU seconds of each, with the load.

On a machine whose speed drifts from one run to the next (a shared VM: the same ``read_info``
took 1.9 to 3.2 s within minutes), whole-process wall times of two trees differ by more than
the change being measured; the phases other than the read show it. Run it as

    python benchmarks/inspect_phases.py /work/bench/scale/moe-1M --trees /work/wt/base7 . \
        --repeat 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _measure as M  # noqa: E402

PHASES = ("import", "read_info", "rest-of-inspect", "to_json", "print_json", "total")

# Runs in the child, the tree first on sys.path: prints one line of the phases' CPU seconds.
CHILD = r"""
import os, sys, time
t0 = time.process_time()
sys.path.insert(0, sys.argv[1])
from ckpttool.cli.common import print_json
from ckpttool.core.inspect import inspect
from ckpttool.formats.dcp import reader
read_info = reader.read_info
spent = []
def timed(*args, **kwargs):
    c = time.process_time()
    out = read_info(*args, **kwargs)
    spent.append(time.process_time() - c)
    return out
reader.read_info = timed
t1 = time.process_time()
report = inspect(sys.argv[2])
t2 = time.process_time()
doc = report.to_json()
t3 = time.process_time()
stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
print_json(doc)
sys.stdout = stdout
t4 = time.process_time()
print(t1 - t0, sum(spent), t2 - t1 - sum(spent), t3 - t2, t4 - t3, t4 - t0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--trees", nargs="+", default=["."], help="ckpttool checkouts to compare")
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-phases"))
    args = ap.parse_args()
    got: dict[str, list[list[float]]] = {t: [] for t in args.trees}
    for _ in range(args.repeat):
        for tree in args.trees:
            env = {**M.bytecode_env(args.workdir / "pycache"), "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree),
                                  args.checkpoint], env=env, check=True, capture_output=True,
                                 text=True).stdout
            values = [float(x) for x in out.split()]
            got[tree].append(values)
            print(f"{tree}: " + "  ".join(f"{p} {v:.3f}" for p, v in
                                          zip(PHASES, values, strict=True))
                  + f"  load {M.load1():.2f}", flush=True)
    print("\nCPU s, min / median of", args.repeat, "runs:")
    print("| tree | " + " | ".join(PHASES) + " |")
    print("|---" * (len(PHASES) + 1) + "|")
    for tree, runs in got.items():
        cells = [f"{min(col):.3f} / {statistics.median(col):.3f}" for col in zip(*runs,
                                                                                  strict=True)]
        print(f"| {tree} | " + " | ".join(cells) + " |")
    print(f"load after: {M.load1():.2f}")


if __name__ == "__main__":
    main()
