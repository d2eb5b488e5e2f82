"""Benchmark ``ckpttool merge`` against accelerate, PyTorch and plain file copies.

    .venv/bin/python benchmarks/merge.py [--sizes 3] [--workdir /tmp/ckpttool-bench] [--keep]

1. Generates (once; cached in the work directory) a real DCP checkpoint written by
   ``torch.distributed.checkpoint.save`` from 4 gloo processes on CPU: a Llama-like stack of
   bf16 parameters, each a DTensor sharded ``[Shard(0)]`` over a 4-rank mesh, as FSDP2 saves
   them, under ``{"model": ...}`` as accelerate saves them.
2. Checks that ckpttool's output is bit-identical to what PyTorch's ``dcp_to_torch_save`` reads
   (smallest size only), and to the values the generator made.
3. Runs each tool in a fresh child process, with the checkpoint already in the page cache, and
   reports wall time and peak RSS (``ru_maxrss`` from ``os.wait4``) side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _measure as M  # noqa: E402

WORLD = 4
VOCAB = 32000
LAYERS = 12
GEN_SPEC_VERSION = 1
SPEC_FILE = "bench-spec.json"
DCP_SUBDIR = "pytorch_model_fsdp_0"


# --------------------------------------------------------------------------------------------
# The synthetic model


def model_shapes(size_gb: float, layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-like list of (name, shape) whose bf16 size is about ``size_gb`` GB (1e9 bytes).

    Hidden size H is solved from the size with a fixed number of layers (intermediate 4H, untied
    lm_head), rounded to a multiple of 64, so every dim 0 is divisible by the 4 ranks.
    """
    params = size_gb * 1e9 / 2
    # 16 H^2 per layer (q, k, v, o: H^2 each; gate, up, down: 4 H^2 each) + 2 * VOCAB * H
    a, b = 16 * layers, 2 * VOCAB
    h = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    h = max(64, int(round(h / 64)) * 64)
    i = 4 * h
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (h, h)),
            (p + "self_attn.v_proj.weight", (h, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (VOCAB, h))]
    for name, shape in shapes:
        assert shape[0] % WORLD == 0, (name, shape)
    return shapes


def make_shard(index: int, rank: int, shape: tuple[int, ...], world: int = WORLD):
    """Rank ``rank``'s Shard(0) piece of tensor ``index``: deterministic, built without the full
    tensor. Norm vectors are near 1, matrices ~N(0, 0.02), as in an initialised Llama."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * index + rank)
    local = (shape[0] // world, *shape[1:])
    t = torch.empty(local, dtype=torch.bfloat16)
    if len(shape) == 1:
        t.normal_(1.0, 0.02, generator=g)
    else:
        t.normal_(0.0, 0.02, generator=g)
    return t


def full_tensor(index: int, shape: tuple[int, ...]):
    """The full value of tensor ``index`` (for checks), from its shards."""
    import torch

    return torch.cat([make_shard(index, r, shape) for r in range(WORLD)], dim=0)


def _gen_worker(rank: int, world: int, port: int, shapes: list, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd = {}
        t0 = time.perf_counter()
        for i, (name, shape) in enumerate(shapes):
            local = make_shard(i, rank, tuple(shape), world)
            full = torch.Size(shape)
            stride = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
            sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                          shape=full, stride=stride)
        if rank == 0:
            print(f"  [gen] shards built in {time.perf_counter() - t0:.1f} s; saving...",
                  flush=True)
        t0 = time.perf_counter()
        dcp.save({"model": sd}, checkpoint_id=out_dir)
        if rank == 0:
            print(f"  [gen] dcp.save took {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def size_label(size_gb: float) -> str:
    return f"{size_gb:g}GB"


def ensure_checkpoint(workdir: Path, size_gb: float) -> tuple[Path, list]:
    """The DCP directory for this size, generated unless a matching one is cached."""
    base = workdir / f"ckpt-{size_label(size_gb)}"
    dcp_dir = base / DCP_SUBDIR
    shapes = model_shapes(size_gb)
    spec = {"version": GEN_SPEC_VERSION, "world": WORLD,
            "shapes": [[n, list(s)] for n, s in shapes]}
    spec_path = base / SPEC_FILE
    if spec_path.exists() and (dcp_dir / ".metadata").exists():
        try:
            if json.loads(spec_path.read_text()) == spec:
                print(f"[gen] using cached checkpoint {dcp_dir} "
                      f"({M.dir_bytes(dcp_dir) / 1e9:.2f} GB)", flush=True)
                return dcp_dir, shapes
        except (OSError, ValueError):
            pass
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    tmp = base / (DCP_SUBDIR + ".partial")
    nbytes = sum(math.prod(s) * 2 for _, s in shapes)
    print(f"[gen] writing {len(shapes)} bf16 tensors, {nbytes / 1e9:.2f} GB, hidden "
          f"{shapes[0][1][1]}, {LAYERS} layers, from {WORLD} gloo ranks -> {dcp_dir}", flush=True)
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.spawn(_gen_worker, args=(WORLD, _free_port(), shapes, str(tmp)), nprocs=WORLD, join=True)
    tmp.rename(dcp_dir)
    spec_path.write_text(json.dumps(spec))
    print(f"[gen] done in {time.perf_counter() - t0:.1f} s: "
          f"{', '.join(sorted(p.name for p in dcp_dir.iterdir()))}", flush=True)
    return dcp_dir, shapes


# --------------------------------------------------------------------------------------------
# The tools


@dataclass
class Tool:
    name: str
    argv: list[str]
    out: Path  # removed after each run
    discard_stdout: bool = False


ACCELERATE_CODE = (
    "import sys; from accelerate.utils import merge_fsdp_weights; "
    "merge_fsdp_weights(sys.argv[1], sys.argv[2], safe_serialization=True)"
)
TORCH_CODE = (
    "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
)


def ckpttool_exe() -> str:
    exe = Path(sys.executable).parent / "ckpttool"
    if exe.exists():
        return str(exe)
    found = shutil.which("ckpttool")
    if not found:
        sys.exit("benchmarks/merge.py: no ckpttool executable beside this python or on PATH")
    return found


def tools(dcp_dir: Path, scratch: Path, workers: int | None) -> list[Tool]:
    py = sys.executable
    ck = [ckpttool_exe(), "merge", str(dcp_dir), str(scratch / "ckpttool-out"), "--dtype", "keep",
          "-q"]
    if workers:
        ck += ["--workers", str(workers)]
    return [
        Tool("ckpttool merge", ck, scratch / "ckpttool-out"),
        Tool("accelerate merge_fsdp_weights",
             [py, "-c", ACCELERATE_CODE, str(dcp_dir), str(scratch / "accelerate-out")],
             scratch / "accelerate-out"),
        Tool("torch dcp_to_torch_save",
             [py, "-c", TORCH_CODE, str(dcp_dir), str(scratch / "torch-out.pt")],
             scratch / "torch-out.pt"),
        Tool("cp -r", ["cp", "-r", str(dcp_dir), str(scratch / "cp-out")], scratch / "cp-out"),
        Tool("cat > /dev/null", ["cat", *map(str, M.files_under(dcp_dir))], scratch / "nothing",
             discard_stdout=True),
    ]


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


# --------------------------------------------------------------------------------------------
# Correctness


def check_correctness(dcp_dir: Path, shapes: list, scratch: Path, ck: Tool, pt: Tool) -> dict:
    """ckpttool's output vs dcp_to_torch_save's, every tensor bit for bit, and a few tensors vs
    the generator's values."""
    import torch
    from safetensors import safe_open

    print("[check] running ckpttool merge and dcp_to_torch_save (untimed)...", flush=True)
    for t in (ck, pt):
        remove(t.out)
        m = M.run_measured(t.argv)
        if not m.ok:
            remove(ck.out)
            remove(pt.out)
            raise SystemExit(f"[check] {t.name} failed: {m.error_line()}\n{m.stderr}")
    try:
        ref = torch.load(pt.out, map_location="cpu", mmap=True, weights_only=True)
        ref = ref["model"] if set(ref) == {"model"} else ref
        files = sorted(ck.out.glob("*.safetensors"))
        got: dict[str, tuple[Path, object]] = {}
        handles = [safe_open(str(f), framework="pt") for f in files]
        for f, h in zip(files, handles, strict=True):
            for k in h.keys():
                got[k] = (f, h)
        expected_names = [n for n, _ in shapes]
        problems: list[str] = []
        if sorted(got) != sorted(ref):
            only_ck, only_pt = sorted(set(got) - set(ref))[:5], sorted(set(ref) - set(got))[:5]
            problems.append(f"tensor names differ: ckpttool-only {only_ck}, torch-only {only_pt}")
        if sorted(got) != sorted(expected_names):
            problems.append("tensor names differ from the generated model")
        compared = 0
        for name in sorted(set(got) & set(ref)):
            a = got[name][1].get_tensor(name)
            b = ref[name]
            if a.dtype != b.dtype or a.shape != b.shape:
                problems.append(f"{name}: {a.dtype}{list(a.shape)} vs torch "
                                f"{b.dtype}{list(b.shape)}")
            elif not torch.equal(a.contiguous().view(torch.uint8),
                                 b.contiguous().view(torch.uint8)):
                problems.append(f"{name}: bytes differ from dcp_to_torch_save")
            compared += 1
        # A few tensors against the generator itself (independent of both readers).
        picks = sorted({0, 1, 2, 7, len(shapes) // 2, len(shapes) - 2, len(shapes) - 1})
        for i in picks:
            name, shape = shapes[i]
            if name not in got:
                continue
            want = full_tensor(i, tuple(shape))
            a = got[name][1].get_tensor(name)
            if not torch.equal(a.view(torch.uint8), want.view(torch.uint8)):
                problems.append(f"{name}: bytes differ from the generator's values")
        result = {"tensors_compared_with_torch": compared,
                  "tensors_compared_with_generator": len(picks),
                  "files": [f.name for f in files], "ok": not problems, "problems": problems}
        del handles, ref
    finally:
        remove(ck.out)
        remove(pt.out)
    if problems:
        print("[check] FAILED:\n  " + "\n  ".join(problems), flush=True)
    else:
        print(f"[check] ok: {compared} tensors bit-identical to dcp_to_torch_save; "
              f"{len(picks)} bit-identical to the generator", flush=True)
    return result


# --------------------------------------------------------------------------------------------
# Measuring


def measure_size(size_gb: float, workdir: Path, args: argparse.Namespace,
                 check: bool) -> dict:
    dcp_dir, shapes = ensure_checkpoint(workdir, size_gb)
    nbytes = M.dir_bytes(dcp_dir)
    scratch = workdir / "out"
    scratch.mkdir(parents=True, exist_ok=True)
    tl = tools(dcp_dir, scratch, args.workers)
    for t in tl:
        remove(t.out)
    result: dict = {"size_gb": size_gb, "label": size_label(size_gb), "dcp_dir": str(dcp_dir),
                    "dcp_bytes": nbytes, "tensors": len(shapes),
                    "hidden": shapes[0][1][1], "layers": LAYERS}
    if check:
        result["check"] = check_correctness(dcp_dir, shapes, scratch, tl[0], tl[2])

    runs: dict[str, list[M.Measurement]] = {t.name: [] for t in tl}
    for rep in range(args.repeat):
        for t in tl:
            if args.only and t.name.split()[0] not in args.only:
                continue
            remove(t.out)
            M.sync()  # no write-back left over from the previous run
            warm = M.warm_page_cache(dcp_dir)
            print(f"[run {rep + 1}/{args.repeat}] {t.name} (cache warmed in {warm:.1f} s)...",
                  end=" ", flush=True)
            m = M.run_measured(t.argv, timeout_s=args.timeout, discard_stdout=t.discard_stdout)
            runs[t.name].append(m)
            if m.ok:
                print(f"{m.wall_s:.2f} s, {m.peak_rss_mb:.0f} MB", flush=True)
            else:
                print(f"FAILED: {m.error_line()}", flush=True)
            if not (args.keep and rep == args.repeat - 1):
                remove(t.out)  # bound disk use: one output at a time
    rows = []
    best = {name: M.best_of(ms) for name, ms in runs.items() if ms}
    base = best.get("ckpttool merge")
    base_ok = base is not None and base.ok
    for name, m in best.items():
        row = {"tool": name, "ok": m.ok, "wall_s": m.wall_s if m.ok else None,
               "peak_rss_mb": m.peak_rss_mb if m.ok else None,
               "runs_wall_s": [x.wall_s for x in runs[name]],
               "runs_peak_rss_mb": [x.peak_rss_mb for x in runs[name]],
               "cpu_s": m.cpu_s if m.ok else None, "rss_at_floor": m.at_floor,
               "rss_floor_mb": None if m.rss_floor_bytes is None else m.rss_floor_bytes / 2**20,
               "rss_method": m.rss_method, "cmd": m.cmd}
        if m.ok and base_ok:
            row["wall_vs_ckpttool"] = M.ratio(m.wall_s, base.wall_s)
            row["rss_vs_ckpttool"] = M.ratio(m.peak_rss_mb, base.peak_rss_mb)
        if not m.ok:
            row["error"] = m.error_line()
            row["stderr_tail"] = m.stderr[-2000:]
        rows.append(row)
    result["results"] = rows
    result["ratios"] = _ratios(best)
    result["ckpttool_throughput_gb_s"] = (nbytes / 1e9 / base.wall_s) if base_ok else None
    return result


def _ratios(best: dict[str, M.Measurement]) -> dict:
    ck = best.get("ckpttool merge")
    acc = best.get("accelerate merge_fsdp_weights")
    pt = best.get("torch dcp_to_torch_save")
    cp = best.get("cp -r")
    out: dict = {}
    if ck and ck.ok:
        if acc and acc.ok:
            out["speedup_vs_accelerate"] = acc.wall_s / ck.wall_s
            out["rss_fraction_of_accelerate"] = ck.peak_rss_mb / acc.peak_rss_mb
            out["meets_target"] = (ck.wall_s < acc.wall_s
                                   and ck.peak_rss_mb < acc.peak_rss_mb / 4)
        if pt and pt.ok:
            out["speedup_vs_torch"] = pt.wall_s / ck.wall_s
            out["rss_fraction_of_torch"] = ck.peak_rss_mb / pt.peak_rss_mb
        if cp and cp.ok:
            out["wall_vs_cp"] = ck.wall_s / cp.wall_s
    return out


# --------------------------------------------------------------------------------------------
# Output


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(result: dict, warm_note: str) -> str:
    lines = [f"### {result['label']} DCP checkpoint: {result['dcp_bytes'] / 1e9:.2f} GB, "
             f"{result['tensors']} bf16 tensors (hidden {result['hidden']}, "
             f"{result['layers']} layers), {WORLD} shards", ""]
    if "check" in result:
        c = result["check"]
        if c["ok"]:
            lines += [f"Correctness: ckpttool output bit-identical to dcp_to_torch_save for all "
                      f"{c['tensors_compared_with_torch']} tensors, and to the generator for "
                      f"{c['tensors_compared_with_generator']}.", ""]
        else:
            lines += ["Correctness: **FAILED**: " + "; ".join(c["problems"][:5]), ""]
    rows = []
    floored = False
    failures: list[str] = []
    for r in result["results"]:
        if r["ok"]:
            star = "*" if r["rss_at_floor"] else ""
            floored |= bool(star)
            rows.append([r["tool"], _f(r["wall_s"], ".2f"), _f(r["peak_rss_mb"], ".0f") + star,
                         _f(r.get("wall_vs_ckpttool"), ".2f") + "x",
                         _f(r.get("rss_vs_ckpttool"), ".2f") + "x", _f(r["cpu_s"], ".2f")])
        else:
            rows.append([r["tool"], "FAILED", "-", "-", "-", "-"])
            failures.append(f"- **{r['tool']} failed**: {r['error'][:300]}")
    lines.append(M.markdown_table(
        ["tool", "wall s", "peak RSS MB", "wall vs ckpttool", "RSS vs ckpttool", "CPU s"],
        rows))
    lines.append("")
    if failures:
        lines += [*failures, ""]
    if floored:
        lines.append("\\* at the measuring launcher's floor (its own RSS, about 7-9 MB, is "
                     "inherited across fork): the true peak is at most this")
    q = result["ratios"]
    if "speedup_vs_accelerate" in q:
        verdict = "meets" if q["meets_target"] else "MISSES"
        lines.append(f"- ckpttool vs accelerate: {q['speedup_vs_accelerate']:.2f}x faster, "
                     f"RSS {q['rss_fraction_of_accelerate']:.3f} of accelerate's "
                     f"(target: faster and < 0.25: {verdict})")
    else:
        lines.append("- ckpttool vs accelerate: n/a (a run failed)")
    if "speedup_vs_torch" in q:
        lines.append(f"- ckpttool vs dcp_to_torch_save: {q['speedup_vs_torch']:.2f}x faster, "
                     f"RSS {q['rss_fraction_of_torch']:.3f} of torch's")
    if "wall_vs_cp" in q:
        lines.append(f"- ckpttool wall / `cp -r` wall: {q['wall_vs_cp']:.2f}")
    if result.get("ckpttool_throughput_gb_s"):
        lines.append(f"- ckpttool throughput: {result['ckpttool_throughput_gb_s']:.2f} GB/s")
    lines.append(f"- {warm_note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3",
                    help="checkpoint sizes in GB (1e9 bytes), comma-separated (default: 3)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"),
                    help="where checkpoints are cached and outputs written")
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed runs per tool; the best is reported (default: 1)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the last outputs of each tool under WORKDIR/out "
                         "(default: remove each output right after it is measured)")
    ap.add_argument("--workers", type=int, default=None,
                    help="pass --workers N to ckpttool (default: its own default)")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help="run only these tools (first words: ckpttool,accelerate,torch,cp,cat)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds before a tool run is killed and recorded as failed")
    args = ap.parse_args(argv)
    sizes = sorted(float(s) for s in args.sizes.split(",") if s.strip())
    if not sizes or any(s <= 0 for s in sizes):
        ap.error("--sizes needs positive numbers")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    workdir: Path = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    free = shutil.disk_usage(workdir).free
    need = max(sizes) * 1e9 * 2.2 + sum(sizes) * 1e9  # cache + two outputs at once, roughly
    if free < need:
        print(f"warning: {free / 1e9:.0f} GB free under {workdir}, about {need / 1e9:.0f} GB "
              "may be needed", file=sys.stderr)

    import torch

    info = M.machine_info({"torch": torch.__version__, "filesystem": M.filesystem_of(workdir),
                           "workdir": str(workdir)})
    for mod in ("accelerate", "safetensors"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            info[mod] = None
    try:
        import ckpttool

        info["ckpttool"] = ckpttool.__version__
    except Exception:  # noqa: BLE001
        info["ckpttool"] = None
    git = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse",
                          "--short", "HEAD"], capture_output=True, text=True)
    info["git_head"] = git.stdout.strip() or None
    warm_note = ("page cache: warm (every checkpoint file read once right before each timed "
                 "run; `sync` before each run; outputs are not fsynced by any tool)")
    print(f"machine: {info['cpu_count']} CPUs, {info.get('mem_total_gib')} GiB, "
          f"torch {info['torch']}, accelerate {info['accelerate']}, fs {info['filesystem']}",
          flush=True)

    results = []
    for k, size in enumerate(sizes):
        results.append(measure_size(size, workdir, args, check=(k == 0 and not args.no_check)))

    md = [f"## ckpttool merge benchmark ({info['cpu_count']} CPUs, torch {info['torch']}, "
          f"accelerate {info['accelerate']}, best of {args.repeat})", ""]
    for r in results:
        md += [render(r, warm_note), ""]
    text = "\n".join(md)
    print()
    print(text)
    out_json = workdir / "results-merge.json"
    out_json.write_text(json.dumps({"machine": info, "repeat": args.repeat,
                                    "cache": "warm", "sizes": results, "markdown": text},
                                   indent=2, default=str))
    print(f"(results written to {out_json})")
    if not args.keep:
        shutil.rmtree(workdir / "out", ignore_errors=True)
    failed_check = any(not r.get("check", {"ok": True})["ok"] for r in results)
    return 1 if failed_check else 0


if __name__ == "__main__":
    sys.exit(main())
