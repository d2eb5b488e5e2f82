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
  (top-k renormalised, so ``moe_router_pre_softmax`` must be False); a QKV bias -> none;
* learnable attention sinks (``softmax_type`` learnable) with the quick-GELU GLU
  (``quick_geglu``) -> ``gpt_oss``, where it also has what transformers' GptOss has: biases in
  every linear layer (``add_bias_linear``), the activation clamp (``swiglu_limit``) and +1
  offset (``glu_linear_offset``), experts in every layer routed by a softmax over the top-k,
  no shared experts, plain RoPE; every layer full attention (no ``window_size``);
* multi-latent attention -> ``deepseek_v3``, where it also has what transformers' DeepseekV3
  always has: q/kv latent norms (``qk_layernorm``), experts with shared experts, sigmoid
  routing renormalised over the top-k (``moe_router_score_function`` sigmoid, top-k > 1),
  dense layers only before the first expert layer (``moe_layer_freq`` ``[0] * k + [1] * n``
  or 1), and RoPE (``rope_type`` rope) or YaRN (``rope_type`` yarn, or unset: MLA's default,
  as ``rope_parameters``, with ``attention_factor`` written where transformers' default for it
  is not Megatron's).

Pure: no I/O.
"""

from __future__ import annotations

import math
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
    "untie_embeddings_and_output_weights": False, "quick_geglu": False,
    "softmax_type": "vanilla", "glu_linear_offset": 0.0, "activation_func_clamp_value": None,
    "moe_router_score_function": "softmax", "window_size": None,
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

    if arg("multi_latent_attention"):
        return _deepseek_v3(args, arg, number, ask)
    if arg("quick_geglu") and arg("softmax_type") == "learnable":
        return _gpt_oss(args, arg, number, ask)
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
    notes: list[str] = []
    vocab = _vocab(args, number, notes, ask)
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
        "rms_norm_eps": _epsilon(args), "rope_theta": float(arg("rotary_base")),
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


def _gpt_oss(args: Mapping[str, Any], arg: Any, number: Any, ask: str) -> DerivedConfig:
    """gpt-oss's config.json from the args of a run with its attention sinks and activation
    (see the module docstring)."""
    clamp = arg("activation_func_clamp_value")
    unlike = [why for why, off in (
        (f"normalization {arg('normalization')}", arg("normalization") != "RMSNorm"),
        (f"position_embedding_type {arg('position_embedding_type')}",
         arg("position_embedding_type") != "rope"),
        (f"rotary_percent {arg('rotary_percent')}", float(arg("rotary_percent")) != 1.0),
        ("RoPE scaling (use_rope_scaling)", bool(arg("use_rope_scaling"))),
        (f"rope_type {args.get('rope_type')}", args.get("rope_type") not in (None, "rope")),
        ("no bias in the linear layers (add_bias_linear)", not arg("add_bias_linear")),
        ("q/k layernorm", bool(arg("qk_layernorm"))),
        ("no experts", not arg("num_experts")),
        ("shared experts", arg("moe_shared_expert_intermediate_size") is not None),
        (f"moe_layer_freq {arg('moe_layer_freq')}", arg("moe_layer_freq") != 1),
        ("experts weighted by the softmax over all experts (moe_router_pre_softmax)",
         bool(arg("moe_router_pre_softmax"))),
        (f"moe_router_score_function {arg('moe_router_score_function')}",
         arg("moe_router_score_function") != "softmax"),
        ("a top-k scaling factor (moe_router_topk_scaling_factor)",
         args.get("moe_router_topk_scaling_factor") not in (None, 1, 1.0)),
        (f"glu_linear_offset {arg('glu_linear_offset')} (gpt-oss's is 1)",
         arg("glu_linear_offset") != 1.0),
        ("no activation clamp (activation_func_clamp_value)",
         not isinstance(clamp, (int, float)) or isinstance(clamp, bool) or clamp <= 0),
        # transformers' layer_types would say which layers slide; Megatron-LM's window flags
        # are not mapped to them here
        (f"sliding-window attention (window_size {arg('window_size')})",
         arg("window_size") is not None)) if off]
    if unlike:
        raise NotDerivable(
            "no config.json beside the run, and Megatron's args describe gpt-oss's attention "
            "sinks and activation but not gpt-oss as transformers builds it: "
            f"{', '.join(unlike)}{ask}")
    heads = number("num_attention_heads")
    hidden = number("hidden_size")
    layers = number("num_layers")
    notes: list[str] = []
    vocab = _vocab(args, number, notes, ask)
    dtype = "bfloat16" if arg("bf16") else "float16" if arg("fp16") else "float32"
    config: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": number("moe_ffn_hidden_size"), "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": number("num_query_groups") if arg("group_query_attention")
        else heads,
        "head_dim": args.get("kv_channels") or hidden // heads,
        "num_local_experts": number("num_experts"),
        "num_experts_per_tok": number("moe_router_topk"),
        "max_position_embeddings": args.get("max_position_embeddings")
        or args.get("seq_length") or 4096,
        "rms_norm_eps": _epsilon(args),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(arg("rotary_base"))},
        "swiglu_limit": float(clamp), "attention_bias": True,
        "layer_types": ["full_attention"] * layers, "router_aux_loss_coef": 0.0,
        "tie_word_embeddings": not arg("untie_embeddings_and_output_weights"),
        "attention_dropout": 0.0, "torch_dtype": dtype,
    }
    return DerivedConfig("gpt_oss", "attention sinks (softmax_type learnable), the quick-GELU "
                         "GLU, biases, experts", config, tuple(notes))


def _epsilon(args: Mapping[str, Any]) -> float:
    """The norms' epsilon: ``--norm-epsilon`` is stored as ``layernorm_epsilon`` in
    Megatron-LM's args (``norm_epsilon`` in hand-built ones), default 1e-5."""
    for key in ("layernorm_epsilon", "norm_epsilon"):
        value = args.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return float(_DEFAULTS["norm_epsilon"])


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention scale, as Megatron's and transformers' YaRN compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# Megatron-LM's tokenizers that add the end-of-document token to ``--vocab-size`` ("the size
# of the vocabulary before EOD or padding"): its id is vocab_size, the tokenizer's size
# vocab_size + 1 (``_NullTokenizer`` and megatron-core's ``NullTokenizer``).
_EOD_AFTER_VOCAB = frozenset({"NullTokenizer", "NullMultimodalTokenizer"})


def _vocab(args: Mapping[str, Any], number: Any, notes: list[str], ask: str) -> int:
    """The tokenizer's vocabulary size, as Megatron-LM's ``build_tokenizer`` makes it from
    ``args``, when they record it (``vocab_size``, plus EOD for the null tokenizers), else the
    padded one (said in ``notes``: the padding rows are then kept).

    Raises:
        NotDerivable: the tokenizer's size is larger than the padded vocabulary.
    """
    vocab = args.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        size = vocab + 1 if args.get("tokenizer_type") in _EOD_AFTER_VOCAB else vocab
        padded = args.get("padded_vocab_size")
        if isinstance(padded, int) and not isinstance(padded, bool) and 0 < padded < size:
            raise NotDerivable(
                f"Megatron's args give a tokenizer of {size} tokens ({args.get('tokenizer_type')}"
                f", vocab_size {vocab}) but only {padded} rows (padded_vocab_size), so no "
                f"config.json can be derived{ask}")
        return size
    padded_size: int = number("padded_vocab_size")
    notes.append(f"vocab_size {padded_size}: Megatron's args hold only the padded vocabulary "
                 "(the tokenizer's size is not recorded), so the padding rows are kept")
    return padded_size


def _deepseek_v3(args: Mapping[str, Any], arg: Any, number: Any, ask: str) -> DerivedConfig:
    """DeepSeek-V3's config.json from an MLA run's args (see the module docstring)."""
    layers = number("num_layers")
    # Megatron-LM leaves rope_type unset without --rope-type, and then MLATransformerConfig's
    # defaults apply: YaRN, factor 40, original 4096 positions, beta 32/1, mscale 1 and 0.
    rope_type = args.get("rope_type") or "yarn"
    factor = float(args.get("rotary_scaling_factor") or 40.0)
    mscale = float(args["mscale"]) if args.get("mscale") is not None else 1.0
    mscale_all_dim = float(args.get("mscale_all_dim") or 0.0)
    all_dim_scale = _yarn_mscale(factor, mscale_all_dim)  # MLA's softmax scale is its square
    freq = arg("moe_layer_freq")
    pattern = freq if isinstance(freq, list) else [1] * layers if freq == 1 else None
    first = next((i for i, v in enumerate(pattern or []) if v == 1), layers)
    unlike = [why for why, off in (
        ("not SwiGLU", not arg("swiglu")),
        (f"normalization {arg('normalization')}", arg("normalization") != "RMSNorm"),
        ("bias in the linear layers (add_bias_linear)", bool(arg("add_bias_linear"))),
        ("no q/kv latent layernorm (qk_layernorm)", not arg("qk_layernorm")),
        ("no experts", not arg("num_experts")),
        ("no shared experts", arg("moe_shared_expert_intermediate_size") is None),
        (f"moe_router_score_function {args.get('moe_router_score_function')}",
         args.get("moe_router_score_function") != "sigmoid"),
        ("top-1 routing", number("moe_router_topk") < 2),
        (f"moe_layer_freq {freq}", pattern is None or len(pattern) != layers
         or pattern != [0] * first + [1] * (layers - first)),
        ("group-limited routing summing other than the top 2 scores of a group (transformers'"
         " DeepseekV3 sums 2)", (args.get("moe_router_num_groups") or 1) > 1
         and number("moe_router_topk") // (args.get("moe_router_group_topk") or 1) != 2),
        (f"rope_type {rope_type}", rope_type not in ("rope", "yarn")),
        (f"mscale_all_dim {mscale_all_dim} (YaRN's scale for it is not positive)",
         all_dim_scale <= 0),
        # MLA scales the softmax by mscale_all_dim whatever the rope type; transformers' only
        # under a rope_parameters that scales
        (f"rope_type rope with mscale_all_dim {mscale_all_dim} and rotary_scaling_factor "
         f"{factor} (Megatron's MLA scales the attention by it; transformers' DeepseekV3 only "
         "under YaRN)", rope_type == "rope" and all_dim_scale != 1.0),
        (f"rotary_percent {arg('rotary_percent')}", float(arg("rotary_percent")) != 1.0)) if off]
    if unlike:
        raise NotDerivable(
            "no config.json beside the run, and Megatron's args describe multi-latent "
            f"attention but not DeepSeek-V3 as transformers builds it: {', '.join(unlike)}{ask}")
    moe_ffn = number("moe_ffn_hidden_size")
    shared = number("moe_shared_expert_intermediate_size")
    if shared % moe_ffn:
        raise NotDerivable(f"Megatron's args give shared experts {shared} wide, not a multiple "
                           f"of moe_ffn_hidden_size {moe_ffn}{ask}")
    heads = number("num_attention_heads")
    notes: list[str] = []
    vocab = _vocab(args, number, notes, ask)
    q_lora = args.get("q_lora_rank")
    theta = float(arg("rotary_base"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                "original_max_position_embeddings":
                    args.get("original_max_position_embeddings") or 4096,
                "beta_fast": float(args.get("beta_fast") or 32.0),
                "beta_slow": float(args.get("beta_slow") or 1.0),
                "mscale": mscale, "mscale_all_dim": mscale_all_dim}
        # Megatron scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim);
        # transformers does too when both are non-zero, else by mscale(factor, 1): where that
        # differs, the factor is written out.
        megatron = _yarn_mscale(factor, mscale) / all_dim_scale
        if not (mscale and mscale_all_dim) and megatron != _yarn_mscale(factor, 1.0):
            rope["attention_factor"] = megatron
    dtype = "bfloat16" if arg("bf16") else "float16" if arg("fp16") else "float32"
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab, "hidden_size": number("hidden_size"),
        "intermediate_size": number("ffn_hidden_size"), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": q_lora if isinstance(q_lora, int) and q_lora > 0 else None,
        "kv_lora_rank": number("kv_lora_rank"), "qk_nope_head_dim": number("qk_head_dim"),
        "qk_rope_head_dim": number("qk_pos_emb_head_dim"), "v_head_dim": number("v_head_dim"),
        "head_dim": number("qk_pos_emb_head_dim"),
        "n_routed_experts": number("num_experts"), "n_shared_experts": shared // moe_ffn,
        "moe_intermediate_size": moe_ffn, "num_experts_per_tok": number("moe_router_topk"),
        "first_k_dense_replace": first, "n_group": args.get("moe_router_num_groups") or 1,
        "topk_group": args.get("moe_router_group_topk") or 1, "norm_topk_prob": True,
        "routed_scaling_factor": float(args.get("moe_router_topk_scaling_factor") or 1.0),
        "max_position_embeddings": args.get("max_position_embeddings")
        or args.get("seq_length") or 4096,
        "rms_norm_eps": _epsilon(args), "rope_parameters": rope,
        "rope_interleave": True, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": not arg("untie_embeddings_and_output_weights"),
        "attention_dropout": 0.0, "torch_dtype": dtype,
        # Megatron's multi-token prediction layers (written as layers num_hidden_layers + k)
        "num_nextn_predict_layers": args.get("mtp_num_layers") or 0,
    }
    if not arg("moe_router_enable_expert_bias"):
        notes.append("no expert bias in the run: e_score_correction_bias stays zero")
    return DerivedConfig("deepseek_v3", "multi-latent attention, shared experts, sigmoid "
                         "routing", config, tuple(notes))
