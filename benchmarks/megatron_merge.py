"""Benchmark ``ckpttool merge`` of a Megatron-Core torch_dist run to Hugging Face against
``cp -r`` of its iteration directory, and its peak memory against the largest output tensor.

    .venv/bin/python benchmarks/megatron_merge.py [--work DIR] [--size-gb 1.1] [--repeat 1]
        [--baseline REV]

1. Writes (once; cached in ``--work``) a run with megatron-core itself on 2 gloo processes
   (``tests/megatron_layouts.py``: a Llama-like GPTModel, TP=2, bf16, GQA, untied, padded
   vocabulary), sized by its hidden size to about ``--size-gb``.
2. Runs ``ckpttool merge RUN OUT`` (the megatron-llama map, chosen from config.json: layers
   unstacked, QKV and gate/up split, vocab cut) and ``cp -r RUN/iter_0000002 COPY``, each in a
   fresh process with the run in the page cache, ``CKPTTOOL_FSYNC=0`` (cp does not fsync).
3. Prints each run's wall time and peak RSS (against the largest output tensor) with the
   machine's load beside it (timings on a shared machine are only comparable at the same
   load), then the best of ``--repeat`` against cp. ``--baseline REV`` times ckpttool as it
   was at a git revision in the same loop.
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


def baseline_tree(work: Path, rev: str) -> tuple[str, Path]:
    """ckpttool's package as it was at ``rev`` (``git archive``, extracted once under
    ``work``): the code to compare with, on the same python and dependencies."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = work / f"baseline-{sha}"
    if not (tree / "ckpttool").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha, "ckpttool"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return sha, tree


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckpttool-bench-megatron"))
    ap.add_argument("--size-gb", type=float, default=1.1)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--baseline", metavar="REV", default=None,
                    help="also time ckpttool at this git revision, side by side")
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
    # Each ckpttool runs in its own tree (``python -m`` puts the working directory first on
    # the path).
    tools: list[tuple[str, list[str], Path, dict[str, str], Path]] = [
        ("ckpttool merge", [sys.executable, "-m", "ckpttool", "merge", str(run),
                            str(args.work / "out"), "-q"], args.work / "out", env, ROOT)]
    if args.baseline:
        sha, tree = baseline_tree(args.work, args.baseline)
        tools.append((f"ckpttool@{sha} merge", [sys.executable, "-m", "ckpttool", "merge",
                                                str(run), str(args.work / "base-out"), "-q"],
                      args.work / "base-out", {**env, "PYTHONPATH": str(tree)}, tree))
    tools.append(("cp -r", ["cp", "-r", str(iteration), str(args.work / "copy")],
                  args.work / "copy", dict(os.environ), ROOT))
    size = M.dir_bytes(iteration)
    print(f"run: {run} ({size / 1e9:.2f} GB, TP=2, bf16, {LAYERS} layers, hidden {hidden})")
    print(f"largest output tensor {largest_out / 1e6:.0f} MB; one layer's linear_qkv "
          f"{layer_qkv / 1e6:.1f} MB; stacked linear_fc1 {stacked_fc1 / 1e6:.0f} MB")
    results: dict[str, list[tuple[M.Measurement, str]]] = {t[0]: [] for t in tools}
    for _ in range(args.repeat):
        for name, argv, out, tool_env, cwd in tools:
            shutil.rmtree(out, ignore_errors=True)
            M.warm_page_cache(iteration)
            before = _load()
            m = M.run_measured(argv, env=tool_env, cwd=cwd)
            if not m.ok:
                sys.exit(f"{name} failed: {m.error_line()}")
            results[name].append((m, before))
            rss = m.peak_rss_bytes or 0
            print(f"{name}: {m.wall_s:.2f} s, peak RSS {rss / 1e6:.0f} MB "
                  f"({rss / largest_out:.1f}x the largest output tensor); {before}")
            shutil.rmtree(out, ignore_errors=True)
    cp = M.best_of([m for m, _ in results["cp -r"]])
    for name, runs in results.items():
        if name == "cp -r":
            continue
        best = M.best_of([m for m, _ in runs])
        print(f"best {name}: {best.wall_s:.2f} s / cp -r {cp.wall_s:.2f} s = "
              f"{best.wall_s / cp.wall_s:.2f}x; {_load()}")


if __name__ == "__main__":
    main()
