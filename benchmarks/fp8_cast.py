"""``--quantize fp8-block``'s last step alone: float32 -> float8_e4m3fn, torch's cast against
the same bytes made from the float32 bits by whole-tensor integer operations (issue 39).

    .venv/bin/python benchmarks/fp8_cast.py [--rows 128] [--cols 5632] [--repeat 7]
        [--threads 1] [--exhaustive]

What is cast is what ``_fp8_block`` casts: one block of rows of a bf16 weight (N(0, 0.02), as
``benchmarks/quantize.py`` generates them) widened to float32 and divided by its blocks'
scales (``amax / 448``), so every value lies in [-448, 448]. Each way runs on one torch
thread (as each merge worker does), on this thread's CPU clock, best and median of
``--repeat`` rounds, the two ways alternating; the 1-minute load is printed beside each
figure. Before timing, the integer way is checked byte for byte against torch's cast on the
block, on every float32 within 64 steps of each float8 value and rounding boundary (both
signs) and on about 2 million random float32 bit patterns of magnitude up to 1024;
``--exhaustive`` first checks every finite float32 (4.28 billion values: 2-3 minutes).

Also prints, for scale, what the other steps of a block cost per element (the widening copy,
the scales, the division): the cast's share of ``_fp8_block``.

The integer way (``by_bits``): torch's own conversion (c10's ``fp8e4m3fn_from_fp32_value``)
written as 14 vectorised operations over the whole block, no branch: the sign apart
(``f >> 31``); the normal path ``(|f| + 0x7FFFF + odd - (120 << 23)) >> 20`` with the bits
clamped first (saturation at 448, no negative codes); the subnormal path
``bits(|x| + 2**14) - (141 << 23)`` computed for every element and joined with
``max(normal, min(subnormal, 8))`` (each path is right where the other is not: below 2**-6
the normal path gives less than the subnormal one, above it the subnormal one is capped at
8); the sign added as 128 and the result narrowed to bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

F8 = torch.float8_e4m3fn
SUB = 141 << 23  # bits of 2**14: |x| + 2**14 rounds |x| to 2**-9, float8's subnormal step
NORMAL_LO = (120 << 23) - 0x7FFFF  # the normal path's code is >= 0 from here
NORMAL_HI = (120 << 23) + (127 << 20) - 0x80000  # and at most 126 (448) up to here


def by_bits(x: torch.Tensor, out: torch.Tensor, sign: torch.Tensor, sub: torch.Tensor,
            odd: torch.Tensor) -> torch.Tensor:
    """``x.to(float8_e4m3fn)`` as uint8 into ``out``, for finite ``x`` (``x`` is overwritten;
    ``sign``, ``sub`` and ``odd`` are int32 work tensors of ``x``'s size)."""
    f = x.view(torch.int32)
    torch.bitwise_right_shift(f, 31, out=sign)  # -1 where negative
    f.bitwise_and_(0x7FFFFFFF)  # |x|
    torch.add(x, 16384.0, out=sub.view(torch.float32))
    sub.clamp_max_(SUB + 8)
    torch.bitwise_right_shift(f, 20, out=odd)
    odd.bitwise_and_(1)
    f.add_(odd)
    f.clamp_(NORMAL_LO, NORMAL_HI)
    f.add_(0x7FFFF - (120 << 23))
    f.bitwise_right_shift_(20)
    f.add_(SUB)  # compared with sub as it is; SUB is 0 modulo 256
    torch.maximum(f, sub, out=f)
    torch.add(f, sign, alpha=-128, out=f)
    return out.copy_(f)


def block(rows: int, cols: int) -> torch.Tensor:
    """One block of rows as ``_fp8_block`` divides it, flat float32."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16).float()
    full = cols // 128
    amax = w.abs().view(rows, full, 128).amax(dim=(0, 2))
    s = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    return (w.view(rows, full, 128) / s.view(1, full, 1)).reshape(-1).contiguous()


def boundaries(steps: int = 64) -> torch.Tensor:
    """Every float32 within ``steps`` steps of each float8 value and each midpoint between
    two (where rounding decides), from 0 to past 480, both signs."""
    values = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(F8).float()
    mids = (values[:-1] + values[1:]) / 2  # exact in float32
    centres = torch.cat([values, mids, torch.tensor([464.0, 480.0, 512.0])])
    bits = centres.view(torch.int32).view(-1, 1) + torch.arange(-steps, steps + 1,
                                                               dtype=torch.int32)
    bits = bits[bits >= 0]
    pos = bits.view(torch.float32)
    return torch.cat([pos, -pos])


def check(x: torch.Tensor) -> None:
    n = x.numel()
    out = torch.empty(n, dtype=torch.uint8)
    work = [torch.empty(n, dtype=torch.int32) for _ in range(3)]
    got = by_bits(x.clone(), out, *work)
    want = x.to(F8).view(torch.uint8)
    bad = (got != want).nonzero().view(-1)
    if len(bad):
        i = int(bad[0])
        raise SystemExit(f"by_bits differs from torch's cast at {len(bad)} of {n} values, "
                         f"e.g. {x[i].item()!r}: {int(got[i]):#04x} != {int(want[i]):#04x}")


def check_all(chunk: int = 1 << 24) -> int:
    """``check`` on every finite float32, both signs, ``chunk`` bit patterns at a time."""
    done = 0
    for lo in range(0, 0x7F800000, chunk):
        bits = torch.arange(lo, min(lo + chunk, 0x7F800000), dtype=torch.int32)
        check(bits.view(torch.float32))
        check((bits | torch.tensor(-(1 << 31), dtype=torch.int32)).view(torch.float32))
        done += 2 * bits.numel()
    return done


def cpu_ns(fn: Callable[[], object], n: int, reps: int) -> tuple[float, float]:
    """CPU (of the whole process: torch's own threads too) and wall ns per element."""
    fn()
    c0, w0 = time.process_time_ns(), time.perf_counter_ns()
    for _ in range(reps):
        fn()
    return ((time.process_time_ns() - c0) / reps / n, (time.perf_counter_ns() - w0) / reps / n)


def show(name: str, runs: list[tuple[float, float]]) -> None:
    cpu, wall = [c for c, _ in runs], [w for _, w in runs]
    print(f"  {name:32s} CPU {min(cpu):6.3f} / {statistics.median(cpu):6.3f}   "
          f"wall {min(wall):6.3f} / {statistics.median(wall):6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--cols", type=int, default=5632)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20, help="casts per timed round")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (a merge runs 1 per worker, a worker a core)")
    ap.add_argument("--exhaustive", action="store_true",
                    help="first check by_bits on every finite float32 (about 4.3 billion)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.exhaustive:
        print(f"by_bits equals torch's cast on all {check_all()} finite float32 values")
    x = block(args.rows, args.cols)
    n = x.numel()
    g = torch.Generator().manual_seed(2)
    sample = torch.randint(-(1 << 31), 1 << 31, (1 << 22,), generator=g, dtype=torch.int64)
    sample = sample.to(torch.int32).view(torch.float32)
    sample = sample[sample.abs() <= 1024]  # every float32 bit pattern alike, finite, to 1024
    check(x)
    check(boundaries())
    check(sample)
    print(f"by_bits equals torch's cast on the block ({n} values), near every boundary and on "
          f"{sample.numel()} random float32 bit patterns of magnitude <= 1024")
    out8 = torch.empty(n, dtype=F8)
    out = torch.empty(n, dtype=torch.uint8)
    work = [torch.empty(n, dtype=torch.int32) for _ in range(3)]
    scratch = torch.empty_like(x)

    def torch_cast() -> None:
        out8.copy_(x)

    def bits_cast() -> None:
        scratch.copy_(x)  # by_bits overwrites its input, as _fp8_block's work buffer
        by_bits(scratch, out, *work)

    def copy_only() -> None:
        scratch.copy_(x)

    ways: dict[str, list[tuple[float, float]]] = {
        "torch cast": [], "by_bits (with its input copy)": [], "input copy alone": []}
    fns = [torch_cast, bits_cast, copy_only]
    loads = []
    for r in range(args.repeat):
        order = list(zip(ways, fns, strict=True))
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            ways[name].append(cpu_ns(fn, n, args.inner))
        loads.append(os.getloadavg()[0])
    print(f"{args.rows} x {args.cols} float32 -> float8_e4m3fn, {args.threads} torch thread(s), "
          f"ns per element, CPU and wall (best / median of {args.repeat}); load "
          f"{min(loads):.1f}-{max(loads):.1f}")
    for name, t in ways.items():
        show(name, t)
    # The other steps of one block of rows, for scale.
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(args.rows, args.cols, generator=g) * 0.02).to(torch.bfloat16)
    factors = torch.rand(args.cols) + 0.5
    steps: dict[str, Callable[[], object]] = {
        "widen bf16 -> float32": lambda: scratch.view(args.rows, args.cols).copy_(w),
        "scales (amax, amin down rows)": lambda: (scratch.view(args.rows, args.cols).amax(0),
                                                  scratch.view(args.rows, args.cols).amin(0)),
        "divide by the scales": lambda: scratch.view(args.rows, args.cols).div_(
            factors.view(1, -1)),
    }
    print("  the other steps of a block:")
    for name, step in steps.items():
        show(name, [cpu_ns(step, n, args.inner) for _ in range(args.repeat)])
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
