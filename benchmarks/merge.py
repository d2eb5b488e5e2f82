"""Benchmark ``ckpttool merge`` against accelerate, PyTorch and plain file copies.

    .venv/bin/python benchmarks/merge.py [--sizes 1.5,3,6] [--repeat 2] [--results-md PATH]

1. Generates (once; cached in the work directory) real DCP checkpoints written by
   ``torch.distributed.checkpoint.save`` from 4 gloo processes on CPU: a Llama-like stack of
   parameters, each a DTensor sharded ``[Shard(0)]`` over a 4-rank mesh, as FSDP2 saves them,
   under ``{"model": ...}`` as accelerate saves them; in bf16 (``ckpt-<size>GB/``) and, with
   the same shapes, in fp32 (``ckpt-<size>GB-fp32/``, for ``--dtype bf16``).
2. Checks that ckpttool's output is bit-identical to what PyTorch's ``dcp_to_torch_save`` reads
   and to the values the generator made, and that ``--dtype bf16`` of the fp32 checkpoint
   equals the generator's values ``.to(torch.bfloat16)`` (smallest size only).
3. Runs each tool in a fresh child process, with the checkpoint it reads in the page cache (and
   the other checkpoints out of it), and reports wall time (best of ``--repeat``) and peak RSS
   (``ru_maxrss`` from ``os.wait4``, the highest of the runs) side by side, plus
   ``python -c "import torch"`` and ``ckpttool --help``.
4. Checks the project's targets (``targets()``) and prints PASS/MISS with the numbers; writes
   JSON to the work directory and the Markdown to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
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
TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
ITEMSIZE = {"bf16": 2, "fp32": 4}


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


def make_shard(index: int, rank: int, shape: tuple[int, ...], world: int = WORLD,
               dtype: str = "bf16"):
    """Rank ``rank``'s Shard(0) piece of tensor ``index``: deterministic, built without the full
    tensor. Norm vectors are near 1, matrices ~N(0, 0.02), as in an initialised Llama.
    ``dtype``: "bf16" or "fp32" (same seeds and shapes)."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * index + rank)
    local = (shape[0] // world, *shape[1:])
    t = torch.empty(local, dtype=getattr(torch, TORCH_DTYPES[dtype]))
    if len(shape) == 1:
        t.normal_(1.0, 0.02, generator=g)
    else:
        t.normal_(0.0, 0.02, generator=g)
    return t


def full_tensor(index: int, shape: tuple[int, ...], dtype: str = "bf16"):
    """The full value of tensor ``index`` (for checks), from its shards."""
    import torch

    return torch.cat([make_shard(index, r, shape, dtype=dtype) for r in range(WORLD)], dim=0)


def _gen_worker(rank: int, world: int, port: int, shapes: list, out_dir: str,
                dtype: str = "bf16") -> None:
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
            local = make_shard(i, rank, tuple(shape), world, dtype)
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


def ckpt_base(workdir: Path, size_gb: float, dtype: str = "bf16") -> Path:
    return workdir / (f"ckpt-{size_label(size_gb)}" + ("" if dtype == "bf16" else f"-{dtype}"))


def _spec(shapes: list, dtype: str) -> dict:
    spec: dict = {"version": GEN_SPEC_VERSION, "world": WORLD,
                  "shapes": [[n, list(s)] for n, s in shapes]}
    if dtype != "bf16":  # bf16 specs stay as they were, so cached checkpoints remain valid
        spec["dtype"] = dtype
    return spec


def is_cached(workdir: Path, size_gb: float, dtype: str = "bf16") -> bool:
    base = ckpt_base(workdir, size_gb, dtype)
    try:
        return ((base / DCP_SUBDIR / ".metadata").exists() and json.loads(
            (base / SPEC_FILE).read_text()) == _spec(model_shapes(size_gb), dtype))
    except (OSError, ValueError):
        return False


def ensure_checkpoint(workdir: Path, size_gb: float, dtype: str = "bf16") -> tuple[Path, list]:
    """The DCP directory for this size and dtype, generated unless a matching one is cached
    (bf16: ``ckpt-<size>GB/``, fp32: ``ckpt-<size>GB-fp32/``, same shapes)."""
    base = ckpt_base(workdir, size_gb, dtype)
    dcp_dir = base / DCP_SUBDIR
    shapes = model_shapes(size_gb)
    if is_cached(workdir, size_gb, dtype):
        print(f"[gen] using cached checkpoint {dcp_dir} "
              f"({M.dir_bytes(dcp_dir) / 1e9:.2f} GB)", flush=True)
        return dcp_dir, shapes
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    tmp = base / (DCP_SUBDIR + ".partial")
    nbytes = sum(math.prod(s) * ITEMSIZE[dtype] for _, s in shapes)
    print(f"[gen] writing {len(shapes)} {dtype} tensors, {nbytes / 1e9:.2f} GB, hidden "
          f"{shapes[0][1][1]}, {LAYERS} layers, from {WORLD} gloo ranks -> {dcp_dir}", flush=True)
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.spawn(_gen_worker, args=(WORLD, _free_port(), shapes, str(tmp), dtype), nprocs=WORLD,
             join=True)
    tmp.rename(dcp_dir)
    (base / SPEC_FILE).write_text(json.dumps(_spec(shapes, dtype)))
    print(f"[gen] done in {time.perf_counter() - t0:.1f} s: "
          f"{', '.join(sorted(p.name for p in dcp_dir.iterdir()))}", flush=True)
    return dcp_dir, shapes


# --------------------------------------------------------------------------------------------
# The tools


@dataclass
class Tool:
    key: str  # for --only
    name: str  # the row's label
    reads: str  # "bf16" or "fp32": which checkpoint it reads (and which is warmed before it)
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
TOOL_KEYS = ("ckpttool-keep", "ckpttool-bf16", "accelerate", "torch", "cp", "cp-fp32", "cat",
             "cat-fp32", "baseline-keep", "baseline-bf16")
GLOBAL_KEYS = ("import-torch", "help")
# The tools that load the whole model into memory (skippable with --full-load-max).
FULL_LOAD = ("accelerate", "torch")


def ckpttool_exe() -> str:
    exe = Path(sys.executable).parent / "ckpttool"
    if exe.exists():
        return str(exe)
    found = shutil.which("ckpttool")
    if not found:
        sys.exit("benchmarks/merge.py: no ckpttool executable beside this python or on PATH")
    return found


def ckpttool_argv(src: Path, out: Path, dtype: str, workers: int | None) -> list[str]:
    # The generated checkpoints have no config.json: weights only (no output contract check).
    argv = [ckpttool_exe(), "merge", str(src), str(out), "--dtype", dtype, "-q",
            "--weights-only"]
    if workers:  # only when asked: ckpttool's own default is the CPU count
        argv += ["--workers", str(workers)]
    return argv


def baseline_argv(tree: Path, src: Path, out: Path, dtype: str, workers: int | None
                  ) -> list[str]:
    """ckpttool as it was at another revision (``--baseline``): that tree's package first on
    the path, the same python and dependencies."""
    argv = ["env", f"PYTHONPATH={tree}", sys.executable, "-m", "ckpttool", "merge", str(src),
            str(out), "--dtype", dtype, "-q"]
    if "--weights-only" in (tree / "ckpttool" / "cli" / "merge.py").read_text():
        argv.append("--weights-only")  # revisions since the output contract check need it
    return argv + (["--workers", str(workers)] if workers else [])


def baseline_tree(workdir: Path, rev: str) -> tuple[str, Path]:
    """A detached worktree of ``rev`` under ``workdir`` (made once): the code to compare with."""
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = workdir / f"baseline-{sha}"
    if not (tree / "ckpttool").is_dir():
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-f", str(tree),
                        sha], check=True, capture_output=True)
    return sha, tree


def tools(dcp_dir: Path, fp32_dir: Path | None, scratch: Path, workers: int | None,
          baseline: tuple[str, Path] | None = None) -> list[Tool]:
    py = sys.executable
    tl = [
        Tool("ckpttool-keep", "ckpttool merge --dtype keep", "bf16",
             ckpttool_argv(dcp_dir, scratch / "ckpttool-out", "keep", workers),
             scratch / "ckpttool-out"),
        Tool("accelerate", "accelerate merge_fsdp_weights", "bf16",
             [py, "-c", ACCELERATE_CODE, str(dcp_dir), str(scratch / "accelerate-out")],
             scratch / "accelerate-out"),
        Tool("torch", "torch dcp_to_torch_save", "bf16",
             [py, "-c", TORCH_CODE, str(dcp_dir), str(scratch / "torch-out.pt")],
             scratch / "torch-out.pt"),
        Tool("cp", "cp -r", "bf16", ["cp", "-r", str(dcp_dir), str(scratch / "cp-out")],
             scratch / "cp-out"),
        Tool("cat", "cat > /dev/null", "bf16", ["cat", *map(str, M.files_under(dcp_dir))],
             scratch / "nothing", discard_stdout=True),
    ]
    if fp32_dir is not None:
        tl += [
            Tool("ckpttool-bf16", "ckpttool merge --dtype bf16", "fp32",
                 ckpttool_argv(fp32_dir, scratch / "ckpttool-bf16-out", "bf16", workers),
                 scratch / "ckpttool-bf16-out"),
            Tool("cp-fp32", "cp -r", "fp32", ["cp", "-r", str(fp32_dir), str(scratch / "cp-out")],
                 scratch / "cp-out"),
            Tool("cat-fp32", "cat > /dev/null", "fp32",
                 ["cat", *map(str, M.files_under(fp32_dir))], scratch / "nothing",
                 discard_stdout=True),
        ]
    if baseline is not None:
        sha, tree = baseline
        tl.append(Tool("baseline-keep", f"ckpttool@{sha} merge --dtype keep", "bf16",
                       baseline_argv(tree, dcp_dir, scratch / "baseline-out", "keep", workers),
                       scratch / "baseline-out"))
        if fp32_dir is not None:
            tl.append(Tool("baseline-bf16", f"ckpttool@{sha} merge --dtype bf16", "fp32",
                           baseline_argv(tree, fp32_dir, scratch / "baseline-bf16-out", "bf16",
                                         workers),
                           scratch / "baseline-bf16-out"))
    return tl


def selected(key: str, only: list[str] | None) -> bool:
    """--only takes tool keys (ckpttool-keep, cp-fp32, help...) or their first words
    (ckpttool, cp, cat...)."""
    return not only or key in only or key.split("-")[0] in only


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
            for k in h.keys():  # noqa: SIM118 (not a dict)
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


def check_cast(fp32_dir: Path, shapes: list, scratch: Path, ck: Tool) -> dict:
    """ckpttool's ``--dtype bf16`` output of the fp32 checkpoint vs the generator's fp32 values
    cast by ``Tensor.to(torch.bfloat16)``: every tensor, bit for bit."""
    import torch
    from safetensors import safe_open

    print("[check] running ckpttool merge --dtype bf16 on the fp32 checkpoint (untimed)...",
          flush=True)
    remove(ck.out)
    m = M.run_measured(ck.argv)
    if not m.ok:
        remove(ck.out)
        raise SystemExit(f"[check] {ck.name} failed: {m.error_line()}\n{m.stderr}")
    problems: list[str] = []
    compared = 0
    try:
        files = sorted(ck.out.glob("*.safetensors"))
        handles = [safe_open(str(f), framework="pt") for f in files]
        where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 (not a dict)
        if sorted(where) != sorted(n for n, _ in shapes):
            problems.append("tensor names differ from the generated model")
        for i, (name, shape) in enumerate(shapes):
            if name not in where:
                continue
            a = where[name].get_tensor(name)
            want = full_tensor(i, tuple(shape), "fp32").to(torch.bfloat16)
            if a.dtype != torch.bfloat16 or tuple(a.shape) != tuple(shape):
                problems.append(f"{name}: {a.dtype}{list(a.shape)}, expected bf16{list(shape)}")
            elif not torch.equal(a.view(torch.uint8), want.view(torch.uint8)):
                problems.append(f"{name}: bytes differ from the fp32 values .to(bfloat16)")
            compared += 1
        del handles, where
    finally:
        remove(ck.out)
    if problems:
        print("[check] bf16 cast FAILED:\n  " + "\n  ".join(problems[:10]), flush=True)
    else:
        print(f"[check] ok: {compared} tensors of the bf16 merge bit-identical to the fp32 "
              "generator values .to(torch.bfloat16)", flush=True)
    return {"tensors_compared_with_generator_cast": compared, "files": [f.name for f in files],
            "ok": not problems, "problems": problems}


# --------------------------------------------------------------------------------------------
# Measuring


def summarize(key: str, name: str, reads: str, runs: list[M.Measurement]) -> dict:
    """One table row: the fastest successful run's wall time (and its CPU time), the highest
    peak RSS of the successful runs, and every run."""
    good = [m for m in runs if m.ok]
    row: dict = {"key": key, "tool": name, "reads": reads, "ok": bool(good),
                 "runs_wall_s": [m.wall_s for m in runs],
                 "runs_peak_rss_mb": [m.peak_rss_mb for m in runs],
                 "runs_ok": [m.ok for m in runs], "cmd": runs[-1].cmd,
                 "rss_method": runs[-1].rss_method}
    if good:
        fast = min(good, key=lambda m: m.wall_s)
        high = max(good, key=lambda m: m.peak_rss_bytes or 0)
        row.update(wall_s=fast.wall_s, cpu_s=fast.cpu_s, peak_rss_mb=high.peak_rss_mb,
                   min_peak_rss_mb=min(m.peak_rss_mb or 0 for m in good),
                   rss_at_floor=high.at_floor,
                   rss_floor_mb=None if high.rss_floor_bytes is None
                   else high.rss_floor_bytes / 2**20)
    bad = [m for m in runs if not m.ok]
    if bad:
        row["error"] = bad[-1].error_line()
        row["stderr_tail"] = bad[-1].stderr[-2000:]
    return row


def _run_one(label: str, argv: list[str], args: argparse.Namespace, warm: Path | None = None,
             discard_stdout: bool = False) -> M.Measurement:
    """Run and measure one command. With ``warm``, the memory state is made the same for every
    command first: every other cached checkpoint of the work directory is dropped from the page
    cache, then ``warm`` is read into it. Without that, a command that runs after one which
    left (say) a 12 GB checkpoint in the cache spends its time in direct reclaim (it doubled
    ckpttool's 6 GB time), and the order of the rows decides the result."""
    M.sync()  # no write-back left over from the previous run
    note = ""
    if warm is not None:
        for other in sorted(args.workdir.glob("ckpt-*")):
            if other.is_dir() and other != warm.parent:
                M.evict_page_cache(other)
        note = f" (cache warmed in {M.warm_page_cache(warm):.1f} s)"
    print(f"{label}{note}...", end=" ", flush=True)
    # Bytecode cached, as an installed package has it (whatever PYTHONDONTWRITEBYTECODE says
    # here): else every run compiles every module it imports, more for a larger tree.
    m = M.run_measured(argv, timeout_s=args.timeout, discard_stdout=discard_stdout,
                       env=M.bytecode_env(args.workdir / "pycache"))
    if m.ok:
        print(f"{m.wall_s:.2f} s, {m.peak_rss_mb:.0f} MB", flush=True)
    else:
        print(f"FAILED: {m.error_line()}", flush=True)
    return m


def measure_global(args: argparse.Namespace) -> list[dict]:
    """Size-independent rows: ``python -c "import torch"`` (the RSS baseline of anything that
    casts with torch) and ``ckpttool --help`` (start-up)."""
    rows = []
    cmds = [("import-torch", 'python -c "import torch"', [sys.executable, "-c", "import torch"]),
            ("help", "ckpttool --help", [ckpttool_exe(), "--help"])]
    for key, name, argv in cmds:
        if not selected(key, args.only):
            continue
        runs = [_run_one(f"[{k + 1}/{args.help_repeat}] {name}", argv, args)
                for k in range(args.help_repeat)]
        rows.append(summarize(key, name, "-", runs))
    return rows


def measure_size(size_gb: float, workdir: Path, args: argparse.Namespace, check: bool,
                 fp32: bool, skipped: dict[str, str]) -> dict:
    dcp_dir, shapes = ensure_checkpoint(workdir, size_gb, "bf16")
    fp32_dir = ensure_checkpoint(workdir, size_gb, "fp32")[0] if fp32 else None
    dirs = {"bf16": dcp_dir, "fp32": fp32_dir}
    nbytes = {k: M.dir_bytes(d) for k, d in dirs.items() if d is not None}
    scratch = workdir / "out"
    scratch.mkdir(parents=True, exist_ok=True)
    baseline = baseline_tree(workdir, args.baseline) if args.baseline else None
    all_tools = tools(dcp_dir, fp32_dir, scratch, args.workers, baseline)
    by_key = {t.key: t for t in all_tools}
    for t in all_tools:
        remove(t.out)
    result: dict = {"size_gb": size_gb, "label": size_label(size_gb), "dcp_dir": str(dcp_dir),
                    "fp32_dir": None if fp32_dir is None else str(fp32_dir),
                    "dcp_bytes": nbytes["bf16"], "fp32_bytes": nbytes.get("fp32"),
                    "tensors": len(shapes), "params": sum(math.prod(s) for _, s in shapes),
                    "hidden": shapes[0][1][1], "layers": LAYERS, "skipped": dict(skipped)}
    if check:
        result["check"] = check_correctness(dcp_dir, shapes, scratch, by_key["ckpttool-keep"],
                                            by_key["torch"])
        if fp32_dir is not None:
            result["check_cast"] = check_cast(fp32_dir, shapes, scratch,
                                              by_key["ckpttool-bf16"])

    todo = [t for t in all_tools if selected(t.key, args.only) and t.key not in skipped]
    runs: dict[str, list[M.Measurement]] = {t.key: [] for t in todo}
    for rep in range(args.repeat):
        # Every other repetition in reverse order, so that no tool always follows the same one.
        for t in (todo if rep % 2 == 0 else todo[::-1]):
            remove(t.out)
            runs[t.key].append(_run_one(
                f"[{result['label']} run {rep + 1}/{args.repeat}] {t.name} ({t.reads} ckpt)",
                t.argv, args, warm=dirs[t.reads], discard_stdout=t.discard_stdout))
            if not (args.keep and rep == args.repeat - 1):
                remove(t.out)  # bound disk use: one output at a time
    rows = [summarize(t.key, t.name, t.reads, runs[t.key]) for t in todo]
    result["results"] = rows
    # Ratios within the table: vs cp -r of the same directory, vs ckpttool on the same one.
    rk = {r["key"]: r for r in rows}
    for r in rows:
        cp = rk.get("cp" if r["reads"] == "bf16" else "cp-fp32")
        ck = rk.get("ckpttool-keep" if r["reads"] == "bf16" else "ckpttool-bf16")
        r["wall_vs_cp"] = _ratio_rows(r, cp)
        r["wall_vs_ckpttool"] = _ratio_rows(r, ck)
        if r["ok"]:
            r["read_gb_s"] = nbytes[r["reads"]] / 1e9 / r["wall_s"]
    return result


def _ratio_rows(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or not a["ok"] or not b["ok"]:
        return None
    return M.ratio(a["wall_s"], b["wall_s"])


# --------------------------------------------------------------------------------------------
# Targets


KEEP_VS_CP, KEEP_VS_ACCELERATE, BF16_VS_CP = 1.5, 10.0, 3.0
KEEP_RSS_MB, BF16_RSS_OVER_TORCH_MB, FLAT, HELP_S = 150.0, 256.0, 0.10, 0.15


def _row(result: dict, key: str) -> dict | None:
    r = next((r for r in result["results"] if r["key"] == key), None)
    return r if r and r["ok"] else None


def _flat(points: list[tuple[str, float]]) -> dict:
    """Flatness between the smallest and the largest size: |b - a| / min(a, b) <= FLAT."""
    if len(points) < 2:
        return {"verdict": "n/a", "text": "needs two sizes"}
    (la, a), (lb, b) = points[0], points[-1]
    change = (b - a) / a
    ok = abs(b - a) / min(a, b) <= FLAT
    return {"verdict": "PASS" if ok else "MISS", "value": change,
            "text": f"{la} {a:.0f} MB -> {lb} {b:.0f} MB ({change:+.1%})"}


def targets(results: list[dict], glob: list[dict]) -> list[dict]:
    """Every target, per size where it depends on size, with its verdict and numbers."""
    g = {r["key"]: r for r in glob if r["ok"]}
    torch_rss = g["import-torch"]["peak_rss_mb"] if "import-torch" in g else None
    out: list[dict] = []

    def per_size(name: str, fn) -> dict:
        cells = {}
        for res in results:
            cells[res["label"]] = fn(res)
        verdicts = [c["verdict"] for c in cells.values() if c]
        overall = ("MISS" if "MISS" in verdicts else "PASS" if verdicts and all(
            v == "PASS" for v in verdicts) else "n/a")
        return {"target": name, "cells": cells, "verdict": overall}

    def keep_vs_cp(res):
        ck, cp = _row(res, "ckpttool-keep"), _row(res, "cp")
        if not ck or not cp:
            return {"verdict": "n/a", "text": "n/a"}
        r = ck["wall_s"] / cp["wall_s"]
        return {"verdict": "PASS" if r <= KEEP_VS_CP else "MISS", "value": r,
                "text": f"{r:.2f}x ({ck['wall_s']:.2f} s vs {cp['wall_s']:.2f} s)"}

    def keep_vs_acc(res):
        ck, acc = _row(res, "ckpttool-keep"), _row(res, "accelerate")
        if not ck or not acc:
            why = res["skipped"].get("accelerate", "n/a")
            return {"verdict": "n/a", "text": f"n/a ({why})" if why != "n/a" else "n/a"}
        r = acc["wall_s"] / ck["wall_s"]
        return {"verdict": "PASS" if r >= KEEP_VS_ACCELERATE else "MISS", "value": r,
                "text": f"{r:.1f}x faster ({acc['wall_s']:.2f} s vs {ck['wall_s']:.2f} s)"}

    def bf16_vs_cp(res):
        ck, cp = _row(res, "ckpttool-bf16"), _row(res, "cp-fp32")
        if not ck or not cp:
            why = res["skipped"].get("ckpttool-bf16", "n/a")
            return {"verdict": "n/a", "text": f"n/a ({why})" if why != "n/a" else "n/a"}
        r = ck["wall_s"] / cp["wall_s"]
        return {"verdict": "PASS" if r <= BF16_VS_CP else "MISS", "value": r,
                "text": f"{r:.2f}x ({ck['wall_s']:.2f} s vs {cp['wall_s']:.2f} s)"}

    def keep_rss(res):
        ck = _row(res, "ckpttool-keep")
        if not ck:
            return {"verdict": "n/a", "text": "n/a"}
        v = ck["peak_rss_mb"]
        return {"verdict": "PASS" if v <= KEEP_RSS_MB else "MISS", "value": v,
                "text": f"{v:.0f} MB"}

    def bf16_rss(res):
        ck = _row(res, "ckpttool-bf16")
        if not ck or torch_rss is None:
            return {"verdict": "n/a", "text": "n/a"}
        v = ck["peak_rss_mb"] - torch_rss
        return {"verdict": "PASS" if v <= BF16_RSS_OVER_TORCH_MB else "MISS", "value": v,
                "text": f"+{v:.0f} MB ({ck['peak_rss_mb']:.0f} MB)"}

    t = per_size(f"`merge --dtype keep` wall <= {KEEP_VS_CP}x `cp -r` (bf16 dir)", keep_vs_cp)
    out.append(t)
    out.append(per_size(f"`merge --dtype keep` >= {KEEP_VS_ACCELERATE:g}x faster than accelerate "
                        "`merge_fsdp_weights`", keep_vs_acc))
    out.append(per_size(f"`merge --dtype bf16` (fp32 ckpt) wall <= {BF16_VS_CP:g}x `cp -r` "
                        "(fp32 dir)", bf16_vs_cp))
    out.append(per_size(f"`merge --dtype keep` peak RSS <= {KEEP_RSS_MB:g} MB", keep_rss))
    pts = [(r["label"], _row(r, "ckpttool-keep")["peak_rss_mb"]) for r in results
           if _row(r, "ckpttool-keep")]
    f = _flat(pts)
    out.append({"target": f"`merge --dtype keep` peak RSS flat (within {FLAT:.0%}, smallest "
                          "vs largest size)", "cells": {}, "verdict": f["verdict"],
                "text": f["text"], "value": f.get("value")})
    out.append(per_size(f"`merge --dtype bf16` peak RSS <= `import torch` + "
                        f"{BF16_RSS_OVER_TORCH_MB:g} MB"
                        + (f" (= {torch_rss:.0f} + {BF16_RSS_OVER_TORCH_MB:g} MB)"
                           if torch_rss else ""), bf16_rss))
    pts = [(r["label"], _row(r, "ckpttool-bf16")["peak_rss_mb"]) for r in results
           if _row(r, "ckpttool-bf16")]
    f = _flat(pts)
    if f["verdict"] != "n/a" and torch_rss is not None:
        f["text"] += (f"; above `import torch`: +{pts[0][1] - torch_rss:.0f} -> "
                      f"+{pts[-1][1] - torch_rss:.0f} MB")
    out.append({"target": f"`merge --dtype bf16` peak RSS flat (within {FLAT:.0%}, smallest vs "
                          "largest fp32 size)", "cells": {}, "verdict": f["verdict"],
                "text": f["text"], "value": f.get("value")})
    h = g.get("help")
    out.append({"target": f"`ckpttool --help` wall < {HELP_S} s (best of {len(h['runs_wall_s'])})"
                if h else f"`ckpttool --help` wall < {HELP_S} s", "cells": {},
                "verdict": ("PASS" if h["wall_s"] < HELP_S else "MISS") if h else "n/a",
                "text": f"{h['wall_s']:.3f} s" if h else "n/a",
                "value": h["wall_s"] if h else None})
    return out


# --------------------------------------------------------------------------------------------
# Output


def _f(x: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, fmt) + suffix


def render_targets(tg: list[dict], labels: list[str]) -> str:
    rows = []
    for t in tg:
        cells = [(t["cells"].get(lb) or {}).get("text", "") for lb in labels]
        if t["cells"]:
            cells = [f"{c['verdict']} {c['text']}" if c and c["verdict"] != "n/a"
                     else (c or {}).get("text", "") for c in
                     (t["cells"].get(lb) for lb in labels)]
            rows.append([t["target"], *cells, f"**{t['verdict']}**"])
        else:
            rows.append([t["target"], *["" for _ in labels], f"**{t['verdict']}** {t['text']}"])
    return M.markdown_table(["target", *labels, "verdict"], rows)


def render_global(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["ok"]:
            out.append([r["tool"], _f(r["wall_s"], ".3f"),
                        ", ".join(f"{w:.3f}" for w in r["runs_wall_s"]),
                        _f(r["peak_rss_mb"], ".0f"), _f(r["cpu_s"], ".2f")])
        else:
            out.append([r["tool"], "FAILED", r.get("error", "")[:200], "-", "-"])
    return M.markdown_table(["command", "wall s (best)", "all runs s", "peak RSS MB (max)",
                             "CPU s"], out)


def render(result: dict) -> str:
    fp = result.get("fp32_bytes")
    lines = [f"### {result['label']}: bf16 DCP checkpoint {result['dcp_bytes'] / 1e9:.2f} GB"
             + (f", fp32 one {fp / 1e9:.2f} GB" if fp else ", no fp32 checkpoint")
             + f"; {result['tensors']} tensors, {result['params'] / 1e9:.2f} B parameters "
             f"(hidden {result['hidden']}, {result['layers']} layers), {WORLD} shards", ""]
    if "check" in result:
        c = result["check"]
        if c["ok"]:
            lines += [f"Correctness: `--dtype keep` output bit-identical to dcp_to_torch_save for "
                      f"all {c['tensors_compared_with_torch']} tensors, and to the generator for "
                      f"{c['tensors_compared_with_generator']}.", ""]
        else:
            lines += ["Correctness: **FAILED**: " + "; ".join(c["problems"][:5]), ""]
    if "check_cast" in result:
        c = result["check_cast"]
        if c["ok"]:
            lines += [f"Correctness: `--dtype bf16` output of the fp32 checkpoint bit-identical "
                      f"to the generator's fp32 values `.to(torch.bfloat16)` for all "
                      f"{c['tensors_compared_with_generator_cast']} tensors.", ""]
        else:
            lines += ["Correctness (bf16 cast): **FAILED**: " + "; ".join(c["problems"][:5]), ""]
    rows = []
    floored = False
    failures: list[str] = []
    for r in result["results"]:
        runs = ", ".join("fail" if not ok else f"{w:.2f}"
                         for w, ok in zip(r["runs_wall_s"], r["runs_ok"], strict=True))
        if r["ok"]:
            star = "*" if r["rss_at_floor"] else ""
            floored |= bool(star)
            rows.append([r["tool"], r["reads"], _f(r["wall_s"], ".2f"), runs,
                         _f(r.get("wall_vs_cp"), ".2f", "x"),
                         _f(r.get("wall_vs_ckpttool"), ".2f", "x"),
                         _f(r["peak_rss_mb"], ".0f") + star, _f(r["cpu_s"], ".2f"),
                         _f(r.get("read_gb_s"), ".2f")])
        else:
            rows.append([r["tool"], r["reads"], "FAILED", runs, "-", "-", "-", "-", "-"])
        if "error" in r:
            failures.append(f"- **{r['tool']} ({r['reads']}) failed** "
                            f"{r['runs_ok'].count(False)} of {len(r['runs_ok'])} runs: "
                            f"{r['error'][:300]}")
    for key, why in result["skipped"].items():
        rows.append([key, "", "skipped", "", "", "", "", "", ""])
        failures.append(f"- {key} skipped: {why}")
    lines.append(M.markdown_table(
        ["tool", "reads", "wall s (best)", "all runs s", "wall / cp -r (same dir)",
         "wall / ckpttool (same dir)", "peak RSS MB (max)", "CPU s", "GB/s read"], rows))
    lines.append("")
    if failures:
        lines += [*failures, ""]
    if floored:
        lines += ["\\* at the measuring launcher's floor (its own RSS, about 7-9 MB, is "
                  "inherited across fork): the true peak is at most this", ""]
    return "\n".join(lines)


def _df_type(path: Path) -> str:
    """The filesystem type as `df -T` prints it."""
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
        return out[1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return M.filesystem_of(path)


def _nproc() -> int | None:
    try:
        return int(subprocess.run(["nproc"], capture_output=True, text=True).stdout)
    except (OSError, ValueError):
        return None


def _git() -> str | None:
    here = str(Path(__file__).resolve().parent)
    head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    if not head:
        return None
    # --no-optional-locks: read-only, never touches the index (others work in this checkout)
    dirty = subprocess.run(["git", "--no-optional-locks", "-C", here, "status", "--porcelain"],
                           capture_output=True, text=True).stdout.splitlines()
    return head + (f" + {len(dirty)} uncommitted/untracked paths" if dirty else "")


def plan_fp32(sizes: list[float], workdir: Path, args: argparse.Namespace
              ) -> tuple[set[float], dict[float, dict[str, str]]]:
    """Which sizes get an fp32 checkpoint, and what is skipped where (and why): fp32 above
    --fp32-max or beyond the free disk; the full-load tools above --full-load-max or where they
    would not fit in memory."""
    skipped: dict[float, dict[str, str]] = {s: {} for s in sizes}
    fp32 = {s for s in sizes if s <= args.fp32_max}
    for s in sizes:
        if s not in fp32:
            for k in ("ckpttool-bf16", "cp-fp32", "cat-fp32"):
                skipped[s][k] = f"no fp32 checkpoint above --fp32-max {args.fp32_max:g} GB"
    free = shutil.disk_usage(workdir).free
    margin = 3e9
    bf16_new = sum(s * 1e9 for s in sizes if not is_cached(workdir, s))
    while True:
        fp32_new = sum(2 * s * 1e9 for s in fp32 if not is_cached(workdir, s, "fp32"))
        largest_out = max([2 * s * 1e9 for s in fp32] + [s * 1e9 for s in sizes])
        need = bf16_new + fp32_new + largest_out + margin
        if need <= free or not fp32:
            break
        big = max(fp32)
        fp32.discard(big)
        for k in ("ckpttool-bf16", "cp-fp32", "cat-fp32"):
            skipped[big][k] = (f"not enough disk for a {2 * big:g} GB fp32 checkpoint and its "
                               f"copy ({free / 1e9:.0f} GB free)")
    if need > free:
        print(f"warning: {free / 1e9:.0f} GB free under {workdir}, about {need / 1e9:.0f} GB "
              "may be needed", file=sys.stderr)
    avail = M.mem_available_bytes()
    for s in sizes:
        for k in FULL_LOAD:
            if s > args.full_load_max:
                skipped[s][k] = f"above --full-load-max {args.full_load_max:g} GB"
            elif avail is not None and s * 1e9 * 1.5 > avail:
                skipped[s][k] = (f"loads the whole {s:g} GB model; only {avail / 1e9:.1f} GB "
                                 "of memory available")
    return fp32, skipped


# The claims of benchmarks/figures.json this script measures are of the 3 GB checkpoint.
CLAIM_SIZE_GB = 3.0


def record(args: argparse.Namespace, results: list[dict], glob: list[dict], info: dict) -> None:
    """This run's figures into the results file (with ``--record``): ``--help`` whatever the
    sizes, the merge rows only from a run at the claims' size."""
    loads = [info[k][0] for k in ("loadavg_at_start", "loadavg_at_end") if info.get(k)]
    load = M.load_span(loads)
    g = {r["key"]: r for r in glob if r["ok"]}
    if "help" in g:
        h = g["help"]
        M.record_figure(args, "help", figure=f"{h['wall_s']:.3f} s", cpu_s=h["cpu_s"],
                        met=h["wall_s"] < HELP_S, peak_mb=h["peak_rss_mb"], load=load)
    if not results:
        return
    res = next((r for r in results if r["size_gb"] == CLAIM_SIZE_GB), results[-1])
    full = res["size_gb"] == CLAIM_SIZE_GB  # another size goes only to --figures PATH
    for claim, key, cp_key, target in (("merge-keep", "ckpttool-keep", "cp", KEEP_VS_CP),
                                       ("merge-cast-bf16", "ckpttool-bf16", "cp-fp32",
                                        BF16_VS_CP)):
        ck, cp = _row(res, key), _row(res, cp_key)
        if ck and cp:
            r = ck["wall_s"] / cp["wall_s"]
            M.record_figure(args, claim, figure=f"{ck['wall_s']:.2f} s", cpu_s=ck["cpu_s"],
                            baseline=f"`cp -r` {cp['wall_s']:.2f} s", ratio=r, met=r <= target,
                            peak_mb=ck["peak_rss_mb"], load=load, full_size=full)
    acc = _row(res, "accelerate")
    if acc:
        M.record_figure(args, "merge-accelerate", figure=f"{acc['wall_s']:.2f} s",
                        cpu_s=acc["cpu_s"], peak_mb=acc["peak_rss_mb"], load=load,
                        full_size=full)


def main(argv: list[str] | None = None) -> int:
    # Like for like with cp -r, which leaves its output to the page cache too.
    os.environ["CKPTTOOL_FSYNC"] = "0"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3",
                    help="bf16 checkpoint sizes in GB (1e9 bytes), comma-separated (default: 3)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"),
                    help="where checkpoints are cached and outputs written")
    ap.add_argument("--repeat", type=int, default=2,
                    help="timed runs per tool and size; the fastest is reported (default: 2)")
    ap.add_argument("--help-repeat", type=int, default=5,
                    help='runs of `ckpttool --help` and `python -c "import torch"` (default: 5)')
    ap.add_argument("--fp32-max", type=float, default=math.inf,
                    help="generate and measure the fp32 checkpoint (for --dtype bf16) only for "
                         "sizes up to this many GB (default: every size the disk allows; "
                         "0: none)")
    ap.add_argument("--full-load-max", type=float, default=math.inf,
                    help="run accelerate and dcp_to_torch_save (which load the whole model into "
                         "memory) only up to this size in GB (default: every size that fits "
                         "in memory)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the last outputs of each tool under WORKDIR/out "
                         "(default: remove each output right after it is measured)")
    ap.add_argument("--workers", type=int, default=None,
                    help="pass --workers N to ckpttool (default: not passed; ckpttool's own "
                         "default is the CPU count)")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help="run only these (keys: " + ",".join(TOOL_KEYS + GLOBAL_KEYS)
                         + "; or first words: ckpttool,cp,cat)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    ap.add_argument("--baseline", metavar="REV", default=None,
                    help="also time ckpttool as it was at git revision REV (a worktree under "
                         "WORKDIR), side by side in the same run: before/after a change")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds before a tool run is killed and recorded as failed")
    ap.add_argument("--results-md", type=Path,
                    default=Path(__file__).resolve().parent / "RESULTS.md",
                    help="where to write the Markdown report (default: benchmarks/RESULTS.md; "
                         "'-' for nowhere)")
    M.add_record_args(ap)
    args = ap.parse_args(argv)
    sizes = sorted(float(s) for s in args.sizes.split(",") if s.strip())
    if not sizes or any(s <= 0 for s in sizes):
        ap.error("--sizes needs positive numbers")
    if args.repeat < 1 or args.help_repeat < 1:
        ap.error("--repeat and --help-repeat must be at least 1")
    if args.only and (bad := [o for o in args.only if not any(
            selected(k, [o]) for k in TOOL_KEYS + GLOBAL_KEYS)]):
        ap.error(f"--only: unknown {', '.join(bad)}")
    workdir: Path = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    args.workdir = workdir
    stamp = time.localtime()
    started, t_start = time.strftime("%Y-%m-%d %H:%M:%S %Z", stamp), time.perf_counter()
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))

    import torch

    info = M.machine_info({"nproc": _nproc(), "torch": torch.__version__,
                           "filesystem": _df_type(workdir), "workdir": str(workdir)})
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
    info["git"] = _git()
    print(f"machine: nproc {info['nproc']}, {info.get('mem_total_gib')} GiB, "
          f"torch {info['torch']}, accelerate {info['accelerate']}, fs {info['filesystem']}",
          flush=True)

    fp32_sizes, skipped = plan_fp32(sizes, workdir, args)
    if args.only:
        for s in sizes:
            skipped[s] = {k: v for k, v in skipped[s].items() if selected(k, args.only)}
    glob = measure_global(args)
    results = []
    for k, size in enumerate(sizes):
        results.append(measure_size(size, workdir, args, check=(k == 0 and not args.no_check),
                                    fp32=size in fp32_sizes, skipped=skipped[size]))
    tg = targets(results, glob)
    with contextlib.suppress(OSError):
        info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    elapsed = time.perf_counter() - t_start

    labels = [r["label"] for r in results]
    fp32_note = (f"fp32 checkpoints (same shapes, for `--dtype bf16`) at "
                 f"{', '.join(size_label(s) for s in sorted(fp32_sizes))}"
                 if fp32_sizes else "no fp32 checkpoints")
    md = ["# ckpttool merge benchmark", "",
          f"- Command: `{command}`",
          f"- Date: {started}; total runtime {elapsed / 60:.1f} min",
          f"- Machine: nproc {info['nproc']}, {info.get('mem_total_gib')} GiB RAM, "
          f"{info.get('cpu_model', '?')}, {info['platform']}; load average "
          f"{info.get('loadavg_at_start')} at start, {info.get('loadavg_at_end')} at end",
          f"- Software: Python {info['python']}, torch {info['torch']}, accelerate "
          f"{info['accelerate']}, safetensors {info['safetensors']}, ckpttool "
          f"{info['ckpttool']} (git {info['git']})",
          f"- Work directory: `{workdir}`, filesystem {info['filesystem']} (`df -T`)",
          f"- Checkpoints: real 4-rank DCP checkpoints (`dcp.save` from 4 gloo processes, "
          f"FSDP2-style `[Shard(0)]` DTensors) of bf16 tensors at {', '.join(labels)}; "
          f"{fp32_note}",
          f"- Method: each command in a fresh process; wall = fork to reap (start-up and "
          f"imports included), best of {args.repeat} runs (best of {args.help_repeat} for the "
          f"size-independent rows); peak RSS = kernel `ru_maxrss`, the highest of the "
          f"successful runs; page cache warm and the same for every command: before each run "
          f"a `sync`, the other benchmark checkpoints dropped from the page cache "
          f"(`POSIX_FADV_DONTNEED`, these files only), then the checkpoint the command reads "
          f"read once; no tool fsyncs its output (ckpttool runs with `CKPTTOOL_FSYNC=0`: "
          f"`cp -r` does not sync either; the sync costs about 0.3 s per GB); tools run in "
          f"reverse order on every other "
          f"repetition; ckpttool "
          + (f"with `--workers {args.workers}`" if args.workers
             else "with its default `--workers` (the CPU count)"),
          "", "## Targets", "", render_targets(tg, labels), "",
          "## Size-independent", "", render_global(glob), "",
          "## Per size", ""]
    for r in results:
        md += [render(r), ""]
    md += ["`wall / cp -r` and `wall / ckpttool` compare with the row of the same kind reading "
           "the same directory (`cp -r` of the bf16 or fp32 directory; ckpttool `--dtype keep` "
           "for the bf16 directory, `--dtype bf16` for the fp32 one); `GB/s read` is that "
           "directory's size over the wall time."]
    text = "\n".join(md) + "\n"
    print()
    print(text)
    # The latest run as results-merge.json, and every run under its start time, so that a
    # smoke run never loses the results of a full one.
    doc = json.dumps({"command": command, "date": started, "elapsed_s": elapsed,
                      "machine": info, "repeat": args.repeat, "help_repeat": args.help_repeat,
                      "cache": "warm", "fp32_sizes": sorted(fp32_sizes), "global": glob,
                      "sizes": results, "targets": tg, "markdown": text},
                     indent=2, default=str)
    out_json = workdir / "results-merge.json"
    stamped = workdir / f"results-merge-{time.strftime('%Y%m%d-%H%M%S', stamp)}.json"
    for path in (out_json, stamped):
        path.write_text(doc)
    print(f"(results written to {out_json} and {stamped.name})")
    if str(args.results_md) != "-":
        # The dated history below the last run is kept (docs/benchmarks.md cites the latest).
        previous = args.results_md.read_text() if args.results_md.exists() else ""
        _, found, history = previous.partition("\n## History\n")
        args.results_md.write_text(text + ("\n## History\n" + history if found else ""))
        print(f"(Markdown written to {args.results_md})")
    record(args, results, glob, info)
    if not args.keep:
        shutil.rmtree(workdir / "out", ignore_errors=True)
    failed_check = any(not r.get(c, {"ok": True})["ok"] for r in results
                       for c in ("check", "check_cast"))
    return 1 if failed_check else 0


if __name__ == "__main__":
    sys.exit(main())
