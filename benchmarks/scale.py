"""Cost per byte, not per chunk: ckpttool on mixture-of-experts-shaped DCP checkpoints of 10k,
100k and 1M chunks, beside ``cp -r``, ``cat``, torch's ``dcp_to_torch_save`` and accelerate's
``merge_fsdp_weights`` (up to ``--accelerate-max`` chunks: it loads everything as torch does).

    .venv/bin/python benchmarks/scale.py [--levels 10k,100k,1M[,10M]] [--torch-max 100k]
                                         [--accelerate-max 100k] [--hog]
                                         [--baseline-tree DIR]

1. Generates (once; cached in the work directory) each checkpoint with
   ``benchmarks/moe_checkpoint.py``: ``layers x experts x 3`` expert projections of [64, 32]
   bf16 plus norms, routers and an embedding, every tensor split in 64 row chunks as FSDP2 on
   64 ranks splits it, written by torch's own ``FileSystemWriter`` over 64 ``.distcp`` files.
2. Runs each command in a fresh process with the checkpoint in the page cache: wall time and
   peak RSS (``ru_maxrss``), best of ``--repeat`` (torch's and accelerate's merges once).
3. Checks that ``merge --dtype keep`` wrote every tensor bit for bit as the generator made it.
4. Prints the issue's tables: each command against its target (a multiple of ``cp -r`` of the
   same directory, a peak RSS), with the 1-minute load average right after each run, time
   per chunk from level to level, memory per chunk, and ckpttool against
   ``dcp_to_torch_save``; writes them to ``--results-md``.

``--hog`` runs ``cp -r``, merge, inspect and verify again with a busy process beside them
(one core of two taken by other work); each ``+hog`` row is compared with ``cp+hog``.
``cp -r`` needs the checkpoint's size again on the disk: where the copy would leave less than
``--keep-free-gb`` free (10M chunks: about 17 GB), it is left out and every ratio of that
level is to ``cat`` of the same files instead (the table says so).
``--baseline-tree DIR`` runs merge, inspect and verify again from another checkout (its
package first on ``PYTHONPATH``), side by side in the same run (with ``--hog``, beside a hog
too). Python commands run with their bytecode cached (``_measure.bytecode_env``), as an
installed package has it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _measure as M  # noqa: E402

# (layers, experts) per level; every tensor is split in (up to) 64 row chunks.
LEVELS = {"10k": (1, 51), "100k": (10, 51), "1M": (40, 128), "10M": (400, 128)}
RANKS = 64
TARGETS = {  # command: (max wall / cp -r, max peak RSS MB); issue 25, with or without a hog
    "merge": (5.0, 512), "inspect": (3.0, 512), "verify": (5.0, 768)}
# At 10M chunks: the memory targets (time: per chunk within 1.3x of 1M's, in the growth table).
TARGETS_10M = {"merge": (None, 2560), "inspect": (None, 3072), "verify": (None, 3072)}
REF_LABEL = {"cp": "cp -r", "cat": "cat"}
NOTES_MARKER = "<!-- notes below: kept by scale.py -->"
GROWTH_LIMIT = 1.3  # us per chunk at the last level over the one before it
TORCH_CODE = (
    "import sys, warnings; warnings.simplefilter('ignore')\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
)


ACCELERATE_CODE = (
    "import sys, warnings; warnings.simplefilter('ignore')\n"
    "from accelerate.utils import merge_fsdp_weights\n"
    "merge_fsdp_weights(sys.argv[1], sys.argv[2], safe_serialization=True)"
)


def ensure(workdir: Path, level: str, gen_workers: int = 1
           ) -> tuple[Path, dict[str, int]]:
    layers, experts = LEVELS[level]
    out = workdir / f"moe-{level}"
    counts_file = workdir / f"moe-{level}.json"
    if (out / ".metadata").exists() and counts_file.exists():
        return out, json.loads(counts_file.read_text())
    # A stopped build's rank files (OUT.build) are kept: moe_checkpoint goes on from them.
    print(f"[gen] {level}: {layers} layers x {experts} experts -> {out}", flush=True)
    t0 = time.perf_counter()
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import moe_checkpoint as m\n"
            "c = m.write(__import__('pathlib').Path(sys.argv[2]), layers=int(sys.argv[3]), "
            "experts=int(sys.argv[4]), ranks=int(sys.argv[5]), workers=int(sys.argv[6]))\n"
            "print(json.dumps(c))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(out),
                           str(layers), str(experts), str(RANKS), str(gen_workers)],
                          check=True, stdout=subprocess.PIPE, text=True)  # progress: stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    counts_file.write_text(json.dumps(counts))
    print(f"[gen] {level}: {counts} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out, counts


def check_merge(out: Path, level: str) -> str:
    """The merged output against the generator's tensors, bit for bit."""
    import moe_checkpoint
    import torch
    from safetensors import safe_open

    want = moe_checkpoint.moe_state(*LEVELS[level])
    files = sorted(out.glob("*.safetensors"))
    got = 0
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = sf.get_tensor(name)
                ref = want.pop(name)
                if t.dtype != ref.dtype or not torch.equal(t.view(torch.uint8),
                                                           ref.view(torch.uint8)):
                    return f"MISMATCH in {name}"
                got += 1
    return f"bit-exact ({got} tensors)" if not want else f"MISSING {len(want)} tensors"


def measure(level: str, ckpt: Path, counts: dict[str, int], args: argparse.Namespace
            ) -> dict:
    scratch = args.workdir / "out"
    scratch.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "ckpttool"]
    files = [str(p) for p in M.files_under(ckpt)]
    ours = {
        # no config.json beside a DCP checkpoint: weights only (no output contract check)
        "merge": ([*exe, "merge", str(ckpt), str(scratch / "merged"), "--dtype", "keep", "-q",
                   "--weights-only"], scratch / "merged", False),
        "inspect": ([*exe, "inspect", str(ckpt), "--json"], None, True),
        "verify": ([*exe, "verify", str(ckpt), "-q"], None, True),
    }
    size = M.dir_bytes(ckpt)
    copy_fits = shutil.disk_usage(scratch).free - size >= args.keep_free_gb * 1e9
    reference = "cp" if copy_fits else "cat"
    cmds = {
        **({"cp": (["cp", "-r", str(ckpt), str(scratch / "cp")], scratch / "cp", False)}
           if copy_fits else {}),
        "cat": (["cat", *files], None, True),
        **ours,
    }
    if not copy_fits:
        print(f"[{level}] cp -r left out: {size / 1e9:.1f} GB more would leave under "
              f"{args.keep_free_gb:g} GB free; ratios are to cat", flush=True)
    if counts["chunks"] <= args.torch_max:
        cmds["torch"] = ([sys.executable, "-c", TORCH_CODE, str(ckpt), str(scratch / "t.pt")],
                         scratch / "t.pt", False)
    if counts["chunks"] <= args.accelerate_max:
        cmds["accelerate"] = ([sys.executable, "-c", ACCELERATE_CODE, str(ckpt),
                               str(scratch / "acc")], scratch / "acc", False)
    env = M.bytecode_env(args.workdir / "pycache")
    # (name, argv, output, discard stdout, environment, hog)
    plan = [(name, argv, out, discard, env, False) for name, (argv, out, discard) in cmds.items()]
    if args.baseline_tree:
        base_env = {**env, "PYTHONPATH": str(args.baseline_tree)}
        if "--weights-only" not in (args.baseline_tree / "ckpttool" / "cli" / "merge.py"
                                    ).read_text():  # a revision before the contract check
            ours = {name: ([a for a in argv if a != "--weights-only"], out, discard)
                    for name, (argv, out, discard) in ours.items()}
        plan += [(f"{name}@base", argv, out, discard, base_env, False)
                 for name, (argv, out, discard) in ours.items()]
    if args.hog:
        plan += [(f"{name}+hog", argv, out, discard, env, True)
                 for name, (argv, out, discard) in ((reference, cmds[reference]),
                                                    *ours.items())]
        if args.baseline_tree:
            plan += [(f"{name}@base+hog", argv, out, discard, base_env, True)
                     for name, (argv, out, discard) in ours.items()]
    # One run of each Python command first, unmeasured: bytecode compiled and cached.
    M.run_measured([*exe, "--help"], env=env, discard_stdout=True)
    if args.baseline_tree:
        M.run_measured([*exe, "--help"], env=base_env, discard_stdout=True)
    rows: dict[str, dict] = {}
    runs: dict[str, list[tuple[M.Measurement, float]]] = {name: [] for name, *_ in plan}
    # Rounds: every command once per round, so that a baseline and its rival share the load.
    for r in range(args.repeat):
        for name, argv, out, discard, cmd_env, hog in plan:
            # torch's and accelerate's merges take minutes at 1M chunks: once is enough.
            if r and name in ("torch", "accelerate"):
                continue
            if out is not None:
                shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(
                    missing_ok=True)
            M.sync()
            M.warm_page_cache(ckpt)
            print(f"[{level}] {name}...", end=" ", flush=True)
            with M.CpuHog() if hog else contextlib.nullcontext():
                m = M.run_measured(argv, timeout_s=args.timeout, discard_stdout=discard,
                                   env=cmd_env)
            load = M.load1()
            print(f"{m.wall_s:.2f} s, {m.peak_rss_mb:.0f} MB, load {load:.2f}" if m.ok else
                  f"FAILED: {m.error_line()}", flush=True)
            runs[name].append((m, load))
            if name == "merge" and m.ok and "check" not in rows.get(name, {}):
                rows[name] = {"check": check_merge(scratch / "merged", level)}
    for name, got in runs.items():
        best = M.best_of([m for m, _ in got])
        load = next(ld for m, ld in got if m is best)
        rows[name] = {**rows.get(name, {}), "ok": best.ok,
                      "wall_s": best.wall_s if best.ok else None, "load": load,
                      "rss_mb": max(m.peak_rss_mb or 0 for m, _ in got)}
    for p in (scratch / "merged", scratch / "cp", scratch / "acc"):
        shutil.rmtree(p, ignore_errors=True)
    (scratch / "t.pt").unlink(missing_ok=True)
    return {"level": level, **counts, "bytes_on_disk": size, "reference": reference,
            "keep_free_gb": args.keep_free_gb,
            "metadata_bytes": (ckpt / ".metadata").stat().st_size, "rows": rows}


def report(results: list[dict]) -> str:
    lines = ["# Scale benchmark: MoE-shaped DCP checkpoints", ""]
    for r in results:
        lines.append(f"## {r['level']}: {r['tensors']:,} tensors, {r['chunks']:,} chunks, "
                     f"{r['payload'] / 1e6:.0f} MB payload, {r['bytes_on_disk'] / 1e9:.2f} GB "
                     f"on disk, .metadata {r['metadata_bytes'] / 1e6:.0f} MB")
        lines.append("")
        ref = r.get("reference", "cp")
        if ref != "cp":
            lines += [f"`cp -r` left out at this level (the copy would leave under "
                      f"{r.get('keep_free_gb', 8):g} GB free on the shared disk): ratios are to "
                      f"`{ref}` of the same files.", ""]
        table = []
        targets = TARGETS_10M if r["chunks"] > 2_000_000 else TARGETS
        for name, row in r["rows"].items():
            wall = row["wall_s"]
            hog = name.endswith("+hog")
            ratio = M.ratio(wall, r["rows"][f"{ref}+hog" if hog else ref]["wall_s"])
            target = targets.get(name.removesuffix("+hog"))
            verdict = ""
            if target and wall is not None:
                x, mb = target
                if ref != "cp":  # the time targets are multiples of cp -r: memory only here
                    x = None
                ok = (x is None or (ratio is not None and ratio <= x)) and row["rss_mb"] <= mb
                verdict = (f"{'PASS' if ok else 'MISS'} ("
                           + (f"<= {x:g}x, " if x is not None else "") + f"<= {mb} MB)")
            table.append([name, f"{wall:.2f}" if wall is not None else "failed",
                          f"{ratio:.1f}x" if ratio is not None else "", f"{row['rss_mb']:.0f}",
                          f"{wall / r['chunks'] * 1e6:.2f}" if wall else "",
                          f"{row.get('load', float('nan')):.2f}", verdict,
                          row.get("check", "")])
        lines.append(M.markdown_table(["command", "wall s", f"vs {REF_LABEL[ref]}",
                                       "peak RSS MB",
                                       "us/chunk", "load", "target", "check"], table))
        merge_row = r["rows"]["merge"]
        for other, label in (("torch", "torch dcp_to_torch_save"),
                             ("accelerate", "accelerate merge_fsdp_weights")):
            row = r["rows"].get(other)
            if row and row["wall_s"] and merge_row["wall_s"]:
                lines += ["", f"{label} / ckpttool merge: "
                              f"{row['wall_s'] / merge_row['wall_s']:.1f}x"]
        lines.append("")
    if len(results) >= 2:
        lines += ["## Growth", "",
                  "Time per chunk from level to level: the added time over the added chunks "
                  "(what a chunk costs, without the fixed start-up: Python, imports, torch "
                  "for verify's value checks), and the plain wall time per chunk beside it. "
                  "Memory per chunk: the added peak RSS over the added chunks, first to last "
                  "level.", ""]
        table = []
        first, last = results[0], results[-1]
        for name in ("merge", "inspect", "verify"):
            walls = [(r["chunks"], r["rows"][name]["wall_s"]) for r in results]
            if any(w is None for _, w in walls):
                continue
            raw = [w / n * 1e6 for n, w in walls]
            step = [(w2 - w1) / (n2 - n1) * 1e6
                    for (n1, w1), (n2, w2) in zip(walls, walls[1:], strict=False)]
            spread = max(step) / min(step) if min(step) > 0 else None
            mem = ((last["rows"][name]["rss_mb"] - first["rows"][name]["rss_mb"]) * 1e6
                   / (last["chunks"] - first["chunks"]))
            table.append([name, ", ".join(f"{p:.1f}" for p in step),
                          f"{spread:.2f}x" if spread else "n/a",
                          ", ".join(f"{p:.1f}" for p in raw), f"{mem:.0f}",
                          ("PASS" if raw[-1] <= GROWTH_LIMIT * raw[-2] else "MISS")
                          if len(raw) > 1 else "n/a"])
        lines.append(M.markdown_table(
            ["command", "us per added chunk, level to level", "max/min",
             "us/chunk (wall / chunks) per level", "bytes per added chunk",
             f"last level's us/chunk <= {GROWTH_LIMIT}x the one before"],
            table))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="10k,100k,1M")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-scale"))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--torch-max", type=lambda s: int(float(s.upper().replace("K", "e3")
                                                         .replace("M", "e6"))),
                    default=2_000_000, help="run dcp_to_torch_save up to this many chunks")
    ap.add_argument("--accelerate-max", type=lambda s: int(float(s.upper().replace("K", "e3")
                                                              .replace("M", "e6"))),
                    default=100_000, help="run accelerate's merge up to this many chunks")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--hog", action="store_true",
                    help="also run cp -r, merge, inspect and verify beside a busy process")
    ap.add_argument("--gen-workers", type=int, default=1,
                    help="processes writing a checkpoint that is not cached yet (rank files)")
    ap.add_argument("--keep-free-gb", type=float, default=8.0,
                    help="leave cp -r out where the copy would leave less free disk (GB)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="also run merge, inspect and verify from this checkout")
    ap.add_argument("--results-md", type=Path,
                    default=Path(__file__).resolve().parent / "SCALE.md")
    M.add_record_args(ap)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for level in args.levels.split(","):
        ckpt, counts = ensure(args.workdir, level, args.gen_workers)
        results.append(measure(level, ckpt, counts, args))
    text = report(results)
    print(text)
    (args.workdir / "results-scale.json").write_text(json.dumps(results, indent=2))
    if str(args.results_md) != "-":
        # Notes written by hand below NOTES_MARKER stay through reruns.
        old = args.results_md.read_text() if args.results_md.exists() else ""
        notes = old[old.index(NOTES_MARKER):] if NOTES_MARKER in old else ""
        args.results_md.write_text(f"Command: `{' '.join(sys.argv)}`\n\n" + text
                                   + ("\n" + notes if notes else ""))
    record(args, results)


def record(args: argparse.Namespace, results: list[dict]) -> None:
    """This run's figures into the results file (with ``--record``): the claims are of the 1M
    and 10M levels (a smaller level stands in for 1M only into ``--figures PATH``)."""
    small = [r for r in results if r["level"] not in ("1M", "10M")]
    one_m = next((r for r in results if r["level"] == "1M"), small[-1] if small else None)
    if one_m is not None:
        rows, ref = one_m["rows"], one_m.get("reference", "cp")
        for name, claim in (("merge", "moe-1m-merge"), ("merge+hog", "moe-1m-merge-hog"),
                            ("inspect", "moe-1m-inspect"), ("verify", "moe-1m-verify"),
                            ("verify+hog", "moe-1m-verify-hog")):
            row = rows.get(name)
            base = rows.get(f"{ref}+hog" if name.endswith("+hog") else ref)
            if not row or not row["ok"] or not base or not base["ok"]:
                continue
            x = row["wall_s"] / base["wall_s"]
            limit, mb = TARGETS[name.removesuffix("+hog")]
            M.record_figure(args, claim, figure=f"{row['wall_s']:.2f} s",
                            baseline=f"`{REF_LABEL[ref]}` {base['wall_s']:.2f} s", ratio=x,
                            met=x <= limit and row["rss_mb"] <= mb, peak_mb=row["rss_mb"],
                            load=M.load_span([row["load"], base["load"]]),
                            full_size=one_m["level"] == "1M")
    ten_m = next((r for r in results if r["level"] == "10M"), None)
    if ten_m is not None:
        rows = ten_m["rows"]
        names = ("merge", "inspect", "verify")
        if all(rows.get(n, {}).get("ok") for n in names):
            met: bool | None = all(rows[n]["rss_mb"] <= TARGETS_10M[n][1] for n in names)
            figure = ", ".join(f"{n} {rows[n]['wall_s']:.1f} s" for n in names)
            prev = one_m["rows"] if one_m is not None and one_m["level"] == "1M" else {}
            if all(prev.get(n, {}).get("ok") for n in names):
                growth = [(rows[n]["wall_s"] / ten_m["chunks"])
                          / (prev[n]["wall_s"] / one_m["chunks"]) for n in names]  # type: ignore[index]
                figure += f"; per chunk {M.span(growth)}x the 1M level"
                met = met and max(growth) <= GROWTH_LIMIT
            else:
                met = None  # the time target needs the 1M level in the same run
            M.record_figure(
                args, "moe-10m", figure=figure,
                met=met, peak_mb=max(rows[n]["rss_mb"] for n in ("merge", "verify")),
                load=M.load_span(rows[n]["load"] for n in ("merge", "inspect", "verify")),
                note=f"peak {rows['merge']['rss_mb']:,.0f} MB for merge, "
                     f"{rows['verify']['rss_mb']:,.0f} MB for verify")


if __name__ == "__main__":
    main()
