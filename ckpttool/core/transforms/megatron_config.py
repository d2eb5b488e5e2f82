"""A Hugging Face ``config.json`` derived from a Megatron-Core run's ``args``, for the families
where ``args`` say unambiguously which one the model is (a merge without a config.json beside
the run or ``--config``).

How the family is decided, from Megatron-LM's own arguments (absent ones take Megatron-LM's
argparse defaults):

* what every family here shares, else no family is certain: SwiGLU (``swiglu``), RMSNorm,
  RoPE over the whole head (``position_embedding_type`` rope, ``rotary_percent`` 1), no bias
  in the linear layers (``add_bias_linear`` False), no RoPE scaling (``use_rope_scaling``),
  no multi-latent attention, and every layer alike (no ``moe_layer_freq`` pattern, no shared
  experts);
* dense (no ``num_experts``): QKV bias alone -> ``qwen2``; q/k layernorm alone -> ``qwen3``;
  neither -> ``llama``; both -> none;
* a mixture of experts in every layer: q/k layernorm -> ``qwen3_moe`` (``norm_topk_prob``:
  the top-k softmax is renormalised unless ``moe_router_pre_softmax``); neither -> ``mixtral``
  (top-k renormalised, so ``moe_router_pre_softmax`` must be False); a QKV bias -> none.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpttool.core.runtime.report import Section, section
from ckpttool.errors import InputError

# Megatron-LM's argparse defaults for the flags that decide (a run's args hold them all; an
# older run may lack the newer ones).
_DEFAULTS: dict[str, Any] = {
    "swiglu": False, "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
    "rotary_percent": 1.0, "add_bias_linear": True, "add_qkv_bias": False,
    "qk_layernorm": False, "use_rope_scaling": False, "multi_latent_attention": False,
    "num_experts": None, "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
    "moe_router_topk": 2, "moe_router_pre_softmax": False, "group_query_attention": False,
    "norm_epsilon": 1e-5, "rotary_base": 10000, "bf16": False, "fp16": False,
    "untie_embeddings_and_output_weights": False,
}

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}


@section(frozen=True)
class DerivedConfig(Section):
    family: str  # the model_type chosen
    why: str  # what in args decided it, for the report
    config: dict[str, Any]  # config.json
    notes: tuple[str, ...] = ()  # what was assumed (a vocabulary size from padding)

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "why": self.why, "notes": list(self.notes)}


class NotDerivable(InputError):
    """``args`` do not name one family; the message says why and what to pass."""


def derive(args: Mapping[str, Any] | None, *, command: str) -> DerivedConfig:
    """The config.json of the model a Megatron-Core run's ``args`` describe.

    Args:
        args: the run's ``args`` (plain values); None where the checkpoint holds none.
        command: the command to run with ``--config`` instead, for the message
            (``ckpttool merge RUN OUT``).

    Raises:
        NotDerivable: no args, or they fit no family here or more than one (the message
            names why and the ``--config`` command to run).
    """
    ask = (f"; pass the model's Hugging Face config.json: {command} --config "
           "path/to/config.json")
    if not args:
        raise NotDerivable("no config.json beside the run and no Megatron args in the "
                           f"checkpoint to derive one from{ask}")

    def arg(key: str) -> Any:
        value = args.get(key, _DEFAULTS.get(key))
        return _DEFAULTS.get(key) if value is None and key in _DEFAULTS else value

    def number(key: str) -> int:
        value = args.get(key) if args.get(key) is not None else _DEFAULTS.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise NotDerivable(f"Megatron's args have no '{key}' (a positive integer), so no "
                               f"config.json can be derived{ask}")
        return value

    unlike = [why for why, off in (
        ("not SwiGLU", not arg("swiglu")),
        (f"normalization {arg('normalization')}", arg("normalization") != "RMSNorm"),
        (f"position_embedding_type {arg('position_embedding_type')}",
         arg("position_embedding_type") != "rope"),
        (f"rotary_percent {arg('rotary_percent')}", float(arg("rotary_percent")) != 1.0),
        ("bias in the linear layers (add_bias_linear)", bool(arg("add_bias_linear"))),
        ("RoPE scaling (use_rope_scaling)", bool(arg("use_rope_scaling"))),
        ("multi-latent attention", bool(arg("multi_latent_attention"))),
        ("shared experts", arg("moe_shared_expert_intermediate_size") is not None),
        (f"moe_layer_freq {arg('moe_layer_freq')}",
         bool(arg("num_experts")) and arg("moe_layer_freq") != 1)) if off]
    bias, qk_norm, experts = bool(arg("add_qkv_bias")), bool(arg("qk_layernorm")), \
        arg("num_experts")
    family, why = None, ""
    if not unlike:
        if not experts:
            family, why = {(True, False): ("qwen2", "QKV bias"),
                           (False, True): ("qwen3", "q/k layernorm"),
                           (False, False): ("llama", "no QKV bias, no q/k layernorm")
                           }.get((bias, qk_norm), (None, ""))
            if family is None:
                unlike.append("both a QKV bias and q/k layernorm")
        elif bias:
            unlike.append("a mixture of experts with a QKV bias")
        elif qk_norm:
            family, why = "qwen3_moe", "experts and q/k layernorm"
        elif arg("moe_router_pre_softmax"):
            unlike.append("experts without q/k layernorm, weighted by the softmax over all "
                          "experts (moe_router_pre_softmax)")
        else:
            family, why = "mixtral", "experts, no q/k layernorm"
    if family is None:
        raise NotDerivable(
            "no config.json beside the run, and Megatron's args fit none of the families a "
            f"config is derived for (llama, qwen2, qwen3, qwen3_moe, mixtral): "
            f"{', '.join(unlike)}{ask}")
    heads = number("num_attention_heads")
    hidden = number("hidden_size")
    notes = []
    vocab = args.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        vocab = number("padded_vocab_size")
        notes.append(f"vocab_size {vocab}: Megatron's args hold only the padded vocabulary "
                     "(the tokenizer's size is not recorded), so the padding rows are kept")
    kv_heads = number("num_query_groups") if arg("group_query_attention") else heads
    head_dim = args.get("kv_channels") or hidden // heads
    dtype = "bfloat16" if arg("bf16") else "float16" if arg("fp16") else "float32"
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]], "model_type": family,
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": number("ffn_hidden_size"),
        "num_hidden_layers": number("num_layers"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": args.get("max_position_embeddings")
        or args.get("seq_length") or 4096,
        "rms_norm_eps": float(arg("norm_epsilon")), "rope_theta": float(arg("rotary_base")),
        "hidden_act": "silu", "tie_word_embeddings": not arg("untie_embeddings_and_output_weights"),
        "attention_dropout": 0.0, "torch_dtype": dtype,
    }
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if family == "qwen3":
        config.update(attention_bias=False)
    if family == "qwen3_moe":
        config.update(attention_bias=False, num_experts=experts,
                      num_experts_per_tok=number("moe_router_topk"),
                      moe_intermediate_size=number("moe_ffn_hidden_size"),
                      norm_topk_prob=not arg("moe_router_pre_softmax"), decoder_sparse_step=1,
                      mlp_only_layers=[], router_aux_loss_coef=0.0)
    if family == "mixtral":
        config.update(num_local_experts=experts, num_experts_per_tok=number("moe_router_topk"),
                      intermediate_size=number("moe_ffn_hidden_size"))
    return DerivedConfig(family, why, config, tuple(notes))
