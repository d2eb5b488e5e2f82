"""Benchmark ``ckpttool verify`` and ``ckpttool inspect`` against reading the same bytes.

    .venv/bin/python benchmarks/verify.py [--sizes 3] [--workdir /tmp/ckpttool-bench-verify]

1. Reuses the generator of ``benchmarks/merge.py``: a real DCP checkpoint written by
   ``torch.distributed.checkpoint.save`` from 4 gloo processes (bf16 Llama-like stack, Shard(0)),
   cached in the work directory; and merges it once (``--dtype keep``, untimed) for ``--against``.
2. Writes a DCP checkpoint of ``--tensors`` small tensors (one process) to time ``inspect`` per
   thousand tensors: metadata only, no tensor data read.
3. Runs each command in a fresh process with what it reads already in the page cache and
   reports wall time, peak RSS (``ru_maxrss``) and CPU time beside ``cat`` of the same files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _measure as M  # noqa: E402
import merge as gen  # noqa: E402  (the checkpoint generator of the merge benchmark)


def many_tensors(workdir: Path, count: int) -> Path:
    """A DCP checkpoint of ``count`` small fp32 tensors under accelerate's ``model`` key."""
    out = workdir / f"many-{count}" / "pytorch_model_fsdp_0"
    if (out / ".metadata").exists():
        return out
    code = (
        "import sys, warnings, torch, torch.distributed.checkpoint as dcp\n"
        "n, out = int(sys.argv[1]), sys.argv[2]\n"
        "sd = {f'layers.{i // 8}.w{i % 8}.weight': torch.randn(16, 8) for i in range(n)}\n"
        "warnings.simplefilter('ignore')\n"
        "dcp.save({'model': sd}, checkpoint_id=out, no_dist=True)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(count), str(out)], check=True)
    return out


def run(label: str, argv: list[str], warm: list[Path], timeout: float,
        discard_stdout: bool = True) -> M.Measurement:
    M.sync()
    for w in warm:
        M.warm_page_cache(w)
    print(f"{label}...", end=" ", flush=True)
    m = M.run_measured(argv, timeout_s=timeout, discard_stdout=discard_stdout)
    print(f"{m.wall_s:.2f} s, {m.peak_rss_mb:.0f} MB" if m.ok else f"FAILED: {m.error_line()}",
          flush=True)
    return m


def measure(size_gb: float, args: argparse.Namespace) -> dict:
    workdir: Path = args.workdir
    dcp_dir, shapes = gen.ensure_checkpoint(workdir, size_gb)
    merged = workdir / "verify-out" / f"merged-{gen.size_label(size_gb)}"
    exe = gen.ckpttool_exe()
    if not (merged / "model.safetensors").exists() and not any(merged.glob("*.index.json")):
        shutil.rmtree(merged, ignore_errors=True)
        subprocess.run([exe, "merge", str(dcp_dir), str(merged), "--dtype", "keep", "-q",
                        "--weights-only"], check=True)  # no config.json beside it
    manifest = workdir / "verify-out" / "manifest.json"
    dcp_files = [str(p) for p in M.files_under(dcp_dir)]
    both = dcp_files + [str(p) for p in M.files_under(merged)]
    dcp_bytes, both_bytes = M.dir_bytes(dcp_dir), M.dir_bytes(dcp_dir) + M.dir_bytes(merged)
    rows = [
        ("cat > /dev/null", ["cat", *dcp_files], [dcp_dir], dcp_bytes),
        ("ckpttool verify", [exe, "verify", str(dcp_dir), "-q"], [dcp_dir], dcp_bytes),
        ("ckpttool verify --workers 1", [exe, "verify", str(dcp_dir), "-q", "--workers", "1"],
         [dcp_dir], dcp_bytes),
        ("ckpttool verify --write-manifest",
         [exe, "verify", str(dcp_dir), "-q", "--write-manifest", str(manifest)], [dcp_dir],
         dcp_bytes),
        ("cat both > /dev/null", ["cat", *both], [dcp_dir, merged], both_bytes),
        ("ckpttool verify --against merged", [exe, "verify", str(dcp_dir), "-q", "--against",
                                              str(merged)], [dcp_dir, merged], both_bytes),
        ("ckpttool inspect --json", [exe, "inspect", str(dcp_dir), "--json"], [dcp_dir], 0),
    ]
    results = []
    for name, argv, warm, nbytes in rows:
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        runs = []
        for rep in range(args.repeat):
            manifest.unlink(missing_ok=True)
            runs.append(run(f"[{gen.size_label(size_gb)} {rep + 1}/{args.repeat}] {name}", argv,
                            warm, args.timeout))
        best = M.best_of(runs)
        results.append({"tool": name, "bytes": nbytes, "ok": best.ok, "wall_s": best.wall_s,
                        "peak_rss_mb": best.peak_rss_mb, "cpu_s": best.cpu_s,
                        "rss_at_floor": best.at_floor, "runs_wall_s": [m.wall_s for m in runs],
                        "error": None if best.ok else best.error_line(), "cmd": best.cmd})
    cat = {r["tool"]: r for r in results if r["tool"].startswith("cat")}
    for r in results:
        floor = cat.get("cat both > /dev/null" if "against" in r["tool"] else "cat > /dev/null")
        r["vs_cat"] = (r["wall_s"] / floor["wall_s"]
                       if floor and floor["ok"] and r["ok"] and r["bytes"] else None)
        r["gb_s"] = r["bytes"] / 1e9 / r["wall_s"] if r["ok"] and r["bytes"] else None
    return {"size_gb": size_gb, "label": gen.size_label(size_gb), "dcp_dir": str(dcp_dir),
            "dcp_bytes": dcp_bytes, "merged_bytes": both_bytes - dcp_bytes,
            "tensors": len(shapes), "results": results}


def measure_inspect(args: argparse.Namespace) -> dict:
    ckpt = many_tensors(args.workdir, args.tensors)
    exe = gen.ckpttool_exe()
    help_runs = [run("ckpttool --help", [exe, "--help"], [], args.timeout)
                 for _ in range(args.repeat)]
    runs = [run(f"ckpttool inspect --json ({args.tensors} tensors)",
                [exe, "inspect", str(ckpt), "--json"], [ckpt], args.timeout)
            for _ in range(args.repeat)]
    best, start = M.best_of(runs), M.best_of(help_runs)
    per_k = (best.wall_s - start.wall_s) / args.tensors * 1000 if best.ok and start.ok else None
    return {"tensors": args.tensors, "metadata_bytes": (ckpt / ".metadata").stat().st_size,
            "wall_s": best.wall_s, "peak_rss_mb": best.peak_rss_mb, "help_wall_s": start.wall_s,
            "seconds_per_1000_tensors": per_k}


def render(result: dict) -> str:
    lines = [f"### {result['label']} DCP checkpoint: {result['dcp_bytes'] / 1e9:.2f} GB, "
             f"{result['tensors']} bf16 tensors, 4 ranks (merged copy: "
             f"{result['merged_bytes'] / 1e9:.2f} GB)", ""]
    rows = []
    for r in result["results"]:
        if not r["ok"]:
            rows.append([r["tool"], "FAILED", "-", "-", "-", "-", "-"])
            continue
        star = "*" if r["rss_at_floor"] else ""
        rows.append([r["tool"], f"{r['bytes'] / 1e9:.2f}", f"{r['wall_s']:.2f}",
                     f"{r['peak_rss_mb']:.0f}{star}",
                     "-" if r["gb_s"] is None else f"{r['gb_s']:.2f}",
                     "-" if r["vs_cat"] is None else f"{r['vs_cat']:.1f}x",
                     "-" if r["cpu_s"] is None else f"{r['cpu_s']:.2f}"])
    lines.append(M.markdown_table(["command", "reads GB", "wall s", "peak RSS MB", "GB/s",
                                   "wall vs cat", "CPU s"], rows))
    if any(r.get("rss_at_floor") for r in result["results"]):
        lines += ["", "\\* at the measuring launcher's RSS floor (~7-9 MB)"]
    return "\n".join(lines)


def record(args: argparse.Namespace, results: list[dict], load: str) -> None:
    """This run's figures into the results file (with ``--record``); the claims are of the
    3 GB checkpoint."""
    if not results:
        return
    res = next((r for r in results if r["size_gb"] == 3.0), results[-1])
    full = res["size_gb"] == 3.0  # another size goes only to --figures PATH
    rows = {r["tool"]: r for r in res["results"] if r["ok"]}
    if "ckpttool verify" in rows:
        r = rows["ckpttool verify"]
        M.record_figure(args, "verify-3gb", figure=f"{r['wall_s']:.2f} s, {r['gb_s']:.2f} GB/s",
                        cpu_s=r["cpu_s"], met=r["gb_s"] >= 3.0, peak_mb=r["peak_rss_mb"],
                        load=load, full_size=full)
    if "ckpttool verify --against merged" in rows:
        r = rows["ckpttool verify --against merged"]
        M.record_figure(args, "verify-against", figure=f"{r['wall_s']:.2f} s", cpu_s=r["cpu_s"],
                        peak_mb=r["peak_rss_mb"], load=load, full_size=full)
    if "ckpttool inspect --json" in rows:
        r = rows["ckpttool inspect --json"]
        M.record_figure(args, "inspect-3gb", figure=f"{r['wall_s']:.2f} s", cpu_s=r["cpu_s"],
                        peak_mb=r["peak_rss_mb"], load=load, full_size=full)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="3", help="checkpoint sizes in GB, comma-separated")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench-verify"))
    ap.add_argument("--repeat", type=int, default=1, help="runs per command; the best is shown")
    ap.add_argument("--tensors", type=int, default=4096,
                    help="tensors of the checkpoint that times inspect per thousand tensors")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help="run only commands starting with these (e.g. 'ckpttool verify,cat')")
    ap.add_argument("--timeout", type=float, default=1800)
    M.add_record_args(ap)
    args = ap.parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    info = M.machine_info({"workdir": str(args.workdir),
                           "filesystem": M.filesystem_of(args.workdir)})
    loads = [M.load1()]
    results = [measure(size, args) for size in sizes]
    many = measure_inspect(args)
    loads.append(M.load1())
    md = [f"## ckpttool verify / inspect benchmark ({info['cpu_count']} CPUs, best of "
          f"{args.repeat}, page cache warm)", ""]
    for r in results:
        md += [render(r), ""]
    md.append(f"`ckpttool inspect --json` of a DCP checkpoint with {many['tensors']} tensors "
              f"(.metadata {many['metadata_bytes'] / 1e6:.1f} MB): {many['wall_s']:.2f} s wall, "
              f"{many['peak_rss_mb']:.0f} MB peak RSS; minus start-up (`ckpttool --help`, "
              f"{many['help_wall_s']:.2f} s): "
              + ("-" if many["seconds_per_1000_tensors"] is None
                 else f"{many['seconds_per_1000_tensors']:.3f} s per 1000 tensors"))
    text = "\n".join(md)
    print()
    print(text)
    out = args.workdir / "results-verify.json"
    out.write_text(json.dumps({"machine": info, "sizes": results, "inspect_many": many,
                               "markdown": text}, indent=2, default=str))
    print(f"(results written to {out})")
    record(args, results, M.load_span(loads))
    return 0 if all(r["ok"] for s in results for r in s["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
