"""The LoRA fold alone, A/B in one process: the fold as it was before issue 25's round 4 (blocks
of rows: the product times the scale, plus the bf16 rows, cast; f4b6df6) against the current
one (:func:`ckpttool.core.transforms.lora` pieces), each piece written into a file of its own,
weight by weight in alternating order, so that whatever else loads the machine weighs on both.

    .venv/bin/python benchmarks/lora_fold_ab.py [--work /tmp/ckpttool-lora-bench/l30-r16]

Reads the model and adapter that ``benchmarks/lora.py`` generates; prints the CPU time (user +
system, of this thread: the fold and its writes into fresh files) of each way, the load, and
whether the two outputs are byte for byte the same. No ``import torch`` and no planning: this
is the part of ``merge --adapter`` that changed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ckpttool.core.transforms import derive
from ckpttool.core.transforms.derive import scratch
from ckpttool.core.transforms.lora import fold, layout
from ckpttool.formats.base import Tensor
from ckpttool.formats.codecs.dtypes import BY_NAME


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def before(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, fd: int,
           offset: int) -> None:
    """The fold of f4b6df6 (main before this change): blocks of rows, each the product of
    those rows, times the scale, plus the bf16 rows (torch widened them into a new float32
    tensor per block), cast into an output piece written at once."""
    b32, a32 = b.float(), a.float()
    rows, cols = w.shape
    bounds = fold.row_blocks(rows, cols)
    most = max(hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)) * cols
    assert fold.blocks_exact(b32, a32, bounds)  # as it checked (cached per shape: shared)
    block = scratch("before-rows", most)
    out = scratch("before-out", most, w.dtype)
    raw, at = getattr(derive._scratch, "before-out")
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        numel = (hi - lo) * cols
        part = block[:numel].view(hi - lo, cols)
        torch.mm(b32[lo:hi], a32, out=part)
        part.mul_(scale)
        part.add_(w[lo:hi])
        out[:numel].copy_(part.view(-1))
        pwrite_all(fd, memoryview(raw)[at : at + numel * w.dtype.itemsize], offset)
        offset += numel * w.dtype.itemsize


def now(pieces: Iterator[memoryview], fd: int, offset: int) -> None:
    for piece in pieces:
        pwrite_all(fd, piece, offset)
        offset += len(piece)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ckpttool-lora-bench/l30-r16"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # as each merge worker runs
    base, adapter = args.work / "base", args.work / "adapter"
    where = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    doc = json.loads((adapter / "adapter_config.json").read_text())
    config = layout.read_config(doc, str(adapter / "adapter_config.json"))
    files: dict[str, Any] = {}
    ad = safe_open(adapter / "adapter_model.safetensors", "pt")
    keys = set(ad.keys())
    outs = [args.work / "ab-before.out", args.work / "ab-now.out"]
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in outs]
    cpu = [0.0, 0.0]
    offset = count = 0
    try:
        for name, file in where.items():
            module = name.removesuffix(".weight")
            if f"{layout.PREFIX}{module}.lora_A.weight" not in keys:
                continue
            w = files.setdefault(file, safe_open(base / file, "pt")).get_tensor(name)
            a = ad.get_tensor(f"{layout.PREFIX}{module}.lora_A.weight")
            b = ad.get_tensor(f"{layout.PREFIX}{module}.lora_B.weight")

            def described(t: torch.Tensor, n: str) -> Tensor:
                dtype = BY_NAME["BF16" if t.dtype == torch.bfloat16 else "F32"]
                return Tensor(n, (n,), dtype, tuple(t.shape), ())

            m = layout.Module(module, a=described(a, "A"), b=described(b, "B"))
            derived = fold.fused_weight(name, described(w, name), m, config, None)
            assert derived.pieces is not None
            scale = config.scale(module, a.shape[0])
            for way in ((0, 1) if count % 2 == 0 else (1, 0)):
                start = time.thread_time()
                if way == 0:
                    before(w, a, b, scale, fds[0], offset)
                else:
                    now(derived.pieces([w, a, b], w.dtype), fds[1], offset)
                cpu[way] += time.thread_time() - start
            offset += w.numel() * w.dtype.itemsize
            count += 1
    finally:
        for fd in fds:
            os.close(fd)
    same = outs[0].read_bytes() == outs[1].read_bytes()
    for p in outs:
        p.unlink()
    print(f"{count} weights folded, {offset / 1e9:.2f} GB written each way: before "
          f"{cpu[0]:.2f} s CPU, now {cpu[1]:.2f} s CPU ({cpu[1] / cpu[0]:.2f}x); outputs "
          f"{'identical' if same else 'DIFFERENT'}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
