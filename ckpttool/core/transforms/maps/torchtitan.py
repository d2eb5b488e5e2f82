"""torchtitan's names (0.3's own ``state_dict_adapter.py``, ``to_hf``, and its fused
``FusedQKVLinear``) to Hugging Face's: Llama 3, Qwen 3 (dense and MoE), DeepSeek-V3 and
gpt-oss, as data."""

from __future__ import annotations

from ckpttool.core.transforms.maps.rules import (
    ATTENTION,
    DENSE,
    DROP,
    EXPERTS,
    HF_LAYER,
    RENAME,
    ROPE,
    TOP,
    TRANSPOSE,
    WQKV_K,
    WQKV_Q,
    WQKV_V,
    NameMap,
    Rule,
    deepseek_v3_map,
    gpt_oss_map,
)

_DS = HF_LAYER  # the Hugging Face layer prefix, short for the tables below


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


#: torchtitan's maps, in the order ``--names`` lists them.
MAPS: tuple[NameMap, ...] = (
    NameMap(
        name="torchtitan-llama3", family="Llama 3", model_types=("llama",),
        rules=_decoder_rules("attention", rope=True, qk_norm=False),
        required=TOP + ATTENTION, dense_mlp=DENSE),
    NameMap(
        name="torchtitan-qwen3", family="Qwen 3 (dense and MoE)",
        model_types=("qwen3", "qwen3_moe"),
        # CosSinRoPE rotates halves, as transformers does: no permutation.
        rules=_decoder_rules("attention", rope=False, qk_norm=True) + _QWEN3_MOE_RULES,
        required=TOP + ATTENTION + ("model.layers.{L}.self_attn.q_norm.weight",
                                      "model.layers.{L}.self_attn.k_norm.weight"),
        dense_mlp=DENSE,
        moe_mlp=("model.layers.{L}.mlp.gate.weight",
                 "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
                 "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
                 "model.layers.{L}.mlp.experts.{E}.down_proj.weight")),
    deepseek_v3_map("torchtitan-deepseek-v3", _DEEPSEEK_V3_RULES, "torchtitan"),
    gpt_oss_map("torchtitan-gpt-oss", _GPT_OSS_RULES, "torchtitan"),
)
