"""The fold of a LoRA adapter into its base weights, as derived tensors: ``W + scale *
B @ A`` block by block, exact where a fused multiply-add cannot round twice."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckpttool.core.transforms.derive import Derived, scratch, scratch_bytes
from ckpttool.core.transforms.lora.layout import AdapterConfig, Module
from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import Reader, Tensor

if TYPE_CHECKING:
    import torch



def _float_base(name: str, tensor: Tensor) -> None:
    if not tensor.dtype.is_float or tensor.dtype.name.startswith("float8"):
        raise UnsupportedError(f"'{name}': a {tensor.dtype.name} base weight; LoRA is folded "
                               "into floating-point (bf16, fp16, fp32) weights only")


def fused_weight(name: str, weight: Tensor, m: Module, config: AdapterConfig,
                  reader: Reader | None) -> Derived:
    _float_base(name, weight)
    assert m.a is not None and m.b is not None
    rank = m.a.shape[0]
    scale = config.scale(m.name, rank)
    transpose = m.embedding or config.fan_in_fan_out

    # PEFT's own order, so that an fp32 fold equals merge_and_unload() to the bit:
    # W + transpose(B @ A) * scale, in fp32. That is PEFT's arithmetic for an adapter it
    # holds in fp32: PeftModel.from_pretrained upcasts a half-precision adapter by default
    # (autocast_adapter_dtype=True). One loaded with autocast_adapter_dtype=False has its
    # product rounded to the adapter's dtype before the add on CPU; its merge differs.
    # In place where the values are the same (one rounding per step either way): memory is
    # the weight in fp32 and one delta, not four temporaries.
    def compute(ts: list[torch.Tensor]) -> torch.Tensor:
        w, a, b = ts
        delta = b.float() @ a.float()
        if transpose:
            delta = delta.T
        return w.float().add_(delta.mul_(scale))

    # The same operations, each element's exactly as above, a block of the weight's rows at a
    # time, in the core's cache: the product of those rows (torch.mm), times the scale, plus
    # the weight's rows (read where they lie in the page cache), cast into the output piece
    # that the merge writes at once. Nothing the size of the weight is ever made (the whole
    # product cost two passes over memory and its write from memory cost twice one from
    # cache: measured, 5632 x 2048 bf16, 53 -> 37 ms of CPU with the write). The weight's
    # rows are widened into a buffer of this thread's (an add of a bf16 operand made a new
    # float32 copy of it per block), and where the scale is a power of two the product is
    # scaled and added in one pass (:func:`fma_exact`: the same bits).
    def pieces(ts: list[torch.Tensor], target: torch.dtype) -> Iterator[memoryview]:
        import torch

        w, a, b = ts
        if w.dtype.itemsize > 4:  # float64: in float32 first, as ``compute`` has it
            w = w.float()
        b32, a32 = b.float(), a.float()
        rows, cols = b32.shape[0], a32.shape[1]
        shape = (cols, rows) if transpose else (rows, cols)
        if shape != tuple(w.shape) or w.dim() != 2:
            raise InputError(f"'{name}': the LoRA product is {list(shape)}, the weight "
                             f"{list(w.shape)}")
        bounds = row_blocks(w.shape[0], w.shape[1])
        most = max(hi - lo for lo, hi in itertools.pairwise(bounds)) * w.shape[1]
        full = None if not transpose and blocks_exact(b32, a32, bounds) else \
            torch.mm(b32, a32, out=scratch("lora-delta", rows * cols).view(rows, cols))
        delta = None if full is None else full.T if transpose else full
        fused = fma_exact(scale, a32, b32)
        block = scratch("lora-rows", most)
        # Where the sum is made: the weight's rows widened (the product is added to them),
        # or, for a float32 weight whose product is scaled apart, the product's block.
        wide = scratch("lora-wide", most) if fused or w.dtype != torch.float32 else None
        out = None if target == torch.float32 else scratch("lora-out", most, target)
        # Per number of rows (blocks have two sizes at most): the product's block, the sum's,
        # the output piece and its bytes, made once (a view costs microseconds, a block of
        # rows about 300: several per block added up to a few percent).
        views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, memoryview]] = {}
        for lo, hi in itertools.pairwise(bounds):
            got = views.get(hi - lo)
            if got is None:
                numel = (hi - lo) * w.shape[1]
                part = block[:numel].view(hi - lo, w.shape[1])
                total = part if wide is None else wide[:numel].view(hi - lo, w.shape[1])
                piece = (scratch_bytes("lora-rows" if wide is None else "lora-wide", numel * 4)
                         if out is None else scratch_bytes("lora-out", numel * target.itemsize))
                got = views[hi - lo] = (part, total, None if out is None else out[:numel],
                                        piece)
            part, total, out_piece, piece = got
            if delta is None:
                torch.mm(b32[lo:hi], a32, out=part)
            else:
                part.copy_(delta[lo:hi])
            # PEFT's order, w + d: the same sum either way, but where both are NaN, the
            # first operand's NaN is the one that comes out.
            if wide is None:
                torch.add(w[lo:hi], part.mul_(scale), out=part)  # one rounding
            else:
                total.copy_(w[lo:hi])  # exactly widened to float32
                if fused:
                    total.add_(part, alpha=scale)
                else:
                    total.add_(part.mul_(scale))  # one rounding
            if out_piece is not None:
                out_piece.copy_(total.view(-1))
            yield piece  # float32 out: the sum's own bytes

    what = f"lora fused: rank {rank}, scale {scale:g}"
    return Derived(name, (weight, m.a, m.b), weight.dtype, weight.shape, compute, what,
                   readers=(None, reader, reader),
                   pieces=pieces if len(weight.shape) == 2 else None)


# Elements of a weight folded per block (float32): the block and its output piece stay in
# the core's cache. A block holds at least FOLD_ROWS rows: torch.mm of a few rows (1 to 3,
# measured) may take another kernel than the whole product's, with other bits.
FOLD_BLOCK = 1 << 18
FOLD_ROWS = 16


def row_blocks(rows: int, cols: int) -> list[int]:
    """Where a weight's blocks of rows begin, and its end: blocks of about
    :data:`FOLD_BLOCK` elements and at least :data:`FOLD_ROWS` rows (one block below that),
    of sizes that differ by one row at most (no short last block)."""
    step = max(FOLD_ROWS, FOLD_BLOCK // max(1, cols))
    count = max(1, rows // step)
    return [rows * k // count for k in range(count + 1)]


# A power-of-two scale is fused with the add only while the product times the scale stays
# below this (float32's largest finite value is just under 2**128).
FMA_LIMIT = 2.0**126


def fma_exact(scale: float, a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if ``w + (b @ a) * scale``, as PEFT rounds it (the product times the scale
    rounded to float32, then the sum), has the bits of ``torch.add(w, b @ a, alpha=scale)``
    for every float32 ``w``, so that the fold may scale and add in one pass (which torch makes
    a fused multiply-add, rounded once).

    That holds when the scale is ``2**k`` with ``k >= 0`` and no product element times the
    scale can overflow: multiplying a finite float32 by such a scale is then exact (normal
    and subnormal values alike: only the exponent grows), so rounding it changes nothing and
    both ways round the same exact sum once. ``a`` and ``b`` must be finite (an infinite or
    NaN product could meet a NaN weight: which NaN comes out would depend on the order), and
    ``rank * max|a| * max|b| * scale`` (a bound on every product element, with room for its
    roundings) below :data:`FMA_LIMIT`. Any other scale (``alpha / r`` of 0.5, rsLoRA's
    ``alpha / sqrt(r)``) is multiplied and added apart."""

    mantissa, exponent = math.frexp(scale)
    # 2**0 .. 2**127: float32's own (a scale beyond is no float32: torch refuses the alpha).
    if mantissa != 0.5 or not 1 <= exponent <= 128 or not a.numel() or not b.numel():
        return False
    bound = a.shape[0] * _max_abs(a) * _max_abs(b) * scale
    return bound < FMA_LIMIT


def _max_abs(t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (one pass, no temporary); infinite where ``t`` holds an
    infinity or a NaN."""
    import torch

    lo, hi = (float(x) for x in torch.aminmax(t))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return math.inf
    return max(-lo, hi)


# Whether torch.mm of blocks of rows gave the whole product's bits, per (rows, rank, cols,
# blocks): checked on the first weight of each shape, then trusted for the others.
_exact: dict[tuple[int, ...], bool] = {}


def blocks_exact(b: torch.Tensor, a: torch.Tensor, bounds: list[int]) -> bool:
    """True if ``b[lo:hi] @ a`` equals the rows ``lo:hi`` of ``b @ a`` to the bit for every
    block of ``bounds``, as PEFT computes it: whole. Each row's elements are the same sums of
    ``rank`` products, but the library may pick its kernel (and so the order of the sums) by
    the number of rows; this compares once per shape and block sizes, on the first weight of
    that shape (a whole product then, in a buffer kept per thread), and the fold uses whole
    products for a shape where any block differed."""
    import torch

    key = (b.shape[0], b.shape[1], a.shape[1], *bounds)
    known = _exact.get(key)
    if known is not None:
        return known
    rows, cols = b.shape[0], a.shape[1]
    whole = torch.mm(b, a, out=scratch("lora-delta", rows * cols).view(rows, cols))
    most = max(hi - lo for lo, hi in itertools.pairwise(bounds))
    part = scratch("lora-rows", most * cols)
    same = all(torch.equal(torch.mm(b[lo:hi], a, out=part[:(hi - lo) * cols].view(hi - lo, cols)),
                           whole[lo:hi]) for lo, hi in itertools.pairwise(bounds))
    _exact[key] = same
    return same


def fused_bias(name: str, bias: Tensor, m: Module, config: AdapterConfig,
                reader: Reader | None) -> Derived:
    _float_base(name, bias)
    assert m.a is not None and m.b_bias is not None
    scale = config.scale(m.name, m.a.shape[0])

    def compute(ts: list[torch.Tensor]) -> torch.Tensor:
        return ts[0].float() + ts[1].float() * scale

    return Derived(name, (bias, m.b_bias), bias.dtype, bias.shape, compute,
                   f"lora bias fused: scale {scale:g}", readers=(None, reader))
