"""Name maps applied: a training framework's parameter names and layouts to a Hugging Face
model family's (``ckpttool merge --names torchtitan-llama3``, ``--names torchtune-llama``).
The tables are data, one module per framework under :mod:`ckpttool.core.transforms.maps`
(the vocabulary they share in :mod:`~ckpttool.core.transforms.maps.rules`); this module picks
a map (:func:`implied`), applies it (:func:`apply`) and computes the derived tensors.

A map is a table of :class:`Rule`: a stored name pattern (``{L}``: a layer number), the Hugging
Face name it becomes, the shape config.json implies for it, and what happens to its values on
the way: nothing (a rename: the stored tensor under a new name, still copied file to file), the
rotary-embedding row permutation, one part of a fused ``wqkv``, one expert of a grouped
``[E, ...]`` weight (a :class:`~ckpttool.core.transforms.derive.Derived` each), or a declared
drop. The facts are those of torchtitan 0.3's own ``state_dict_adapter.py`` (``to_hf``) and
its fused ``FusedQKVLinear``, and of torchtune 0.6's ``convert_weights`` (``tune_to_hf``,
``qwen2_tune_to_hf``), written down as data. Where torchtitan's own adapter writes what no
loader reads (gpt-oss: its grouped experts under MXFP4 names, unconverted), the map writes
what transformers' model holds instead (a transposition, :data:`TRANSPOSE`).

A wrong map fails loudly and never writes a misnamed or reshaped model: config.json's
``model_type`` must be the map's family, every stored tensor must match a rule (nothing is
passed through or dropped unless the table says so), every stored shape must be the one
config.json implies, and every layer must come out complete.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from ckpttool.core.runtime.report import Section, section
from ckpttool.core.transforms.derive import Derived, identity, read_whole
from ckpttool.core.transforms.maps import MAPS, NAMES
from ckpttool.core.transforms.maps.megatron import MEGATRON_MAPS
from ckpttool.core.transforms.maps.rules import (
    DIMS,
    DROP,
    EXPERT,
    EXPERT_GATE,
    EXPERT_UP,
    EXPERTS,
    GATE,
    INTERLEAVE,
    INTERLEAVE_T,
    QKV_K,
    QKV_Q,
    QKV_V,
    RENAME,
    ROPE,
    TRANSPOSE,
    UP,
    VOCAB,
    WQKV_K,
    WQKV_Q,
    WQKV_V,
    Dims,
    Missing,
    NameMap,
    Rule,
    sparse_layers,
)
from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import Reader, Tensor

if TYPE_CHECKING:
    import torch

Source = Tensor | Derived

# --------------------------------------------------------------------------------------------
# Values: what the derived tensors compute


def _rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's rows, (re, im) pairs interleaved per head, into transformers' order (the
    real halves, then the imaginary halves: ``rotate_half``), as torchtitan's to_hf does."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _wqkv_part(inputs: list[torch.Tensor], *, op: str, kv_heads: int, head_dim: int,
               rope_heads: int) -> torch.Tensor:
    """One of q, k, v from FusedQKVLinear's ``[kv_heads, heads/kv_heads + 2, head_dim, in]``
    rows (each KV group's query heads, then its key, then its value)."""
    (w,) = inputs
    rows, cols = w.shape
    per_group = rows // (kv_heads * head_dim)
    grouped = w.reshape(kv_heads, per_group, head_dim, cols)
    part = {WQKV_Q: grouped[:, : per_group - 2], WQKV_K: grouped[:, per_group - 2],
            WQKV_V: grouped[:, per_group - 1]}[op]
    out = part.reshape(-1, cols)
    return _rope_permute(out, rope_heads) if rope_heads else out


def _first(inputs: list[torch.Tensor]) -> torch.Tensor:
    return inputs[0]


def _transposed(inputs: list[torch.Tensor]) -> torch.Tensor:
    return inputs[0].transpose(1, 2)


def _interleaved(inputs: list[torch.Tensor], *, transpose: bool) -> torch.Tensor:
    """``[E, 2F, ...]`` with each expert's ``[gate; up]`` rows as ``gate_0, up_0, gate_1,
    up_1...`` (transformers' gpt-oss), then dims 1 and 2 swapped (``transpose``)."""
    import torch

    (w,) = inputs
    out = torch.stack(w.chunk(2, dim=1), dim=2).reshape(w.shape)
    return out.transpose(1, 2) if transpose else out


def _permuted(inputs: list[torch.Tensor], *, heads: int) -> torch.Tensor:
    return _rope_permute(inputs[0], heads)


# --------------------------------------------------------------------------------------------
# Applying a map


@section
class Mapped(Section):
    """A map applied: the output tensors, and what was done, for the report."""

    map: str
    tensors: list[tuple[str, Source]]
    how: list[dict[str, str]] = field(default_factory=list)  # {"from", "to", "op"}
    dropped: list[tuple[str, Tensor, str]] = field(default_factory=list)  # name, tensor, note
    mtp_layers: int = 0  # multi-token prediction layers written after the decoder's

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.how:
            out[h["op"]] = out.get(h["op"], 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"map": self.map, "counts": self.counts(), "tensors": self.how,
                "dropped": [{"name": n, "note": note} for n, _, note in self.dropped]}


@dataclass(frozen=True)
class _Compiled:
    rule: Rule
    pattern: re.Pattern[str]


def _compile(rule: Rule) -> _Compiled:
    return _Compiled(rule, re.compile(re.escape(rule.source).replace(r"\{L\}", r"(?P<L>\d+)")))


# Names only Megatron-Core's GPTModel stores (its embedding and final norm).
_MEGATRON_NAMES = frozenset({"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"})


def is_megatron(tensors: list[tuple[str, Tensor]]) -> bool:
    """True if ``tensors`` are a Megatron-Core GPTModel's (its embedding or final norm)."""
    return any(name in _MEGATRON_NAMES for name, _ in tensors)


def implied(tensors: list[tuple[str, Tensor]], config: Mapping[str, Any] | None, *,
            config_path: str | None = None) -> str | None:
    """The map a merge applies without ``--names``: a Megatron-Core model's, chosen by
    config.json's ``model_type``, because Megatron's names and layouts (stacked layers, fused
    QKV, padded vocabulary) are something no Hugging Face loader reads; None for every other
    checkpoint (its names are kept).

    Raises:
        InputError: a Megatron model without config.json (it decides the family and sizes).
        UnsupportedError: a family that has no Megatron map yet.
    """
    if not is_megatron(tensors):
        return None
    families = ", ".join(MEGATRON_MAPS)
    if config is None:
        raise InputError(
            "a Megatron-Core model stores Megatron's names and layouts (stacked layers, fused "
            "QKV, padded vocabulary), which no Hugging Face loader reads; ckpttool writes the "
            "Hugging Face model from its config.json (family, heads, sizes): put the model's "
            f"config.json beside the run or pass --config (families: {families})")
    model_type = config.get("model_type")
    chosen = MEGATRON_MAPS.get(str(model_type))
    if chosen is None:
        raise UnsupportedError(
            f"{config_path or 'config.json'}: model_type '{model_type}' has no Megatron-Core "
            f"map yet (families: {families}); not supported yet")
    return chosen


def apply(map_name: str, tensors: list[tuple[str, Tensor]],
          config: Mapping[str, Any] | None, *, config_path: str | None = None,
          asked: bool = True) -> Mapped:
    """The Hugging Face tensors the map ``map_name`` makes of ``tensors``. Pure: no data read.

    Args:
        map_name: one of :data:`NAMES`.
        tensors: (canonical name, stored tensor), in model order.
        config: the model's Hugging Face config.json, for dimensions and checks.
        config_path: where it came from, for messages.
        asked: the map was passed as ``--names`` (else implied: a Megatron-Core model's), for
            what the messages ask next.

    Returns:
        A :class:`Mapped`: (Hugging Face name, source) in model order, renames as the stored
        tensors themselves.

    Raises:
        InputError: an unknown map, no or another family's config, a stored tensor no rule
            maps, a shape config.json does not imply, or an incomplete model.
    """
    nmap = MAPS.get(map_name)
    if nmap is None:
        raise InputError(f"no name map '{map_name}'; choose one of {', '.join(NAMES)}")
    where = config_path or "config.json"
    if config is None:
        raise InputError(f"--names {map_name} needs the model's Hugging Face config.json "
                         "(heads, sizes); put it beside the checkpoint or pass --config")
    model_type = config.get("model_type")
    if model_type not in nmap.model_types:
        raise InputError(
            f"{where}: model_type '{model_type}' is not {nmap.family} "
            f"({', '.join(nmap.model_types)}), which --names {map_name} maps to; pass the "
            "config.json of the model that was trained, or the map of its family")
    dims = Dims(config, where, map_name)
    compiled = [_compile(r) for r in nmap.rules]
    matched = [(name, tensor, [(c.rule, m) for c in compiled
                                if (m := c.pattern.fullmatch(name))])
               for name, tensor in tensors]
    # Errors name tensors in sorted order, whatever order the checkpoint stores them in.
    unmapped = sorted(name for name, _, matches in matched if not matches)
    mtp = [n for n in unmapped if n.startswith("mtp.")]
    if mtp and nmap.framework == "Megatron-Core" and not nmap.mtp_required:
        raise UnsupportedError(
            f"--names {map_name}: the checkpoint holds Megatron-Core's multi-token prediction "
            f"(MTP) layers ('{mtp[0]}'{f' and {len(mtp) - 1} more' if len(mtp) > 1 else ''}), "
            f"which {nmap.family}'s Hugging Face model has no place for (DeepSeek-V3's has); "
            "not supported. Save the run without --mtp-num-layers to convert the main model")
    if unmapped:
        shown = ", ".join(f"'{n}'" for n in unmapped[:3])
        more = f" and {len(unmapped) - 3} more" if len(unmapped) > 3 else ""
        raise InputError(
            f"--names {map_name}: no rule maps {shown}{more}; this is not a "
            f"{nmap.framework} {nmap.family} model checkpoint (or it holds more than the "
            "model). " + ("Check the map, or merge without --names" if asked else
                          "--names none writes the stored tensors under their own names"))
    for name, tensor, matches in sorted(matched, key=lambda x: x[0]):
        for rule, _ in matches:
            _check_shape(nmap, dims, rule, name, tensor)
    out = Mapped(map_name, [])
    mtp_layers: set[int] = set()
    for name, tensor, matches in matched:
        for rule, m in matches:
            layer = m.groupdict().get("L")
            if rule.mtp and layer is not None:
                mtp_layers.add(int(layer))
                layer = str(int(layer) + dims.number("num_hidden_layers"))
            target = rule.target.replace("{L}", layer) if layer is not None else rule.target
            _emit(out, dims, rule, name, tensor, target)
    if mtp_layers:
        _emit_mtp_shared(out, dims, nmap, tensors, sorted(mtp_layers))
    _check_complete(nmap, dims, out)
    return out


def _emit_mtp_shared(out: Mapped, dims: Dims, nmap: NameMap, tensors: list[tuple[str, Tensor]],
                     layers: list[int]) -> None:
    """Each MTP layer's ``embed_tokens`` and ``shared_head.head``: Megatron's MTP layers use
    the model's own embedding and output layer; DeepSeek-V3's checkpoints store a copy of each
    per MTP layer (what vLLM's and SGLang's MTP drafters load), so they are written from the
    model's (a tied model's embedding for both), vocabulary padding cut."""
    stored = dict(tensors)
    embedding = stored.get("embedding.word_embeddings.weight")
    output = stored.get("output_layer.weight", embedding)
    if embedding is None or output is None:
        raise InputError(
            f"--names {nmap.name}: the checkpoint holds multi-token prediction layers but not "
            "the model's embedding ('embedding.word_embeddings.weight'), which they share; "
            "merge a checkpoint of the whole model (every pipeline stage)")
    rule = Rule("", "", ("padded_vocab", "hidden"), VOCAB)
    first = dims.number("num_hidden_layers")
    out.mtp_layers = len(layers)
    for k in layers:
        hf = f"model.layers.{first + k}"
        _emit(out, dims, rule, "embedding.word_embeddings.weight", embedding,
              f"{hf}.embed_tokens.weight")
        _emit(out, dims, rule, "output_layer.weight" if output is not embedding
              else "embedding.word_embeddings.weight", output, f"{hf}.shared_head.head.weight")


def _check_shape(nmap: NameMap, dims: Dims, rule: Rule, name: str, tensor: Tensor) -> None:
    try:
        expected = tuple(n if s == "padded_vocab" and n >= dims.size(s) else dims.size(s)
                         for s, n in zip(rule.shape, tensor.shape + (0,) * len(rule.shape),
                                         strict=False))
    except Missing as e:
        raise InputError(
            f"'{name}': {dims.where} has no '{e.key}', which --names {nmap.name} needs for "
            f"this tensor: it describes another model (model_type "
            f"{dims.config.get('model_type')}); pass the config.json of the model that was "
            "trained") from e
    if tensor.shape == expected:
        return
    spec = ", ".join(DIMS[s][0] for s in rule.shape)
    raise InputError(
        f"'{name}': shape {list(tensor.shape)}, but --names {nmap.name} with {dims.where} "
        f"({dims.describe(set(rule.shape))}) expects {list(expected)} ([{spec}]); the "
        "checkpoint is not this model: check the map and config.json")


def _emit(out: Mapped, dims: Dims, rule: Rule, name: str, tensor: Tensor, target: str) -> None:
    """The output tensor(s) of one rule for one stored tensor, into ``out``."""
    if rule.op == DROP:
        out.dropped.append((name, tensor, rule.note))
        return
    if rule.stacked:
        _emit_layers(out, dims, rule, name, tensor, target)
        return
    if rule.op == VOCAB:
        rows = dims.size("vocab")
        out.tensors.append((target, _selection(
            target, tensor, ((0,) * len(tensor.shape), (rows, *tensor.shape[1:])),
            what=f"first {rows} rows of {name} (vocabulary padding cut)")))
        out.how.append({"from": name, "to": target, "op": "vocab-cut"})
        return
    if rule.op in _LAYER_OPS:
        _emit_layer(out, dims, rule, name, tensor, target, None)
        return
    if rule.op in (EXPERT_GATE, EXPERT_UP, EXPERT):
        _emit_experts(out, rule, name, tensor, target, None)
        return
    if rule.op in (INTERLEAVE_T, INTERLEAVE):
        _emit_computed(out, rule, name, tensor, target, None)
        return
    if rule.op == RENAME:
        out.tensors.append((target, tensor))
        out.how.append({"from": name, "to": target, "op": "renamed"})
        return
    rope_heads = getattr(dims, rule.rope_heads) if rule.rope_heads else 0
    if rope_heads and dims.head_dim % 2:
        raise InputError(f"{dims.where}: head_dim {dims.head_dim} is odd; RoPE rotates pairs, "
                         f"so '{name}' cannot be a {rule.op} of this model")
    if rule.op == ROPE:
        derived = Derived(target, (tensor,), tensor.dtype, tensor.shape,
                          partial(_permuted, heads=rope_heads),
                          f"RoPE row permutation of {name} ({rope_heads} heads)")
        out.tensors.append((target, derived))
        out.how.append({"from": name, "to": target, "op": "rope-permuted"})
    elif rule.op in (WQKV_Q, WQKV_K, WQKV_V):
        if dims.heads % max(dims.kv_heads, 1):
            raise InputError(f"{dims.where}: num_attention_heads {dims.heads} is not a "
                             f"multiple of num_key_value_heads {dims.kv_heads}; '{name}' "
                             "cannot be a fused wqkv of this model")
        rows = dims.size("q" if rule.op == WQKV_Q else "kv")
        derived = Derived(target, (tensor,), tensor.dtype, (rows, tensor.shape[1]),
                          partial(_wqkv_part, op=rule.op, kv_heads=dims.kv_heads,
                                  head_dim=dims.head_dim, rope_heads=rope_heads),
                          f"{rule.op[-1]} of fused {name}"
                          + (" with RoPE row permutation" if rope_heads else ""))
        out.tensors.append((target, derived))
        out.how.append({"from": name, "to": target,
                        "op": "split-rope-permuted" if rope_heads else "split"})
    elif rule.op == TRANSPOSE:
        shape = (tensor.shape[0], tensor.shape[2], tensor.shape[1])
        out.tensors.append((target, Derived(target, (tensor,), tensor.dtype, shape,
                                            _transposed, f"{name} transposed (dims 1 and 2)")))
        out.how.append({"from": name, "to": target, "op": "transposed"})
    elif rule.op == EXPERTS:
        for e in range(tensor.shape[0]):
            expert = target.replace("{E}", str(e))
            out.tensors.append((expert, Derived(
                expert, (tensor,), tensor.dtype, tensor.shape[1:], _first,
                f"expert {e} of {name}", select=(e,))))
            out.how.append({"from": f"{name}[{e}]", "to": expert, "op": "expert-split"})
    else:  # pragma: no cover - a table names an op this module lacks
        raise AssertionError(rule.op)


_LAYER_OPS = frozenset({QKV_Q, QKV_K, QKV_V, GATE, UP})
_OP_WORDS = {RENAME: "unstacked", QKV_Q: "qkv-split", QKV_K: "qkv-split",
             QKV_V: "qkv-split", GATE: "gate-up-split", UP: "gate-up-split"}


def _emit_layers(out: Mapped, dims: Dims, rule: Rule, name: str, tensor: Tensor,
                 target: str) -> None:
    """Each layer's slice of a stacked tensor: read alone (``Derived.select``), so memory is
    bounded by one layer's slice, never by the stacked tensor."""
    for layer in range(tensor.shape[0]):
        if rule.op in (EXPERT_GATE, EXPERT_UP, EXPERT):
            _emit_experts(out, rule, name, tensor, target.replace("{L}", str(layer)), layer)
        elif rule.op in (INTERLEAVE_T, INTERLEAVE, TRANSPOSE):
            _emit_computed(out, rule, name, tensor, target.replace("{L}", str(layer)), layer)
        else:
            _emit_layer(out, dims, rule, name, tensor, target.replace("{L}", str(layer)), layer)


def _emit_computed(out: Mapped, rule: Rule, name: str, tensor: Tensor, target: str,
                   layer: int | None) -> None:
    """One layer's grouped ``[E, ...]`` expert tensor rearranged by torch (gpt-oss's
    interleaved gate/up columns, a transposition): that layer's slice alone is read
    (``Derived.select``), so memory is bounded by one output tensor."""
    shape = tensor.shape[1:] if layer is not None else tensor.shape
    if rule.op in (INTERLEAVE_T, TRANSPOSE) and len(shape) == 3:
        shape = (shape[0], shape[2], shape[1])
    compute = (_transposed if rule.op == TRANSPOSE
               else partial(_interleaved, transpose=rule.op == INTERLEAVE_T))
    source = f"{name}[{layer}]" if layer is not None else name
    what = {INTERLEAVE_T: "gate/up rows interleaved, transposed",
            INTERLEAVE: "gate/up interleaved", TRANSPOSE: "transposed (dims 1 and 2)"}[rule.op]
    out.tensors.append((target, Derived(
        target, (tensor,), tensor.dtype, tuple(shape), compute, f"{source} {what}",
        select=((layer,),) if layer is not None else ())))
    out.how.append({"from": source, "to": target, "op": rule.op})


def _emit_experts(out: Mapped, rule: Rule, name: str, tensor: Tensor, target: str,
                  layer: int | None) -> None:
    """Each expert of one layer of a stacked ``[L, E, ...]`` weight (or of one layer's
    ``[E, ...]``: ``layer`` None), read alone."""
    lead, one = ((layer,), (1,)) if layer is not None else ((), ())
    rest = tensor.shape[len(lead) + 1:]
    for e in range(tensor.shape[len(lead)]):
        expert = target.replace("{E}", str(e))
        what = f"expert {e} of {f'layer {layer} of ' if layer is not None else ''}{name}"
        start, rows = 0, rest[0] if rest else 1
        if rule.op in (EXPERT_GATE, EXPERT_UP):
            rows //= 2
            start = rows if rule.op == EXPERT_UP else 0
            what = f"{'up' if rule.op == EXPERT_UP else 'gate'} half of {what}"
        box = ((*lead, e, start, *(0,) * len(rest[1:])), (*one, 1, rows, *rest[1:])) if rest \
            else ((*lead, e), (*one, 1))
        out.tensors.append((expert, _selection(expert, tensor, box, what=what,
                                               shape=(rows, *rest[1:]) if rest else ())))
        where = f"{layer}, {e}" if layer is not None else f"{e}"
        out.how.append({"from": f"{name}[{where}]", "to": expert,
                        "op": "expert-split" if rule.op == EXPERT else "expert-gate-up-split"})


def _selection(target: str, tensor: Tensor, *boxes: tuple[tuple[int, ...], tuple[int, ...]],
               what: str = "", shape: tuple[int, ...] | None = None) -> Derived:
    """``boxes`` of ``tensor``, one after the other, as the output tensor ``target`` of
    ``shape`` (default: the one box's sizes without its leading layer/expert dims of 1)."""
    if shape is None:
        ((_, sizes),) = boxes
        shape = tuple(sizes)
    return Derived(target, (tensor,), tensor.dtype, shape, identity, what, boxes=(boxes,))


def _emit_layer(out: Mapped, dims: Dims, rule: Rule, name: str, tensor: Tensor, target: str,
                layer: int | None) -> None:
    """One output of a Megatron per-layer rule: the layer's slice (``layer``; None: the
    tensor is one layer's already) as it is, its q/k/v rows taken per query group, or its
    gate/up half: boxes of the stored tensor (:class:`Derived` ``boxes``), so merge moves
    their bytes file to file and reads no other layer."""
    shape = tensor.shape[1:] if layer is not None else tensor.shape
    source = f"{name}[{layer}]" if layer is not None else name
    lead = (layer,) if layer is not None else ()
    one = (1,) if layer is not None else ()
    rest = shape[1:]

    def rows(start: int, num: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (*lead, start, *(0,) * len(rest)), (*one, num, *rest)

    if rule.op in (QKV_Q, QKV_K, QKV_V):
        if dims.heads % max(dims.kv_heads, 1):
            raise InputError(f"{dims.where}: num_attention_heads {dims.heads} is not a "
                             f"multiple of num_key_value_heads {dims.kv_heads}; '{name}' "
                             "cannot be a fused linear_qkv of this model")
        groups, hd = dims.kv_heads, dims.head_dim
        per_group = shape[0] // (groups * hd)  # query heads per group, then k, then v
        first, num = {QKV_Q: (0, per_group - 2), QKV_K: (per_group - 2, 1),
                      QKV_V: (per_group - 1, 1)}[rule.op]
        boxes = [rows((g * per_group + first) * hd, num * hd) for g in range(groups)]
        derived = _selection(target, tensor, *boxes, shape=(groups * num * hd, *rest),
                             what=f"{rule.op[-1]} rows of {source} (grouped per query group)")
    elif rule.op in (GATE, UP):
        half = shape[0] // 2
        derived = _selection(target, tensor, rows(half if rule.op == UP else 0, half),
                             shape=(half, *rest),
                             what=f"{'up' if rule.op == UP else 'gate'} half of {source}")
    elif rule.op == RENAME:
        derived = _selection(target, tensor, rows(0, shape[0]) if shape else (lead, one),
                             shape=tuple(shape), what=f"layer {layer} of {name}")
    else:  # pragma: no cover - a table names an op this module lacks
        raise AssertionError(rule.op)
    out.tensors.append((target, derived))
    out.how.append({"from": source, "to": target, "op": _OP_WORDS[rule.op]})


def _check_complete(nmap: NameMap, dims: Dims, out: Mapped) -> None:
    """Every output name once; every layer config.json describes, and each complete."""
    seen: set[str] = set()
    for name, _ in out.tensors:
        if name in seen:
            sources = [h["from"] for h in out.how if h["to"] == name]
            if any(s.startswith("mtp.") for s in sources):
                raise InputError(
                    f"--names {nmap.name}: '{name}' would be written twice (from "
                    f"{', '.join(repr(s) for s in sources)}): multi-token prediction layer k "
                    f"is written as layer num_hidden_layers + k, and {dims.where} says "
                    f"num_hidden_layers {dims.number('num_hidden_layers')}, fewer than the "
                    "checkpoint's decoder layers; pass the config of the model that was trained")
            raise InputError(f"--names {nmap.name}: '{name}' would be written twice (from "
                             f"{', '.join(repr(s) for s in sources)}); the checkpoint holds "
                             "one weight in two forms")
        seen.add(name)
    num_layers = dims.number("num_hidden_layers")
    mtp = out.mtp_layers
    layers = {int(m.group(1)) for n in seen if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if layers != set(range(num_layers + mtp)):
        held = f"layers 0-{max(layers)}" if layers == set(range(len(layers))) else (
            f"layers {', '.join(map(str, sorted(layers)))}")
        also = f" and {mtp} multi-token prediction layer(s) after them" if mtp else ""
        raise InputError(f"--names {nmap.name}: the checkpoint has {held}, but {dims.where} "
                         f"says num_hidden_layers {num_layers}{also}; pass the config of the "
                         "model that was trained (a pipeline stage alone is not a model)")
    sparse = (nmap.sparse or sparse_layers)(dims, num_layers)
    # Megatron builds each MTP layer as the decoder's last (its spec): experts if that has.
    if num_layers - 1 in sparse:
        sparse |= frozenset(range(num_layers, num_layers + mtp))
    tied = dims.config.get("tie_word_embeddings") is True
    needed = [n for n in nmap.required if "{L}" not in n]
    if not tied:
        needed.append("lm_head.weight")
    for layer in range(num_layers + mtp):
        per_layer = [n for n in nmap.required if "{L}" in n]
        if layer >= num_layers:
            per_layer += list(nmap.mtp_required)
        if layer in sparse:
            experts = dims.size("experts")
            per_layer += [n.replace("{E}", str(e)) for n in nmap.moe_mlp
                          for e in (range(experts) if "{E}" in n else (0,))]
        else:
            per_layer += list(nmap.dense_mlp)
        needed += [n.replace("{L}", str(layer)) for n in per_layer]
    missing = [n for n in needed if n not in seen]
    if missing:
        kind = ""
        if any(".mlp." in n for n in missing):
            kind = (f" ({dims.where} describes layer {_layer(missing[0])} as "
                    f"{'a mixture of experts' if _layer(missing[0]) in sparse else 'dense'})")
        raise InputError(
            f"--names {nmap.name}: nothing in the checkpoint becomes '{missing[0]}'"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}{kind}; the "
            "checkpoint is not the model config.json describes: check the map and config")
    allowed = {n.replace("{L}", str(layer)) for n in nmap.optional
               for layer in range(num_layers + mtp)}
    stray = sorted(seen - set(needed) - allowed - {"lm_head.weight"})
    if stray:
        raise InputError(
            f"--names {nmap.name}: '{stray[0]}' has no place in the model {dims.where} "
            f"describes{f' (and {len(stray) - 1} more)' if len(stray) > 1 else ''}; check "
            "the map and config.json")


def _layer(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def check_dropped(reader: Reader, mapped: Mapped) -> list[str]:
    """A warning for each dropped tensor that is not all zero (a trained value the Hugging
    Face model has no place for). Reads those tensors (small: a bias per layer)."""
    warnings = []
    for name, tensor, note in mapped.dropped:
        values = read_whole(reader, tensor)
        if values.numel() and bool(values.ne(0).any()):
            top = float(values.float().abs().max())
            warnings.append(
                f"dropped '{name}', which is not zero (max |value| {top:.3g}): {note}; the "
                "merged model can behave differently from the trained one")
    return warnings
