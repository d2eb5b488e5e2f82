"""Benchmark ``ckpttool merge`` of a Megatron-Core torch_dist run to Hugging Face against
``cp -r`` of its iteration directory, and its peak memory against the largest output tensor.

    .venv/bin/python benchmarks/megatron_merge.py [--work DIR] [--size-gb 1.1] [--repeat 1]

1. Writes (once; cached in ``--work``) a run with megatron-core itself on 2 gloo processes
   (``tests/megatron_layouts.py``: a Llama-like GPTModel, TP=2, bf16, GQA, untied, padded
   vocabulary), sized by its hidden size to about ``--size-gb``.
2. Runs ``ckpttool merge RUN OUT`` (the megatron-llama map, chosen from config.json: layers
   unstacked, QKV and gate/up split, vocab cut) and ``cp -r RUN/iter_0000002 COPY``, each in a
   fresh process with the run in the page cache, ``CKPTTOOL_FSYNC=0`` (cp does not fsync).
3. Prints wall time (best of ``--repeat``) and peak RSS of each, the ratio to cp, the largest
   output tensor and the largest stacked source tensor, and ``uptime`` (the machine's load:
   timings on a shared machine are only comparable at the same load).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # (this file is not megatron.py: it would shadow
# the megatron package for everything on this path)

import _measure as M  # noqa: E402

LAYERS, HEADS, GROUPS, VOCAB = 8, 16, 4, 32000


def _shape(size_gb: float) -> tuple[int, int]:
    """Hidden and FFN sizes (FFN = 8/3 hidden, both multiples of 128) for about ``size_gb``
    GB of bf16 weights (per layer (2 + 2 g/h) H^2 + 3 H F, plus two V x H embeddings)."""
    per_h2 = LAYERS * (2 + 2 * GROUPS / HEADS + 3 * 8 / 3)
    a, b, c = per_h2, 2 * VOCAB, -size_gb * 1e9 / 2
    hidden = int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)) // 128 * 128
    return hidden, (hidden * 8 // 3) // 128 * 128


def generate(work: Path, size_gb: float) -> Path:
    from tests import megatron_layouts as ml

    hidden, ffn = _shape(size_gb)
    name = f"bench-{hidden}"
    run = work / name
    if (run / "iter_0000002" / "metadata.json").is_file():
        return run
    shutil.rmtree(run, ignore_errors=True)
    v = ml.Variant(name, "llama", tp=2, heads=HEADS, groups=GROUPS, layers=LAYERS, hidden=hidden,
                   ffn=ffn, vocab=VOCAB, dtype="bfloat16", reference=False)
    ml.write_runs(work, variants=[v])
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckpttool-bench-megatron"))
    ap.add_argument("--size-gb", type=float, default=1.1)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    run = generate(args.work, args.size_gb)
    iteration = run / "iter_0000002"
    config = json.loads((run / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    largest_out = max(vocab * hidden, hidden * config["intermediate_size"]) * 2
    layer_qkv = (HEADS + 2 * GROUPS) * (hidden // HEADS) * hidden * 2
    stacked_fc1 = LAYERS * 2 * config["intermediate_size"] * hidden * 2
    env = {**os.environ, "CKPTTOOL_FSYNC": "0", "PYTHONPATH": str(ROOT)}
    out, copy = args.work / "out", args.work / "copy"
    merges, copies = [], []
    for _ in range(args.repeat):
        for p in (out, copy):
            shutil.rmtree(p, ignore_errors=True)
        M.warm_page_cache(iteration)
        merges.append(M.run_measured([sys.executable, "-m", "ckpttool", "merge", str(run),
                                      str(out), "-q"], env=env))
        M.warm_page_cache(iteration)
        copies.append(M.run_measured(["cp", "-r", str(iteration), str(copy)]))
    merge, cp = M.best_of(merges), M.best_of(copies)
    if not merge.ok:
        sys.exit(f"merge failed: {merge}")
    size = M.dir_bytes(iteration)
    print(f"run: {run} ({size / 1e9:.2f} GB, TP=2, bf16, {LAYERS} layers, hidden {hidden})")
    print(f"merge: {merge.wall_s:.2f} s, peak RSS {merge.peak_rss_bytes / 1e6:.0f} MB")
    print(f"cp -r: {cp.wall_s:.2f} s; merge / cp = {merge.wall_s / cp.wall_s:.2f}x")
    print(f"largest output tensor {largest_out / 1e6:.0f} MB; one layer's linear_qkv "
          f"{layer_qkv / 1e6:.1f} MB; stacked linear_fc1 {stacked_fc1 / 1e6:.0f} MB")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
