"""Benchmark ``ckpttool diff`` against ``cmp`` on the same bytes, and the size of a delta.

    .venv/bin/python benchmarks/diff.py [--size-gb 3.2] [--workdir /tmp/ckpttool-bench-diff]

1. Writes A: one ``model.safetensors`` of bf16 tensors (Llama-like sizes, values from a normal
   distribution), through ckpttool's own safetensors layout, streamed (memory stays small);
   ``A2``: a byte copy of it; ``B``: A with 1% of the elements of every tensor changed (spread
   at random). All cached in the work directory.
2. Times, each in a fresh process with both files in the page cache, alternating, ``--repeat``
   times: ``ckpttool diff A A2`` (every byte compared, identical: exit 0) beside ``cmp A A2``
   (every byte compared); ``ckpttool diff A B`` (1% changed: every block looked at element by
   element); ``ckpttool diff A B --write-delta D`` and the delta's size against B's.
3. Prints one Markdown table, with the 1-minute load average beside every figure (the machine
   may be shared), and the targets: diff at most 1.5x cmp; the delta of a 1% change.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _measure as M  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.5  # diff / cmp


def shapes(size_gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-like bf16 tensors adding up to about ``size_gb`` GB."""
    hidden, inter, vocab = 2048, 5632, 32000
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden)),
                                              ("lm_head.weight", (vocab, hidden))]
    per_layer = [("self_attn.q_proj.weight", (hidden, hidden)),
                 ("self_attn.k_proj.weight", (hidden // 4, hidden)),
                 ("self_attn.v_proj.weight", (hidden // 4, hidden)),
                 ("self_attn.o_proj.weight", (hidden, hidden)),
                 ("mlp.gate_proj.weight", (inter, hidden)),
                 ("mlp.up_proj.weight", (inter, hidden)),
                 ("mlp.down_proj.weight", (hidden, inter)),
                 ("input_layernorm.weight", (hidden,)),
                 ("post_attention_layernorm.weight", (hidden,))]
    total = 2 * vocab * hidden * 2
    layer = 0
    while total < size_gb * 1e9:
        for name, shape in per_layer:
            out.append((f"model.layers.{layer}.{name}", shape))
            n = 2
            for s in shape:
                n *= s
            total += n
        layer += 1
    out.append(("model.norm.weight", (hidden,)))
    return out


def write_pair(workdir: Path, size_gb: float, fraction: float) -> tuple[Path, Path, Path]:
    """A, its copy A2 and B (``fraction`` of each tensor's elements changed), cached."""
    import numpy as np

    from ckpttool.formats import safetensors as st
    from ckpttool.formats.codecs.dtypes import get

    a_dir, a2_dir, b_dir = (workdir / n for n in ("A", "A2", "B"))
    done = workdir / "done.json"
    want = {"size_gb": size_gb, "fraction": fraction}
    if done.exists() and json.loads(done.read_text()) == want:
        return a_dir, a2_dir, b_dir
    for d in (a_dir, a2_dir, b_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    bf16 = get("BF16")
    layout = st.layout([(n, bf16, s) for n, s in shapes(size_gb)])
    rng = np.random.default_rng(0)
    step = 1 << 24
    with open(a_dir / "model.safetensors", "wb") as fa, open(b_dir / "model.safetensors",
                                                             "wb") as fb:
        fa.write(layout.header)
        fb.write(layout.header)
        for slot in layout.slots:
            n = slot.nbytes // 2
            for lo in range(0, n, step):
                k = min(step, n - lo)
                x = (rng.standard_normal(k, dtype=np.float32) * 0.02).view(np.uint32)
                a = (x >> 16).astype(np.uint16)
                fa.write(a.tobytes())
                where = rng.choice(k, size=max(1, int(k * fraction)), replace=False)
                b = a.copy()
                b[where] ^= 0x0001 | (rng.integers(1, 0x7F, size=len(where), dtype=np.uint16)
                                      << 1)  # mantissa bits: a small change, never a NaN
                fb.write(b.tobytes())
    shutil.copy(a_dir / "model.safetensors", a2_dir / "model.safetensors")
    for d in (a_dir, a2_dir, b_dir):
        (d / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    done.write_text(json.dumps(want))
    return a_dir, a2_dir, b_dir


def timed(label: str, argv: list[str], warm: list[Path], env: dict[str, str],
          ok: tuple[int, ...] = (0,)) -> dict[str, object]:
    M.sync()
    for w in warm:
        M.warm_page_cache(w)
    load = M.load1()
    m = M.run_measured(argv, env=env, timeout_s=3600, discard_stdout=True)
    if m.returncode not in ok or m.timed_out:
        raise SystemExit(f"{label}: failed: {m.error_line()}")
    print(f"{label}: {m.wall_s:.2f} s, {m.peak_rss_mb or 0:.0f} MB, load {load:.1f}",
          flush=True)
    return {"label": label, "wall_s": m.wall_s, "cpu_s": m.cpu_s,
            "rss_mb": m.peak_rss_mb, "load": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=3.2)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench-diff"))
    M.add_record_args(p)
    args = p.parse_args()
    a, a2, b = write_pair(args.workdir, args.size_gb, args.fraction)
    env = M.bytecode_env(args.workdir / "pycache")
    env["PYTHONPATH"] = str(ROOT)
    env["CKPTTOOL_FSYNC"] = "0"
    py = [sys.executable, "-m", "ckpttool"]
    fa, fa2, fb = (d / "model.safetensors" for d in (a, a2, b))
    rows: list[dict[str, object]] = []
    for _ in range(args.repeat):
        rows.append(timed("cmp A A2", ["cmp", fa, fa2], [a, a2], env))
        rows.append(timed("ckpttool diff A A2", [*py, "diff", a, a2, "-q"], [a, a2], env))
    for _ in range(args.repeat):
        rows.append(timed("ckpttool diff A B (1% changed)", [*py, "diff", a, b, "-q"], [a, b],
                          env, ok=(1,)))
    delta = args.workdir / "delta"
    shutil.rmtree(delta, ignore_errors=True)
    rows.append(timed("ckpttool diff A B --write-delta", [*py, "diff", a, b, "-q",
                                                          "--write-delta", delta], [a, b], env,
                      ok=(1,)))
    out = args.workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    rows.append(timed("ckpttool apply A delta out", [*py, "apply", a, delta, out], [a, delta],
                      env))
    same = M.run_measured(["cmp", fb, out / "model.safetensors"], env=env, timeout_s=3600)
    delta_bytes = M.dir_bytes(delta)
    b_bytes = fb.stat().st_size
    print()
    print(M.markdown_table(["command", "wall s", "CPU s", "peak RSS MB", "load"],
                           [[r["label"], f"{r['wall_s']:.2f}",
                             f"{r['cpu_s']:.2f}" if r["cpu_s"] is not None else "-",
                             f"{r['rss_mb']:.0f}" if r["rss_mb"] is not None else "-",
                             f"{r['load']:.1f}"] for r in rows]))
    cmp_best = min(float(r["wall_s"]) for r in rows if r["label"] == "cmp A A2")  # type: ignore[arg-type]
    diff_best = min(float(r["wall_s"]) for r in rows if r["label"] == "ckpttool diff A A2")  # type: ignore[arg-type]
    print(f"\nA: {fa.stat().st_size / 1e9:.2f} GB; diff / cmp (best of {args.repeat}): "
          f"{diff_best / cmp_best:.2f}x (target <= {TARGET}x)")
    print(f"delta of a {args.fraction:.0%} change: {delta_bytes / 1e6:.1f} MB, "
          f"{delta_bytes / b_bytes:.1%} of B ({b_bytes / 1e9:.2f} GB); apply rebuilt B "
          f"{'bit for bit' if same.returncode == 0 else 'WRONG'}")
    print(f"machine: {json.dumps(M.machine_info())}; pid {os.getpid()}")
    record(args, rows, delta_bytes, b_bytes, same.returncode == 0)


def record(args: argparse.Namespace, rows: list[dict[str, Any]], delta_bytes: int,
           b_bytes: int, rebuilt: bool) -> None:
    """This run's figures into the results file (with ``--record``)."""
    def best(label: str) -> dict[str, Any]:
        return min((r for r in rows if r["label"] == label), key=lambda r: r["wall_s"])

    def cpu(r: dict[str, Any]) -> float | None:
        return None if r["cpu_s"] is None else float(r["cpu_s"])

    load = M.load_span(float(r["load"]) for r in rows)
    full = args.size_gb == 3.2 and args.fraction == 0.01  # the claims' checkpoint and change
    c, d = best("cmp A A2"), best("ckpttool diff A A2")
    ratio = d["wall_s"] / c["wall_s"]
    M.record_figure(args, "diff-same", figure=f"{d['wall_s']:.2f} s", cpu_s=cpu(d),
                    baseline=f"`cmp` {c['wall_s']:.2f} s, {c['cpu_s'] or 0:.2f} s CPU",
                    ratio=ratio, met=ratio <= TARGET, peak_mb=d["rss_mb"], load=load,
                    full_size=full)
    r = best("ckpttool diff A B (1% changed)")
    both = 2 * b_bytes / 1e9
    M.record_figure(args, "diff-changed", figure=f"{r['wall_s']:.2f} s", cpu_s=cpu(r),
                    peak_mb=r["rss_mb"], load=load, full_size=full,
                    note=f"about {both / (cpu(r) or 1):.1f} GB/s per core over the "
                         f"{both:.1f} GB" if cpu(r) else None)
    r = best("ckpttool diff A B --write-delta")
    M.record_figure(args, "diff-delta", figure=f"{r['wall_s']:.2f} s; the delta "
                    f"{delta_bytes / 1e6:.1f} MB, {delta_bytes / b_bytes:.1%} of B",
                    cpu_s=cpu(r), peak_mb=r["rss_mb"], load=f"{r['load']:.1f}",
                    full_size=full)
    r = best("ckpttool apply A delta out")
    M.record_figure(args, "diff-apply", figure=f"{r['wall_s']:.2f} s"
                    + ("" if rebuilt else " (B NOT rebuilt bit for bit)"),
                    cpu_s=cpu(r), peak_mb=r["rss_mb"], load=f"{r['load']:.1f}",
                    full_size=full)


if __name__ == "__main__":
    main()
