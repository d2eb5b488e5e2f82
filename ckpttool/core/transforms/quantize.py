"""``merge --dequantize`` and ``merge --quantize fp8-block``: quantized weights decoded to
floating ones, or floating ones encoded to DeepSeek-style block FP8, as derived tensors
(:mod:`ckpttool.core.transforms.derive`): each output computed from whole stored tensors, a
block of rows at a time, so memory is bounded by the largest weight's inputs, never by the
model, whatever the source format.

Each decode follows the code that wrote the format, operation for operation:

- block FP8 (DeepSeek-V3, transformers' FineGrainedFP8): DeepSeek's ``weight_dequant``,
  ``fp8.float() * scale_inv[i // bi, j // bj]`` in float32, then the output dtype; edge
  blocks are the same blocks cut short;
- MXFP4 (gpt-oss): transformers' ``convert_moe_packed_tensors``: the low nibble first, the
  e2m1 value table in the output dtype, ``ldexp`` by ``scale - 127``, the last two dims
  swapped ([E, rows, G, 16] -> [E, G * 32, rows]);
- NVFP4 (compressed-tensors ``nvfp4-pack-quantized``): the low nibble first, bit 3 the
  sign, each group of 16 times ``weight_scale / weight_global_scale`` in float32 (the
  global scale divides: it is stored as ``448 * 6 / amax``);
- FP8 (compressed-tensors ``float-quantized``): ``fp8.float() * scale`` in float32, the
  scale per tensor, channel, group or block.

Torch is imported only inside the functions that compute.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckpttool.core import quantization
from ckpttool.core.transforms.derive import Derived, is_selection
from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import Tensor
from ckpttool.formats.codecs import dtypes
from ckpttool.formats.codecs.dtypes import DType

if TYPE_CHECKING:
    import torch

    from ckpttool.core.merge.plan import Source

CHOICES = ("fp8-block",)
BLOCK = (128, 128)  # --quantize fp8-block's weight_block_size
# Rows decoded at a time where a scheme has no row blocks of its own.
ROWS = 256
# A scale covering at least this many values is applied by table (_fp8_by_table): the table
# (256 entries a block) is then at most a quarter of the values it makes.
LUT_BLOCK = 1024
LUT_TARGETS = ("bfloat16", "float16", "float32")  # the output dtypes tables are made in

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class Recoded:
    """What ``--dequantize`` or ``--quantize`` did: the sources as written, the config.json
    written with them, and one line each for the report."""

    sources: list[tuple[str, Source]]
    config: dict[str, Any] | None
    changes: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    num_weights: int = 0
    warnings: list[str] = field(default_factory=list)


def _torch_dtype(d: DType) -> torch.dtype:
    import torch

    return getattr(torch, d.torch_name)  # type: ignore[no-any-return]


def _bytes(t: torch.Tensor) -> memoryview:
    import torch

    return t.reshape(-1).view(torch.uint8).numpy().data


def fp8_to_float(w8: torch.Tensor) -> torch.Tensor:
    """``w8.float()``, the same bits, for float8_e4m3fn: its sign, exponent and mantissa
    moved into a float16 (whose exponent bias is 8 more: the value / 256, exactly, for
    subnormals too), widened, times 256 (measured: 2.5x less CPU than torch's float8
    conversion). NaN codes (0x7F, 0xFF) are converted by torch itself."""
    import torch

    if w8.dtype != torch.float8_e4m3fn:
        return w8.float()
    u = w8.view(torch.uint8).to(torch.int16)
    magnitude = u & 0x7F
    half = (magnitude << 7) | ((u & 0x80) << 8)
    out = half.view(torch.float16).float().mul_(256.0)
    nan = magnitude == 0x7F
    if bool(nan.any()):
        out[nan] = w8[nan].float()
    return out


# --- dequantize ---------------------------------------------------------------------------

def dequantize(sources: list[tuple[str, Source]], config: Mapping[str, Any] | None, *,
               target: DType | None, config_name: str = "config.json") -> Recoded:
    """Every quantized weight of ``sources`` as a derived tensor of its decoded values (in
    ``target``'s dtype, bf16 by default; the dtype policy may cast it further), the scales
    and activation scales left out, ``quantization_config`` dropped from the config.

    Raises:
        InputError: nothing in the checkpoint is quantized.
        UnsupportedError: a scheme ckpttool does not decode (named).
    """
    by_name = dict(sources)
    shapes = {n: (s.dtype, tuple(s.shape)) for n, s in sources}
    s = quantization.scheme(config, shapes)
    if s is None:
        raise InputError("--dequantize: the checkpoint holds no quantized weight (no "
                         f"quantization_config in {config_name}, no float8 or packed "
                         "weights with scales); leave out --dequantize")
    if s.unsupported is not None:
        raise UnsupportedError(f"--dequantize: {s.unsupported} ({s.source})")
    found, other = quantization.groups(s, by_name)
    if not found:
        raise InputError(f"--dequantize: {config_name} says {s.method} but no weight is "
                         "stored that way; check it with: ckpttool verify SRC")
    problems = [p for p in quantization.check(config, shapes, config_name) if p.severity == "error"
                and p.code != "quant-scale-missing"]
    if problems:
        raise InputError(f"--dequantize: {problems[0].message}")
    out_dtype = target or dtypes.get("BF16")
    made: dict[str, Derived] = {}
    for g in found:
        made[g.out] = _decoder(s, g, by_name, out_dtype)
    parts = {p for g in found for _, p in g.parts}
    drop = parts | set(other)
    for n, src in sources:  # a float8 weight with no scale: refused, not written as is
        if src.dtype.kind == "float8" and n not in parts:
            raise InputError(f"--dequantize: tensor '{n}' is {src.dtype.name} with no scale "
                             "ckpttool can find; its values cannot be decoded")
    written: list[tuple[str, Source]] = []
    for n, src in sources:
        first = next((g.out for g in found if g.part("q") == n), None)
        if first is not None:
            written.append((first, made[first]))
        elif n not in drop:
            written.append((n, src))
    new_config = None
    changes = []
    if config is not None:
        new_config = {k: v for k, v in config.items()
                      if k not in ("quantization_config", "compression_config")}
        if len(new_config) != len(config):
            changes.append(f"quantization_config: removed ({len(found)} {s.method} weights "
                           f"decoded to {out_dtype.name})")
    return Recoded(written, new_config, changes, sorted(drop - parts), len(found))


def _decoder(s: quantization.Scheme, g: quantization.Group, by_name: Mapping[str, Source],
             out: DType) -> Derived:
    stored = [by_name[p] for _, p in g.parts]
    if not all(isinstance(t, Tensor) for t in stored):
        raise UnsupportedError(f"--dequantize: '{g.out}' is computed by another transform "
                               "(a name map or layout change); merge with --layout stored")
    qt, sc = by_name[g.part("q")], by_name[g.part("scale")]
    assert isinstance(qt, Tensor) and isinstance(sc, Tensor)
    if s.method == quantization.FP8_BLOCK:
        fitted = quantization.fp8_block(tuple(qt.shape), tuple(sc.shape), s.block)
        if fitted is None:
            raise InputError(f"--dequantize: '{g.part('scale')}' {list(sc.shape)} fits no "
                             f"block of '{g.out}' {list(qt.shape)}"
                             + (f" in {list(s.block)} blocks" if s.block else ""))
        what = ("fp8 per tensor" if math.prod(sc.shape) == 1 else f"block fp8 {list(fitted)}")
        return _fp8_scaled(g.out, qt, sc, fitted, out, what)
    if s.method == quantization.FP8_CT:
        shape = tuple(qt.shape)
        sshape = tuple(sc.shape)
        if math.prod(sshape) == 1:
            block = shape
        else:
            block = (math.ceil(shape[0] / sshape[0]), math.ceil(shape[1] / sshape[1]))
        strategy = _ct_block(s)
        if strategy is not None:
            block = strategy
        return _fp8_scaled(g.out, qt, sc, block, out, "compressed-tensors fp8")
    if s.method == quantization.MXFP4:
        return _mxfp4(g.out, qt, sc, out, original=g.part("q").endswith(".blocks"))
    assert s.method == quantization.NVFP4
    gs = by_name[g.part("global")]
    assert isinstance(gs, Tensor)
    return _nvfp4(g.out, qt, sc, gs, out)


def _ct_block(s: quantization.Scheme) -> tuple[int, int] | None:
    for w in quantization._ct_weights(s.config):
        size = w.get("block_structure")
        if w.get("strategy") == "block" and isinstance(size, list) and len(size) == 2:
            return (int(size[0]), int(size[1]))
    return None


def _fp8_scaled(name: str, weight: Tensor, scale: Tensor, block: tuple[int, ...], out: DType,
                what: str) -> Derived:
    """``weight.float() * scale[i // block[0], j // block[1]]`` (float32), in ``out``."""
    if len(weight.shape) != 2:
        raise UnsupportedError(f"--dequantize: '{name}' is {list(weight.shape)}; {what} "
                               "weights of 2 dims are decoded")
    rows, cols = weight.shape
    br, bc = block[0], block[1]
    per_tensor = math.prod(scale.shape) == 1
    if not per_tensor and tuple(scale.shape) != quantization.ceil_blocks((rows, cols), (br, bc)):
        raise InputError(f"--dequantize: '{name}_scale' shape {list(scale.shape)} does not "
                         f"fit {list(weight.shape)} in blocks of {[br, bc]}")
    # Where a block holds at least LUT_BLOCK values: by table. The 256 float8 codes times
    # each block's scale, in float32, cast to the output dtype, are the only values the
    # block can hold; each element is its code's entry (bit for bit the same operations,
    # once per code and block instead of once per element: measured 3.6 ns an element
    # against 9-13). Else a block of rows at a time, each scale broadcast over its block
    # where whole blocks of columns allow (no per-element factor made), else rows in ROWS,
    # the factor gathered.
    bbr, bbc = (rows, cols) if per_tensor else (br, bc)
    broadcast = not per_tensor and cols % bc == 0 and br <= 4 * ROWS
    step = br if broadcast else ROWS

    def pieces(ts: list[torch.Tensor], target: torch.dtype) -> Iterator[memoryview]:
        import torch

        w8, s32 = ts
        s32 = s32.float().reshape(1, 1) if per_tensor else s32.float()
        if bbr * bbc >= LUT_BLOCK and str(target).removeprefix("torch.") in LUT_TARGETS:
            yield from _fp8_by_table(w8, s32, (bbr, bbc), target)
            return
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            x = fp8_to_float(w8[lo:hi])
            if per_tensor:
                x.mul_(s32)
            elif broadcast:
                x.view(hi - lo, cols // bc, bc).mul_(s32[lo // br].view(1, -1, 1))
            else:
                idx = torch.arange(lo, hi) // br
                x.mul_(s32[idx].repeat_interleave(bc, dim=1)[:, :cols])
            yield _bytes(x.to(target))

    def compute(ts: list[torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.cat([torch.frombuffer(bytearray(p), dtype=torch.float32)
                          for p in pieces(ts, torch.float32)]).reshape(rows, cols)

    return Derived(name, (weight, scale), out, (rows, cols), compute, f"dequantized: {what}",
                   pieces=pieces)


def _codes() -> torch.Tensor:
    """The 256 float8_e4m3fn codes as torch's ``.float()`` reads them (its NaNs too)."""
    import torch

    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _fp8_by_table(w8: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                  target: torch.dtype) -> Iterator[memoryview]:
    """``(w8.float() * scales[i // block[0], j // block[1]]).to(target)`` in pieces of about
    ROWS rows, each element looked up in a table of the 256 codes times its block's scale."""
    import torch

    from ckpttool.core.transforms.derive import scratch

    rows, cols = w8.shape
    br, bc = block
    ncb = scales.shape[1]
    codes = _codes().view(1, 1, 256)
    # One block of rows a piece where it is large enough (no per-row offset to add), else
    # as many whole blocks as make about ROWS rows
    step = (br if br * cols >= 1 << 16 else max(1, ROWS // br) * br) if br <= ROWS else ROWS
    col_at = (torch.arange(cols, dtype=torch.int32) // bc * 256).view(1, cols)
    u8 = w8.view(torch.uint8)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        first, last = lo // br, (hi - 1) // br
        table = (codes * scales[first:last + 1].view(-1, ncb, 1)).to(target).view(-1)
        n = (hi - lo) * cols
        idx = scratch("dequant-idx", n, torch.int32).view(hi - lo, cols)
        # Widened first, then added in int32: an add of uint8 and int32 into int32 takes
        # torch's slow mixed-dtype loop (measured: 2.1 ns an element in all, against 0.9)
        idx.copy_(u8[lo:hi])
        idx.add_(col_at)
        if last > first:
            idx.add_(((torch.arange(lo, hi, dtype=torch.int32) // br - first)
                      * (ncb * 256)).view(-1, 1))
        out = scratch("dequant-out", n, target)
        torch.index_select(table, 0, idx.view(-1), out=out)
        yield _bytes(out)


def _mxfp4(name: str, blocks: Tensor, scales: Tensor, out: DType, *, original: bool = False
           ) -> Derived:
    """MXFP4 bytes [..., G, 16] (or [..., G * 16]) and exponents [..., G], decoded as
    transformers' ``convert_moe_packed_tensors`` does: the low nibble first, the e2m1 table
    in the output dtype, ``ldexp`` by ``scale - 127``; then laid out as each writer's loader
    reads it:

    - transformers' ``X_blocks`` of experts [E, rows, G, 16]: its transpose, [E, G * 32, rows];
    - ``X_blocks`` of one matrix [rows, G, 16] (transformers' function needs the expert dim
      for its transpose) and the original gpt-oss release's ``X.blocks`` of any rank:
      gpt-oss' own ``_get_mxfp4_tensor``, [..., G * 32], no transpose."""
    layout = quantization.mxfp4_layout(tuple(blocks.shape), tuple(scales.shape))
    if layout is None:
        raise InputError(f"--dequantize: '{name}' blocks {list(blocks.shape)} and scales "
                         f"{list(scales.shape)} are not MXFP4's [..., G, 16] (or [..., G * 16])"
                         " and [..., G]")
    *prefix, groups_, width = layout
    transpose = not original and len(prefix) == 2
    if not original and len(prefix) > 2:
        raise UnsupportedError(f"--dequantize: MXFP4 '{name}_blocks' {list(blocks.shape)}: "
                               "transformers decodes experts [E, rows, G, 16] and ckpttool "
                               "one matrix [rows, G, 16]; a stacked layout is not supported")
    values = groups_ * width * 2
    out_shape = (prefix[0], values, prefix[1]) if transpose else (*prefix, values)
    # Pieces: one expert where transposed (the transpose needs all its rows), else ROWS rows.
    outer = prefix[0] if transpose else math.ceil(math.prod(prefix) / ROWS)
    per = prefix[1] if transpose else ROWS
    total = math.prod(prefix)

    def pieces(ts: list[torch.Tensor], target: torch.dtype) -> Iterator[memoryview]:
        import torch

        from ckpttool.core.transforms.derive import scratch

        b8, e8 = ts
        b8 = b8.reshape(total * groups_, width)
        e8 = e8.reshape(total * groups_, 1)
        pairs = _mxfp4_pairs(target)
        for k in range(outer):
            lo, hi = k * per * groups_, min((k + 1) * per, total) * groups_
            n = (hi - lo) * width
            idx = scratch("mxfp4-idx", n, torch.int32).view(hi - lo, width)
            idx.copy_(e8[lo:hi]).mul_(256).add_(b8[lo:hi])
            vals = torch.index_select(pairs, 0, idx.view(-1)).view(target)
            if transpose:
                yield _bytes(vals.reshape(per, values).T.contiguous())
            else:
                yield _bytes(vals)

    def compute(ts: list[torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.cat([torch.frombuffer(bytearray(p), dtype=torch.float32)
                          for p in pieces(ts, torch.float32)]).reshape(out_shape)

    return Derived(name, (blocks, scales), out, out_shape, compute, "dequantized: mxfp4",
                   pieces=pieces)


def _mxfp4_pairs(target: torch.dtype) -> torch.Tensor:
    """Every byte's two e2m1 values under every exponent, as transformers computes them
    (the table in ``target``, ``ldexp`` by ``exponent - 127`` into ``target``): entry
    ``exponent * 256 + byte`` holds the pair (low nibble first) as one element of twice
    ``target``'s width, so one lookup writes both values of a byte."""
    import torch

    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=target)
    codes = torch.arange(256, dtype=torch.int32)
    vals = torch.empty(256, 256, 2, dtype=target)
    vals[:, :, 0] = lut[codes & 0x0F]
    vals[:, :, 1] = lut[codes >> 4]
    exps = (torch.arange(256, dtype=torch.int32) - 127).view(256, 1, 1)
    torch.ldexp(vals, exps, out=vals)
    wide = {2: torch.int32, 4: torch.int64}[vals.element_size()]
    return vals.view(wide).reshape(256 * 256)


def _nvfp4(name: str, packed: Tensor, scale: Tensor, global_scale: Tensor, out: DType
           ) -> Derived:
    """compressed-tensors' NVFP4: e2m1 pairs (low nibble first, bit 3 the sign) times
    ``scale.float() / global_scale`` per group of 16 along the rows."""
    rows, half = packed.shape
    cols = half * 2
    group = cols // scale.shape[1] if scale.shape[1] else 16
    if group * scale.shape[1] != cols or scale.shape[0] != rows:
        raise InputError(f"--dequantize: '{name}_scale' {list(scale.shape)} does not fit "
                         f"{[rows, cols]} in groups along the rows")

    def pieces(ts: list[torch.Tensor], target: torch.dtype) -> Iterator[memoryview]:
        import torch

        from ckpttool.core.transforms.derive import scratch

        p8, s8, g32 = ts
        gs = g32.float().reshape(())
        lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
        if group % 2 == 0 and str(target).removeprefix("torch.") in LUT_TARGETS:
            # By table: each scale code's factor times each byte's two values, in float32,
            # cast to the output dtype (the same operations, once per code and byte).
            codes = torch.arange(256, dtype=torch.int32)
            vals = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1)
            table = (vals.view(1, 256, 2) * (_codes() / gs).view(256, 1, 1)).to(target)
            wide = {2: torch.int32, 4: torch.int64}[table.element_size()]
            pairs = table.view(wide).reshape(256 * 256)
            s8u, ngroups, per = s8.view(torch.uint8), cols // group, group // 2
            for lo in range(0, rows, ROWS):
                hi = min(lo + ROWS, rows)
                idx = scratch("nvfp4-idx", (hi - lo) * half, torch.int32)
                idx3 = idx.view(hi - lo, ngroups, per)
                idx3.copy_(s8u[lo:hi].unsqueeze(-1)).mul_(256)
                idx3.add_(p8[lo:hi].view(hi - lo, ngroups, per))
                yield _bytes(torch.index_select(pairs, 0, idx))
            return
        for lo in range(0, rows, ROWS):
            hi = min(lo + ROWS, rows)
            blk = p8[lo:hi]
            vals = torch.empty(hi - lo, cols, dtype=torch.float32)
            vals[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
            vals[:, 1::2] = lut[(blk >> 4).to(torch.int)]
            factor = s8[lo:hi].float() / gs
            res = (vals.view(hi - lo, cols // group, group) * factor.unsqueeze(-1))
            yield _bytes(res.reshape(hi - lo, cols).to(target))

    def compute(ts: list[torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.cat([torch.frombuffer(bytearray(p), dtype=torch.float32)
                          for p in pieces(ts, torch.float32)]).reshape(rows, cols)

    return Derived(name, (packed, scale, global_scale), out, (rows, cols), compute,
                   "dequantized: nvfp4", pieces=pieces)


# --- quantize -----------------------------------------------------------------------------

ROUTERS = ("gate", "router")  # a mixture of experts' router: kept (its logits pick experts)


def quantizable(name: str, src: Source, ignore: Sequence[str]) -> bool:
    """A Linear weight of a decoder layer: ``...layers.N....weight``, 2 dims, floating, not
    a norm, an embedding, a router gate or ``lm_head``, and not matched by ``ignore``."""
    if not name.endswith(".weight") or len(src.shape) != 2 or not src.dtype.is_float:
        return False
    module = quantization.module_of(name)
    parts = module.split(".")
    if not any(p == "layers" and i + 1 < len(parts) and parts[i + 1].isdecimal()
               for i, p in enumerate(parts)):
        return False
    last = parts[-1]
    if "norm" in last or "embed" in module or last in ROUTERS or "lm_head" in module:
        return False
    return not quantization.matches(module, ignore)


def _kept_linear(name: str, src: Source) -> bool:
    """A stored floating weight of a Linear module (not an embedding or a norm), or a
    mixture of experts' stacked weights: left as stored, it is named in the config."""
    module = quantization.module_of(name)
    if not src.dtype.is_float or "embed" in module or "norm" in module.rpartition(".")[2]:
        return False
    if name.endswith(".weight") and len(src.shape) == 2:
        return True
    return len(src.shape) >= 3 and quantization.experts_layer(module) == module


def quantize(sources: list[tuple[str, Source]], config: Mapping[str, Any] | None, *,
             scheme: str, ignore: Sequence[str] = ()) -> Recoded:
    """The decoder layers' Linear weights as float8_e4m3fn per 128 x 128 block with their
    float32 ``weight_scale_inv`` (``amax(|w|) / 448``, 1.0 for a zero block), the rest kept;
    config.json's ``quantization_config`` as transformers' FineGrainedFP8 reads it, the
    Linear modules left unquantized in ``modules_to_not_convert``.

    Raises:
        InputError: an unknown scheme, or nothing to quantize.
        UnsupportedError: the checkpoint is quantized already.
    """
    if scheme not in CHOICES:
        raise InputError(f"unknown --quantize {scheme!r}; use one of: {', '.join(CHOICES)}")
    shapes = {n: (s.dtype, tuple(s.shape)) for n, s in sources}
    by_shape = {n: shape for n, (_, shape) in shapes.items()}
    if quantization.scheme(config, shapes) is not None:
        raise UnsupportedError("--quantize: the checkpoint is quantized already; re-quantizing "
                               "is not supported: merge with --dequantize first, then "
                               "--quantize the result")
    chosen = {n for n, src in sources if quantizable(n, src, ignore)}
    kept = quantization.keep_whole_layers({quantization.module_of(n) for n in chosen},
                               {quantization.module_of(n) for n, src in sources
                                if n not in chosen and _kept_linear(n, src)})
    written: list[tuple[str, Source]] = []
    edges: list[str] = []
    num = 0
    for n, src in sources:
        if n in chosen and quantization.module_of(n) in kept.quantized:
            if src.shape[0] % BLOCK[0] or src.shape[1] % BLOCK[1]:
                edges.append(n)
            weight, scale = _fp8_block(n, src)
            written += [(n, weight), (n + "_scale_inv", scale)]
            num += 1
            continue
        written.append((n, src))
    if not num:
        raise InputError("--quantize: no Linear weight of a decoder layer (model.layers.N...) "
                         "to quantize; nothing was written")
    # modules_to_not_convert for transformers, ignored_layers for vLLM and SGLang: the same
    # list (quantization.IGNORE_KEYS)
    qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": list(BLOCK)}
    qc.update({key: list(kept.listed) for key in quantization.IGNORE_KEYS})
    new_config = dict(config or {})
    new_config["quantization_config"] = qc
    changes = [f"quantization_config: fp8 e4m3 in {list(BLOCK)} blocks ({num} weights; "
               f"{len(kept.listed)} modules kept)"]
    warnings = []
    if kept.widened:
        layers = sorted(kept.widened)
        named = ", ".join(f"'{x}'" for x in layers[:3]) + (", ..." if len(layers) > 3 else "")
        more = sum(len(ms) for ms in kept.widened.values())
        warnings.append(
            f"--quantize: {len(layers)} layers that vLLM and SGLang load as one were kept in "
            f"part ({named}): the rest of each is kept too, {more} more modules (e.g. "
            f"'{kept.widened[layers[0]][0]}'), so that they load it")
    if edges:
        warnings.append(
            f"--quantize: {len(edges)} weights (e.g. '{edges[0]}' {list(by_shape[edges[0]])}) "
            f"have dimensions that are no multiple of {BLOCK[0]}: their edge blocks are "
            "written as DeepSeek's format has them, but transformers' CPU loader refuses "
            "them (it dequantizes whole blocks only), and vLLM and SGLang refuse a layer "
            "they fuse or split across GPUs into parts no multiple of 128; keep them with "
            "--quantize-ignore")
    return Recoded(written, new_config if config is not None else None, changes, [], num,
                   warnings)


def _fp8_block(name: str, src: Source) -> tuple[Derived, Derived]:
    """The weight as float8_e4m3fn per block and its float32 ``weight_scale_inv``.

    One block of rows at a time, on this thread's work buffers (no allocation per block):
    the block of rows widened to float32 once, its blocks' amax taken from it, divided by
    their scales in place, cast into a float8 buffer. The two outputs share the scales:
    whichever is written first leaves them for the other (one amax pass per weight, not
    two)."""
    rows, cols = src.shape
    br, bc = BLOCK
    grid = quantization.ceil_blocks((rows, cols), BLOCK)
    f8, f32 = dtypes.get("F8_E4M3"), dtypes.get("F32")
    shared = _Shared()
    computed: list[Derived] = []  # the transform computing the weight, where one does

    def weight_of(ts: list[torch.Tensor]) -> torch.Tensor:
        """The weight [rows, cols] from the inputs as read."""
        return computed[0].compute(ts).reshape(rows, cols) if computed else ts[0]

    def row_scales(x: torch.Tensor) -> torch.Tensor:
        """amax(|x|) / 448 per block of one block of rows ``x`` (float32), 1.0 where the
        block is zero: [col blocks] float32. As max(max x, -min x): float32 reductions, no
        |x| made (measured: 5x less CPU than amax of |bf16|), first down the rows (each a
        vectorised pass along the contiguous columns), then per block over the
        ``cols`` results (a max is exact in any order: the same scales)."""
        import torch

        full = cols // bc
        high, low = x.amax(dim=0), x.amin(dim=0)  # [cols]
        highs, lows = [], []
        if full:
            highs.append(high[:full * bc].view(full, bc).amax(dim=1))
            lows.append(low[:full * bc].view(full, bc).amin(dim=1))
        if cols % bc:
            highs.append(high[full * bc:].amax().reshape(1))
            lows.append(low[full * bc:].amin().reshape(1))
        amax = torch.maximum(torch.cat(highs), torch.cat(lows).neg())
        s = amax / quantization.FP8_MAX
        return torch.where(amax == 0, torch.ones_like(s), s)

    def stored_scales(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor | None:
        """:func:`row_scales` of rows [lo, hi) of ``w`` read from its stored bits, without
        widening them: the sign bit cleared, a float's bits order as its magnitude does
        (finite values), so the largest is amax(|w|), exactly. For the scales written
        before their weight (measured, one thread: both outputs 1.92 -> 1.72 ns an element);
        the weight's own pass takes them from the rows it widens anyway, still in cache
        (from the stored bits there: 1.79 -> 1.94). None where a block holds an infinity or
        a NaN (the float path then keeps its bits), or ``w``'s dtype has no such view."""
        import torch

        bits = _magnitude_bits().get(w.dtype)
        if bits is None or w.stride(-1) != 1:
            return None
        as_int, mask, inf = bits
        from ckpttool.core.transforms.derive import scratch

        mag = scratch("quant-magnitude", (hi - lo) * cols, as_int).view(hi - lo, cols)
        torch.bitwise_and(w[lo:hi].view(as_int), mask, out=mag)
        top = mag.amax(dim=0)  # [cols]
        full = cols // bc
        parts = [top[:full * bc].view(full, bc).amax(dim=1)] if full else []
        if cols % bc:
            parts.append(top[full * bc:].amax().reshape(1))
        block = torch.cat(parts) if len(parts) > 1 else parts[0]
        if bool((block >= inf).any()):
            return None
        amax = block.view(w.dtype).float()
        s = amax / quantization.FP8_MAX
        return torch.where(amax == 0, torch.ones_like(s), s)

    def widened(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of ``w`` as float32, on this thread's work buffer."""
        from ckpttool.core.transforms.derive import scratch

        return scratch("quant-rows", (hi - lo) * cols).view(hi - lo, cols).copy_(w[lo:hi])

    def scales(w: torch.Tensor) -> torch.Tensor:
        import torch

        made = []
        for i in range(grid[0]):
            lo, hi = i * br, min((i + 1) * br, rows)
            found = stored_scales(w, lo, hi)
            made.append(found if found is not None else row_scales(widened(w, lo, hi)))
        return torch.stack(made)

    def weight_pieces(ts: list[torch.Tensor], target: torch.dtype) -> Iterator[memoryview]:
        import torch

        from ckpttool.core.transforms.derive import scratch

        w = weight_of(ts)
        known = shared.take()
        made = []
        q_all = scratch("quant-f8", br * cols, torch.float8_e4m3fn)
        out_all = None if target == torch.float8_e4m3fn else scratch("quant-out", br * cols,
                                                                     target)
        for i in range(grid[0]):
            lo, hi = i * br, min((i + 1) * br, rows)
            n = (hi - lo) * cols
            x = widened(w, lo, hi)  # once; divided in place: never the input
            s = known[i] if known is not None else row_scales(x)
            made.append(s)
            # Each scale repeated over its block's columns: one row of factors that every
            # row divides by (vectorised along the row; a [blocks, 1] broadcast is not).
            x.div_(s.repeat_interleave(bc)[:cols].view(1, cols))
            q8 = q_all[:n]
            q8.copy_(x.view(-1))
            if out_all is None:
                yield _bytes(q8)
            else:
                yield _bytes(out_all[:n].copy_(q8))
        if known is None:
            shared.leave(torch.stack(made))

    def weight_compute(ts: list[torch.Tensor]) -> torch.Tensor:
        import torch

        data = bytearray()
        for p in weight_pieces(ts, torch.float8_e4m3fn):
            data += p
        return torch.frombuffer(data, dtype=torch.float8_e4m3fn).reshape(rows, cols)

    def scale_compute(ts: list[torch.Tensor]) -> torch.Tensor:
        known = shared.take()
        if known is None:
            known = scales(weight_of(ts))
            shared.leave(known)
        return known

    # In pieces (one): the weight is then read where it lies in the page cache, not copied
    # (and not read at all where the weight's pieces left the scales).
    def scale_pieces(ts: list[torch.Tensor], target: torch.dtype) -> Iterator[memoryview]:
        yield _bytes(scale_compute(ts).to(target))

    what_w = "quantized: fp8 block 128x128"
    what_s = "weight_scale_inv: amax / 448 per 128x128 block"
    if isinstance(src, Tensor):
        return (Derived(name, (src,), f8, (rows, cols), weight_compute, what_w,
                        pieces=weight_pieces),
                Derived(name + "_scale_inv", (src,), f32, grid, scale_compute, what_s,
                        pieces=scale_pieces))
    # A weight another transform computes (a Megatron layer's box of a stored tensor, a
    # split of a fused projection, a LoRA fold): read as that transform reads it, computed
    # whole (one weight in memory), then quantized. Boxes are read in the output's shape,
    # which the scale's is not: only a pure selection of boxes, or inputs without boxes.
    if any(b is not None for b in src.boxes) and not is_selection(src):
        raise UnsupportedError(f"--quantize: '{name}' is computed from parts of stored tensors "
                               "by another transform; merge it first, then --quantize the "
                               "result")
    computed.append(src)
    return (replace(src, name=name, dtype=f8, compute=weight_compute, what=what_w,
                    pieces=weight_pieces),
            replace(src, name=name + "_scale_inv", dtype=f32, shape=grid,
                    compute=scale_compute, what=what_s, pieces=scale_pieces))


@functools.cache
def _magnitude_bits() -> dict[torch.dtype, tuple[torch.dtype, int, int]]:
    """Per floating dtype: the integer dtype of its width, the mask that clears the sign,
    and the bits of infinity (a magnitude at least that is an infinity or a NaN)."""
    import torch

    return {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
            torch.float16: (torch.int16, 0x7FFF, 0x7C00),
            torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}


class _Shared:
    """The scales of one weight, left by whichever of its two outputs computed them first
    for the other to take (once: each output takes or computes, never holds on)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._scales: torch.Tensor | None = None
        self._taken = 0

    def take(self) -> torch.Tensor | None:
        with self._lock:
            s, self._scales = self._scales, None
            self._taken += 1
            return s

    def leave(self, s: torch.Tensor) -> None:
        with self._lock:
            if self._taken < 2:  # the other output has not asked yet
                self._scales = s
