"""Megatron-Core GPTModel's names (as ``torch_dist`` stores them) to Hugging Face's: Llama,
Qwen 2, Qwen 3, Qwen 3 MoE, Mixtral, DeepSeek-V3 and gpt-oss, as data."""

from __future__ import annotations

from ckpttool.core.transforms.maps.rules import (
    ATTENTION,
    DENSE,
    EXPERT,
    EXPERT_GATE,
    EXPERT_UP,
    GATE,
    INTERLEAVE,
    INTERLEAVE_T,
    QKV_K,
    QKV_Q,
    QKV_V,
    RENAME,
    TOP,
    TRANSPOSE,
    UP,
    VOCAB,
    NameMap,
    Rule,
    deepseek_v3_map,
    gpt_oss_map,
)

# A per-layer rule: (Megatron's name below ``decoder.layers.``, Hugging Face's, the shape's
# dimensions, the operation), made into both stored forms by :func:`_both_forms`.
_PerLayer = tuple[str, str, tuple[str, ...], str]
_HF = "model.layers.{L}"


def _norm(fused: str, apart: str, target: str) -> list[_PerLayer]:
    """A norm before a block: fused into its first linear layer as ``layer_norm_weight``
    (Transformer Engine's spec), or a module of its own (the local spec)."""
    return [(f"{fused}.layer_norm_weight", f"{_HF}.{target}.weight", ("hidden",), RENAME),
            (f"{apart}.weight", f"{_HF}.{target}.weight", ("hidden",), RENAME)]


def _mlp(source: str, target: str, ffn: str) -> list[_PerLayer]:
    """A gated MLP: ``linear_fc1`` (``[gate; up]`` rows) and ``linear_fc2`` under ``source``
    to the gate, up and down projections under ``target``; ``ffn``: its width's dimension."""
    fc1, fc2 = f"{source}.linear_fc1.weight", f"{source}.linear_fc2.weight"
    return [(fc1, f"{_HF}.{target}.gate_proj.weight", (f"2{ffn}", "hidden"), GATE),
            (fc1, f"{_HF}.{target}.up_proj.weight", (f"2{ffn}", "hidden"), UP),
            (fc2, f"{_HF}.{target}.down_proj.weight", ("hidden", ffn), RENAME)]


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
    hf, a = _HF, "self_attention"
    per_layer = [
        *_norm(f"{a}.linear_qkv", "input_layernorm", "input_layernorm"),
        (f"{a}.linear_qkv.weight", f"{hf}.self_attn.q_proj.weight", ("qkv", "hidden"), QKV_Q),
        (f"{a}.linear_qkv.weight", f"{hf}.self_attn.k_proj.weight", ("qkv", "hidden"), QKV_K),
        (f"{a}.linear_qkv.weight", f"{hf}.self_attn.v_proj.weight", ("qkv", "hidden"), QKV_V),
        (f"{a}.linear_proj.weight", f"{hf}.self_attn.o_proj.weight", ("hidden", "q"), RENAME),
        *_norm("mlp.linear_fc1", "pre_mlp_layernorm", "post_attention_layernorm"),
        *_mlp("mlp", "mlp", "ffn"),
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
    hf, a = _HF, "self_attention"
    per_layer = [
        ("input_layernorm.weight", f"{hf}.input_layernorm.weight", ("hidden",), RENAME),
        (f"{a}.linear_q_proj.weight", f"{hf}.self_attn.q_proj.weight", ("q_mla", "hidden"),
         RENAME),
        *_latent("q", ("q_a_proj", "q_lora"), "q_a_layernorm", ("q_b_proj", "q_mla"), "q_lora"),
        *_latent("kv", ("kv_a_proj_with_mqa", "kv_a"), "kv_a_layernorm", ("kv_b_proj", "kv_b"),
                 "kv_lora"),
        (f"{a}.linear_proj.weight", f"{hf}.self_attn.o_proj.weight", ("hidden", "o_mla"),
         RENAME),
        *_norm("mlp.linear_fc1", "pre_mlp_layernorm", "post_attention_layernorm"),
        *_mlp("mlp", "mlp", "ffn"),
        ("mlp.router.expert_bias", f"{hf}.mlp.gate.e_score_correction_bias", ("experts",),
         RENAME),
        *_mlp("mlp.shared_experts", "mlp.shared_experts", "shared_ffn"),
    ]
    rules = (_MEGATRON_TOP + _both_forms(per_layer)
             + _megatron_moe_rules("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_ffn"))
    return rules + _megatron_mtp_rules(rules)


def _latent(name: str, down: tuple[str, str], norm: str, up: tuple[str, str], rank: str
            ) -> list[_PerLayer]:
    """One of MLA's low-rank projections (``q`` or ``kv``): ``linear_<name>_down_proj``, the
    latent norm (``<name>_layernorm``, or fused into the up projection), ``linear_<name>_up_proj``
    to transformers' ``down``, ``norm`` and ``up`` (each with its rows' dimension); ``rank``:
    the latent's dimension."""
    a, hf = "self_attention", f"{_HF}.self_attn"
    return [(f"{a}.linear_{name}_down_proj.weight", f"{hf}.{down[0]}.weight",
             (down[1], "hidden"), RENAME),
            (f"{a}.{name}_layernorm.weight", f"{hf}.{norm}.weight", (rank,), RENAME),
            (f"{a}.linear_{name}_up_proj.layer_norm_weight", f"{hf}.{norm}.weight", (rank,),
             RENAME),
            (f"{a}.linear_{name}_up_proj.weight", f"{hf}.{up[0]}.weight", (up[1], rank),
             RENAME)]


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


def _both_forms(per_layer: list[_PerLayer]) -> tuple[Rule, ...]:
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
    attention = list(ATTENTION)
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
                   required=TOP + tuple(attention), dense_mlp=DENSE, moe_mlp=moe_mlp,
                   framework="Megatron-Core")


#: The Megatron-Core map of each Hugging Face model_type (what a Megatron merge picks).
MEGATRON_MAPS = {"llama": "megatron-llama", "qwen2": "megatron-qwen2", "qwen3": "megatron-qwen3",
                 "qwen3_moe": "megatron-qwen3_moe", "mixtral": "megatron-mixtral",
                 "deepseek_v3": "megatron-deepseek_v3", "gpt_oss": "megatron-gpt_oss"}


#: Megatron-Core's maps, in the order ``--names`` lists them.
MAPS: tuple[NameMap, ...] = (
    _megatron_map("megatron-llama", "Llama", "llama"),
    _megatron_map("megatron-qwen2", "Qwen 2", "qwen2", qkv_bias=True),
    _megatron_map("megatron-qwen3", "Qwen 3", "qwen3", qk_norm=True),
    _megatron_map("megatron-qwen3_moe", "Qwen 3 MoE", "qwen3_moe", qk_norm=True,
                  moe=("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_ffn")),
    # Mixtral's hub layout (what save_pretrained writes): w1 gate, w3 up, w2 down.
    _megatron_map("megatron-mixtral", "Mixtral", "mixtral",
                  moe=("block_sparse_moe", ("w1", "w3", "w2"), "ffn")),
    deepseek_v3_map("megatron-deepseek_v3", _megatron_deepseek_v3_rules(), "Megatron-Core"),
    gpt_oss_map("megatron-gpt_oss", _megatron_gpt_oss_rules(), "Megatron-Core"),
)
