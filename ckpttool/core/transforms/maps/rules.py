"""The vocabulary of the name maps (:mod:`ckpttool.core.transforms.namemaps`): what a rule
does to the stored values, :class:`Rule` and :class:`NameMap`, the dimensions config.json gives
a map (:class:`Dims`), and the Hugging Face side every framework's tables share (the names a
decoder layer has, DeepSeek-V3's and gpt-oss's models). Data and pure functions: no tensor is
read here, torch is not imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import InputError

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


class Missing(InputError):
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
            raise Missing(f"{self.where}: needs an integer '{key}' for --names "
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


def sparse_layers(dims: Dims, num_layers: int) -> frozenset[int]:
    """The layers config.json gives a mixture of experts, as transformers' Qwen3-MoE decides
    (``num_experts``, ``decoder_sparse_step``, ``mlp_only_layers``); none for a dense model."""
    if not (_int(dims.config, "num_experts") or _int(dims.config, "num_local_experts")):
        return frozenset()
    step = _int(dims.config, "decoder_sparse_step") or 1
    only = set(dims.config.get("mlp_only_layers") or ())
    return frozenset(i for i in range(num_layers) if i not in only and (i + 1) % step == 0)



# --------------------------------------------------------------------------------------------
# The Hugging Face side: names every framework's table maps to


ATTENTION = tuple(f"model.layers.{{L}}.{n}" for n in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"))
TOP = ("model.embed_tokens.weight", "model.norm.weight")
DENSE = tuple(f"model.layers.{{L}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))

HF_LAYER = "model.layers.{L}"


def deepseek_v3_map(name: str, rules: tuple[Rule, ...], framework: str) -> NameMap:
    """DeepSeek-V3's Hugging Face model, whichever framework's names ``rules`` read: q_proj,
    or q_a_proj, q_a_layernorm and q_b_proj with a q_lora_rank; dense layers before
    ``first_k_dense_replace``, experts and shared experts from it on."""
    return NameMap(
        name=name, family="DeepSeek-V3", model_types=("deepseek_v3",), rules=rules,
        required=TOP + tuple(f"{HF_LAYER}.{n}" for n in (
            "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
            "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")),
        dense_mlp=DENSE,
        moe_mlp=tuple(f"{HF_LAYER}.mlp.{n}" for n in (
            "gate.weight", "experts.{E}.gate_proj.weight", "experts.{E}.up_proj.weight",
            "experts.{E}.down_proj.weight", "shared_experts.gate_proj.weight",
            "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")),
        optional=tuple(f"{HF_LAYER}.self_attn.{n}.weight" for n in (
            "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj"))
        + (f"{HF_LAYER}.mlp.gate.e_score_correction_bias",),
        sparse=_deepseek_sparse, framework=framework,
        mtp_required=tuple(f"{HF_LAYER}.{n}" for n in (
            "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "embed_tokens.weight", "shared_head.head.weight"))
        if framework == "Megatron-Core" else ())


def gpt_oss_map(name: str, rules: tuple[Rule, ...], framework: str) -> NameMap:
    """gpt-oss's Hugging Face model (transformers' GptOss: grouped expert tensors, attention
    sinks, biases), whichever framework's names ``rules`` read."""
    return NameMap(
        name=name, family="gpt-oss", model_types=("gpt_oss",), rules=rules,
        required=TOP + ATTENTION + tuple(
            f"{HF_LAYER}.self_attn.{n}" for n in (
                "q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias", "sinks")),
        dense_mlp=(),
        moe_mlp=tuple(f"{HF_LAYER}.mlp.{n}" for n in (
            "router.weight", "router.bias", "experts.gate_up_proj",
            "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")),
        sparse=_all_sparse, framework=framework)
