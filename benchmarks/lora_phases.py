"""Where the LoRA fold's CPU goes, per GB of bf16 output: each step of the per-block loop timed
on its own (``time.thread_time``), one thread, the weights mapped from the page cache as the
merge maps them, every block written into a scratch file.

    .venv/bin/python benchmarks/lora_phases.py [--way now|before] [--layers 15] [--block N]
                                               [--work /tmp/ckpttool-lora-bench/l30-r16]

``before`` is the loop of f4b6df6 (product, times the scale, plus the bf16 rows: torch widens
them into a new float32 tensor per block, cast); ``now`` widens the rows into a kept buffer
and, the scale being a power of two, scales and adds in one pass
(:func:`ckpttool.core.transforms.lora.fold.fma_exact`). Reads the model and adapter that
``benchmarks/lora.py`` generates (scale 2). Prints seconds of CPU per step and per GB, with
the load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import struct
import time
from pathlib import Path

import torch
from safetensors import safe_open


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--way", choices=["now", "before"], default="now")
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--block", type=int, default=1 << 18, help="elements per block")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckpttool-lora-bench/l30-r16"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # as each merge worker runs
    base, adapter = args.work / "base", args.work / "adapter"
    where = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    scale = 2.0  # lora.py's adapter: alpha = 2 r
    heads: dict[str, tuple[int, dict[str, dict[str, list[int]]]]] = {}
    fds: dict[str, int] = {}
    for file in set(where.values()):
        with open(base / file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            heads[file] = (8 + n, json.loads(f.read(n)))
        fds[file] = os.open(base / file, os.O_RDONLY)
    out_path = args.work / "phases.out"
    out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    cap = 2 * args.block + 16 * 8192
    part_all, wide_all = torch.empty(cap), torch.empty(cap)
    raw = bytearray(cap * 2)
    out_all = torch.frombuffer(raw, dtype=torch.bfloat16)
    spent: dict[str, float] = {}

    def tick(step: str, t0: float) -> float:
        t1 = time.thread_time()
        spent[step] = spent.get(step, 0.0) + t1 - t0
        return t1

    offset = written = 0
    with safe_open(adapter / "adapter_model.safetensors", "pt") as ad:
        keys = set(ad.keys())
        for name, file in where.items():
            module = name.removesuffix(".weight")
            prefix = f"base_model.model.{module}"
            if f"{prefix}.lora_A.weight" not in keys or int(name.split(".")[2]) >= args.layers:
                continue
            a = ad.get_tensor(f"{prefix}.lora_A.weight")
            b = ad.get_tensor(f"{prefix}.lora_B.weight")
            data_start, header = heads[file]
            lo_byte, hi_byte = header[name]["data_offsets"]
            rows, cols = header[name]["shape"]
            t0 = time.thread_time()
            start = data_start + lo_byte
            aligned = start - start % mmap.ALLOCATIONGRANULARITY
            mapped = mmap.mmap(fds[file], hi_byte - lo_byte + start - aligned, offset=aligned,
                               access=mmap.ACCESS_COPY)
            w = torch.frombuffer(memoryview(mapped)[start - aligned :],
                                 dtype=torch.bfloat16).view(rows, cols)
            t0 = tick("map", t0)
            step = max(16, args.block // cols)
            count = max(1, rows // step)
            for lo, hi in itertools.pairwise([rows * k // count for k in range(count + 1)]):
                n = (hi - lo) * cols
                part = part_all[:n].view(hi - lo, cols)
                torch.mm(b[lo:hi], a, out=part)
                t0 = tick("mm", t0)
                if args.way == "before":
                    part.mul_(scale)
                    t0 = tick("mul", t0)
                    part.add_(w[lo:hi])
                    t0 = tick("add (bf16 rows)", t0)
                    total = part
                else:
                    total = wide_all[:n].view(hi - lo, cols)
                    total.copy_(w[lo:hi])
                    t0 = tick("widen", t0)
                    total.add_(part, alpha=scale)
                    t0 = tick("add (alpha)", t0)
                out_all[:n].copy_(total.view(-1))
                t0 = tick("cast", t0)
                os.pwrite(out_fd, memoryview(raw)[: n * 2], offset)
                offset += n * 2
                t0 = tick("pwrite", t0)
            del w
            mapped.close()
            tick("unmap", t0)
            written += rows * cols * 2
    os.close(out_fd)
    out_path.unlink()
    total_s = sum(spent.values())
    gb = written / 1e9
    print(f"{args.way}, block {args.block} elements, {gb:.2f} GB: {total_s:.2f} s CPU, "
          f"{total_s / gb:.2f} s/GB; per GB: "
          + ", ".join(f"{k} {v / gb:.3f}" for k, v in spent.items())
          + f"; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
