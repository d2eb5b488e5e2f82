"""Quantized weights, torch-free: which scheme a checkpoint uses (``quantization_config``
and the tensors stored), which tensors scale or index a float8 or integer weight (kept as
stored under every dtype policy), how the stored tensors group into the weights a
``--dequantize`` decodes, and what ``verify`` checks between the config and the tensors.

The decodes and the ``--quantize`` encoder are in :mod:`ckpttool.core.transforms.quantize`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpttool.core.runtime.report import Section, section
from ckpttool.formats.base import Problem, error, warning
from ckpttool.formats.codecs.dtypes import DType

# The last name segment of a tensor that scales or indexes a quantized one: DeepSeek's
# weight_scale_inv, compressed-tensors' weight_scale / weight_global_scale / input_scale /
# weight_zero_point / weight_packed, ModelOpt's weight_scale_2, gpt-oss' *_blocks / *_scales,
# vLLM's k_scale / v_scale.
AUX_SUFFIXES = ("_scale_inv", "_scale", "_scale_2", "_global_scale", "_scales", "_blocks",
                "_zero_point", "_packed")
AUX_NAMES = ("input_scale", "weight_shape")

# ``--dequantize`` decodes these (the scheme's ``method``).
FP8_BLOCK = "fp8-block"  # DeepSeek-V3 / transformers' FineGrainedFP8: quant_method "fp8"
MXFP4 = "mxfp4"  # gpt-oss: *_blocks (uint8, two e2m1 per byte) + *_scales (uint8 e8m0)
NVFP4 = "nvfp4"  # compressed-tensors nvfp4-pack-quantized
FP8_CT = "fp8"  # compressed-tensors float-quantized (per tensor, channel, group or block)
METHODS = (FP8_BLOCK, MXFP4, NVFP4, FP8_CT)

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def leaf(name: str) -> str:
    return name.rpartition(".")[2]


def module_of(name: str) -> str:
    return name.rpartition(".")[0]


def is_aux_name(name: str) -> bool:
    """True for a name quantization schemes give their scales, zero points and packed
    values (``*_scale_inv``, ``*_scale``, ``*_scale_2``, ``input_scale``, ``*_global_scale``,
    ``*_scales``, ``*_blocks``...)."""
    last = leaf(name)
    return last in AUX_NAMES or last.endswith(AUX_SUFFIXES)


def quantization_config(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (older compressed-tensors exports:
    ``compression_config``), or None."""
    if config is None:
        return None
    for key in ("quantization_config", "compression_config"):
        value = config.get(key)
        if isinstance(value, dict):
            return value
    return None


def kept_names(tensors: Iterable[tuple[str, DType]], config: Mapping[str, Any] | None
               ) -> frozenset[str]:
    """The floating tensors that scale or index a quantized one, and so keep their stored
    dtype under every ``--dtype``: an auxiliary name (:func:`is_aux_name`) in a module that
    holds (or is above one that holds) a float8 or integer tensor, or any auxiliary name
    where config.json has a ``quantization_config``. A ``logit_scale`` of a plain model is
    cast as before."""
    listed = list(tensors)
    quantized = {module_of(n) for n, d in listed if d.kind in ("float8", "int")}
    above: set[str] = set()
    for m in quantized:
        parts = m.split(".")
        above.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    configured = quantization_config(config) is not None
    return frozenset(n for n, d in listed if d.is_float and is_aux_name(n)
                     and (configured or module_of(n) in above))


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint is quantized."""

    method: str  # one of METHODS, or the config's own name where unsupported
    source: str  # "config.json quantization_config" or "tensors (no quantization_config)"
    block: tuple[int, int] | None = None  # fp8-block's weight_block_size
    ignored: tuple[str, ...] = ()  # modules_to_not_convert / ignore
    # Why --dequantize refuses it (exit 4), naming it; None: decoded.
    unsupported: str | None = None
    config: dict[str, Any] = field(default_factory=dict)


def _ct_weights(qc: Mapping[str, Any]) -> list[dict[str, Any]]:
    groups = qc.get("config_groups")
    out: list[dict[str, Any]] = []
    if isinstance(groups, dict):
        for g in groups.values():
            if isinstance(g, dict) and isinstance(g.get("weights"), dict):
                out.append(g["weights"])
    return out


def scheme(config: Mapping[str, Any] | None, tensors: Mapping[str, tuple[DType, tuple[int, ...]]]
           ) -> Scheme | None:
    """The quantization scheme: from config.json's ``quantization_config``, else from the
    stored tensors' names and dtypes; None for a checkpoint with no quantized weight."""
    qc = quantization_config(config)
    if qc is not None:
        return _configured(qc)
    names = set(tensors)
    f8 = {n for n, (d, _) in tensors.items() if d.kind == "float8"}
    source = "tensors (no quantization_config)"
    if any(n.endswith(".weight_scale_inv") and n.removesuffix("_scale_inv") in f8
           for n in names):
        return Scheme(FP8_BLOCK, source)  # each weight's block: from its scale's grid
    if any(mxfp4_pair(n, names) for n in names):
        return Scheme(MXFP4, source)
    if any(n.endswith(".weight_packed") and n.removesuffix("_packed") + "_global_scale" in names
           for n in names):
        return Scheme(NVFP4, source)
    if any(n.endswith(".weight_scale") and n.removesuffix("_scale") in f8 for n in names):
        return Scheme(FP8_CT, source)
    # float8 tensors with no scale (a mixed-precision model's own): plain float8 data
    return None


def _configured(qc: dict[str, Any]) -> Scheme:
    source = "config.json quantization_config"
    method = str(qc.get("quant_method", "?"))
    if method == "fp8":
        # transformers reads modules_to_not_convert (ignored_layers as an alias), vLLM and
        # SGLang ignored_layers first (IGNORE_KEYS)
        ignored = tuple(str(m) for m in next(
            (qc[k] for k in IGNORE_KEYS if isinstance(qc.get(k), list) and qc[k]), ()))
        size = qc.get("weight_block_size")
        block = (tuple(int(x) for x in size) if isinstance(size, list) and len(size) == 2
                 else None)
        why = None  # without weight_block_size: each weight's block from its scale's grid
        if qc.get("scale_fmt") not in (None, "float32", "fp32"):
            why = f"fp8 scale_fmt {qc.get('scale_fmt')!r} is not supported yet"
        elif str(qc.get("fmt", "e4m3")) != "e4m3":
            why = f"fp8 fmt {qc.get('fmt')!r} is not supported yet (e4m3 is)"
        return Scheme(FP8_BLOCK, source, block=block,  # type: ignore[arg-type]
                      ignored=ignored, unsupported=why, config=qc)
    if method == "mxfp4":
        ignored = tuple(str(m) for m in qc.get("modules_to_not_convert") or ())
        return Scheme(MXFP4, source, ignored=ignored, config=qc)
    if method == "compressed-tensors":
        fmt = str(qc.get("format", "?"))
        ignored = tuple(str(m) for m in qc.get("ignore") or ())
        weights = _ct_weights(qc)
        if fmt == "nvfp4-pack-quantized":
            return Scheme(NVFP4, source, ignored=ignored, config=qc)
        if fmt == "float-quantized" and all(w.get("num_bits") == 8 and w.get("type") == "float"
                                            for w in weights):
            asym = [w for w in weights if w.get("symmetric") is False]
            why = ("compressed-tensors float-quantized with zero points (symmetric: false) is "
                   "not supported yet") if asym else None
            return Scheme(FP8_CT, source, ignored=ignored, unsupported=why, config=qc)
        return Scheme(f"compressed-tensors {fmt}", source, ignored=ignored, config=qc,
                      unsupported=f"compressed-tensors format {fmt!r} is not supported yet "
                      f"(decoded: nvfp4-pack-quantized, float-quantized)")
    return Scheme(method, source, config=qc,
                  unsupported=f"quant_method {method!r} is not supported yet (decoded: fp8 "
                  "with weight_block_size, mxfp4, compressed-tensors nvfp4 and fp8)")


@dataclass(frozen=True)
class Group:
    """The stored tensors that make one weight: ``parts`` by role (``q``: the quantized
    values; ``scale``; ``global``: NVFP4's global scale), written as ``out``."""

    out: str
    parts: tuple[tuple[str, str], ...]

    def part(self, role: str) -> str:
        return dict(self.parts)[role]


def groups(s: Scheme, names: Iterable[str]) -> tuple[list[Group], list[str]]:
    """The weights of scheme ``s`` among ``names``, and the other auxiliary tensors
    (activation and kv-cache scales, zero points) a dequantized model has no use for."""
    have = set(names)
    found: list[Group] = []
    used: set[str] = set()
    for n in sorted(have):
        g: Group | None = None
        if s.method == FP8_BLOCK and n + "_scale_inv" in have and leaf(n) == "weight":
            g = Group(n, (("q", n), ("scale", n + "_scale_inv")))
        elif s.method == FP8_CT and n + "_scale" in have and leaf(n) == "weight":
            g = Group(n, (("q", n), ("scale", n + "_scale")))
        elif s.method == MXFP4 and (scales := mxfp4_pair(n, have)) is not None:
            g = Group(n[:-7], (("q", n), ("scale", scales)))
        elif (s.method == NVFP4 and n.endswith(".weight_packed")
              and n[:-7] + "_scale" in have and n[:-7] + "_global_scale" in have):
            base = n[:-7]
            g = Group(base, (("q", n), ("scale", base + "_scale"),
                             ("global", base + "_global_scale")))
        if g is not None:
            found.append(g)
            used.update(p for _, p in g.parts)
    other = sorted(n for n in have - used if is_aux_name(n))
    return found, other


def mxfp4_pair(name: str, names: Iterable[str] | set[str]) -> str | None:
    """The scales of MXFP4 blocks ``name``: transformers' ``X_blocks`` / ``X_scales``, or the
    original gpt-oss release's ``X.blocks`` / ``X.scales``; None if ``name`` is neither."""
    for blocks, scales in (("_blocks", "_scales"), (".blocks", ".scales")):
        if name.endswith(blocks) and (other := name[:-len(blocks)] + scales) in names:
            return other
    return None


def mxfp4_layout(blocks: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, ...] | None:
    """MXFP4 ``blocks`` and ``scales`` [..., G] as blocks [..., G, 16]: stored so (what
    transformers serialises), or with the last two dims as one (its Mxfp4 module's own
    [..., G * 16] parameter, as some writers save it); None for neither."""
    if len(scales) < 2:
        return None
    if tuple(blocks) == tuple(scales) + (16,):
        return tuple(blocks)
    if tuple(blocks) == tuple(scales[:-1]) + (scales[-1] * 16,):
        return tuple(scales) + (16,)
    return None


def ceil_blocks(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's, and transformers' FineGrainedFP8 default


def fp8_block(weight: tuple[int, ...], scale: tuple[int, ...],
              configured: tuple[int, int] | None) -> tuple[int, int] | None:
    """The block each value of a block-FP8 ``scale`` covers in ``weight`` [rows, cols]: the
    whole weight for one scale (per-tensor: ``[]``, ``[1]``, ``[1, 1]``); else
    ``weight_block_size`` where the config gives it (edge blocks cut short); else, as
    transformers' ``Fp8Dequantize`` derives it, from the scale's grid: 128 x 128 blocks where
    they make it, else a grid that divides the weight. None: the scale fits no block."""
    if len(weight) != 2:
        return None
    if math.prod(scale) == 1:
        return (weight[0], weight[1])
    if len(scale) != 2 or 0 in scale:
        return None
    if configured is not None:
        return configured if tuple(scale) == ceil_blocks(weight, configured) else None
    if tuple(scale) == ceil_blocks(weight, DEFAULT_BLOCK):
        return DEFAULT_BLOCK
    if weight[0] % scale[0] == 0 and weight[1] % scale[1] == 0:
        return (weight[0] // scale[0], weight[1] // scale[1])
    return None


# --- what vLLM and SGLang need of a block-FP8 config ---------------------------------------
#
# Read in (facts, no code taken): vLLM's Fp8Config.from_config and is_layer_skipped
# (vllm/model_executor/layers/quantization/fp8.py and utils/quant_utils.py), SGLang's
# (python/sglang/srt/layers/quantization/fp8.py and utils.py), transformers 5's
# FineGrainedFP8Config and should_convert_module. tests/core/test_quantization_serving.py
# holds the written config against each loader's rules, written there as data with the
# versions they come from; docs/quantization.md says what was checked.
#
# - The kept modules' key: transformers reads modules_to_not_convert (ignored_layers as an
#   alias when that is absent); vLLM reads ignored_layers (newer releases fall back to
#   modules_to_not_convert when it is empty); SGLang reads the first of the two present. Both
#   keys are written, with the same list.
# - Names: vLLM and SGLang skip a layer whose name is in the list (SGLang since April 2026
#   also a name under a listed one); so the list holds full module names as stored.
# - Fused layers: vLLM and SGLang load q/k/v, gate/up and DeepSeek's q_a/kv_a_with_mqa shards
#   as one Linear (their models' packed_modules_mapping), and refuse to load one whose shards
#   are listed in part ("some but not all shards ... are quantized"); every expert's Linear of
#   one layer is one FusedMoE layer, ``...experts``, skipped when a listed name containing
#   "experts" contains that name (vLLM) or is that name (SGLang). A module kept from such a
#   layer keeps the whole layer, and a mixture of experts' layer is listed by its own name
#   (also what transformers 5 needs: it loads the experts as one module of that name).
# - transformers adds its default kept modules (the output head, tied weights) only where the
#   config lists none, so ``lm_head`` is always listed (a tied head is stored nowhere).

IGNORE_KEYS = ("modules_to_not_convert", "ignored_layers")
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
HEAD = "lm_head"


def experts_layer(module: str) -> str | None:
    """The mixture-of-experts layer ``module`` belongs to: ``...experts`` for an expert's
    Linear (``...experts.N....``) or the experts' own stacked tensors' module; else None."""
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p == "experts" and (i + 1 == len(parts) or parts[i + 1].isdecimal()):
            return ".".join(parts[:i + 1])
    return None


def serving_layer(module: str) -> str:
    """The layer vLLM and SGLang load the Linear ``module`` into: its mixture of experts'
    layer, the fused layer of its shard (``...qkv_proj`` for ``...q_proj``), or itself."""
    if (moe := experts_layer(module)) is not None:
        return moe
    parent, _, last = module.rpartition(".")
    for fused, shards in FUSED_SHARDS.items():
        if last in shards:
            return f"{parent}.{fused}" if parent else fused
    return module


@dataclass(frozen=True)
class Kept:
    """Which Linear modules ``--quantize`` quantizes, whole serving layers only."""

    quantized: frozenset[str]
    # modules_to_not_convert / ignored_layers: the kept modules (a mixture of experts' layer
    # by its name) and lm_head, sorted
    listed: tuple[str, ...]
    # serving layer -> the modules kept with it that the caller would have quantized
    widened: dict[str, tuple[str, ...]]


def keep_whole_layers(quantized: Iterable[str], kept: Iterable[str]) -> Kept:
    """``quantized`` less the modules that share a serving layer (:func:`serving_layer`) with
    a module of ``kept``, and the list of kept modules for the config."""
    q, k = set(quantized), set(kept)
    widened: dict[str, list[str]] = {}
    while True:
        kept_layers = {serving_layer(m) for m in k}
        listed = {experts_layer(m) or m for m in k} | {HEAD}
        more = {m for m in q if serving_layer(m) in kept_layers
                # SGLang between its 2026 releases matched a listed name anywhere inside a
                # layer's name: "x.mlp.gate" (a router) would keep "x.mlp.gate_up_proj"
                or any(x in name for x in listed for name in (m, serving_layer(m)))}
        if not more:
            break
        for m in sorted(more):
            widened.setdefault(serving_layer(m), []).append(m)
        q -= more
        k |= more
    return Kept(frozenset(q), tuple(sorted(listed)),
                {layer: tuple(ms) for layer, ms in widened.items()})


def matches(module: str, patterns: Iterable[str]) -> bool:
    """transformers' rule for ``modules_to_not_convert``: a pattern matches ``module`` from
    its start up to a segment boundary (as a regular expression), or as its suffix."""
    for p in patterns:
        try:
            if re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module):
                return True
        except re.error:
            pass
        if module.endswith(p):
            return True
    return False


@section
class QuantizationSummary(Section):
    """``inspect``'s quantization: the scheme, where it was read from, the block size, how
    many weights it holds, the modules the config leaves unquantized, and what
    ``merge --dequantize`` would do (None: decodes it; else why it refuses)."""

    method: str
    source: str
    block: list[int] | None
    num_quantized: int
    ignored: list[str]
    unsupported: str | None

    def line(self) -> str:
        """One line for inspect's human output."""
        block = f" in {self.block[0]}x{self.block[1]} blocks" if self.block else ""
        kept = f", {len(self.ignored)} modules kept unquantized" if self.ignored else ""
        what = ("merge --dequantize decodes it" if self.unsupported is None
                else f"merge --dequantize refuses it: {self.unsupported}")
        return (f"quantized: {self.method}{block}, {self.num_quantized} weights{kept} "
                f"(from {self.source}); scales kept as stored; {what}")


def summarise(config: Mapping[str, Any] | None,
              tensors: Mapping[str, tuple[DType, tuple[int, ...]]]) -> QuantizationSummary | None:
    s = scheme(config, tensors)
    if s is None:
        return None
    found, _ = groups(s, tensors)
    return QuantizationSummary(s.method, s.source, list(s.block) if s.block else None,
                               len(found), list(s.ignored), s.unsupported)


def check(config: Mapping[str, Any] | None,
          tensors: Mapping[str, tuple[DType, tuple[int, ...]]], config_name: str = "config.json"
          ) -> list[Problem]:
    """``quantization_config`` against the stored tensors: each quantized weight's scale
    exists, has the dtype the scheme stores and the shape its block size gives; the
    modules the config leaves unquantized hold no quantized weight. Pure."""
    s = scheme(config, tensors)
    if s is None:
        return []
    problems: list[Problem] = []
    found, _ = groups(s, tensors)
    where = config_name if s.source.startswith("config") else "the tensors"
    if s.source.startswith("tensors") and found:
        problems.append(warning(
            "quant-no-config", f"{len(found)} {s.method} weights (e.g. '{found[0].out}') but "
            f"{config_name} has no quantization_config: transformers and vLLM read them as "
            "plain weights; add the config the checkpoint was quantized with"))
    if not found and s.source.startswith("config") and s.unsupported is None:
        problems.append(error(
            "quant-config", f"{config_name} says quant_method {s.config.get('quant_method')!r}"
            f" ({s.method}) but no tensor is stored that way", file=config_name))
        return problems
    grouped = {p for g in found for _, p in g.parts}
    if s.method in (FP8_BLOCK, FP8_CT):
        for n, (d, _) in sorted(tensors.items()):
            if d.kind == "float8" and n not in grouped and leaf(n) == "weight":
                suffix = "_scale_inv" if s.method == FP8_BLOCK else "_scale"
                problems.append(error(
                    "quant-scale-missing", f"tensor '{n}' is {d.name} but '{n}{suffix}' is not "
                    "stored: its values cannot be read", tensor=n))
    for g in found:
        problems += _check_group(s, g, tensors, where)
    problems += _split_layers({module_of(g.out) for g in found}, tensors)
    if s.ignored:
        for g in found:
            if matches(module_of(g.out), s.ignored):
                problems.append(error(
                    "quant-config", f"'{g.out}' is stored quantized but {config_name} leaves "
                    f"its module unquantized (modules_to_not_convert / ignore): a loader reads "
                    "it as a plain weight", tensor=g.out))
    return problems


def _split_layers(quantized: set[str], tensors: Mapping[str, tuple[DType, tuple[int, ...]]]
                  ) -> list[Problem]:
    """The layers vLLM and SGLang load as one (:func:`serving_layer`) whose Linear modules
    are stored partly quantized (``quantized``), partly as plain floating weights."""
    plain = {module_of(n) for n, (d, shape) in tensors.items()
             if n.endswith(".weight") and len(shape) == 2 and d.is_float and d.kind != "float8"
             and module_of(n) not in quantized}
    by_layer: dict[str, tuple[set[str], set[str]]] = {}
    for m in quantized | plain:
        q, p = by_layer.setdefault(serving_layer(m), (set(), set()))
        (q if m in quantized else p).add(m)
    return [warning("quant-fused-split", f"'{layer}' is one layer to vLLM and SGLang but "
                    f"'{sorted(p)[0]}' is stored unquantized and '{sorted(q)[0]}' quantized: "
                    "they refuse to load it (\"some but not all shards\"); transformers loads "
                    "it", tensor=sorted(p)[0])
            for layer, (q, p) in sorted(by_layer.items()) if q and p]


def _check_group(s: Scheme, g: Group, tensors: Mapping[str, tuple[DType, tuple[int, ...]]],
                 where: str) -> list[Problem]:
    q, sc = g.part("q"), g.part("scale")
    (qd, qs), (sd, ss) = tensors[q], tensors[sc]
    bad: list[str] = []
    if s.method == FP8_BLOCK:
        if qd.kind != "float8":
            bad.append(f"'{q}' is {qd.name}, not float8")
        if sd.name != "F32":
            bad.append(f"'{sc}' is {sd.name}, not F32 (a cast scale shifts every weight of its "
                       "block)")
        if len(qs) == 2 and fp8_block(qs, ss, s.block) is None:
            if s.block is not None:
                bad.append(f"'{sc}' is {list(ss)}, but {list(qs)} in {list(s.block)} blocks "
                           f"(weight_block_size, {where}) makes "
                           f"{list(ceil_blocks(qs, s.block))}")
            else:
                bad.append(f"'{sc}' is {list(ss)}: one scale, or a grid of blocks of "
                           f"{list(qs)}")
    elif s.method == MXFP4:
        if qd.name != "U8" or sd.name != "U8":
            bad.append(f"'{q}' and '{sc}' are {qd.name} and {sd.name}, not U8")
        if mxfp4_layout(qs, ss) is None:
            bad.append(f"'{q}' is {list(qs)} and '{sc}' {list(ss)}: MXFP4 stores [..., G, 16] "
                       "(or [..., G * 16]) bytes and [..., G] scales (32 values a scale)")
    elif s.method == NVFP4:
        gs = tensors[g.part("global")]
        if qd.name != "U8" or sd.kind != "float8" or gs[0].name != "F32":
            bad.append(f"'{q}', '{sc}', '{g.part('global')}' are {qd.name}, {sd.name}, "
                       f"{gs[0].name}, not U8, F8_E4M3, F32")
        if len(qs) != 2 or len(ss) != 2 or ss[0] != qs[0] or qs[1] * 2 != ss[1] * 16:
            bad.append(f"'{q}' is {list(qs)} and '{sc}' {list(ss)}: NVFP4 has a scale per 16 "
                       "values (two a byte)")
        if math.prod(gs[1]) != 1:
            bad.append(f"'{g.part('global')}' is {list(gs[1])}, not one value")
    elif s.method == FP8_CT:
        if qd.kind != "float8":
            bad.append(f"'{q}' is {qd.name}, not float8")
        if not sd.is_float or sd.itemsize < 2:
            bad.append(f"'{sc}' is {sd.name}")
        if len(qs) != 2 or not _divides(ss, qs):
            bad.append(f"'{sc}' is {list(ss)}: no per-tensor, channel, group or block "
                       f"layout of {list(qs)}")
    return [error("quant-config", f"{m} ({s.method}, {where})", tensor=g.out) for m in bad]


def _divides(scale: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    if math.prod(scale) == 1:
        return True
    return (len(scale) == 2 and 0 < scale[0] <= shape[0] and 0 < scale[1] <= shape[1])


def check_casts(pairs: Iterable[tuple[str, DType, DType]], kept: frozenset[str]
                ) -> list[Problem]:
    """``verify --against``: a tensor that scales or indexes a quantized one (``kept``) has
    another dtype on the other side. An error with ``--allow-cast`` or without: a cast
    scale moves every weight of its block."""
    return [error("quant-scale-cast", f"tensor '{n}' scales a quantized weight and is {a.name}"
                  f" on one side, {b.name} on the other: a cast scale changes every value it "
                  "scales; merge keeps it as stored", tensor=n)
            for n, a, b in pairs if n in kept and a != b]
