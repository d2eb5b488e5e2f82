"""torchtune's names (0.6's ``convert_weights``: ``tune_to_hf``, ``qwen2_tune_to_hf``) to
Hugging Face's: Llama and Qwen 2, as data."""

from __future__ import annotations

from ckpttool.core.transforms.maps.rules import (
    ATTENTION,
    DENSE,
    RENAME,
    ROPE,
    TOP,
    NameMap,
    Rule,
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


#: torchtune's maps, in the order ``--names`` lists them.
MAPS: tuple[NameMap, ...] = (
    NameMap(
        name="torchtune-llama", family="Llama (2, 3, 3.1, 3.2, 3.3)", model_types=("llama",),
        rules=_torchtune_rules(rope=True, bias=False), required=TOP + ATTENTION,
        dense_mlp=DENSE, framework="torchtune"),
    NameMap(
        name="torchtune-qwen2", family="Qwen 2 and 2.5", model_types=("qwen2",),
        rules=_torchtune_rules(rope=False, bias=True),
        required=TOP + ATTENTION + tuple(
            f"model.layers.{{L}}.self_attn.{p}_proj.bias" for p in "qkv"),
        dense_mlp=DENSE, framework="torchtune"),
)
