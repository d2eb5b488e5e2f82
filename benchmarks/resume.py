"""Resume a cut merge: kill ``ckpttool merge`` of the 3 GB benchmark checkpoint at random
points, run the same command again, and check what it wrote.

    .venv/bin/python benchmarks/resume.py [--size 3] [--kills 3] [--seed 0]

1. The checkpoint of ``benchmarks/merge.py`` (generated once, cached in ``--workdir``).
2. A reference merge, timed, and the same merge written whole (``CKPTTOOL_RESUME_PIECE`` larger
   than the output: no pieces, no journal), timed: the cost of writing in pieces.
3. ``--kills`` times: a merge killed (SIGKILL) at a random point between 10% and 90% of the
   reference time, then the same command again; its ``--json`` report says how many pieces
   the killed run had recorded and how many bytes it did not write again; the output is
   compared with the reference byte for byte.

Measures; asserts only that every output equals the reference.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import merge as bench  # noqa: E402


def _merge(src: Path, out: Path, env: dict[str, str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    done = subprocess.run([bench.ckpttool_exe(), "merge", str(src), str(out), "--json",
                           "--no-progress"], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=3.0, help="checkpoint size in GB")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    src, _ = bench.ensure_checkpoint(args.workdir, args.size)
    scratch = args.workdir / "resume"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    env = {**os.environ, "CKPTTOOL_FSYNC": "0"}
    ref = scratch / "ref"
    pieces, report = _merge(src, ref, env)
    whole, _ = _merge(src, scratch / "whole", {**env, "CKPTTOOL_RESUME_PIECE": str(1 << 50)})
    shutil.rmtree(scratch / "whole")
    print(f"merge in pieces: {pieces:.2f} s ({report['resumed']['pieces']} pieces); "
          f"written whole: {whole:.2f} s; {report['total_bytes'] / 1e9:.2f} GB", flush=True)
    ok = True
    for k in range(args.kills):
        out = scratch / f"cut-{k}"
        at = rng.uniform(0.1, 0.9) * pieces
        proc = subprocess.Popen([bench.ckpttool_exe(), "merge", str(src), str(out),
                                 "--no-progress", "-q"], env=env)
        time.sleep(at)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        took, again = _merge(src, out, env)
        r = again["resumed"]
        same = all(filecmp.cmp(ref / f["name"], out / f["name"], shallow=False)
                   for f in again["files"])
        ok = ok and same
        print(f"killed at {at:.2f} s: re-run {took:.2f} s, {r['done_before']} of {r['pieces']} "
              f"pieces kept, {r['bytes_skipped'] / 1e9:.2f} of "
              f"{again['total_bytes'] / 1e9:.2f} GB not written again; "
              f"{'bit-exact' if same else 'DIFFERENT'}", flush=True)
        shutil.rmtree(out)
    shutil.rmtree(scratch)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
