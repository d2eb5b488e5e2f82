"""Name maps: a training framework's parameter names and layouts to a Hugging Face model
family's (``ckpttool merge --names torchtitan-llama3``, ``--names torchtune-llama``).

A map is a table of :class:`Rule`: a stored name pattern (``{L}``: a layer number), the Hugging
Face name it becomes, the shape config.json implies for it, and what happens to its values on
the way: nothing (a rename: the stored tensor under a new name, still copied file to file), the
rotary-embedding row permutation, one part of a fused ``wqkv``, one expert of a grouped
``[E, ...]`` weight (a :class:`~ckpttool.core.transforms.derive.Derived` each), or a declared drop.
The
facts are those of torchtitan 0.3's own ``state_dict_adapter.py`` (``to_hf``) and its fused
``FusedQKVLinear``, and of torchtune 0.6's ``convert_weights`` (``tune_to_hf``,
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from ckpttool.core.runtime.report import Section, section
from ckpttool.core.transforms.derive import Derived, identity, read_whole
from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import Reader, Tensor

if TYPE_CHECKING:
    import torch

Source = Tensor | Derived

# What a rule does to the stored values.
RENAME = "rename"  # the stored tensor under another name, bytes untouched
ROPE = "rope"  # rows permuted from torchtitan's interleaved RoPE pairs to HF's halves
EXPERTS = "experts"  # a grouped [E, ...] weight split into E tensors ("{E}" in the target)
WQKV_Q, WQKV_K, WQKV_V = "wqkv-q", "wqkv-k", "wqkv-v"  # one part of a fused wqkv
DROP = "drop"  # no Hugging Face counterpart; warned about when not all zero
QKV_Q, QKV_K, QKV_V = "qkv-q", "qkv-k", "qkv-v"  # Megatron's linear_qkv (weight or bias)
GATE, UP = "fc1-gate", "fc1-up"  # one half of a fused SwiGLU [gate; up] projection
# One expert of a stacked [L, E, ...] expert weight: its fc1's gate or up half, or as it is.
EXPERT_GATE, EXPERT_UP, EXPERT = "expert-gate", "expert-up", "expert"
VOCAB = "vocab-cut"  # the rows of the real vocabulary, padding rows cut off
TRANSPOSE = "transpose"  # a grouped [E, A, B] weight as [E, B, A] (transformers' gpt-oss)
# Megatron's [E, 2F, ...] expert fc1 ([gate; up] per expert) as transformers' gpt-oss holds it:
# gate and up rows interleaved (gate_0, up_0, gate_1...), the weight transposed to [E, H, 2F].
INTERLEAVE_T, INTERLEAVE = "gate-up-interleave-transpose", "gate-up-interleave"


@dataclass(frozen=True)
class Rule:
    """One stored tensor pattern and what it becomes."""

    source: str  # stored (canonical) name; "{L}" stands for a layer number
    target: str  # Hugging Face name; "{L}" the same layer, "{E}" each expert (EXPERTS)
    shape: tuple[str, ...]  # the stored shape, in the config dimensions of DIMS
    op: str = RENAME
    rope_heads: str = ""  # ROPE and fused parts: the heads permuted ("heads", "kv_heads")
    note: str = ""  # DROP: why, and what dropping a non-zero tensor changes
    # The stored tensor holds every layer along dim 0 (Megatron's homogeneous decoder,
    # ``shape`` starts with "layers"): the rule applies to each layer's slice, read alone.
    stacked: bool = False
    # A multi-token prediction layer (Megatron's ``mtp.layers.{L}``): its Hugging Face layer
    # is ``num_hidden_layers + L``, after the decoder's last (DeepSeek-V3's layout).
    mtp: bool = False


@dataclass(frozen=True)
class NameMap:
    name: str
    family: str  # for messages: "Llama 3"
    model_types: tuple[str, ...]  # config.json model_type values this map is for
    rules: tuple[Rule, ...]
    required: tuple[str, ...]  # Hugging Face names every model has ("{L}": every layer)
    dense_mlp: tuple[str, ...]  # per layer, a dense feed-forward ("{L}")
    moe_mlp: tuple[str, ...] = ()  # per layer, a mixture of experts ("{L}", "{E}")
    framework: str = "torchtitan"  # whose names the map reads, for messages
    # Per layer ("{L}"), names a model may have or not (DeepSeek-V3's q_proj, or its
    # q_a_proj, q_a_layernorm and q_b_proj with a q_lora_rank)
    optional: tuple[str, ...] = ()
    # Which layers config.json gives a mixture of experts (default: Qwen 3 MoE's rule)
    sparse: Callable[[Dims, int], frozenset[int]] | None = None
    # Per multi-token prediction layer ("{L}": num_hidden_layers + k), beside the decoder
    # layer's own names; empty: the family has no MTP map
    mtp_required: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# config.json dimensions


def _int(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Missing(InputError):
    """config.json lacks a dimension (``key``)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Dims:
    """The dimensions a map needs, from a Hugging Face config.json."""

    config: Mapping[str, Any]
    where: str  # the config's path, for messages
    map_name: str

    def number(self, key: str) -> int:
        value = _int(self.config, key)
        if value is None or value < 0:
            raise _Missing(f"{self.where}: needs an integer '{key}' for --names "
                           f"{self.map_name}; pass the model's Hugging Face config.json "
                           "with --config", key)
        return value

    @property
    def heads(self) -> int:
        return self.number("num_attention_heads")

    @property
    def kv_heads(self) -> int:
        if self.config.get("num_key_value_heads") is None:
            return self.heads
        return self.number("num_key_value_heads")

    @property
    def head_dim(self) -> int:
        if self.config.get("head_dim") is not None:
            return self.number("head_dim")
        return self.number("hidden_size") // max(self.heads, 1)

    @property
    def experts(self) -> int:
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts; DeepSeek-V3
        # calls them n_routed_experts.
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if self.config.get(key) is not None:
                return self.number(key)
        return self.number("num_experts")

    def mla(self, *keys: str) -> int:
        """Heads times the sum of DeepSeek's multi-head latent attention dims ``keys``."""
        return self.heads * sum(self.number(k) for k in keys)

    def size(self, symbol: str) -> int:
        return DIMS[symbol][1](self)

    def describe(self, symbols: set[str]) -> str:
        keys = sorted({k for s in symbols for k in DIMS[s][2]})
        return ", ".join(f"{k} {self.config[k]}" for k in keys if k in self.config)


# symbol -> (how messages spell it, its size, the config.json keys it comes from)
DIMS: dict[str, tuple[str, Callable[[Dims], int], tuple[str, ...]]] = {
    "vocab": ("vocab_size", lambda d: d.number("vocab_size"), ("vocab_size",)),
    "hidden": ("hidden_size", lambda d: d.number("hidden_size"), ("hidden_size",)),
    "2hidden": ("2*hidden_size", lambda d: 2 * d.number("hidden_size"), ("hidden_size",)),
    "head_dim": ("head_dim", lambda d: d.head_dim,
                 ("head_dim", "hidden_size", "num_attention_heads")),
    "q": ("num_attention_heads*head_dim", lambda d: d.heads * d.head_dim,
          ("num_attention_heads", "head_dim", "hidden_size")),
    "kv": ("num_key_value_heads*head_dim", lambda d: d.kv_heads * d.head_dim,
           ("num_key_value_heads", "num_attention_heads", "head_dim", "hidden_size")),
    "qkv": ("(num_attention_heads+2*num_key_value_heads)*head_dim",
            lambda d: (d.heads + 2 * d.kv_heads) * d.head_dim,
            ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")),
    "ffn": ("intermediate_size", lambda d: d.number("intermediate_size"),
            ("intermediate_size",)),
    "experts": ("num_experts", lambda d: d.experts,
                ("num_experts", "num_local_experts", "n_routed_experts")),
    "heads": ("num_attention_heads", lambda d: d.heads, ("num_attention_heads",)),
    "ffn2": ("2*intermediate_size", lambda d: 2 * d.number("intermediate_size"),
             ("intermediate_size",)),
    # DeepSeek-V3's multi-head latent attention
    "q_lora": ("q_lora_rank", lambda d: d.number("q_lora_rank"), ("q_lora_rank",)),
    "kv_lora": ("kv_lora_rank", lambda d: d.number("kv_lora_rank"), ("kv_lora_rank",)),
    "q_mla": ("num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)",
              lambda d: d.mla("qk_nope_head_dim", "qk_rope_head_dim"),
              ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim")),
    "kv_a": ("kv_lora_rank+qk_rope_head_dim",
             lambda d: d.number("kv_lora_rank") + d.number("qk_rope_head_dim"),
             ("kv_lora_rank", "qk_rope_head_dim")),
    "kv_b": ("num_attention_heads*(qk_nope_head_dim+v_head_dim)",
             lambda d: d.mla("qk_nope_head_dim", "v_head_dim"),
             ("num_attention_heads", "qk_nope_head_dim", "v_head_dim")),
    "o_mla": ("num_attention_heads*v_head_dim", lambda d: d.mla("v_head_dim"),
              ("num_attention_heads", "v_head_dim")),
    "shared_ffn": ("moe_intermediate_size*n_shared_experts",
                   lambda d: d.number("moe_intermediate_size") * d.number("n_shared_experts"),
                   ("moe_intermediate_size", "n_shared_experts")),
    "2shared_ffn": ("2*moe_intermediate_size*n_shared_experts",
                    lambda d: 2 * d.number("moe_intermediate_size")
                    * d.number("n_shared_experts"),
                    ("moe_intermediate_size", "n_shared_experts")),
    "moe_ffn": ("moe_intermediate_size", lambda d: d.number("moe_intermediate_size"),
                ("moe_intermediate_size",)),
    "2ffn": ("2*intermediate_size", lambda d: 2 * d.number("intermediate_size"),
             ("intermediate_size",)),
    "2moe_ffn": ("2*moe_intermediate_size", lambda d: 2 * d.number("moe_intermediate_size"),
                 ("moe_intermediate_size",)),
    "layers": ("num_hidden_layers", lambda d: d.number("num_hidden_layers"),
               ("num_hidden_layers",)),
    # At least vocab_size rows: Megatron pads the vocabulary to a multiple of
    # make_vocab_size_divisible_by x TP (checked in _check_shape).
    "padded_vocab": ("vocab_size (or more)", lambda d: d.number("vocab_size"), ("vocab_size",)),
}


def _deepseek_sparse(dims: Dims, num_layers: int) -> frozenset[int]:
    """DeepSeek-V3's experts: every layer from ``first_k_dense_replace`` on."""
    first = _int(dims.config, "first_k_dense_replace") or 0
    return frozenset(range(first, num_layers))


def _all_sparse(dims: Dims, num_layers: int) -> frozenset[int]:
    return frozenset(range(num_layers))


def _sparse_layers(dims: Dims, num_layers: int) -> frozenset[int]:
    """The layers config.json gives a mixture of experts, as transformers' Qwen3-MoE decides
    (``num_experts``, ``decoder_sparse_step``, ``mlp_only_layers``); none for a dense model."""
    if not (_int(dims.config, "num_experts") or _int(dims.config, "num_local_experts")):
        return frozenset()
    step = _int(dims.config, "decoder_sparse_step") or 1
    only = set(dims.config.get("mlp_only_layers") or ())
    return frozenset(i for i in range(num_layers) if i not in only and (i + 1) % step == 0)


# --------------------------------------------------------------------------------------------
# The tables


def _decoder_rules(attention: str, *, rope: bool, qk_norm: bool) -> tuple[Rule, ...]:
    """torchtitan's decoder names (models/common), shared by its Llama 3 and Qwen 3."""
    a, hf = f"layers.{{L}}.{attention}", "model.layers.{L}.self_attn"
    q_op, k_op = (ROPE, ROPE) if rope else (RENAME, RENAME)
    rules = [
        Rule("tok_embeddings.weight", "model.embed_tokens.weight", ("vocab", "hidden")),
        Rule("norm.weight", "model.norm.weight", ("hidden",)),
        Rule("lm_head.weight", "lm_head.weight", ("vocab", "hidden")),
        Rule(f"{a}.qkv_linear.wq.weight", f"{hf}.q_proj.weight", ("q", "hidden"), q_op,
             "heads" if rope else ""),
        Rule(f"{a}.qkv_linear.wk.weight", f"{hf}.k_proj.weight", ("kv", "hidden"), k_op,
             "kv_heads" if rope else ""),
        Rule(f"{a}.qkv_linear.wv.weight", f"{hf}.v_proj.weight", ("kv", "hidden")),
        # FusedQKVLinear's own parameter: torchtitan's state_dict hook splits it on save, so a
        # checkpoint holds it only when saved from the parameters themselves.
        Rule(f"{a}.qkv_linear.wqkv.weight", f"{hf}.q_proj.weight", ("qkv", "hidden"), WQKV_Q,
             "heads" if rope else ""),
        Rule(f"{a}.qkv_linear.wqkv.weight", f"{hf}.k_proj.weight", ("qkv", "hidden"), WQKV_K,
             "kv_heads" if rope else ""),
        Rule(f"{a}.qkv_linear.wqkv.weight", f"{hf}.v_proj.weight", ("qkv", "hidden"), WQKV_V),
        Rule(f"{a}.wo.weight", f"{hf}.o_proj.weight", ("hidden", "q")),
        Rule("layers.{L}.feed_forward.w1.weight", "model.layers.{L}.mlp.gate_proj.weight",
             ("ffn", "hidden")),
        Rule("layers.{L}.feed_forward.w3.weight", "model.layers.{L}.mlp.up_proj.weight",
             ("ffn", "hidden")),
        Rule("layers.{L}.feed_forward.w2.weight", "model.layers.{L}.mlp.down_proj.weight",
             ("hidden", "ffn")),
        Rule("layers.{L}.attention_norm.weight", "model.layers.{L}.input_layernorm.weight",
             ("hidden",)),
        Rule("layers.{L}.ffn_norm.weight", "model.layers.{L}.post_attention_layernorm.weight",
             ("hidden",)),
    ]
    if qk_norm:
        rules += [Rule(f"{a}.q_norm.weight", f"{hf}.q_norm.weight", ("head_dim",)),
                  Rule(f"{a}.k_norm.weight", f"{hf}.k_norm.weight", ("head_dim",))]
    return tuple(rules)


_ATTENTION = tuple(f"model.layers.{{L}}.{n}" for n in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"))
_TOP = ("model.embed_tokens.weight", "model.norm.weight")
_DENSE = tuple(f"model.layers.{{L}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))

_MOE = "layers.{L}.moe"
_QWEN3_MOE_RULES = (
    # GroupedExperts: w1/w3 [E, moe_ffn, hidden] and w2 [E, hidden, moe_ffn], each expert's
    # slice already in nn.Linear's [out, in] layout: a split, no transposition.
    Rule(f"{_MOE}.routed_experts.inner_experts.w1_EFD",
         "model.layers.{L}.mlp.experts.{E}.gate_proj.weight", ("experts", "moe_ffn", "hidden"),
         EXPERTS),
    Rule(f"{_MOE}.routed_experts.inner_experts.w3_EFD",
         "model.layers.{L}.mlp.experts.{E}.up_proj.weight", ("experts", "moe_ffn", "hidden"),
         EXPERTS),
    Rule(f"{_MOE}.routed_experts.inner_experts.w2_EDF",
         "model.layers.{L}.mlp.experts.{E}.down_proj.weight", ("experts", "hidden", "moe_ffn"),
         EXPERTS),
    Rule(f"{_MOE}.router.gate.weight", "model.layers.{L}.mlp.gate.weight",
         ("experts", "hidden")),
    Rule(f"{_MOE}.expert_bias_E", "", ("experts",), DROP, note=(
        "torchtitan's load-balancing expert bias, which Hugging Face's Qwen3-MoE has no place "
        "for (torchtitan's own to_hf drops it too)")),
)

def _megatron_rules(*, qkv_bias: bool, qk_norm: bool) -> tuple[Rule, ...]:
    """Megatron-Core GPTModel's names (as ``torch_dist`` stores them: Transformer Engine's, the
    local spec maps its own to them) to Hugging Face's. A homogeneous decoder is stored
    stacked (``decoder.layers.<module>``, layer axis first); a model whose layers differ
    stores ``decoder.layers.<L>.<module>``: both forms are here. Facts (megatron-core 0.16):
    ``linear_qkv`` rows are grouped per query group, ``[q_0 .. q_{heads/groups-1}, k, v]``
    each ``head_dim`` rows (the layout of torchtitan's fused wqkv); ``linear_fc1`` is
    ``[gate; up]``; the norm before attention (MLP) is fused into ``linear_qkv``
    (``linear_fc1``) as ``layer_norm_weight`` (``input_layernorm`` / ``pre_mlp_layernorm``
    where it is not); embedding and output rows are padded past vocab_size; RoPE rotates
    halves, as transformers does (no permutation)."""
    hf, a, m = "model.layers.{L}", "self_attention", "mlp"
    per_layer = [
        (f"{a}.linear_qkv.layer_norm_weight", f"{hf}.input_layernorm.weight", ("hidden",),
         RENAME),
        ("input_layernorm.weight", f"{hf}.input_layernorm.weight", ("hidden",), RENAME),
        (f"{a}.linear_qkv.weight", f"{hf}.self_attn.q_proj.weight", ("qkv", "hidden"), QKV_Q),
        (f"{a}.linear_qkv.weight", f"{hf}.self_attn.k_proj.weight", ("qkv", "hidden"), QKV_K),
        (f"{a}.linear_qkv.weight", f"{hf}.self_attn.v_proj.weight", ("qkv", "hidden"), QKV_V),
        (f"{a}.linear_proj.weight", f"{hf}.self_attn.o_proj.weight", ("hidden", "q"), RENAME),
        (f"{m}.linear_fc1.layer_norm_weight", f"{hf}.post_attention_layernorm.weight",
         ("hidden",), RENAME),
        ("pre_mlp_layernorm.weight", f"{hf}.post_attention_layernorm.weight", ("hidden",),
         RENAME),
        (f"{m}.linear_fc1.weight", f"{hf}.mlp.gate_proj.weight", ("2ffn", "hidden"), GATE),
        (f"{m}.linear_fc1.weight", f"{hf}.mlp.up_proj.weight", ("2ffn", "hidden"), UP),
        (f"{m}.linear_fc2.weight", f"{hf}.mlp.down_proj.weight", ("hidden", "ffn"), RENAME),
    ]
    if qkv_bias:
        per_layer += [
            (f"{a}.linear_qkv.bias", f"{hf}.self_attn.{p}_proj.bias", ("qkv",), op)
            for p, op in (("q", QKV_Q), ("k", QKV_K), ("v", QKV_V))]
    if qk_norm:
        per_layer += [
            (f"{a}.q_layernorm.weight", f"{hf}.self_attn.q_norm.weight", ("head_dim",), RENAME),
            (f"{a}.k_layernorm.weight", f"{hf}.self_attn.k_norm.weight", ("head_dim",), RENAME)]
    return _MEGATRON_TOP + _both_forms(per_layer)


_MEGATRON_TOP = (
    Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight",
         ("padded_vocab", "hidden"), VOCAB),
    Rule("decoder.final_layernorm.weight", "model.norm.weight", ("hidden",)),
    Rule("output_layer.weight", "lm_head.weight", ("padded_vocab", "hidden"), VOCAB),
)


def _megatron_gpt_oss_rules() -> tuple[Rule, ...]:
    """Megatron-Core's gpt-oss (biases in every linear layer, ``softmax_type="learnable"``
    attention sinks, a biased router, biased experts) to transformers' GptOss: attention as
    Qwen 2's (q/k/v rows and biases per query group), ``core_attention.softmax_offset`` ->
    ``self_attn.sinks``; each layer's experts as transformers' grouped tensors: fc1 ``[E, 2F,
    H]`` (``[gate; up]`` per expert) -> ``gate_up_proj`` ``[E, H, 2F]``, gate and up columns
    interleaved (its forward reads ``[..., ::2]`` and ``[..., 1::2]``), the fc1 bias likewise;
    fc2 ``[E, H, F]`` -> ``down_proj`` ``[E, F, H]``; the fc2 bias as it is."""
    hf, e = "model.layers.{L}", "mlp.experts.experts"
    per_layer = [
        ("self_attention.linear_proj.bias", f"{hf}.self_attn.o_proj.bias", ("hidden",),
         RENAME),
        ("self_attention.core_attention.softmax_offset", f"{hf}.self_attn.sinks", ("heads",),
         RENAME),
        ("mlp.router.weight", f"{hf}.mlp.router.weight", ("experts", "hidden"), RENAME),
        ("mlp.router.bias", f"{hf}.mlp.router.bias", ("experts",), RENAME),
        (f"{e}.linear_fc1.weight", f"{hf}.mlp.experts.gate_up_proj",
         ("experts", "2ffn", "hidden"), INTERLEAVE_T),
        (f"{e}.linear_fc1.bias", f"{hf}.mlp.experts.gate_up_proj_bias", ("experts", "2ffn"),
         INTERLEAVE),
        (f"{e}.linear_fc2.weight", f"{hf}.mlp.experts.down_proj", ("experts", "hidden", "ffn"),
         TRANSPOSE),
        (f"{e}.linear_fc2.bias", f"{hf}.mlp.experts.down_proj_bias", ("experts", "hidden"),
         RENAME),
    ]
    return _megatron_rules(qkv_bias=True, qk_norm=False) + _both_forms(per_layer)


def _megatron_deepseek_v3_rules() -> tuple[Rule, ...]:
    """Megatron-Core's DeepSeek-V3 (``MLASelfAttention``, a ``MoELayer`` with shared experts
    and the router's expert bias) to transformers' DeepseekV3. Facts (megatron-core 0.16,
    checked against its own forward pass): ``linear_q_proj`` / ``linear_q_up_proj`` rows are
    per head ``[qk_head_dim, qk_pos_emb_head_dim]`` as transformers' q_proj / q_b_proj;
    ``linear_kv_down_proj`` is ``[kv_lora_rank; qk_pos_emb_head_dim]`` rows as
    kv_a_proj_with_mqa; ``linear_kv_up_proj`` per head ``[qk_head_dim, v_head_dim]`` as
    kv_b_proj; MLA's RoPE de-interleaves its rotary dims as transformers' ``rope_interleave``
    does, so every weight is a rename. The q/kv latent norms are ``q_layernorm`` /
    ``kv_layernorm`` (the local spec) or fused into the up projections as
    ``layer_norm_weight`` (Transformer Engine's); the MLA layer's input norm is never fused.
    The router's ``expert_bias`` is DeepSeek's ``e_score_correction_bias``; shared experts'
    ``linear_fc1`` is ``[gate; up]`` as a dense MLP's."""
    hf, a, m = "model.layers.{L}", "self_attention", "mlp"
    per_layer = [
        ("input_layernorm.weight", f"{hf}.input_layernorm.weight", ("hidden",), RENAME),
        (f"{a}.linear_q_proj.weight", f"{hf}.self_attn.q_proj.weight", ("q_mla", "hidden"),
         RENAME),
        (f"{a}.linear_q_down_proj.weight", f"{hf}.self_attn.q_a_proj.weight",
         ("q_lora", "hidden"), RENAME),
        (f"{a}.q_layernorm.weight", f"{hf}.self_attn.q_a_layernorm.weight", ("q_lora",),
         RENAME),
        (f"{a}.linear_q_up_proj.layer_norm_weight", f"{hf}.self_attn.q_a_layernorm.weight",
         ("q_lora",), RENAME),
        (f"{a}.linear_q_up_proj.weight", f"{hf}.self_attn.q_b_proj.weight",
         ("q_mla", "q_lora"), RENAME),
        (f"{a}.linear_kv_down_proj.weight", f"{hf}.self_attn.kv_a_proj_with_mqa.weight",
         ("kv_a", "hidden"), RENAME),
        (f"{a}.kv_layernorm.weight", f"{hf}.self_attn.kv_a_layernorm.weight", ("kv_lora",),
         RENAME),
        (f"{a}.linear_kv_up_proj.layer_norm_weight", f"{hf}.self_attn.kv_a_layernorm.weight",
         ("kv_lora",), RENAME),
        (f"{a}.linear_kv_up_proj.weight", f"{hf}.self_attn.kv_b_proj.weight",
         ("kv_b", "kv_lora"), RENAME),
        (f"{a}.linear_proj.weight", f"{hf}.self_attn.o_proj.weight", ("hidden", "o_mla"),
         RENAME),
        ("pre_mlp_layernorm.weight", f"{hf}.post_attention_layernorm.weight", ("hidden",),
         RENAME),
        (f"{m}.linear_fc1.layer_norm_weight", f"{hf}.post_attention_layernorm.weight",
         ("hidden",), RENAME),
        (f"{m}.linear_fc1.weight", f"{hf}.mlp.gate_proj.weight", ("2ffn", "hidden"), GATE),
        (f"{m}.linear_fc1.weight", f"{hf}.mlp.up_proj.weight", ("2ffn", "hidden"), UP),
        (f"{m}.linear_fc2.weight", f"{hf}.mlp.down_proj.weight", ("hidden", "ffn"), RENAME),
        (f"{m}.router.expert_bias", f"{hf}.mlp.gate.e_score_correction_bias", ("experts",),
         RENAME),
        (f"{m}.shared_experts.linear_fc1.weight", f"{hf}.mlp.shared_experts.gate_proj.weight",
         ("2shared_ffn", "hidden"), GATE),
        (f"{m}.shared_experts.linear_fc1.weight", f"{hf}.mlp.shared_experts.up_proj.weight",
         ("2shared_ffn", "hidden"), UP),
        (f"{m}.shared_experts.linear_fc2.weight", f"{hf}.mlp.shared_experts.down_proj.weight",
         ("hidden", "shared_ffn"), RENAME),
    ]
    rules = (_MEGATRON_TOP + _both_forms(per_layer)
             + _megatron_moe_rules("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_ffn"))
    return rules + _megatron_mtp_rules(rules)


_MTP = "mtp.layers.{L}"


def _megatron_mtp_rules(decoder: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """Megatron-Core's multi-token prediction layers (``mtp_num_layers``; megatron-core 0.16's
    ``MultiTokenPredictionLayer``) as DeepSeek-V3's own checkpoints hold them: MTP layer ``k``
    is ``model.layers.{num_hidden_layers + k}``, its ``enorm`` (the next token's embedding) and
    ``hnorm`` (the main model's last hidden state) as they are; ``eh_proj`` ``[hidden,
    2 hidden]`` as it is (both concatenate ``[embedding; hidden]``, in that order);
    ``final_layernorm`` is ``shared_head.norm``; its ``transformer_layer`` is a decoder layer
    under the usual names. Megatron's MTP shares the model's embedding and output layer, so
    ``embed_tokens`` and ``shared_head.head`` are written from those (see :func:`apply`)."""
    hf = "model.layers.{L}"
    rules = [
        Rule(f"{_MTP}.enorm.weight", f"{hf}.enorm.weight", ("hidden",), mtp=True),
        Rule(f"{_MTP}.hnorm.weight", f"{hf}.hnorm.weight", ("hidden",), mtp=True),
        Rule(f"{_MTP}.eh_proj.weight", f"{hf}.eh_proj.weight", ("hidden", "2hidden"),
             mtp=True),
        Rule(f"{_MTP}.final_layernorm.weight", f"{hf}.shared_head.norm.weight", ("hidden",),
             mtp=True),
    ]
    prefix = "decoder.layers.{L}."
    rules += [Rule(f"{_MTP}.transformer_layer.{r.source[len(prefix):]}", r.target, r.shape,
                   r.op, mtp=True)
              for r in decoder if r.source.startswith(prefix) and not r.stacked]
    return tuple(rules)


def _megatron_moe_rules(block: str, names: tuple[str, str, str], ffn: str) -> tuple[Rule, ...]:
    """Megatron's MoE layer (SequentialMLP / TEGroupedMLP as torch_dist stores them): the
    router ``[L, E, hidden]`` and the experts ``[L, E, 2 ffn, hidden]`` (fc1, ``[gate; up]``)
    and ``[L, E, hidden, ffn]`` (fc2), one expert of one layer per output tensor. ``block``:
    the Hugging Face module (``mlp``, ``block_sparse_moe``); ``names``: its gate, up and down
    projections' names; ``ffn``: the expert width's dimension."""
    gate, up, down = (f"model.layers.{{L}}.{block}.experts.{{E}}.{n}.weight" for n in names)
    per_layer = [
        ("mlp.router.weight", f"model.layers.{{L}}.{block}.gate.weight", ("experts", "hidden"),
         RENAME),
        ("mlp.experts.experts.linear_fc1.weight", gate, ("experts", f"2{ffn}", "hidden"),
         EXPERT_GATE),
        ("mlp.experts.experts.linear_fc1.weight", up, ("experts", f"2{ffn}", "hidden"),
         EXPERT_UP),
        ("mlp.experts.experts.linear_fc2.weight", down, ("experts", "hidden", ffn), EXPERT),
    ]
    return _both_forms(per_layer)


def _both_forms(per_layer: list[tuple[str, str, tuple[str, ...], str]]) -> tuple[Rule, ...]:
    """Each per-layer rule as Megatron stores it in a homogeneous decoder (stacked,
    ``decoder.layers.<module>``, layer axis first) and in one whose layers differ
    (``decoder.layers.<L>.<module>``)."""
    rules = []
    for source, target, shape, op in per_layer:
        rules.append(Rule(f"decoder.layers.{source}", target, ("layers", *shape), op,
                          stacked=True))
        rules.append(Rule(f"decoder.layers.{{L}}.{source}", target, shape, op))
    return tuple(rules)


def _megatron_map(name: str, family: str, model_type: str, *, qkv_bias: bool = False,
                  qk_norm: bool = False, moe: tuple[str, tuple[str, str, str], str] | None = None
                  ) -> NameMap:
    attention = list(_ATTENTION)
    if qkv_bias:
        attention += [f"model.layers.{{L}}.self_attn.{p}_proj.bias" for p in "qkv"]
    if qk_norm:
        attention += ["model.layers.{L}.self_attn.q_norm.weight",
                      "model.layers.{L}.self_attn.k_norm.weight"]
    rules = _megatron_rules(qkv_bias=qkv_bias, qk_norm=qk_norm)
    moe_mlp: tuple[str, ...] = ()
    if moe is not None:
        block, projections, ffn = moe
        rules += _megatron_moe_rules(block, projections, ffn)
        moe_mlp = (f"model.layers.{{L}}.{block}.gate.weight", *(
            f"model.layers.{{L}}.{block}.experts.{{E}}.{n}.weight" for n in projections))
    return NameMap(name=name, family=family, model_types=(model_type,), rules=rules,
                   required=_TOP + tuple(attention), dense_mlp=_DENSE, moe_mlp=moe_mlp,
                   framework="Megatron-Core")


#: The Megatron-Core map of each Hugging Face model_type (what a Megatron merge picks).
MEGATRON_MAPS = {"llama": "megatron-llama", "qwen2": "megatron-qwen2", "qwen3": "megatron-qwen3",
                 "qwen3_moe": "megatron-qwen3_moe", "mixtral": "megatron-mixtral",
                 "deepseek_v3": "megatron-deepseek_v3", "gpt_oss": "megatron-gpt_oss"}

_DS = "model.layers.{L}"
_DEEPSEEK_V3_RULES = (
    # torchtitan's DeepSeek-V3 (models/deepseek_v3/state_dict_adapter.py): multi-head latent
    # attention and experts renamed, the grouped experts split; RoPE stays interleaved, as
    # transformers' rope_interleave reads it.
    Rule("tok_embeddings.weight", "model.embed_tokens.weight", ("vocab", "hidden")),
    Rule("norm.weight", "model.norm.weight", ("hidden",)),
    Rule("lm_head.weight", "lm_head.weight", ("vocab", "hidden")),
    Rule("layers.{L}.attention.wq.weight", f"{_DS}.self_attn.q_proj.weight", ("q_mla", "hidden")),
    Rule("layers.{L}.attention.wq_a.weight", f"{_DS}.self_attn.q_a_proj.weight",
         ("q_lora", "hidden")),
    Rule("layers.{L}.attention.q_norm.weight", f"{_DS}.self_attn.q_a_layernorm.weight",
         ("q_lora",)),
    Rule("layers.{L}.attention.wq_b.weight", f"{_DS}.self_attn.q_b_proj.weight",
         ("q_mla", "q_lora")),
    Rule("layers.{L}.attention.wkv_a.weight", f"{_DS}.self_attn.kv_a_proj_with_mqa.weight",
         ("kv_a", "hidden")),
    Rule("layers.{L}.attention.kv_norm.weight", f"{_DS}.self_attn.kv_a_layernorm.weight",
         ("kv_lora",)),
    Rule("layers.{L}.attention.wkv_b.weight", f"{_DS}.self_attn.kv_b_proj.weight",
         ("kv_b", "kv_lora")),
    Rule("layers.{L}.attention.wo.weight", f"{_DS}.self_attn.o_proj.weight", ("hidden", "o_mla")),
    Rule("layers.{L}.attention_norm.weight", f"{_DS}.input_layernorm.weight", ("hidden",)),
    Rule("layers.{L}.ffn_norm.weight", f"{_DS}.post_attention_layernorm.weight", ("hidden",)),
    Rule("layers.{L}.feed_forward.w1.weight", f"{_DS}.mlp.gate_proj.weight", ("ffn", "hidden")),
    Rule("layers.{L}.feed_forward.w3.weight", f"{_DS}.mlp.up_proj.weight", ("ffn", "hidden")),
    Rule("layers.{L}.feed_forward.w2.weight", f"{_DS}.mlp.down_proj.weight", ("hidden", "ffn")),
    Rule(f"{_MOE}.routed_experts.inner_experts.w1_EFD", f"{_DS}.mlp.experts.{{E}}.gate_proj.weight",
         ("experts", "moe_ffn", "hidden"), EXPERTS),
    Rule(f"{_MOE}.routed_experts.inner_experts.w3_EFD", f"{_DS}.mlp.experts.{{E}}.up_proj.weight",
         ("experts", "moe_ffn", "hidden"), EXPERTS),
    Rule(f"{_MOE}.routed_experts.inner_experts.w2_EDF", f"{_DS}.mlp.experts.{{E}}.down_proj.weight",
         ("experts", "hidden", "moe_ffn"), EXPERTS),
    Rule(f"{_MOE}.router.gate.weight", f"{_DS}.mlp.gate.weight", ("experts", "hidden")),
    # The load-balancing bias is DeepSeek-V3's own e_score_correction_bias: kept.
    Rule(f"{_MOE}.expert_bias_E", f"{_DS}.mlp.gate.e_score_correction_bias", ("experts",)),
    Rule(f"{_MOE}.shared_experts.w1.weight", f"{_DS}.mlp.shared_experts.gate_proj.weight",
         ("shared_ffn", "hidden")),
    Rule(f"{_MOE}.shared_experts.w3.weight", f"{_DS}.mlp.shared_experts.up_proj.weight",
         ("shared_ffn", "hidden")),
    Rule(f"{_MOE}.shared_experts.w2.weight", f"{_DS}.mlp.shared_experts.down_proj.weight",
         ("hidden", "shared_ffn")),
)



def _deepseek_v3_map(name: str, rules: tuple[Rule, ...], framework: str) -> NameMap:
    """DeepSeek-V3's Hugging Face model, whichever framework's names ``rules`` read: q_proj,
    or q_a_proj, q_a_layernorm and q_b_proj with a q_lora_rank; dense layers before
    ``first_k_dense_replace``, experts and shared experts from it on."""
    return NameMap(
        name=name, family="DeepSeek-V3", model_types=("deepseek_v3",), rules=rules,
        required=_TOP + tuple(f"{_DS}.{n}" for n in (
            "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
            "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")),
        dense_mlp=_DENSE,
        moe_mlp=tuple(f"{_DS}.mlp.{n}" for n in (
            "gate.weight", "experts.{E}.gate_proj.weight", "experts.{E}.up_proj.weight",
            "experts.{E}.down_proj.weight", "shared_experts.gate_proj.weight",
            "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")),
        optional=tuple(f"{_DS}.self_attn.{n}.weight" for n in (
            "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj"))
        + (f"{_DS}.mlp.gate.e_score_correction_bias",),
        sparse=_deepseek_sparse, framework=framework,
        mtp_required=tuple(f"{_DS}.{n}" for n in (
            "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "embed_tokens.weight", "shared_head.head.weight"))
        if framework == "Megatron-Core" else ())


def _gpt_oss_map(name: str, rules: tuple[Rule, ...], framework: str) -> NameMap:
    """gpt-oss's Hugging Face model (transformers' GptOss: grouped expert tensors, attention
    sinks, biases), whichever framework's names ``rules`` read."""
    return NameMap(
        name=name, family="gpt-oss", model_types=("gpt_oss",), rules=rules,
        required=_TOP + _ATTENTION + tuple(
            f"{_DS}.self_attn.{n}" for n in (
                "q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias", "sinks")),
        dense_mlp=(),
        moe_mlp=tuple(f"{_DS}.mlp.{n}" for n in (
            "router.weight", "router.bias", "experts.gate_up_proj",
            "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")),
        sparse=_all_sparse, framework=framework)


_GO = "layers.{L}.attention"
_GO_EXPERTS = f"{_MOE}.routed_experts.inner_experts"
_GPT_OSS_RULES = (
    # torchtitan's gpt-oss (models/gpt_oss/state_dict_adapter.py), whose fused wqkv its
    # state-dict hook splits on save. The grouped experts go where transformers' GptOss holds
    # them, transposed: torchtitan 0.3's to_hf names them mlp1_weight (the parameters are
    # mlp1_weight_EGD) and drops them.
    Rule("tok_embeddings.weight", "model.embed_tokens.weight", ("vocab", "hidden")),
    Rule("norm.weight", "model.norm.weight", ("hidden",)),
    Rule("lm_head.weight", "lm_head.weight", ("vocab", "hidden")),
    *(Rule(f"{_GO}.qkv_linear.w{p}.{kind}", f"{_DS}.self_attn.{p}_proj.{kind}", shape)
      for p, rows in (("q", "q"), ("k", "kv"), ("v", "kv"))
      for kind, shape in (("weight", (rows, "hidden")), ("bias", (rows,)))),
    Rule(f"{_GO}.wo.weight", f"{_DS}.self_attn.o_proj.weight", ("hidden", "q")),
    Rule(f"{_GO}.wo.bias", f"{_DS}.self_attn.o_proj.bias", ("hidden",)),
    Rule(f"{_GO}.sinks", f"{_DS}.self_attn.sinks", ("heads",)),
    Rule("layers.{L}.attention_norm.weight", f"{_DS}.input_layernorm.weight", ("hidden",)),
    Rule("layers.{L}.ffn_norm.weight", f"{_DS}.post_attention_layernorm.weight", ("hidden",)),
    Rule(f"{_GO_EXPERTS}.mlp1_weight_EGD", f"{_DS}.mlp.experts.gate_up_proj",
         ("experts", "ffn2", "hidden"), TRANSPOSE),
    Rule(f"{_GO_EXPERTS}.mlp1_bias_EG", f"{_DS}.mlp.experts.gate_up_proj_bias",
         ("experts", "ffn2")),
    Rule(f"{_GO_EXPERTS}.mlp2_weight_EDF", f"{_DS}.mlp.experts.down_proj",
         ("experts", "hidden", "ffn"), TRANSPOSE),
    Rule(f"{_GO_EXPERTS}.mlp2_bias_ED", f"{_DS}.mlp.experts.down_proj_bias",
         ("experts", "hidden")),
    Rule(f"{_MOE}.router.gate.weight", f"{_DS}.mlp.router.weight", ("experts", "hidden")),
    Rule(f"{_MOE}.router.gate.bias", f"{_DS}.mlp.router.bias", ("experts",)),
    Rule(f"{_MOE}.expert_bias_E", "", ("experts",), DROP, note=(
        "torchtitan's load-balancing expert bias, which Hugging Face's gpt-oss has no place "
        "for (torchtitan's own to_hf drops it too)")),
)


def _torchtune_rules(*, rope: bool, bias: bool) -> tuple[Rule, ...]:
    """torchtune's decoder names (``convert_weights._FROM_HF``; Qwen 2's adds the q/k/v
    biases). Llama's q and k rows are permuted from torchtune's interleaved RoPE pairs, as
    ``tune_to_hf`` does; Qwen 2's RoPE already rotates halves."""
    a, hf = "layers.{L}.attn", "model.layers.{L}.self_attn"
    rules = [
        Rule("tok_embeddings.weight", "model.embed_tokens.weight", ("vocab", "hidden")),
        Rule("norm.scale", "model.norm.weight", ("hidden",)),
        Rule("output.weight", "lm_head.weight", ("vocab", "hidden")),
        Rule(f"{a}.q_proj.weight", f"{hf}.q_proj.weight", ("q", "hidden"),
             ROPE if rope else RENAME, "heads" if rope else ""),
        Rule(f"{a}.k_proj.weight", f"{hf}.k_proj.weight", ("kv", "hidden"),
             ROPE if rope else RENAME, "kv_heads" if rope else ""),
        Rule(f"{a}.v_proj.weight", f"{hf}.v_proj.weight", ("kv", "hidden")),
        Rule(f"{a}.output_proj.weight", f"{hf}.o_proj.weight", ("hidden", "q")),
        Rule("layers.{L}.mlp.w1.weight", "model.layers.{L}.mlp.gate_proj.weight",
             ("ffn", "hidden")),
        Rule("layers.{L}.mlp.w3.weight", "model.layers.{L}.mlp.up_proj.weight",
             ("ffn", "hidden")),
        Rule("layers.{L}.mlp.w2.weight", "model.layers.{L}.mlp.down_proj.weight",
             ("hidden", "ffn")),
        Rule("layers.{L}.sa_norm.scale", "model.layers.{L}.input_layernorm.weight",
             ("hidden",)),
        Rule("layers.{L}.mlp_norm.scale", "model.layers.{L}.post_attention_layernorm.weight",
             ("hidden",)),
    ]
    if bias:
        rules += [Rule(f"{a}.{p}_proj.bias", f"{hf}.{p}_proj.bias", (rows,))
                  for p, rows in (("q", "q"), ("k", "kv"), ("v", "kv"))]
    return tuple(rules)


MAPS: dict[str, NameMap] = {m.name: m for m in (
    _megatron_map("megatron-llama", "Llama", "llama"),
    _megatron_map("megatron-qwen2", "Qwen 2", "qwen2", qkv_bias=True),
    _megatron_map("megatron-qwen3", "Qwen 3", "qwen3", qk_norm=True),
    _megatron_map("megatron-qwen3_moe", "Qwen 3 MoE", "qwen3_moe", qk_norm=True,
                  moe=("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_ffn")),
    # Mixtral's hub layout (what save_pretrained writes): w1 gate, w3 up, w2 down.
    _megatron_map("megatron-mixtral", "Mixtral", "mixtral",
                  moe=("block_sparse_moe", ("w1", "w3", "w2"), "ffn")),
    _deepseek_v3_map("megatron-deepseek_v3", _megatron_deepseek_v3_rules(), "Megatron-Core"),
    _gpt_oss_map("megatron-gpt_oss", _megatron_gpt_oss_rules(), "Megatron-Core"),
    NameMap(
        name="torchtitan-llama3", family="Llama 3", model_types=("llama",),
        rules=_decoder_rules("attention", rope=True, qk_norm=False),
        required=_TOP + _ATTENTION, dense_mlp=_DENSE),
    NameMap(
        name="torchtitan-qwen3", family="Qwen 3 (dense and MoE)",
        model_types=("qwen3", "qwen3_moe"),
        # CosSinRoPE rotates halves, as transformers does: no permutation.
        rules=_decoder_rules("attention", rope=False, qk_norm=True) + _QWEN3_MOE_RULES,
        required=_TOP + _ATTENTION + ("model.layers.{L}.self_attn.q_norm.weight",
                                      "model.layers.{L}.self_attn.k_norm.weight"),
        dense_mlp=_DENSE,
        moe_mlp=("model.layers.{L}.mlp.gate.weight",
                 "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
                 "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
                 "model.layers.{L}.mlp.experts.{E}.down_proj.weight")),
    _deepseek_v3_map("torchtitan-deepseek-v3", _DEEPSEEK_V3_RULES, "torchtitan"),
    _gpt_oss_map("torchtitan-gpt-oss", _GPT_OSS_RULES, "torchtitan"),
    NameMap(
        name="torchtune-llama", family="Llama (2, 3, 3.1, 3.2, 3.3)", model_types=("llama",),
        rules=_torchtune_rules(rope=True, bias=False), required=_TOP + _ATTENTION,
        dense_mlp=_DENSE, framework="torchtune"),
    NameMap(
        name="torchtune-qwen2", family="Qwen 2 and 2.5", model_types=("qwen2",),
        rules=_torchtune_rules(rope=False, bias=True),
        required=_TOP + _ATTENTION + tuple(
            f"model.layers.{{L}}.self_attn.{p}_proj.bias" for p in "qkv"),
        dense_mlp=_DENSE, framework="torchtune"),
)}

NAMES = tuple(MAPS)
KEEP = "none"  # --names none: the stored names, even where a map is implied


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
    except _Missing as e:
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
    sparse = (nmap.sparse or _sparse_layers)(dims, num_layers)
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
